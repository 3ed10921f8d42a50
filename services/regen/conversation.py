"""Regenerating one conversation turn by turn with the target.

Rule: walk the canonical messages; every assistant message is replaced by the target's own
answer to everything before it, so each next user turn follows the target's previous answer
(the EAGLE-3 recipe: train on the target's own distribution). System, user and tool
messages are kept as they are.

Invariants:
- the output's k-th assistant message is the text of `turns[k]`, whose ids are exactly what
  the server saw (`prompt_token_ids`) and sampled (`completion_token_ids`);
- at most `max_turns` answers; a trailing user turn with no answer in the source is
  answered too (within `max_turns`); messages after the last answer are dropped;
- an assistant message with no user (or tool) turn before it is not regenerated and is
  dropped (ShareGPT records that start mid-conversation);
- regeneration stops before an assistant message with tool calls: the recorded tool results
  answer the original calls, not the target's;
- an answer the `AnswerPolicy` rejects (a loop, or a length cut when dropped) is drawn again
  up to `resample_attempts` times, then regeneration stops before it: the row is skipped
  with that reason if it was the first answer, else keeps its earlier answers (`stopped`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.regen.client import ChatClient, ChatResult, RejectedError, RequestTimeoutError
from services.regen.quality import AnswerPolicy
from shared.chat import TemplateRenderError
from shared.records import Conversation, Message, RegenTurn

#: Outcome statuses; the job's accounting is success + error + skipped == input.
SUCCESS, ERROR, SKIPPED = "success", "error", "skipped"

#: Skip reasons every draw of a row would repeat (no second draw is made).
DETERMINISTIC = ("no_user_turn", "prompt_too_long", "tool_calls")


@dataclass
class Outcome:
    """The result for one input row.

    Attributes:
        status: success, error or skipped.
        reason: why not success (`prompt_too_long`, `no_user_turn`, `tool_calls`,
        reason: why not success (`prompt_too_long`, `no_user_turn`, `tool_calls`,
            `server_rejected`, `request_timeout`, `template_render_error`), or why a success
            stopped early ('' = not early).
        detail: human-readable detail (server message, token counts).
        messages: the regenerated conversation (success only).
        turns: per answer, the ids the server saw and sampled.
        results: the raw `ChatResult`s, in turn order.
        resampled: answers drawn again because the policy rejected the earlier draw.
    """

    status: str
    reason: str = ""
    detail: str = ""
    messages: list[Message] = field(default_factory=list)
    turns: list[RegenTurn] = field(default_factory=list)
    results: list[ChatResult] = field(default_factory=list)
    resampled: int = 0


def request_message(m: Message) -> dict[str, Any]:
    """A canonical message as sent to the server (role, content, and tool fields)."""
    # null content kept only on a tool-call turn, where the OpenAI API allows it
    content = m.content if m.tool_calls else (m.content or "")
    out: dict[str, Any] = {"role": m.role, "content": content}
    d = m.chat_dict()
    for key in ("name", "tool_calls", "tool_call_id"):
        if d.get(key):
            out[key] = d[key]
    return out


class Regenerator:
    """Answers one conversation's turns through `client`.

    Args:
        client: the chat client (server, sampling, template kwargs).
        prompt_tokens: counts the tokens of the rendered prompt of `(messages, tools)` with
            the generation prompt, exactly as the server renders it.
        max_turns: answers regenerated per conversation.
        max_prompt_tokens: a turn whose prompt is longer is not sent.
        policy: which answers may be trained on; None = all.
        resample_attempts: extra draws of a rejected answer (0 at temperature 0, where a
            draw repeats itself).
    """

    def __init__(
        self,
        client: ChatClient,
        prompt_tokens: Callable[[list[dict[str, Any]], list | None], int],
        max_turns: int,
        max_prompt_tokens: int,
        policy: AnswerPolicy | None = None,
        resample_attempts: int = 0,
    ):
        self.client, self.prompt_tokens = client, prompt_tokens
        self.max_turns, self.max_prompt_tokens = max_turns, max_prompt_tokens
        self.policy, self.resample_attempts = policy, resample_attempts

    async def run(self, row: Conversation) -> Outcome:
        """Regenerate `row` (a deduplicated conversation). Never raises for a bad row.

        Raises:
            ServiceUnavailableError: the server is down (from the client).
        """
        tools = row.tools or None
        history: list[dict[str, Any]] = []
        out = Outcome(SUCCESS)
        answerable = False
        for m in row.messages:
            if m.role != "assistant":
                history.append(request_message(m))
                answerable = m.role in ("user", "tool")
                continue
            if not answerable:
                continue  # nothing to answer: a record that starts mid-conversation
            if len(out.turns) >= self.max_turns or m.tool_calls:
                out.reason = out.reason or ("tool_calls" if m.tool_calls else "")
                break
            if not await self._answer(history, tools, out):
                break
            answerable = False
        else:
            if answerable and len(out.turns) < self.max_turns:
                await self._answer(history, tools, out)
        return self._finish(out, history)

    async def run_samples(self, row: Conversation, n: int) -> list[Outcome]:
        """`n` independent regenerations of `row`, in draw order.

        A row the first draw skips for a reason no other draw can change (no user turn, a
        prompt too long, tool calls first) is not drawn again.

        Raises:
            ServiceUnavailableError: the server is down (from the client).
        """
        outs = [await self.run(row)]
        if outs[0].status != SUCCESS and outs[0].reason in DETERMINISTIC:
            return outs
        for _ in range(n - 1):
            outs.append(await self.run(row))
        return outs

    async def _answer(self, history: list[dict], tools: list | None, out: Outcome) -> bool:
        """Append the server's answer to `history` and `out`; False when it cannot."""
        try:
            n = self.prompt_tokens(history, tools)
        except TemplateRenderError as e:
            out.reason, out.detail = "template_render_error", f"turn {len(out.turns)}: {e}"
            return False
        if n > self.max_prompt_tokens:
            out.reason = "prompt_too_long"
            out.detail = (
                f"prompt of turn {len(out.turns)} has {n} tokens > {self.max_prompt_tokens}"
            )
            return False
        for attempt in range(self.resample_attempts + 1):
            try:
                res = await self.client.chat(history, tools)
            except RejectedError as e:
                reason = (
                    "request_timeout" if isinstance(e, RequestTimeoutError) else "server_rejected"
                )
                out.reason, out.detail = reason, f"turn {len(out.turns)}: {e.detail}"
                return False
            bad = self.policy and self.policy.verdict(
                res.completion_token_ids, res.finish_reason, res.text
            )
            if not bad:
                break
            if attempt == self.resample_attempts:
                out.reason, out.detail = bad.reason, f"turn {len(out.turns)}: {bad.detail}"
                return False
            out.resampled += 1
        answer: dict[str, Any] = {"role": "assistant", "content": res.text}
        if res.reasoning:
            answer["reasoning_content"] = res.reasoning
        history.append(answer)
        out.results.append(res)
        out.turns.append(
            RegenTurn(
                prompt_token_ids=res.prompt_token_ids,
                completion_token_ids=res.completion_token_ids,
                finish_reason=res.finish_reason,
            )
        )
        return True

    @staticmethod
    def _finish(out: Outcome, history: list[dict[str, Any]]) -> Outcome:
        if not out.turns:
            out.status = ERROR if out.reason in ("server_rejected", "request_timeout") else SKIPPED
            out.reason = out.reason or "no_user_turn"
            return out
        last = max(i for i, m in enumerate(history) if m["role"] == "assistant")
        out.messages = [Message.model_validate(m) for m in history[: last + 1]]
        return out
