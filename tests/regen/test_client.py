"""The regen client's failure policy, against a real HTTP server started by each test.

`services.regen.client.ChatClient` uses the `openai` SDK and its retries. The server below
is a real `http.server` on a free local port that answers each request from a script (status,
headers, body) and records what it received; nothing of the SDK is replaced. It answers
`/tokenize` (the regen stage's tokenizer check) as a vLLM server of SmolLM2 would. Policy checked:
- 429 is retried and its `Retry-After` honoured (the wait is measured between requests);
- 5xx, 408, 409 and connection failures are retried, `regen.max_retries` times, then the
  server is down: `ServiceUnavailableError` (the job fails and a rerun resumes);
- 404 (wrong model or route) stops the job at once: `ServiceUnavailableError`, no retry;
- any other 4xx is this row's fault: `RejectedError` with the server's message, no retry;
- a 200 without vLLM's token ids is `ServiceUnavailableError` (no retry fixes it);
- a timeout after the retries is the server being down only when `/health` fails too;
  with a healthy server it is this row being slow: `RequestTimeoutError`.
The regen stage over the same server counts a rejected row as an error and moves on, but
fails without a manifest when the server stays down.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from services.conductor.processes import free_port
from services.regen.client import ChatClient, RejectedError, RequestTimeoutError
from shared.errors import ServiceUnavailableError

Reply = tuple[int, dict[str, str], Any]


def vllm_body(text: str = "Paris.", prompt_ids=(1, 2, 3), ids=(7, 8, 2)) -> dict[str, Any]:
    """A chat completion as vLLM >= 0.11 writes it with `return_token_ids`."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "system_fingerprint": "vllm-test",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "token_ids": list(ids),
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        "prompt_token_ids": list(prompt_ids),
    }


def vllm_error(status: int, message: str) -> dict[str, Any]:
    """vLLM's error body."""
    return {"error": {"message": message, "type": "BadRequestError", "code": status}}


@dataclass
class Recorded:
    at: float
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class ScriptedServer:
    """A local HTTP server answering request n with `script(n, body)`."""

    script: Callable[[int, dict[str, Any]], Reply]
    requests: list[Recorded] = field(default_factory=list)
    delay_s: float = 0.0
    url: str = ""
    healthy: bool = False
    tokenized: list[dict[str, Any]] = field(default_factory=list)


@functools.cache
def _smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tests.conftest import cache_root

    return AutoTokenizer.from_pretrained(str(cache_root() / "models" / "SmolLM2-135M-Instruct"))


