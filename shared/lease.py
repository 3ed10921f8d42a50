"""The GPU lease: which pipeline phase owns the node's GPUs, held in Redis.

On one node the baseline vLLM server (regen), the extractor, the trainer and the bench
servers cannot all hold the GPUs at once, so GPU phases take turns. A phase takes the lease
before it starts and releases it when it ends; the next phase waits. The lease is a redis-py
`Lock` whose value is the holder's record (so `eyrie status` and error messages can name
it) and whose TTL a holder thread renews, so a dead conductor does not block the node for
longer than the TTL. A renewal that fails because Redis is briefly away is retried; the
lease is only lost if its TTL runs out meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis
from redis.exceptions import LockError, RedisError

from shared.errors import ServiceUnavailableError

LEASE_KEY = "eyrie:gpu-lease"

log = logging.getLogger("eyrie.lease")


def current_holder(conn: Redis) -> dict | None:
    """The lease's holder record `{phase, run_id, token, owner, since}`, or None when free."""
    raw = conn.get(LEASE_KEY)
    return json.loads(raw) if raw else None  # type: ignore[arg-type]


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
        poll_s: seconds between attempts while another phase holds it.

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
    lock = conn.lock(LEASE_KEY, timeout=ttl_s, sleep=poll_s, thread_local=False)
    if not lock.acquire(blocking_timeout=wait_s, token=json.dumps(record)):
        raise ServiceUnavailableError(
            f"GPU lease for phase {phase!r} not granted within {wait_s:.0f}s; "
            f"held by {current_holder(conn)}"
        )
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                lock.reacquire()
            except RedisError as e:  # Redis briefly away: the TTL gives time to retry
                log.warning("GPU lease %s: renewal failed (%s); retrying", phase, e)
            except LockError:
                log.error("GPU lease %s was lost (expired or taken over)", phase)
                return

    t = threading.Thread(target=renew, daemon=True, name=f"lease-{phase}")
    t.start()
    try:
        yield record
    finally:
        stop.set()
        t.join(timeout=5)
        try:
            lock.release()
        except (LockError, RedisError) as e:
            log.warning("GPU lease %s: release failed (%s); it expires in %.0fs", phase, e, ttl_s)
