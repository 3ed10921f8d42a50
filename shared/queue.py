"""rq plumbing: Redis connection, JSON-only jobs, deterministic ids, workers, reconciler.

Invariants:
- every queue and job uses rq's JSON serializer: pickle would let anyone who can write to
  Redis run code in the workers;
- a job's payload is `{run_id, stage, shard}`; everything else is read from the run's
  resolved recipe on the volume;
- job ids are `<run_id>-<stage>-<shard>`, letters, digits, `_` and `-` only;
- a stage is done when its manifest exists, not when rq says so: rq's registries are
  unreliable when workers die (rq #2015, #2289). The reconciler only re-enqueues;
- workers run only `JOB_FUNC`: any other function, callbacks, webhooks or non-JSON data are
  refused before anything runs (`AllowlistWorkerMixin`);
- a Redis outage is ridden out for `$EYRIE_REDIS_OUTAGE_S` seconds (`RedisOutage`) by the
  conductor, the reconciler, the GPU lease and the workers (`OutageTolerantWorkerMixin`);
  past that each stops with one line.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit, urlunsplit

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, Retry, SimpleWorker, Worker
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import InvalidJobOperation, StopRequested
from rq.job import Job, JobStatus
from rq.scheduler import RQScheduler
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

log = logging.getLogger("eyrie.queue")
T = TypeVar("T")

#: Redis errors that mean "Redis is away for now", as opposed to a bad command.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)

#: Environment setting: how long (seconds) the conductor, the reconciler, the GPU lease and
#: the workers ride out a Redis outage before giving up with one line and a non-zero exit.
REDIS_OUTAGE_ENV = "EYRIE_REDIS_OUTAGE_S"
DEFAULT_REDIS_OUTAGE_S = 600.0


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


def redis_outage_s() -> float:
    """`$EYRIE_REDIS_OUTAGE_S`: seconds a Redis outage is ridden out (default 600).

    Raises:
        ConfigError: the value is not a finite number > 0.
    """
    raw = os.environ.get(REDIS_OUTAGE_ENV)
    if raw is None or raw == "":
        return DEFAULT_REDIS_OUTAGE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{REDIS_OUTAGE_ENV}={raw!r:.40}: expected seconds, a number > 0")
    return value


class RedisOutage:
    """Rides out one Redis outage at a time for at most `budget_s` seconds.

    `call(fn)` runs `fn`; while it raises a connection or timeout error it is retried with
    exponential backoff (0.5 s doubling to 10 s). An outage starts at the first error and
    ends at the next success; when one lasts longer than `budget_s` the error becomes a
    `ServiceUnavailableError` with one line naming Redis (password masked), what was being
    done and for how long. Only idempotent work may be wrapped: a call interrupted midway
    is run again from its start.

    Args:
        what: what the caller does, for messages ("the conductor's wait loop").
        budget_s: seconds one outage may last; None = `redis_outage_s()`.
        url: the Redis URL for messages; None = `redis_url()`.
    """

    def __init__(self, what: str, budget_s: float | None = None, url: str | None = None):
        self.what = what
        self.budget_s = redis_outage_s() if budget_s is None else budget_s
        self.url = url or redis_url()
        self.since: float | None = None
        self._delay = 0.5

    def failed(self, err: BaseException) -> None:
        """Record a failed attempt; sleep the backoff, or raise once past the budget.

        Raises:
            ServiceUnavailableError: the outage has lasted longer than `budget_s`.
        """
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self._delay = 0.5
            log.warning(
                "%s: Redis at %s unreachable (%s); retrying for up to %.0fs",
                self.what, mask_url(self.url), err, self.budget_s,
            )  # fmt: skip
        elapsed = now - self.since
        if elapsed >= self.budget_s:
            raise ServiceUnavailableError(
                f"Redis at {mask_url(self.url)} unreachable for {elapsed:.0f}s during "
                f"{self.what} ({type(err).__name__}: {str(err)[:200]}); gave up after "
                f"{REDIS_OUTAGE_ENV}={self.budget_s:g}s. Start Redis and rerun: finished "
                "shards are kept."
            ) from err
        time.sleep(min(self._delay, self.budget_s - elapsed))
        self._delay = min(self._delay * 2, 10.0)

    def succeeded(self) -> None:
        """Record a success: the outage, if any, is over."""
        if self.since is not None:
            log.warning("%s: Redis is back after %.1fs", self.what, time.monotonic() - self.since)
            self.since = None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, retried through Redis outages (see the class).

        Raises:
            ServiceUnavailableError: Redis stayed away longer than the budget.
        """
        while True:
            try:
                result = fn(*args, **kwargs)
            except REDIS_DOWN as e:
                self.failed(e)
                continue
            self.succeeded()
            return result

    def wait_for(self, conn: Redis) -> None:
        """Block until `conn` answers PING (within the budget).

        Raises:
            ServiceUnavailableError: it did not within the budget.
        """
        self.call(conn.ping)


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


