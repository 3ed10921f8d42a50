"""Format adapters: one raw dataset row → one canonical conversation, or a counted rejection.

Canonical conversation (the prep shard format, `shared/artifacts.py`):
`{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?, "name"?}],
"tools": list | None}`, roles in {system, user, assistant, tool}. `content` is null only on
an assistant tool-call turn whose source had null (kept as is: templates tell null from "").

Invariants:
- an adapter never guesses: an unknown role, a non-string or null content, a missing field or
  a row of another format raises `RowRejected` naming the field and the reason;
- role aliases are fixed (`ROLE_ALIASES`): human→user; gpt, chatgpt, bing, bard, model →
  assistant; function_call → assistant tool call; observation → tool;
- realignments (leading assistant turns dropped, trailing non-assistant turns dropped) are
  returned as named counts, never done silently.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
    "function_call": "assistant",
}

#: Names datasets and servers use for an assistant turn's reasoning, in order of preference:
#: `reasoning_content` (DeepSeek, vLLM < 0.10, HF templates), `reasoning` (vLLM >= 0.10,
#: OpenRouter), `thinking` (Anthropic-style exports).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

#: Message keys the OpenAI adapter reads; any other key is counted, never silently dropped.
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name", *REASONING_KEYS})


class RowRejected(Exception):
    """A row cannot become a conversation. `reason` is the counted key, `field` the culprit."""

    def __init__(self, reason: str, field: str, detail: str = ""):
        super().__init__(f"{field}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason, self.field, self.detail = reason, field, detail


@dataclass
class Adapted:
    """An adapted row: canonical messages, tools, and the realignments applied."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    realigned: Counter = field(default_factory=Counter)
    fields: Counter = field(default_factory=Counter)


def _text(value: Any, where: str) -> str:
    if value is None:
        raise RowRejected("null_content", where)
    if not isinstance(value, str):
        raise RowRejected("non_string_content", where, f"got {type(value).__name__}")
    return value


def _parse_tools(value: Any, where: str) -> list[Any] | None:
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowRejected("bad_tools_json", where, e.msg) from None
    if not isinstance(value, list):
        raise RowRejected("bad_tools", where, f"expected a list, got {type(value).__name__}")
    return value


def _tool_call(obj: Any, where: str) -> dict[str, Any]:
    """A `{name, arguments}` object (or its JSON text) → canonical tool call (args as JSON)."""
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            raise RowRejected("bad_tool_call_json", where, e.msg) from None
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise RowRejected("bad_tool_call", where, "expected {name, arguments}")
    args = obj.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"type": "function", "function": {"name": obj["name"], "arguments": args}}


def _role(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or raw.strip().lower() not in ROLE_ALIASES:
        raise RowRejected(f"unknown_role:{str(raw)[:32]}", where)
    return raw.strip().lower()


# -- adapters: row → list of canonical messages (+ tools) ----------------------------------


def adapt_sharegpt(row: dict[str, Any]) -> Adapted:
    """ShareGPT `conversations` [{from, value}] + optional `system`; tools variant included.

    `function_call` turns become assistant `tool_calls` (their value is `{name, arguments}`
    JSON); `observation` turns become `tool` messages; `tools` may be a JSON string.
    """
    turns = _field(row, "conversations", list)
    msgs: list[dict[str, Any]] = []
    if row.get("system") is not None:
        sys_text = _text(row["system"], "system")
        if sys_text.strip():
            msgs.append({"role": "system", "content": sys_text})
    for i, t in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(t, dict):
            raise RowRejected("bad_turn", where, f"expected an object, got {type(t).__name__}")
        src = _role(t.get("from"), f"{where}.from")
        value = _text(t.get("value"), f"{where}.value")
        if src == "function_call":
            msgs.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_tool_call(value, f"{where}.value")],
                }
            )
        else:
            msgs.append({"role": ROLE_ALIASES[src], "content": value})
    return Adapted(_merge_tool_calls(msgs), _parse_tools(row.get("tools"), "tools"))