def smollm2_tokenize(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `/tokenize` answer for a server of SmolLM2 (chat or plain-text request)."""
    tok = _smollm2_tokenizer()
    if "messages" in body:
        text = tok.apply_chat_template(
            body["messages"],
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))[
            "input_ids"
        ]
    return {"count": len(ids), "max_model_len": 2048, "tokens": ids}


@pytest.fixture
def serve() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ThreadingHTTPServer] = []

    def start(script, delay_s: float = 0.0, healthy: bool = False) -> ScriptedServer:
        state = ScriptedServer(script, delay_s=delay_s, healthy=healthy)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                ok = self.path == "/health" and state.healthy
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw or b"{}")
                if self.path == "/tokenize":
                    state.tokenized.append(body)
                    self._send(200, {}, smollm2_tokenize(body))
                    return
                with lock:
                    n = len(state.requests)
                    state.requests.append(
                        Recorded(
                            time.monotonic(),
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                        )
                    )
                if state.delay_s:
                    time.sleep(state.delay_s)
                self._send(*state.script(n, body))

            def _send(self, status: int, headers: dict[str, str], reply: Any) -> None:
                data = json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    for k, v in {"Content-Type": "application/json", **headers}.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        return state

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def _client(url: str, max_retries: int = 2, timeout_s: float = 10, api_key=None) -> ChatClient:
    return ChatClient(
        url,
        "m",
        {"temperature": 0.7, "top_p": 1.0, "max_tokens": 16},
        {"enable_thinking": False},
        timeout_s,
        max_retries,
        api_key=api_key,
    )


def _chat(client: ChatClient, content: str = "Capital of France?"):
    async def go():
        try:
            return await client.chat([{"role": "user", "content": content}])
        finally:
            await client.aclose()

    return asyncio.run(go())


def _always(reply: Reply) -> Callable[[int, dict], Reply]:
    return lambda n, body: reply


def _then(*replies: Reply) -> Callable[[int, dict], Reply]:
    """The replies in order, the last one repeated."""
    return lambda n, body: replies[min(n, len(replies) - 1)]


def test_answer_carries_the_servers_token_ids_and_the_request_is_vllms(serve):
    srv = serve(_always((200, {}, vllm_body("Paris.", [5, 6, 7, 8], [9, 10, 2]))))
    res = _chat(_client(srv.url, api_key="s3cret"))
    assert (res.text, res.prompt_token_ids, res.completion_token_ids) == (
        "Paris.",
        [5, 6, 7, 8],
        [9, 10, 2],
    )
    assert (res.finish_reason, res.model, res.fingerprint) == ("stop", "m", "vllm-test")
    (req,) = srv.requests
    assert req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer s3cret"
    assert req.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "stream": False,
        "temperature": 0.7,
        "top_p": 1.0,
        "max_tokens": 16,
        "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_429_waits_retry_after_then_answers(serve):
    # The SDK's own first backoff is at most 0.5 s: a 2 s gap is the server's Retry-After.
    srv = serve(
        _then((429, {"Retry-After": "2"}, vllm_error(429, "slow down")), (200, {}, vllm_body()))
    )
    res = _chat(_client(srv.url))
    assert res.text == "Paris."
    assert len(srv.requests) == 2
    assert srv.requests[1].at - srv.requests[0].at >= 2.0


def test_429_until_retries_are_spent_is_service_unavailable(serve):
    srv = serve(_always((429, {"Retry-After": "0.2"}, vllm_error(429, "slow down"))))
    with pytest.raises(ServiceUnavailableError, match="no answer after 2 retries"):
        _chat(_client(srv.url, max_retries=2))
    assert len(srv.requests) == 3


def test_5xx_is_retried_then_answers(serve):
    srv = serve(
        _then(
            (503, {}, vllm_error(503, "loading")),
            (500, {}, vllm_error(500, "boom")),
            (200, {}, vllm_body()),
        )
    )
    assert _chat(_client(srv.url, max_retries=2)).text == "Paris."
    assert len(srv.requests) == 3


def test_503_forever_is_service_unavailable_after_the_retries(serve):
    srv = serve(_always((503, {}, vllm_error(503, "overloaded"))))
    with pytest.raises(ServiceUnavailableError, match="no answer after 3 retries"):
        _chat(_client(srv.url, max_retries=3))
    assert len(srv.requests) == 4


@pytest.mark.parametrize("status", [408, 409])
def test_408_and_409_are_retried_then_service_unavailable(serve, status):
    srv = serve(_always((status, {"Retry-After": "0.1"}, vllm_error(status, "try again"))))
    with pytest.raises(ServiceUnavailableError, match="no answer after 1 retries"):
        _chat(_client(srv.url, max_retries=1))
    assert len(srv.requests) == 2


def test_no_server_is_service_unavailable():
    with pytest.raises(ServiceUnavailableError, match="APIConnectionError"):
        _chat(_client(f"http://127.0.0.1:{free_port()}", max_retries=1))


def test_timeout_is_retried_then_service_unavailable(serve):
    srv = serve(_always((200, {}, vllm_body())), delay_s=3)
    with pytest.raises(ServiceUnavailableError, match="APITimeoutError"):
        _chat(_client(srv.url, max_retries=1, timeout_s=0.5))
    assert len(srv.requests) == 2


def test_timeout_with_a_healthy_server_is_a_slow_row_not_a_down_server(serve):
    srv = serve(_always((200, {}, vllm_body())), delay_s=3, healthy=True)
    with pytest.raises(RequestTimeoutError, match="raise regen.request_timeout_s") as e:
        _chat(_client(srv.url, max_retries=1, timeout_s=0.5))
    assert isinstance(e.value, RejectedError) and e.value.status == 408
    assert len(srv.requests) == 2  # still retried first


def test_400_is_a_rejected_row_not_retried(serve):
    msg = "This model's maximum context length is 2048 tokens. However, you requested 9000."
    srv = serve(_always((400, {}, vllm_error(400, msg))))
    with pytest.raises(RejectedError) as e:
        _chat(_client(srv.url, max_retries=3))
    assert e.value.status == 400 and msg in e.value.detail
    assert len(srv.requests) == 1


def test_422_is_a_rejected_row(serve):
    srv = serve(_always((422, {}, vllm_error(422, "bad field"))))
    with pytest.raises(RejectedError) as e:
        _chat(_client(srv.url, max_retries=3))
    assert e.value.status == 422 and "bad field" in e.value.detail
    assert len(srv.requests) == 1


def test_404_stops_the_job_without_retrying(serve):
    srv = serve(_always((404, {}, vllm_error(404, "The model `m` does not exist."))))
    with pytest.raises(ServiceUnavailableError, match="404 for model 'm'"):
        _chat(_client(srv.url, max_retries=3))
    assert len(srv.requests) == 1


def test_answer_without_token_ids_is_service_unavailable(serve):
    body = vllm_body()
    del body["prompt_token_ids"]
    srv = serve(_always((200, {}, body)))
    with pytest.raises(ServiceUnavailableError, match="return_token_ids"):
        _chat(_client(srv.url))
    assert len(srv.requests) == 1


# -- the regen stage over the same server -------------------------------------------------


def _stage_store(smollm2_path, tmp_path, prompts: list[str], **regen):
    from tests.regen.realdata import store_with_dedup

    rows = [
        {
            "messages": [
                {"role": "user", "content": p},
                {"role": "assistant", "content": "dataset answer"},
            ],
            "tools": None,
        }
        for p in prompts
    ]
    recipe = {
        "name": "regen-client",
        "target": {"path": str(smollm2_path)},
        "datasets": [{"path": "replaced.jsonl"}],
        "regen": {
            "max_retries": 1,
            "request_timeout_s": 10,
            "max_turns": 1,
            "max_tokens": 16,
            **regen,
        },
        "serve": {"served_model_name": "m"},
    }
    store, _ = store_with_dedup(recipe, tmp_path / "data", rows)
    return store


def test_stage_counts_a_rejected_row_and_keeps_the_others(serve, smollm2_path, tmp_path):
    from tests.conftest import run_stage

    def script(n, body):
        if "REJECT" in body["messages"][-1]["content"]:
            return 400, {}, vllm_error(400, "prompt is too long")
        return 200, {}, vllm_body(f"answer to {body['messages'][-1]['content']}")

    srv = serve(script)
    store = _stage_store(smollm2_path, tmp_path, ["first question", "REJECT me", "third one"])
    rows = [c.messages[0].content for c in store.dedup.conversations(0)]
    (m,) = run_stage(store, "regen", urls={"baseline": srv.url})
    assert (m.counts["input"], m.counts["success"], m.counts["error"]) == (3, 2, 1)
    assert m.counts["error:server_rejected"] == 1
    (bad,) = store.regen.errors_path(0).read_text().splitlines()
    bad = json.loads(bad)
    assert bad["row"] == rows.index("REJECT me") and bad["reason"] == "server_rejected"
    assert "prompt is too long" in bad["detail"]
    ok = store.regen.records(0)
    assert [r.row for r in ok] == sorted(i for i, p in enumerate(rows) if p != "REJECT me")
    for r in ok:
        assert r.messages[-1].content == f"answer to {rows[r.row]}"
        assert r.turns[0].prompt_token_ids == [1, 2, 3]
    assert len(srv.requests) == 3  # the rejection was not retried
    # Before generating, the three prompts and their answers were tokenized by the server.
    ids = [c.id for c in store.dedup.conversations(0)]
    assert m.extra["tokenizer_check"]["rows"] == ids and len(srv.tokenized) == 6


def test_stage_counts_a_slow_row_on_a_healthy_server_and_keeps_the_others(
    serve, smollm2_path, tmp_path
):
    from tests.conftest import run_stage

    def script(n, body):
        if "SLOW" in body["messages"][-1]["content"]:
            time.sleep(2.5)  # past the 1 s request timeout
        return 200, {}, vllm_body(f"answer to {body['messages'][-1]['content']}")

    srv = serve(script, healthy=True)
    store = _stage_store(
        smollm2_path, tmp_path, ["first question", "SLOW one", "third one"], request_timeout_s=1
    )
    (m,) = run_stage(store, "regen", urls={"baseline": srv.url})
    assert (m.counts["input"], m.counts["success"], m.counts["error"]) == (3, 2, 1)
    assert m.counts["error:request_timeout"] == 1
    (bad,) = store.regen.errors_path(0).read_text().splitlines()
    assert "raise regen.request_timeout_s" in json.loads(bad)["detail"]


def test_stage_fails_without_a_manifest_when_the_server_stays_down(serve, smollm2_path, tmp_path):
    from tests.conftest import run_stage

    srv = serve(_always((503, {}, vllm_error(503, "overloaded"))))
    store = _stage_store(smollm2_path, tmp_path, ["one question", "another question"])
    with pytest.raises(ServiceUnavailableError, match="no answer after 1 retries"):
        run_stage(store, "regen", urls={"baseline": srv.url})
    assert not store.is_done("regen", 0)
    assert not store.regen.records_path(0).exists()
    # No row was counted as an error: the rerun will send them again.
    assert store.regen.partial_errors_path(0).read_text() == ""
    assert store.regen.partial_path(0).read_text() == ""