def refusal_reason(job: Job, job_funcs: frozenset[str] = frozenset({JOB_FUNC})) -> str | None:
    """Why a worker must not run `job`, or None when it may.

    Only the job's function name and its callback and webhook fields are read; nothing is
    imported and the arguments are not acted on (the queue's serializer is JSON, so reading
    the job's data runs no code). A job is refused when its function is not in `job_funcs`,
    when it is bound to an instance, when it names an `on_success`/`on_failure`/`on_stopped`
    callback (each an import path rq would call), or when it carries webhooks (URLs rq would
    post to).
    """
    try:
        func, instance = job.func_name, job._instance
    except Exception as e:  # data that is not JSON: pickle, or garbage
        return f"job data is not Eyrie's JSON payload ({type(e).__name__})"
    if func not in job_funcs:
        return f"function {func!r:.120} is not Eyrie's job function {JOB_FUNC}"
    if instance is not None:
        return "the job is bound to an instance"
    callbacks = {
        "on_success": job._success_callback_name,
        "on_failure": job._failure_callback_name,
        "on_stopped": job._stopped_callback_name,
    }
    named = [f"{k}={v!r:.120}" for k, v in callbacks.items() if v]
    if named:
        return f"the job names callbacks ({', '.join(named)})"
    webhooks = getattr(job, "webhooks", None) or []  # rq 3's; rq 2 has none
    if webhooks:
        return f"the job carries {len(webhooks)} webhook(s)"
    return None


class AllowlistWorkerMixin:
    """Refuses, before running anything, every job that is not an Eyrie stage job.

    Anyone who can write to Redis can push a job naming any importable function (with the
    JSON serializer, `os.system` and a string are enough) or callbacks and webhooks. The
    worker checks each dequeued job with `refusal_reason`; a refused job is logged, moved to
    the failed registry with the reason as its failure text, and the worker goes on serving.

    Attributes:
        job_funcs: function import paths this worker runs; `{JOB_FUNC}` for `eyrie worker`.
    """

    job_funcs: frozenset[str] = frozenset({JOB_FUNC})

    def execute_job(self, job: Job, queue: Queue) -> None:
        reason = refusal_reason(job, self.job_funcs)
        if reason is None:
            super().execute_job(job, queue)  # type: ignore[misc]
            return
        worker: Worker = self  # type: ignore[assignment]
        text = f"RefusedJobError: job {job.id} refused by worker {worker.name}: {reason}"
        worker.log.error(text)
        with worker.connection.pipeline() as pipe:
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            job.ended_at = datetime.now(UTC)
            job._handle_failure(text, pipeline=pipe, worker_name=worker.name or "")
            pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            pipe.execute()


