"""The GPU lease: which pipeline phase owns the node's GPUs, held in Redis.

On one node the baseline vLLM server (regen), the extractor, the trainer and the eval
servers cannot all hold the GPUs at once, so GPU phases take turns. A phase takes the lease
before it starts and releases it when it ends; the next phase waits. The lease has a TTL
that a holder thread renews, so a dead conductor does not block the node forever.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis

from shared.errors import ServiceUnavailableError

LEASE_KEY = "eyrie:gpu-lease"

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""


def current_holder(conn: Redis) -> dict | None:
    """The lease's holder record `{phase, run_id, owner, since}`, or None when free."""
    raw = conn.get(LEASE_KEY)
    return json.loads(raw) if raw else None


@contextmanager
def gpu_lease(
    conn: Redis,
    phase: str,
    run_id: str,
    ttl_s: float = 60,
    wait_s: float = 24 * 3600,
    poll_s: float = 1.0,
) -> Iterator[dict]:
    """Hold the GPU lease for `phase` for the duration of the block.

    Args:
        ttl_s: lease lifetime without renewal; a daemon thread renews it every ttl_s/3.
        wait_s: how long to wait for the current holder to release.

    Raises:
        ServiceUnavailableError: the lease stayed taken for `wait_s` seconds; the message
            names the holder.
    """
    record = {
        "phase": phase,
        "run_id": run_id,
        "token": uuid.uuid4().hex,
        "owner": f"{socket.gethostname()}:{os.getpid()}",
        "since": time.time(),
    }
    value = json.dumps(record)
    deadline = time.monotonic() + wait_s
    while not conn.set(LEASE_KEY, value, nx=True, px=int(ttl_s * 1000)):
        if time.monotonic() > deadline:
            raise ServiceUnavailableError(
                f"GPU lease for phase {phase!r} not granted within {wait_s:.0f}s; "
                f"held by {current_holder(conn)}"
            )
        time.sleep(poll_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 3):
            conn.eval(_RENEW, 1, LEASE_KEY, value, int(ttl_s * 1000))

    t = threading.Thread(target=renew, daemon=True, name=f"lease-{phase}")
    t.start()
    try:
        yield record
    finally:
        stop.set()
        t.join(timeout=5)
        conn.eval(_RELEASE, 1, LEASE_KEY, value)