def _merge_tool_calls(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold a tool-call-only assistant turn into the assistant text turn right before it."""
    out: list[dict[str, Any]] = []
    for m in msgs:
        prev = out[-1] if out else None
        if (
            m.get("tool_calls")
            and not m["content"]
            and prev is not None
            and prev["role"] == "assistant"
            and not prev.get("tool_calls")
        ):
            prev["tool_calls"] = m["tool_calls"]
        else:
            out.append(m)
    return out


def _content_parts(parts: list[Any], where: str) -> dict[str, Any]:
    """Content parts: OpenAI `{type: text, text}` or LLaMA-Factory `{type, value}` parts."""
    text, reasoning, calls = [], [], []
    for j, p in enumerate(parts):
        pw = f"{where}[{j}]"
        if not isinstance(p, dict):
            raise RowRejected("bad_content_part", pw)
        kind = p.get("type", "text")
        if kind not in ("text", "reasoning", "tool_call"):
            # image_url, input_audio, video, file, ...: named, not reported as null text
            raise RowRejected(f"unsupported_content_part:{str(kind)[:32]}", f"{pw}.type")
        value = _text(p.get("text", p.get("value")), f"{pw}.text")
        if kind == "text":
            text.append(value)
        elif kind == "reasoning":
            reasoning.append(value)
        else:
            calls.append(_tool_call(value, f"{pw}.value"))
    out: dict[str, Any] = {"content": "".join(text)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def adapt_openai(row: dict[str, Any]) -> Adapted:
    """OpenAI `messages` [{role, content, tool_calls?, name?, reasoning_content?}] + `tools`.

    `content` may be a string, null (only with tool_calls, kept null), or a list of parts.
    Reasoning is read under any of `REASONING_KEYS` (an alias counted); keys outside
    `MESSAGE_KEYS` are counted per role and name.
    """
    msgs: list[dict[str, Any]] = []
    fields: Counter = Counter()
    for i, m in enumerate(_field(row, "messages", list)):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RowRejected("bad_turn", where, f"expected an object, got {type(m).__name__}")
        role = ROLE_ALIASES[_role(m.get("role"), f"{where}.role")]
        content = m.get("content")
        if isinstance(content, list):
            msg: dict[str, Any] = {"role": role, **_content_parts(content, f"{where}.content")}
        elif content is None and m.get("tool_calls"):
            # Kept null: some templates render the calls only for null content (DeepSeek-V3).
            msg = {"role": role, "content": None}
        else:
            msg = {"role": role, "content": _text(content, f"{where}.content")}
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise RowRejected("bad_tool_call", f"{where}.tool_calls")
            msg["tool_calls"] = msg.get("tool_calls", []) + [
                _tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)
            ]
        key = next((k for k in REASONING_KEYS if m.get(k) is not None), None)
        if key is not None and "reasoning_content" not in msg:
            msg["reasoning_content"] = _text(m[key], f"{where}.{key}")
            if key != "reasoning_content":
                fields[f"reasoning_alias:{key}"] += 1
        for k in ("name", "tool_call_id"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        fields.update(f"unknown_field:{role}.{str(k)[:32]}" for k in m if k not in MESSAGE_KEYS)
        msgs.append(msg)
    return Adapted(msgs, _parse_tools(row.get("tools"), "tools"), fields=fields)


def _pair(prompt: str, answer: str, system: Any = None) -> Adapted:
    msgs = []
    if system is not None and _text(system, "system").strip():
        msgs.append({"role": "system", "content": system})
    msgs += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return Adapted(msgs)


def adapt_alpaca(row: dict[str, Any]) -> Adapted:
    """Alpaca `instruction`, optional `input` (may be empty), `output`, optional `system`."""
    instruction = _text(_field(row, "instruction", object), "instruction")
    extra = row.get("input")
    extra = "" if extra is None else _text(extra, "input")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return _pair(prompt, _text(_field(row, "output", object), "output"), row.get("system"))


def _qa(q: str, a: str) -> Callable[[dict[str, Any]], Adapted]:
    def adapt(row: dict[str, Any]) -> Adapted:
        return _pair(_text(_field(row, q, object), q), _text(_field(row, a, object), a))

    adapt.__doc__ = f"Single-turn `{q}` → user, `{a}` → assistant."
    return adapt


def _field(row: Any, name: str, kind: type) -> Any:
    if not isinstance(row, dict):
        raise RowRejected("not_an_object", "<row>", f"got {type(row).__name__}")
    if name not in row:
        raise RowRejected("format_mismatch", name, "field missing")
    value = row[name]
    if kind is not object and not isinstance(value, kind):
        raise RowRejected("format_mismatch", name, f"expected {kind.__name__}")
    return value


ADAPTERS: dict[str, Callable[[dict[str, Any]], Adapted]] = {
    "sharegpt": adapt_sharegpt,
    "sharegpt_tools": adapt_sharegpt,
    "openai": adapt_openai,
    "ultrachat": adapt_openai,
    "alpaca": adapt_alpaca,
    "gsm8k": _qa("question", "answer"),
    "math": _qa("problem", "solution"),
    "opencodeinstruct": _qa("input", "output"),
}


def detect_format(row: Any) -> str | None:
    """The adapter a row looks like (`conversations`, `messages`, alpaca keys), or None."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("conversations"), list):
        return "sharegpt"
    if isinstance(row.get("messages"), list):
        return "openai"
    if "instruction" in row and "output" in row:
        return "alpaca"
    return None


# -- validation and realignment ------------------------------------------------------------


def normalize(adapted: Adapted, max_turn_chars: int) -> Adapted:
    """Validate and realign an adapted conversation.

    Leading assistant/tool turns (after system turns) are dropped, as are trailing turns
    after the last assistant turn; each is counted in `adapted.realigned`.

    Raises:
        RowRejected: empty, system-only, no user→assistant pair, an empty assistant turn, or
            a turn longer than `max_turn_chars`.
    """
    msgs = adapted.messages
    if not msgs:
        raise RowRejected("empty_conversation", "messages")
    for i, m in enumerate(msgs):
        size = len(m["content"] or "") + len(m.get("reasoning_content") or "")
        if size > max_turn_chars:
            raise RowRejected(
                "turn_too_long",
                f"messages[{i}].content",
                f"{size} chars > prep.max_turn_chars {max_turn_chars}",
            )
    system = [m for m in msgs if m["role"] == "system"]
    if len(system) == len(msgs):
        raise RowRejected("system_only", "messages")
    head = 0 if msgs[0]["role"] != "system" else 1
    first_user = next((i for i in range(head, len(msgs)) if msgs[i]["role"] == "user"), None)
    if first_user is None:
        raise RowRejected("no_user_assistant_pair", "messages", "no user turn")
    if first_user > head:
        adapted.realigned["leading_non_user_turns_dropped"] += 1
    body = msgs[:head] + msgs[first_user:]
    last_asst = max((i for i, m in enumerate(body) if m["role"] == "assistant"), default=None)
    if last_asst is None:
        raise RowRejected("no_user_assistant_pair", "messages", "no assistant turn after a user")
    if last_asst < len(body) - 1:
        adapted.realigned["trailing_turns_dropped"] += 1
    body = body[: last_asst + 1]
    for i, m in enumerate(body):
        if m["role"] == "system" and i > 0:
            raise RowRejected("system_not_first", f"messages[{i}].role")
        if (
            m["role"] == "assistant"
            and not (m["content"] or "").strip()
            and not m.get("tool_calls")
            and not m.get("reasoning_content")
        ):
            raise RowRejected("empty_assistant_turn", f"messages[{i}].content")
    adapted.messages = body
    return adapted
