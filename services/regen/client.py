"""An async OpenAI-chat client for regeneration, with vLLM's exact token ids.

Each request asks vLLM for `return_token_ids` (vLLM ≥ 0.11; 0.32's
`entrypoints/openai/chat_completion/protocol.py`): the response then carries the prompt ids
the server rendered (top-level `prompt_token_ids`) and the ids it sampled
(`choices[0].token_ids`, ending with the stop token when it stopped on one). The server
applies the chat template with `chat_template_kwargs`.

Failure policy:
- connection errors, timeouts and 5xx are retried with exponential backoff; when the
  retries are spent the server is treated as down (`ServiceUnavailableError`): the job
  fails and a rerun resumes, rather than marking good rows as errors;
- 4xx (e.g. a prompt longer than max-model-len) is the server rejecting this row:
  `RejectedError`, which the job counts and moves on; except 404 (wrong model name or
  route), which would fail every row alike and so stops the job.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import httpx

from shared.errors import EyrieError, ServiceUnavailableError


class RejectedError(EyrieError):
    """The server answered 4xx: this request (row) is bad, the server is fine."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"server rejected the request ({status}): {detail}")
        self.status, self.detail = status, detail


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
        max_retries: retries on connection errors, timeouts and 5xx.
        backoff_s: first backoff in seconds; doubles per retry, with jitter, capped at 30 s.
        concurrency: connection pool size (the caller bounds in-flight requests).
        headers: extra HTTP headers (the API key, `launcher.auth_headers()`).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        sampling: dict[str, Any],
        chat_template_kwargs: dict[str, Any],
        timeout_s: float,
        max_retries: int,
        backoff_s: float = 1.0,
        concurrency: int = 16,
        headers: dict[str, str] | None = None,
    ):
        self.url = f"{base_url}/v1/chat/completions"
        self.model, self.sampling = model, dict(sampling)
        self.kwargs = dict(chat_template_kwargs)
        self.max_retries, self.backoff_s = max_retries, backoff_s
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers or {}
        )

    def payload(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> dict[str, Any]:
        """The JSON body of one request."""
        body = {
            "model": self.model,
            "messages": messages,
            **self.sampling,
            "return_token_ids": True,
            "chat_template_kwargs": self.kwargs,
            "stream": False,
        }
        if tools:
            body["tools"] = tools
        return body

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> ChatResult:
        """Send one chat request; retry transient failures.

        Raises:
            RejectedError: 4xx other than 404 (a bad row, e.g. too long for max-model-len).
            ServiceUnavailableError: still failing after `max_retries` retries, or 404.
        """
        body = self.payload(messages, tools)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(30.0, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
            try:
                resp = await self.http.post(self.url, json=body)
            except httpx.TransportError as e:  # connect/read errors and timeouts
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                continue
            if resp.status_code == 404:
                # Wrong model name or route: every row would fail the same way.
                raise ServiceUnavailableError(
                    f"{self.url}: 404 for model {self.model!r}: {resp.text[:300]}. Check "
                    "serve.served_model_name and that the baseline server serves the target."
                )
            if resp.status_code >= 400:
                raise RejectedError(resp.status_code, resp.text[:500])
            return parse_response(resp.json())
        raise ServiceUnavailableError(
            f"{self.url}: no answer after {self.max_retries} retries (regen.max_retries); "
            f"last error: {last}. Is the baseline server up?"
        )

    async def aclose(self) -> None:
        await self.http.aclose()
