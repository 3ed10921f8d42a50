"""rq plumbing: Redis connection, JSON-only jobs, deterministic ids, workers, reconciler.

Invariants:
- every queue and job uses rq's JSON serializer: pickle would let anyone who can write to
  Redis run code in the workers;
- a job's payload is `{run_id, stage, shard}`; everything else is read from the run's
  resolved recipe on the volume;
- job ids are `<run_id>-<stage>-<shard>`, letters, digits, `_` and `-` only;
- a stage is done when its manifest exists, not when rq says so: rq's registries are
  unreliable when workers die (rq #2015, #2289). The reconciler only re-enqueues.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from rq import Queue, Retry, SimpleWorker, Worker
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from shared.errors import ConfigError, ServiceUnavailableError

#: Every queue Eyrie uses. Extraction and training never share a queue, so neither worker
#: takes the other's job.
QUEUES = ("prep", "regen", "extract", "train", "bench")

#: Queues whose workers hold a model for their whole life: rq's non-forking SimpleWorker.
NON_FORKING_QUEUES = frozenset({"extract", "train"})

#: The one job function every stage job runs; it dispatches on the payload's stage
#: (`shared.stage.run_stage_job`). Workers refuse every other function.
JOB_FUNC = "shared.stage.run_stage_job"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

#: An abandoned job is requeued at most this many times; then it stays failed.
MAX_ABANDON_REQUEUES = 5

_JOB_ID_OK = re.compile(r"^[A-Za-z0-9_-]+$")


def redis_url() -> str:
    """`$EYRIE_REDIS_URL`, default redis://127.0.0.1:6379/0. May carry a password."""
    return os.environ.get("EYRIE_REDIS_URL", DEFAULT_REDIS_URL)


