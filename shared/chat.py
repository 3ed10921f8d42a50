"""Chat-template rendering of canonical messages, as the server renders them.

Prep renders conversations to build the loss mask; regen renders prompts to count their
tokens before sending them. Both go through these functions, so the two cannot differ in how
a message reaches the template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from shared.errors import InputError


class TemplateRenderError(InputError):
    """The chat template raised on these messages (a row the template cannot express)."""


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A canonical message as HF chat templates expect it.

    Tool-call arguments are stored as JSON text (the OpenAI wire format); templates iterate
    over them as objects, so valid JSON is passed decoded and anything else as is.
    """
    out = dict(m)
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = dict(c["function"])
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except (TypeError, json.JSONDecodeError):
                pass  # templates print a string argument as is
            calls.append({**c, "function": fn})
        out["tool_calls"] = calls
    return out


def render_text(
    tok: Any,
    messages: Sequence[dict[str, Any]],
    chat_template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    tools: list | None = None,
) -> str:
    """The chat template applied to canonical `messages`, as text.

    Raises:
        TemplateRenderError: the template raised (Qwen3 on null content, DeepSeek-V3 on
            decoded tool-call arguments); the message holds the template's own error.
    """
    from jinja2 import TemplateError

    kwargs = dict(chat_template_kwargs)
    if tools:
        kwargs["tools"] = tools
    try:
        return tok.apply_chat_template(
            [template_message(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except (TemplateError, TypeError, KeyError, AttributeError) as e:
        raise TemplateRenderError(f"{type(e).__name__}: {e}"[:300]) from e


def render_ids(
    tok: Any,
    messages: Sequence[dict[str, Any]],
    chat_template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    tools: list | None = None,
) -> list[int]:
    """Token ids of the rendered conversation: rendered once, tokenized once, no extra BOS.

    Returns:
        list[int] of length = tokens of the rendered text (`add_special_tokens=False`: a
        template that writes BOS itself gets no second one).
    """
    text = render_text(tok, messages, chat_template_kwargs, add_generation_prompt, tools)
    return tok(text, add_special_tokens=False)["input_ids"]
