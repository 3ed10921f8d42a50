"""Local processes the conductor starts on a CPU machine: redis-server and rq workers.

On the GPU node compose runs these as services; the demo, the tests and the benchmark
scripts start them here, all through these functions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from shared.errors import ServiceUnavailableError

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis_server(
    port: int, folder: Path, log: IO | int = subprocess.DEVNULL, ready_timeout_s: float = 20
) -> tuple[subprocess.Popen, str]:
    """Start a throw-away redis-server on 127.0.0.1:`port` (no persistence) and wait for it.

    Returns:
        (process, URL).

    Raises:
        ServiceUnavailableError: no redis-server binary, or it did not answer in time.
    """
    from redis import Redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceUnavailableError("redis-server not found: run scripts/setup (apt)")
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            Redis.from_url(url).ping()
            return proc, url
        except Exception:  # redis-py raises several kinds while the server boots
            if time.monotonic() > deadline or proc.poll() is not None:
                stop_process(proc)
                raise ServiceUnavailableError(
                    f"redis-server did not start on port {port}"
                ) from None
            time.sleep(0.1)


def start_worker(
    queues: list[str],
    name: str,
    env: dict[str, str],
    log: IO | int = subprocess.DEVNULL,
    monitor_interval_s: int = 5,
    burst: bool = False,
) -> subprocess.Popen:
    """Start `eyrie worker QUEUES` as a subprocess of this repo's Python.

    Args:
        name: the rq worker name; must be unique while a killed namesake is still
            registered in Redis.
        env: its environment (EYRIE_REDIS_URL, EYRIE_DATA, ...).
        monitor_interval_s: rq heartbeat period; short, so a dead worker is noticed soon.
    """
    cmd = [
        sys.executable,
        "-m",
        "services.conductor.cli",
        "worker",
        *queues,
        "--name",
        name,
        "--monitor-interval-s",
        str(monitor_interval_s),
    ] + (["--burst"] if burst else [])
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def is_running(pid: int | None) -> bool:
    """Whether `pid` runs here (an exited child not yet reaped, a zombie, does not)."""
    import psutil

    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_tree(pid: int, grace_s: float = 20) -> None:
    """SIGTERM `pid` and all its descendants; SIGKILL whatever is left after `grace_s`.

    Exited children are reaped (psutil waits on them), so none is left a zombie.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """Stop a process this one started, and its descendants (`stop_tree`); reap it."""
    if proc.poll() is None:
        stop_tree(proc.pid, grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
