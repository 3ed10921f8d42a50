"""Healthcheck of an Eyrie rq worker container (compose `healthcheck`, images/*.Dockerfile).

Healthy when Redis answers and an rq worker registered from this container (same hostname)
is in Redis. rq renews a worker's key while the worker heart-beats, so a hung or dead worker
drops out within its TTL. Exit 0 = healthy, 1 = not (the reason goes to stdout, which
`docker inspect` shows).
"""

import socket
import sys

from rq import Worker
from rq.serializers import JSONSerializer

from shared.errors import EyrieError
from shared.queue import connect


def main() -> int:
    try:
        conn = connect()
    except EyrieError as e:
        print(f"unhealthy: {e}")
        return 1
    host = socket.gethostname()
    workers = Worker.all(connection=conn, serializer=JSONSerializer)
    if any(w.hostname == host for w in workers):
        return 0
    print(f"unhealthy: no rq worker from host {host} is registered in Redis")
    return 1


if __name__ == "__main__":
    sys.exit(main())