class OutageTolerantWorkerMixin:
    """Keeps an rq worker, and the shard it runs, alive through a short Redis outage.

    rq's own loop retries only while it waits for a job; a Redis error anywhere else (a
    heartbeat, a state update, the monitoring of a running work-horse, a job's start or end
    bookkeeping) ends the worker, and with it the shard it was running. Here:

    - heartbeats, state updates, suspension checks and maintenance passes that hit an
      outage are skipped (the next one runs when Redis is back), so a running work-horse
      keeps being monitored and the job keeps running;
    - when a job's own rq bookkeeping fails on an outage, the worker waits for Redis
      (`RedisOutage`) and puts the job back on its queue: a shard that finished meanwhile
      has its manifest, and its re-run is a no-op, so nothing is lost or done twice;
    - past `outage_s` without Redis (idle or busy), the worker stops: `gave_up` says why
      and `eyrie worker` exits 1 with that line; compose restarts it. A forked work-horse
      still finishes its shard; a shard without a manifest is re-enqueued by the
      reconciler.

    Attributes:
        outage_s: seconds an outage is ridden out (`redis_outage_s()`).
        gave_up: None, or the one-line reason the worker stopped.
    """

    outage_s: float = DEFAULT_REDIS_OUTAGE_S
    gave_up: str | None = None

    def _outage(self) -> RedisOutage:
        existing: RedisOutage | None = getattr(self, "_redis_outage", None)
        if existing is None:
            existing = RedisOutage(f"worker {getattr(self, 'name', '?')}", self.outage_s)
            self._redis_outage = existing
        return existing

    def _tolerate(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            result = fn()
        except REDIS_DOWN as e:
            outage = self._outage()
            if outage.since is None:
                outage.since = time.monotonic()
                log.warning("worker: Redis unreachable during %s (%s); carrying on", what, e)
            elif time.monotonic() - outage.since > outage.budget_s:
                try:
                    outage.failed(e)
                except ServiceUnavailableError as gave_up:
                    self._give_up(gave_up)
            return None
        current: RedisOutage | None = getattr(self, "_redis_outage", None)
        if current is not None:
            current.succeeded()
        return result

    def _give_up(self, err: ServiceUnavailableError) -> NoReturn:
        # rq's loop ends quietly on StopRequested (any other exception is logged with its
        # traceback); `eyrie worker` then prints `gave_up` as its one line.
        self.gave_up = str(err)
        getattr(self, "log", log).error("%s", err)
        raise StopRequested() from err

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        sup: Any = super()
        if pipeline is not None:  # only queues commands; whoever executes the pipeline fails
            sup.heartbeat(timeout, pipeline)
            return
        self._tolerate(lambda: sup.heartbeat(timeout), "a heartbeat")

    def maintain_heartbeats(self, job: Job, execution: Any) -> None:
        sup: Any = super()
        self._tolerate(lambda: sup.maintain_heartbeats(job, execution), f"job {job.id}'s heartbeat")

    def set_state(self, state: str, pipeline: Any = None) -> None:
        sup: Any = super()
        if pipeline is not None:
            sup.set_state(state, pipeline)
            return
        self._tolerate(lambda: sup.set_state(state), "a state update")

    def check_for_suspension(self, burst: bool) -> None:
        sup: Any = super()
        self._tolerate(lambda: sup.check_for_suspension(burst), "the suspension check")

    def run_maintenance_tasks(self) -> None:
        sup: Any = super()
        self._tolerate(sup.run_maintenance_tasks, "maintenance")

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            super().execute_job(job, queue)  # type: ignore[misc]
        except REDIS_DOWN as e:
            w: Worker = self  # type: ignore[assignment]
            w.log.warning("job %s: Redis went away during its bookkeeping (%s)", job.id, e)
            outage = self._outage()
            try:
                outage.failed(e)
                outage.wait_for(w.connection)
                outage.call(_requeue_interrupted, job, queue)
            except ServiceUnavailableError as gave_up:
                self._give_up(gave_up)
            w.log.warning("job %s: back on queue %s after the Redis outage", job.id, queue.name)


def _requeue_interrupted(job: Job, queue: Queue) -> None:
    """Put a job whose rq bookkeeping an outage interrupted back on its queue.

    A finished job is left alone. Stale entries of its execution in the started registry
    and the intermediate queue are removed, so rq's cleanup does not later take the re-run
    for an abandoned job.
    """
    conn = queue.connection
    try:
        status = job.get_status(refresh=True)
    except InvalidJobOperation:  # its hash is gone (Redis came back without it)
        log.warning("job %s: gone from Redis after the outage; nothing to requeue", job.id)
        return
    if status == JobStatus.FINISHED:
        return
    reg = queue.started_job_registry
    members: list[bytes] = conn.zrange(reg.key, 0, -1)  # type: ignore[assignment]
    stale = [m for m in members if m.decode().split(":")[0] == job.id]
    with conn.pipeline() as pipe:
        if stale:
            pipe.zrem(reg.key, *stale)
        pipe.lrem(queue.intermediate_queue_key, 0, job.id)
        pipe.execute()
    if status != JobStatus.QUEUED or job.id not in queue.get_job_ids():
        queue.enqueue_job(job)


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have this (forked) process get `sig` when its parent process dies.

    On Linux the kernel does it (`prctl(PR_SET_PDEATHSIG)`); elsewhere a daemon thread polls
    the parent pid every second. A parent that died before this call is caught by comparing
    `os.getppid()` with `parent_pid`.
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os.kill(os.getpid(), sig)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the kernel was told to watch
        os.kill(os.getpid(), sig)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ParentBoundScheduler(RQScheduler):
    """rq's scheduler process, stopped (locks released) when the worker that forked it dies.

    rq forks the scheduler from the worker and never tells it when the worker dies: after a
    `kill -9` of the worker it lives on with parent 1, renewing the scheduler lock, so no
    live worker can take over the scheduling of retries. Here the child asks for SIGTERM on
    its parent's death; rq's handler then stops it, releasing its locks.

    rq's scheduler loop also ends on the first Redis error; this one (rq 3.0's loop, same
    steps) skips a pass while Redis is away and lives as long as its worker does.
    """

    def start(self) -> Any:
        self._parent_pid = os.getpid()
        return super().start()

    def work(self) -> None:
        die_with_parent(self._parent_pid)
        self._install_signal_handlers()
        self.register_birth()
        down_since: float | None = None
        while True:
            if self._stop_requested:
                try:
                    self.stop()
                except REDIS_DOWN:  # the locks expire on their own
                    pass
                break
            try:
                if self.should_reacquire_locks:
                    self.acquire_locks()
                self.heartbeat()
                self.enqueue_scheduled_jobs()
            except REDIS_DOWN as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("rq scheduler: Redis unreachable (%s); waiting for it", e)
            else:
                if down_since is not None:
                    log.warning("rq scheduler: Redis is back")
                    down_since = None
            time.sleep(self.interval)


class ParentBoundSchedulerMixin:
    """Starts `ParentBoundScheduler` where rq's worker would start its own `RQScheduler`."""

    def _start_scheduler(
        self,
        burst: bool = False,
        logging_level: str | None = "INFO",
        date_format: str = DEFAULT_LOGGING_DATE_FORMAT,
        log_format: str = DEFAULT_LOGGING_FORMAT,
    ) -> None:
        # rq 3.0's BaseWorker._start_scheduler, with the scheduler class swapped.
        w: Any = self
        w.scheduler = ParentBoundScheduler(
            w.queues,
            connection=w.connection,
            logging_level=logging_level if logging_level is not None else w.log.level,
            date_format=date_format,
            log_format=log_format,
            serializer=w.serializer,
        )
        w.scheduler.acquire_locks()
        if w.scheduler.acquired_locks:
            if burst:
                try:
                    w.scheduler.register_birth()
                    w.scheduler.enqueue_scheduled_jobs()
                finally:
                    w.scheduler.release_locks()
                    w.scheduler.register_death()
            else:
                w.scheduler.start()


class EyrieWorker(
    ParentBoundSchedulerMixin, OutageTolerantWorkerMixin, AllowlistWorkerMixin, Worker
):
    """rq's forking worker, running only Eyrie's stage jobs, riding out Redis outages.

    See `AllowlistWorkerMixin`, `OutageTolerantWorkerMixin` and `ParentBoundSchedulerMixin`.
    """


class HeartbeatSimpleWorker(
    ParentBoundSchedulerMixin, OutageTolerantWorkerMixin, AllowlistWorkerMixin, SimpleWorker
):
    """rq's non-forking worker, heart-beating while a job runs, running only Eyrie's jobs.

    rq's SimpleWorker runs the job in its own main thread, so it sends no heartbeat until the
    job ends: a worker on another host busy with a long training job would look exactly like
    a dead one. A daemon thread keeps `last_heartbeat` fresh; it dies with the process, so a
    killed worker still goes stale.
    """

    def execute_job(self, job: Job, queue: Queue) -> None:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.job_monitoring_interval):
                try:
                    self.heartbeat()
                except StopRequested:  # Redis gone past the budget: the job's end decides
                    return

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
    job_funcs: frozenset[str] = frozenset({JOB_FUNC}),
) -> EyrieWorker | HeartbeatSimpleWorker:
    """Build an rq worker for `queues`.

    extract/train get rq's non-forking SimpleWorker (the model stays loaded across jobs);
    CPU stages get the forking Worker. Mixing the two kinds in one worker is refused. Either
    kind runs only jobs whose function is in `job_funcs` and refuses the rest
    (`AllowlistWorkerMixin`); `eyrie worker` leaves it at Eyrie's one job function.

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
    cls = HeartbeatSimpleWorker if kinds == {True} else EyrieWorker
    w = cls(
        [get_queue(q, conn) for q in queues],
        connection=conn,
        name=name,
        serializer=JSONSerializer,
        job_monitoring_interval=job_monitoring_interval,
        worker_ttl=worker_ttl,
    )
    w.job_funcs = frozenset(job_funcs)
    w.outage_s = redis_outage_s()
    return w


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
        ids of the jobs put back on their queue by this call, each once: a job with retries
        left goes to rq's scheduled registry first (its retry interval) and is returned by the
        pass that moves it to the queue; one without goes to the failed registry and is
        requeued from there at once (at most `MAX_ABANDON_REQUEUES` times).
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
            for jid in dead:
                job = q.fetch_job(jid)
                status = job.get_status(refresh=True) if job is not None else None
                if status == JobStatus.SCHEDULED:
                    # Returned only once due (`_enqueue_due_retries`), so a retry is not
                    # reported twice; logged now, as the driver logs re-enqueues, in case
                    # rq's own scheduler moves it first.
                    log.warning("job %s abandoned by a dead worker: scheduled for a retry", jid)
                elif status == JobStatus.QUEUED:
                    requeued.append(jid)
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
