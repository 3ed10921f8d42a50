"""The GPU lease: which pipeline phase owns the node's GPUs, held in Redis.

On one node the baseline vLLM server (regen), the extractor, the trainer and the bench
servers cannot all hold the GPUs at once, so GPU phases take turns. A phase takes the lease
before it starts and releases it when it ends; the next phase waits. The lease is a redis-py
`Lock` whose value is the holder's record (so `eyrie status` and error messages can name
it) and whose TTL a holder thread renews, so a dead conductor does not block the node for
longer than the TTL. A renewal that fails because Redis is briefly away is retried for up
to the Redis outage budget (`$EYRIE_REDIS_OUTAGE_S`); a lease whose TTL ran out during the
outage is taken again if it is still free.
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
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import LockError, RedisError

from shared.errors import ServiceUnavailableError
from shared.queue import REDIS_DOWN, RedisOutage

LEASE_KEY = "eyrie:gpu-lease"

log = logging.getLogger("eyrie.lease")


def current_holder(conn: Redis) -> dict | None:
    """The lease's holder record `{phase, run_id, token, owner, since}`, or None when free."""
    raw = conn.get(LEASE_KEY)
    return json.loads(raw) if raw else None  # type: ignore[arg-type]


@dataclass
class Lease:
    """A held GPU lease.

    Attributes:
        record: the holder record stored in Redis `{phase, run_id, token, owner, since}`.
        lost: None while held; else why it was lost (renewal failed past the outage
            budget, or another holder took it).
    """

    record: dict
    lost: str | None = None

    def check(self) -> None:
        """Raise unless the lease is still held.

        Raises:
            ServiceUnavailableError: the lease was lost; the message says why.
        """
        if self.lost is not None:
            raise ServiceUnavailableError(self.lost)


@contextmanager
def gpu_lease(
    conn: Redis,
    phase: str,
    run_id: str,
    ttl_s: float = 60,
    wait_s: float = 24 * 3600,
    poll_s: float = 1.0,
    outage_s: float | None = None,
) -> Iterator[Lease]:
    """Hold the GPU lease for `phase` for the duration of the block.

    Redis outages are ridden out for up to `outage_s` seconds, both while taking the lease
    and while renewing it (`shared.queue.RedisOutage`). When Redis comes back after the
    lease's TTL ran out, a free lease is taken again; one taken by another holder, or an
    outage longer than `outage_s`, marks the lease lost: `Lease.check()` then raises.

    Args:
        ttl_s: lease lifetime without renewal; a daemon thread renews it every ttl_s/3.
        wait_s: how long to wait for the current holder to release.
        poll_s: seconds between attempts while another phase holds it.
        outage_s: seconds a Redis outage is ridden out; None = `$EYRIE_REDIS_OUTAGE_S`.

    Raises:
        ServiceUnavailableError: the lease stayed taken for `wait_s` seconds (the message
            names the holder), or Redis stayed away longer than `outage_s`.
    """
    record = {
        "phase": phase,
        "run_id": run_id,
        "token": uuid.uuid4().hex,
        "owner": f"{socket.gethostname()}:{os.getpid()}",
        "since": time.time(),
    }
    token = json.dumps(record)
    lock = conn.lock(LEASE_KEY, timeout=ttl_s, sleep=poll_s, thread_local=False)
    outage = RedisOutage(f"the GPU lease for phase {phase!r}", outage_s)

    def take() -> bool:
        # An acquire whose reply an outage swallowed may have taken the lease: then it is ours.
        if conn.get(LEASE_KEY) == token.encode():
            lock.local.token = token.encode()
            return True
        return lock.acquire(blocking_timeout=wait_s, token=token)

    if not outage.call(take):
        holder = outage.call(current_holder, conn)
        raise ServiceUnavailableError(
            f"GPU lease for phase {phase!r} not granted within {wait_s:.0f}s; held by {holder}"
        )
    lease = Lease(record)
    stop = threading.Event()
    renewal = RedisOutage(f"renewing the GPU lease for phase {phase!r}", outage_s)

    def renew() -> None:
        period = ttl_s / 3
        while not stop.wait(period):
            try:
                lock.reacquire()
            except REDIS_DOWN as e:  # the TTL, then the outage budget, give time to retry
                if renewal.since is None:
                    renewal.since = time.monotonic()
                    log.warning("GPU lease %s: renewal failed (%s); retrying", phase, e)
                if time.monotonic() - renewal.since > renewal.budget_s:
                    lease.lost = (
                        f"GPU lease for phase {phase!r}: Redis unreachable for more than "
                        f"{renewal.budget_s:g}s while renewing it ({e})"
                    )
                    log.error("%s", lease.lost)
                    return
                period = min(ttl_s / 3, 2.0)
                continue
            except LockError:
                if renewal.since is not None and lock.acquire(blocking=False, token=token):
                    # Redis came back after the TTL ran out and nobody took the lease.
                    log.warning("GPU lease %s: expired during a Redis outage; taken again", phase)
                else:
                    try:
                        holder: object = current_holder(conn)
                    except RedisError:
                        holder = "unknown"
                    lease.lost = (
                        f"GPU lease for phase {phase!r} was lost (expired or taken over); "
                        f"now held by {holder}"
                    )
                    log.error("%s", lease.lost)
                    return
            renewal.succeeded()
            period = ttl_s / 3

    t = threading.Thread(target=renew, daemon=True, name=f"lease-{phase}")
    t.start()
    try:
        yield lease
    finally:
        stop.set()
        t.join(timeout=5)
        try:
            lock.release()
        except (LockError, RedisError) as e:
            log.warning("GPU lease %s: release failed (%s); it expires in %.0fs", phase, e, ttl_s)
