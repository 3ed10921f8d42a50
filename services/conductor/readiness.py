"""Readiness of a vLLM server: `/health` answers 200, then `/v1/models` lists the model.

`/health` turns 200 once the engine is up; `/v1/models` then proves the OpenAI routes are
mounted and names what is served. Polling stops early when the server process died, with the
tail of its log in the error, so a bad flag fails in seconds rather than at the timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from shared.errors import ServiceUnavailableError


def log_tail(path: Path | None, lines: int = 25) -> str:
    """The last `lines` lines of a log file ('' when there is none)."""
    if path is None or not Path(path).is_file():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.get(url)
    except httpx.HTTPError:
        return None


def wait_ready(
    url: str,
    timeout_s: float,
    alive: Callable[[], bool] = lambda: True,
    log_path: Path | None = None,
    poll_s: float = 1.0,
) -> list[str]:
    """Poll `url`/health, then `url`/v1/models, until both answer or `timeout_s` passes.

    Args:
        url: server base URL without `/v1`.
        timeout_s: total wait in seconds.
        alive: returns False once the server process/container has exited.
        log_path: the server's log, quoted in errors.

    Returns:
        the served model ids from `/v1/models`.

    Raises:
        ServiceUnavailableError: the server exited, or was not ready in time; the message
            has the URL, the wait and the log tail.
    """
    from shared.vllm import auth_headers

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, headers=auth_headers()) as client:
        while True:
            if not alive():
                raise ServiceUnavailableError(
                    f"vLLM server for {url} exited during startup; log {log_path}:\n"
                    f"{log_tail(log_path)}"
                )
            health = _get(client, f"{url}/health")
            if health is not None and health.status_code == 200:
                models = _get(client, f"{url}/v1/models")
                if models is not None and models.status_code == 200:
                    return [m["id"] for m in models.json().get("data", [])]
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"vLLM server at {url} not ready after {timeout_s:.0f}s; raise "
                    "serve.startup_timeout_s (unset, it is the weights' size at "
                    f"rates.load_bytes_per_s); log {log_path}:\n{log_tail(log_path)}"
                )
            time.sleep(poll_s)
