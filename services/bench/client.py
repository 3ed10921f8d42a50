"""Async load generator: client-side throughput and latency against one OpenAI-style server.

Every request streams from `/v1/chat/completions` (the server applies the chat template with
the recipe's `chat_template_kwargs`), so the client sees the first token (TTFT) and every
later chunk (inter-token latency). Output tokens are the server's own count
(`stream_options.include_usage`), never a re-tokenization.

Invariants:
- Both servers get the same messages, `max_tokens`, temperature and per-request seed.
- Every loop is bounded: a fixed prompt list, `concurrency` workers, a per-request timeout.
- A failed request is counted with its reason, never silently dropped; throughput counts
  only completed requests' tokens over the whole window.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.errors import ServiceUnavailableError

Messages = list[dict[str, str]]


@dataclass
class RequestResult:
    """One streamed request.

    Attributes:
        output_tokens: completion tokens (server usage count).
        ttft_s: seconds from send to the first choice chunk (vLLM sends it with the first
            token's output).
        latency_s: seconds from send to the end of the stream.
        chunk_gaps_s: seconds between successive content chunks (ITL samples).
        text: the generated text.
        error: why the request failed; None when it succeeded.
    """

    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None


@dataclass
class LevelResult:
    """Client metrics of one (temperature, concurrency) window.

    Attributes:
        concurrency: in-flight requests.
        temperature: sampling temperature.
        requests, failed: request counts; `errors` maps reason → count.
        output_tokens: completion tokens of successful requests.
        wall_s: seconds from the first send to the last response.
        output_tok_s: output_tokens / wall_s.
        ttft_s_mean, ttft_s_p50: time to first token (s).
        itl_s_mean: mean gap between streamed chunks (s); a speculative server may send
            several tokens per chunk.
        tpot_s_mean: mean per-request (latency - ttft) / (output_tokens - 1) (s/token).
    """

    concurrency: int
    temperature: float
    requests: int
    failed: int
    errors: dict[str, int]
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_s_mean: float | None
    ttft_s_p50: float | None
    itl_s_mean: float | None
    tpot_s_mean: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(
    results: list[RequestResult], concurrency: int, temperature: float, wall_s: float
) -> LevelResult:
    """Aggregate request results of one window into a `LevelResult`."""
    ok = [r for r in results if r.error is None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpots = [
        (r.latency_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.output_tokens > 1
    ]
    return LevelResult(
        concurrency=concurrency,
        temperature=temperature,
        requests=len(results),
        failed=len(results) - len(ok),
        errors=errors,
        output_tokens=tokens,
        wall_s=wall_s,
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_s_mean=_mean(ttfts),
        ttft_s_p50=statistics.median(ttfts) if ttfts else None,
        itl_s_mean=_mean(gaps),
        tpot_s_mean=_mean(tpots),
    )


@dataclass
class RequestSpec:
    """What every request of a window sends (identical for both servers)."""

    model: str
    max_tokens: int
    temperature: float
    seed: int = 0
    timeout_s: float = 300.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body(self, messages: Messages, index: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed + index,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }


async def stream_one(client: Any, url: str, body: dict[str, Any]) -> RequestResult:
    """Send one streaming chat request; time the first chunk and every later content chunk."""
    import httpx

    res = RequestResult()
    t0 = time.perf_counter()
    last: float | None = None
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = int(chunk["usage"]["completion_tokens"])
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                now = time.perf_counter()
                if res.ttft_s is None:
                    # vLLM sends its first choice chunk (the role) with the first token's
                    # output, so this also times tokens that decode to no text.
                    res.ttft_s = now - t0
                content = (choices[0].get("delta") or {}).get("content")
                if content:
                    if last is not None:
                        res.chunk_gaps_s.append(now - last)
                    last = now
                    parts.append(content)
    except httpx.HTTPError as e:
        res.error = type(e).__name__
    res.latency_s = time.perf_counter() - t0
    res.text = "".join(parts)
    return res


async def run_window(
    base_url: str, prompts: list[Messages], spec: RequestSpec, concurrency: int
) -> tuple[list[RequestResult], float]:
    """Send every prompt once with at most `concurrency` in flight.

    Returns:
        (per-prompt results in prompt order, wall seconds of the window).
    """
    import httpx

    url = base_url.rstrip("/") + "/v1/chat/completions"
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[RequestResult] = [RequestResult() for _ in prompts]
    limits = httpx.Limits(max_connections=concurrency)

    from shared.vllm import auth_headers

    async with httpx.AsyncClient(
        timeout=spec.timeout_s, limits=limits, headers=auth_headers()
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await stream_one(client, url, spec.body(prompts[i], i))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - t0
    return results, wall


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id `<base_url>/v1/models` lists.

    Raises:
        ServiceUnavailableError: the server cannot be reached or lists no model.
    """
    import httpx

    from shared.vllm import auth_headers

    url = base_url.rstrip("/") + "/v1/models"
    try:
        data = httpx.get(url, timeout=timeout_s, headers=auth_headers()).json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ServiceUnavailableError(f"{url}: cannot list models ({e}); is the server up?") from e
    if not data:
        raise ServiceUnavailableError(f"{url}: the server lists no model")
    return str(data[0]["id"])


def complete(
    base_url: str, prompts: list[Messages], spec: RequestSpec, concurrency: int
) -> list[RequestResult]:
    """Run one window synchronously (for callers outside an event loop)."""
    results, _ = asyncio.run(run_window(base_url, prompts, spec, concurrency))
    return results
