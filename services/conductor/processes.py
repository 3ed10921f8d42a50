"""Local processes the conductor starts on a CPU machine: redis-server and rq workers.

On the GPU node compose runs these as services; the demo, the tests and the benchmark
scripts start them here, all through these functions.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from shared.errors import ServiceUnavailableError

ROOT = Path(__file__).resolve().parents[2]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the ephemeral range.

    A server started minutes later on a port the kernel also hands out to outgoing
    connections can find it taken by a client socket (`Address already in use`: a demo's
    vLLM lost its port to one of the many Redis/HTTP client sockets of a long run), so
    ports come from below the kernel's ephemeral range (`ip_local_port_range`).

    Raises:
        ServiceUnavailableError: no port in 10000 … ephemeral-low is free.
    """
    low, high = _ephemeral_range()
    top = low if low > 11000 else 65536
    bottom = 10000 if low > 11000 else high + 1
    for port in random.sample(range(bottom, top), min(200, top - bottom)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServiceUnavailableError(f"no free TCP port in {bottom}-{top - 1}")


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
