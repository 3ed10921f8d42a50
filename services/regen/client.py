"""The regeneration client: the `openai` SDK against a vLLM server, with vLLM's token ids.

Each request asks vLLM for `return_token_ids` (vLLM ≥ 0.11): the response then carries the
prompt ids the server rendered (top-level `prompt_token_ids`) and the ids it sampled
(`choices[0].token_ids`, ending with the stop token when it stopped on one). The server
applies the chat template with `chat_template_kwargs`.

Failure policy:
- connection errors, timeouts, 408/409, 429 (rate limiting) and 5xx are retried by the SDK
  with exponential backoff, honouring `Retry-After` (`regen.max_retries`); when the retries
  are spent the server is treated as down or overloaded (`ServiceUnavailableError`): the job
  fails and a rerun resumes, rather than marking good rows as errors;
- any other 4xx (e.g. a prompt longer than max-model-len) is the server rejecting this row:
  `RejectedError`, which the job counts and moves on; except 404 (wrong model name or
  route), which would fail every row alike and so stops the job;
- a request that still times out after the retries while the server's `/health` answers
  is this row being slow (a long answer at a slow decode rate), not the server being down:
  `RequestTimeoutError`, counted like a rejected row, its message naming the setting to
  raise (`regen.request_timeout_s`, sized from `regen.max_tokens` when unset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import EyrieError, ServiceUnavailableError

#: 4xx statuses the SDK retries (request timeout, conflict, rate limit): when the retries are
#: spent they mean the server is overloaded, not that the row is bad.
RETRIED_STATUSES = (408, 409, 429)


class RejectedError(EyrieError):
    """The server answered 4xx: this request (row) is bad, the server is fine."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"server rejected the request ({status}): {detail}")
        self.status, self.detail = status, detail


class RequestTimeoutError(RejectedError):
    """No answer within the request timeout, while the server itself is healthy."""

    def __init__(self, timeout_s: float):
        detail = (
            f"no answer within {timeout_s:.0f}s while the server is healthy; raise "
            "regen.request_timeout_s (unset, it is regen.max_tokens at "
            "rates.decode_tokens_per_s)"
        )
        super().__init__(408, detail)
        self.timeout_s = timeout_s


@dataclass
class ChatResult:
    """One assistant turn as the server produced it.

    Attributes:
        text: the answer (special tokens skipped, as vLLM detokenizes by default).
        reasoning: separated reasoning text when the server runs a reasoning parser, else None.
        prompt_token_ids: the prompt ids the server rendered (template applied).
        completion_token_ids: the sampled ids, including the stop token if it stopped on one.
        finish_reason: `stop` or `length`.
        model: the `model` field of the response.
        fingerprint: the response's `system_fingerprint` (vLLM version and build).
    """

    text: str
    reasoning: str | None
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    finish_reason: str
    model: str
    fingerprint: str = ""


def parse_response(body: dict[str, Any]) -> ChatResult:
    """Turn a vLLM chat-completion JSON body into a `ChatResult`.

    Raises:
        ServiceUnavailableError: the body lacks the token ids (the server is not vLLM, or too
            old for `return_token_ids`), which no retry fixes.
    """
    choice = body["choices"][0]
    prompt_ids, ids = body.get("prompt_token_ids"), choice.get("token_ids")
    if prompt_ids is None or ids is None:
        raise ServiceUnavailableError(
            "chat response has no prompt_token_ids/token_ids: the server ignored "
            "return_token_ids; regen needs vLLM >= 0.11"
        )
    msg = choice["message"]
    return ChatResult(
        text=msg.get("content") or "",
        reasoning=msg.get("reasoning_content") or msg.get("reasoning"),
        prompt_token_ids=list(prompt_ids),
        completion_token_ids=list(ids),
        finish_reason=choice.get("finish_reason") or "",
        model=body.get("model", ""),
        fingerprint=body.get("system_fingerprint") or "",
    )


class ChatClient:
    """Async chat-completions client for one server.

    Args:
        base_url: server base URL without `/v1`.
        model: served model name.
        sampling: request fields sent as is (temperature, top_p, max_tokens, ...).
        chat_template_kwargs: passed to the server's apply_chat_template.
        timeout_s: per-request timeout in seconds.
        max_retries: the SDK's retries on transient failures (see the module docstring).
        api_key: the server's API key (`shared.vllm.api_key`), or None.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: dict[str, Any],
        chat_template_kwargs: dict[str, Any],
        timeout_s: float,
        max_retries: int,
        api_key: str | None = None,
    ):
        from openai import AsyncOpenAI

        self.url = f"{base_url}/v1"
        self.model, self.sampling = model, dict(sampling)
        self.kwargs = dict(chat_template_kwargs)
        self.max_retries, self.timeout_s = max_retries, timeout_s
        self.base_url = base_url
        self.api_key = api_key
        self.openai = AsyncOpenAI(
            base_url=self.url,
            api_key=api_key or "EMPTY",
            timeout=timeout_s,
            max_retries=max_retries,
        )

    def extra_body(self) -> dict[str, Any]:
        """The vLLM-specific request fields."""
        return {"return_token_ids": True, "chat_template_kwargs": self.kwargs}

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> ChatResult:
        """Send one chat request (the SDK retries transient failures).

        Raises:
            RejectedError: 4xx other than 404/408/409/429 (a bad row).
            RequestTimeoutError: timed out after the retries, but the server is healthy.
            ServiceUnavailableError: still failing after the retries, or 404.
        """
        import openai

        request: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": False,
            "extra_body": self.extra_body(),
            **({"tools": tools} if tools else {}),
            **self.sampling,
        }
        try:
            resp = await self.openai.chat.completions.create(**request)
        except openai.NotFoundError as e:
            raise ServiceUnavailableError(
                f"{self.url}: 404 for model {self.model!r}: {e.message}. Check "
                "serve.served_model_name and that the baseline server serves the target."
            ) from e
        except openai.APITimeoutError as e:
            if await self.healthy():
                raise RequestTimeoutError(self.timeout_s) from e
            raise ServiceUnavailableError(
                f"{self.url}: no answer after {self.max_retries} retries (regen.max_retries) "
                f"and /health does not answer; last error: {type(e).__name__}: {e}"
            ) from e
        except (openai.APIStatusError, openai.APIConnectionError) as e:
            status = getattr(e, "status_code", None)
            if status is not None and status not in RETRIED_STATUSES and status < 500:
                raise RejectedError(status, str(e.message)[:500]) from e
            raise ServiceUnavailableError(
                f"{self.url}: no answer after {self.max_retries} retries (regen.max_retries); "
                f"last error: {type(e).__name__}: {e}. Is the baseline server up?"
            ) from e
        return parse_response(resp.model_dump())

    async def healthy(self) -> bool:
        """Whether the server's `/health` answers 200 within 10 s."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=10.0, headers=headers) as c:
                return (await c.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        await self.openai.close()