def mask_url(url: str) -> str:
    """The URL with any password replaced by `***` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str | None = None) -> Redis:
    """A checked Redis connection.

    Raises:
        ServiceUnavailableError: Redis does not answer PING; the message has the URL with the
            password masked.
    """
    url = url or redis_url()
    try:
        conn = Redis.from_url(url, socket_connect_timeout=5)
        conn.ping()
    except (RedisConnectionError, RedisError, ValueError) as e:
        raise ServiceUnavailableError(
            f"cannot reach Redis at {mask_url(url)}: {e}. Start redis-server or set "
            "EYRIE_REDIS_URL."
        ) from e
    return conn


def job_id(run_id: str, stage: str, shard: int) -> str:
    """Deterministic rq job id `<run_id>-<stage>-<shard>`.

    Raises:
        ConfigError: a part holds characters rq does not accept in job ids.
    """
    jid = f"{run_id}-{stage}-{int(shard)}"
    if not _JOB_ID_OK.match(jid):
        raise ConfigError(f"job id {jid!r}: only letters, digits, '_' and '-' are allowed")
    return jid


def validate_payload(run_id: object, stage: object, shard: object) -> tuple[str, str, int]:
    """Check a job payload before anything acts on it: a run id, a known stage, a shard.

    The shard's range is checked against the run when the stage executes.

    Raises:
        ConfigError: naming the field that is wrong.
    """
    from shared.recipe import check_run_id
    from shared.stage import get_stage

    check_run_id(run_id)  # type: ignore[arg-type]
    if not isinstance(stage, str):
        raise ConfigError(f"job payload stage: expected a stage name (got {stage!r:.80})")
    get_stage(stage)
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
        raise ConfigError(f"job payload shard: expected an integer >= 0 (got {shard!r:.80})")
    return str(run_id), stage, shard


def queue_drained(name: str, conn: Redis) -> bool:
    """Whether queue `name` holds no job waiting to start."""
    return len(get_queue(name, conn)) == 0


def get_queue(name: str, conn: Redis) -> Queue:
    """The named Eyrie queue, with the JSON serializer."""
    if name not in QUEUES:
        raise ConfigError(f"unknown queue {name!r}; known: {', '.join(QUEUES)}")
    return Queue(name, connection=conn, serializer=JSONSerializer)


def _check_json(payload: dict[str, Any]) -> None:
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"job payload is not plain JSON ({e}): {payload!r}") from e


@dataclass(frozen=True)
class JobSpec:
    """What to enqueue for one stage shard."""

    queue: str
    run_id: str
    stage: str
    shard: int
    timeout_s: int
    retries: int = 2
    failure_ttl_s: int = 7 * 24 * 3600


def enqueue(spec: JobSpec, conn: Redis, depends_on: list[str] | None = None) -> Job:
    """Enqueue one stage-shard job, idempotently.

    An existing job with the same id that is queued, started, deferred or finished is left
    alone and returned; a failed or stopped one is re-enqueued.

    Raises:
        ConfigError: the payload is not JSON or the id is invalid.
    """
    payload = {"run_id": spec.run_id, "stage": spec.stage, "shard": spec.shard}
    _check_json(payload)
    if not isinstance(spec.shard, int) or isinstance(spec.shard, bool):
        raise ConfigError(f"job payload shard must be an integer (got {spec.shard!r})")
    jid = job_id(spec.run_id, spec.stage, spec.shard)
    q = get_queue(spec.queue, conn)
    existing = q.fetch_job(jid)
    if existing is not None:
        status = existing.get_status(refresh=True)
        if status in (
            JobStatus.QUEUED,
            JobStatus.STARTED,
            JobStatus.DEFERRED,
            JobStatus.SCHEDULED,
            JobStatus.FINISHED,
        ):
            return existing
        existing.delete()
    return q.enqueue(
        JOB_FUNC,
        kwargs=payload,
        job_id=jid,
        job_timeout=spec.timeout_s,
        failure_ttl=spec.failure_ttl_s,
        result_ttl=24 * 3600,
        retry=Retry(max=spec.retries, interval=[5, 30, 120][: max(spec.retries, 1)])
        if spec.retries
        else None,
        depends_on=depends_on or None,
        description=f"{spec.stage}[{spec.shard}] of {spec.run_id}",
        meta={"stage": spec.stage, "shard": spec.shard, "run_id": spec.run_id},
    )


class HeartbeatSimpleWorker(SimpleWorker):
    """rq's non-forking worker, heart-beating while a job runs.

    rq's SimpleWorker runs the job in its own main thread, so it sends no heartbeat until the
    job ends: a worker on another host busy with a long training job would look exactly like
    a dead one. A daemon thread keeps `last_heartbeat` fresh; it dies with the process, so a
    killed worker still goes stale.
    """

    def execute_job(self, job: Job, queue: Queue) -> None:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.job_monitoring_interval):
                self.heartbeat()

        thread = threading.Thread(target=beat, daemon=True, name="rq-heartbeat")
        thread.start()
        try:
            super().execute_job(job, queue)
        finally:
            stop.set()
            thread.join(timeout=5)


def make_worker(
    queues: list[str],
    conn: Redis,
    name: str | None = None,
    job_monitoring_interval: int = 30,
    worker_ttl: int | None = None,
) -> Worker | HeartbeatSimpleWorker:
    """Build an rq worker for `queues`.

    extract/train get rq's non-forking SimpleWorker (the model stays loaded across jobs);
    CPU stages get the forking Worker. Mixing the two kinds in one worker is refused.

    Raises:
        ConfigError: unknown queue, or extract/train mixed with forking queues.
    """
    for q in queues:
        if q not in QUEUES:
            raise ConfigError(f"unknown queue {q!r}; known: {', '.join(QUEUES)}")
    kinds = {q in NON_FORKING_QUEUES for q in queues}
    if len(kinds) > 1:
        raise ConfigError(
            f"queues {queues}: extract/train need a non-forking worker of their own; "
            "start them separately from prep/regen/eval"
        )
    cls = HeartbeatSimpleWorker if kinds == {True} else Worker
    return cls(
        [get_queue(q, conn) for q in queues],
        connection=conn,
        name=name,
        serializer=JSONSerializer,
        job_monitoring_interval=job_monitoring_interval,
        worker_ttl=worker_ttl,
    )


def local_workers_dir() -> Path:
    """Where `eyrie worker` records the rq names of the workers started in this container.

    `<tmp>/eyrie-workers` (tempfile's folder: `$TMPDIR`, else /tmp): a container's own
    /tmp, so a healthcheck sees exactly the workers of its container, whatever the hostname
    (every container of a host-networked stack has the host's).
    """
    return Path(tempfile.gettempdir()) / "eyrie-workers"


def record_local_worker(name: str) -> Path:
    """Record worker `name` as started here (`local_workers_dir()/<name>`); returns the file."""
    d = local_workers_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    path.write_text(f"{os.getpid()}\n")
    return path


def local_workers_health(conn: Redis, stale_after_s: float) -> str | None:
    """Why the workers recorded here are unhealthy, or None when each one is alive in Redis.

    Alive: `worker_gone` finds nothing wrong (rq renews the key and the heartbeat while the
    worker heart-beats, also during a job: `make_worker`).
    """
    d = local_workers_dir()
    names = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    if not names:
        return f"no worker recorded in {d}: `eyrie worker` has not started here"
    for name in names:
        why = worker_gone(conn, name, stale_after_s)
        if why is not None:
            return why
    return None


def failure_text(job: Job) -> str:
    """The traceback (or rq's failure note) of a failed job's latest run, or ''."""
    result = job.latest_result()
    return (result.exc_string or "") if result is not None else ""


#: How to inspect Eyrie's queues with rq's own CLI: its default serializer is pickle, which
#: would unpickle what Redis holds. Never run a plain `rq worker` or `rq info` on them.
RQ_CLI_FLAGS = "--serializer rq.serializers.JSONSerializer"


def failed_reason(conn: Redis, queue: str, run_id: str, stage: str, shard: int) -> str | None:
    """Why a stage shard's job failed for good, or None (not failed, or being retried).

    A job abandoned by a dead worker is not a failure here: the reconciler requeues it.
    """
    job = get_queue(queue, conn).fetch_job(job_id(run_id, stage, shard))
    if job is None or job.get_status(refresh=True) != JobStatus.FAILED:
        return None
    text = failure_text(job)
    if "AbandonedJobError" in text:
        return None
    tail = " | ".join(text.strip().splitlines()[-3:])
    return f"{tail}\n  (full traceback: `rq info {RQ_CLI_FLAGS}`, job {job.id})"


def worker_gone(conn: Redis, worker_name: str, stale_after_s: float) -> str | None:
    """Why rq worker `worker_name` is gone, or None while it lives, by what it keeps in Redis.

    Only rq's worker key and heartbeat count, never a pid or hostname looked up here: the
    workers run in other containers (their own pid namespaces; under host networking all of
    them share one hostname) and on other hosts. Gone = its key expired, it registered its
    death (a clean exit), or its heartbeat is older than `stale_after_s`.
    """
    key = Worker.redis_worker_namespace_prefix + worker_name
    w = Worker.find_by_key(key, connection=conn, serializer=JSONSerializer)
    if w is None:
        return f"worker {worker_name} is not registered in Redis (its key expired)"
    if conn.hexists(key, "death"):
        return f"worker {worker_name} exited"
    hb = w.last_heartbeat
    if hb is not None and time.time() - hb.timestamp() > stale_after_s:
        return f"worker {worker_name}: last heartbeat {time.time() - hb.timestamp():.0f} s ago"
    return None


def _worker_is_dead(conn: Redis, worker_name: str | None, stale_after_s: float) -> bool:
    return bool(worker_name) and worker_gone(conn, str(worker_name), stale_after_s) is not None


def _enqueue_due_retries(q: Queue) -> list[str]:
    """Move retries whose time has come from the scheduled registry into the queue.

    rq's scheduler does this, but its lock belongs to whichever worker won it: when that
    worker is the one that died, due retries wait until its lock expires. A job enqueued
    twice by a race with the scheduler is harmless, since stages are idempotent.
    """
    from rq.utils import current_timestamp

    reg = q.scheduled_job_registry
    moved = []
    for jid in reg.get_jobs_to_schedule(int(current_timestamp())):
        job = q.fetch_job(jid)
        reg.remove(jid)
        if job is not None:
            q.enqueue_job(job)
            moved.append(jid)
    return moved


def reconcile(
    conn: Redis, queues: tuple[str, ...] = QUEUES, stale_after_s: float = 90
) -> list[str]:
    """Find abandoned jobs (worker died, job left "started") and re-enqueue them.

    Runs rq's started-registry cleanup itself instead of waiting for a worker's maintenance
    pass (every 10 min by default), and also treats as abandoned any started job whose worker
    is gone: its Redis key expired or its heartbeat is older than `stale_after_s` (workers
    heart-beat every `job_monitoring_interval` while a job runs, `make_worker`). rq's
    cleanup then fails or retries it; a failed abandoned job is requeued here. Stages are
    idempotent and atomic, so a re-run beside an orphaned work-horse still writes each
    output once.

    Returns:
        ids of the jobs re-enqueued.
    """
    requeued: list[str] = []
    for name in queues:
        q = get_queue(name, conn)
        reg = q.started_job_registry
        reg.cleanup()  # rq's own pass: executions whose heartbeat TTL ran out
        dead = []
        members: list[bytes] = conn.zrange(reg.key, 0, -1)  # type: ignore[assignment]
        for member in members:
            jid = member.decode().split(":")[0]
            job = q.fetch_job(jid)
            if job is None or job.get_status(refresh=True) != JobStatus.STARTED:
                continue
            if _worker_is_dead(conn, job.worker_name, stale_after_s):
                # Expire the entry now so rq's cleanup does the bookkeeping (retry or fail).
                conn.zadd(reg.key, {member: 0}, xx=True)
                dead.append(jid)
        if dead:
            reg.cleanup(timestamp=1)
            requeued.extend(dead)
        requeued.extend(j for j in _enqueue_due_retries(q) if j not in requeued)
        failed = q.failed_job_registry
        for jid in failed.get_job_ids():
            job = q.fetch_job(jid)
            if job is None or "AbandonedJobError" not in failure_text(job):
                continue
            job.meta["abandoned"] = int(job.meta.get("abandoned", 0)) + 1
            job.save_meta()
            if job.meta["abandoned"] <= MAX_ABANDON_REQUEUES:
                failed.requeue(jid)
                if jid not in requeued:
                    requeued.append(jid)
    return requeued
