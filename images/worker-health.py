"""Healthcheck of an Eyrie rq worker container (compose `healthcheck`, images/*.Dockerfile).

Healthy when Redis answers and every rq worker started in this container (`eyrie worker`
records its name in the container's own /tmp: `shared.queue.local_workers_dir`) is
registered in Redis with a fresh heartbeat. Not by hostname: under host networking every
container has the host's, so another container's worker would pass for this one's. rq
renews a worker's key while it heart-beats, also during a long job, so a hung or dead worker
drops out within its TTL. Exit 0 = healthy, 1 = not (the reason goes to stdout, which
`docker inspect` shows).
"""

import sys

from shared.errors import EyrieError
from shared.queue import connect, local_workers_health

#: A worker heart-beats every 30 s (`eyrie worker --monitor-interval-s`); three missed beats
#: mean it is gone.
STALE_AFTER_S = 90.0


def main() -> int:
    try:
        conn = connect()
    except EyrieError as e:
        print(f"unhealthy: {e}")
        return 1
    why = local_workers_health(conn, STALE_AFTER_S)
    if why is None:
        return 0
    print(f"unhealthy: {why}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
