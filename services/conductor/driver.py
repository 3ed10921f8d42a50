"""The conductor: turns a run into rq jobs, stage by stage, and drives GPU phases.

Within a stage every shard is an independent rq job, so N workers share it. Across stages
the conductor waits on manifests (a stage is done when every shard's manifest exists), not
on rq registries, which are unreliable when workers die (STYLE.md §11). While it waits it
runs the reconciler, so a job abandoned by a dead worker is re-enqueued within seconds.

GPU phases (regen server, extract, train, eval servers) take the GPU lease in turn; the
phase's servers are started before its jobs are enqueued and stopped after.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from redis import Redis
from rq.job import JobStatus

from services.conductor.stages import Stage, pipeline, shards_of
from shared.errors import StageFailedError
from shared.lease import gpu_lease
from shared.queue import JobSpec, enqueue, failure_text, get_queue, job_id, reconcile
from shared.recipe import Recipe
from shared.store import RunStore, atomic_write_json

log = logging.getLogger("eyrie.conductor")


@dataclass
class DriveOptions:
    """Knobs of the wait loop.

    Attributes:
        poll_s: seconds between manifest checks.
        reconcile_every_s: seconds between reconciler passes.
        stale_after_s: a started job whose worker's heartbeat is older than this is abandoned.
        stop_after: stop after this stage (inclusive); None = run everything.
    """

    poll_s: float = 1.0
    reconcile_every_s: float = 5.0
    stale_after_s: float = 90.0
    stop_after: str | None = None


def plan(store: RunStore, recipe: Recipe) -> int:
    """Write the run's plan (`plan.json`: shard count and per-shard source rows) if absent."""
    from services.prep.plan import make_plan

    return make_plan(store, recipe)


@contextlib.contextmanager
def stage_phase(
    stage: Stage, store: RunStore, recipe: Recipe, conn: Redis, shards: list[int]
) -> Iterator[None]:
    """Hold the GPU lease and the servers `stage` needs while its `shards` run."""
    if stage.gpu_phase is None:
        yield
        return
    from services.serve.launcher import modes_for_stage, serving

    with gpu_lease(conn, stage.gpu_phase, store.run_id):
        modes = modes_for_stage(stage.name, recipe, shards)
        if modes:
            with serving(recipe, store, modes):
                yield
        else:
            yield


def _shard_groups(stage: Stage, recipe: Recipe, shards: list[int]) -> list[list[int]]:
    if stage.name == "eval" and not recipe.eval.side_by_side:
        return [[s] for s in shards]
    return [shards]


def _failed_error(stage: Stage, conn: Redis, run_id: str, shard: int) -> StageFailedError | None:
    job = get_queue(stage.queue, conn).fetch_job(job_id(run_id, stage.name, shard))
    if job is None or job.get_status(refresh=True) != JobStatus.FAILED:
        return None
    text = failure_text(job)
    if "AbandonedJobError" in text:
        return None  # the reconciler requeues these
    tail = text.strip().splitlines()[-3:]
    return StageFailedError(
        f"stage {stage.name} shard {shard} of {run_id} failed: "
        + " | ".join(tail)
        + f"\n  (full traceback: `rq info` or job {job.id})"
    )


def run_stage(
    stage: Stage,
    store: RunStore,
    recipe: Recipe,
    conn: Redis,
    opts: DriveOptions,
    on_tick: Callable[[], None] | None = None,
) -> bool:
    """Enqueue the unfinished shards of `stage` and wait until all are done.

    Returns:
        False when every shard was already done (nothing ran), else True.
    """
    all_shards = shards_of(stage, store)
    todo = [s for s in all_shards if not store.is_done(stage.name, s)]
    if not todo:
        log.info("stage %s: all %d shard(s) done, skipping", stage.name, len(all_shards))
        return False
    for group in _shard_groups(stage, recipe, todo):
        with stage_phase(stage, store, recipe, conn, group):
            for shard in group:
                enqueue(
                    JobSpec(stage.queue, store.run_id, stage.name, shard, stage.timeout_s), conn
                )
            _wait(stage, store, conn, group, opts, on_tick)
    return True


def _wait(
    stage: Stage,
    store: RunStore,
    conn: Redis,
    shards: list[int],
    opts: DriveOptions,
    on_tick: Callable[[], None] | None,
) -> None:
    last_reconcile = 0.0
    while True:
        pending = [s for s in shards if not store.is_done(stage.name, s)]
        if not pending:
            return
        for s in pending:
            err = _failed_error(stage, conn, store.run_id, s)
            if err is not None:
                raise err
        if time.monotonic() - last_reconcile > opts.reconcile_every_s:
            last_reconcile = time.monotonic()
            requeued = reconcile(conn, (stage.queue,), opts.stale_after_s)
            for jid in requeued:
                log.warning("re-enqueued abandoned job %s", jid)
        if on_tick:
            on_tick()
        time.sleep(opts.poll_s)


def drive(
    store: RunStore,
    conn: Redis,
    opts: DriveOptions | None = None,
    on_tick: Callable[[], None] | None = None,
) -> None:
    """Run every stage of the run to completion, skipping finished shards.

    Raises:
        StageFailedError: a shard failed for good (its retries are spent).
    """
    opts = opts or DriveOptions()
    recipe = store.recipe()
    plan(store, recipe)
    timings_path = store.root / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    for stage in pipeline(recipe):
        t0 = time.monotonic()
        if run_stage(stage, store, recipe, conn, opts, on_tick):
            dt = round(time.monotonic() - t0, 1)
            log.info("stage %s done in %.1fs", stage.name, dt)
            timings[stage.name] = dt
            atomic_write_json(timings_path, timings)
        if opts.stop_after == stage.name:
            return
