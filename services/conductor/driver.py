"""The conductor: turns a run into rq jobs, stage by stage, and drives the GPU phases.

The stages and their order come from their declarations (`shared.stage.pipeline`). Within a
stage every shard is an independent rq job, so N workers share it. Across stages the
conductor waits on manifests (a stage is done when every shard's manifest exists), not on
rq's registries, which are unreliable when workers die. While it waits it runs the
reconciler, so a job abandoned by a dead worker is re-enqueued within seconds.

A GPU stage takes the GPU lease for its phase; the vLLM servers each of its shard groups
declares are running before the group's jobs are enqueued (a server the next group launches
the same way stays up: the bench's baseline across its k groups), and all are stopped when
the stage ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from redis import Redis

from shared.artifacts import RunStore
from shared.errors import StageFailedError
from shared.lease import gpu_lease
from shared.queue import JobSpec, RedisOutage, enqueue, failed_reason, reconcile
from shared.recipe import Recipe
from shared.stage import Stage, pipeline

if TYPE_CHECKING:
    from services.conductor.servers import ServerPool

log = logging.getLogger("eyrie.conductor")


@dataclass
class DriveOptions:
    """Knobs of the wait loop.

    Attributes:
        poll_s: seconds between manifest checks.
        reconcile_every_s: seconds between reconciler passes.
        stale_after_s: a started job whose worker's heartbeat is older than this is abandoned.
        stop_after: stop after this stage (inclusive); None = run everything.
        redis_outage_s: how long a Redis outage is ridden out before the run stops with
            one line; None = `$EYRIE_REDIS_OUTAGE_S` (default 600 s).
    """

    poll_s: float = 1.0
    reconcile_every_s: float = 5.0
    stale_after_s: float = 90.0
    stop_after: str | None = None
    redis_outage_s: float | None = None


def _no_lease() -> None:
    return None


@dataclass
class Phase:
    """What a stage holds while its shard groups run.

    Attributes:
        check: call while waiting: raises `ServiceUnavailableError` once the GPU lease is
            lost (a no-op for CPU stages).
        pool: the GPU phase's servers (`services.conductor.servers.ServerPool`), kept across
            the stage's shard groups; None for CPU stages.
    """

    check: Callable[[], None]
    pool: ServerPool | None = None


@contextlib.contextmanager
def stage_phase(
    stage: Stage, store: RunStore, conn: Redis, opts: DriveOptions | None = None
) -> Iterator[Phase]:
    """Hold the GPU lease and a server pool while `stage`'s shard groups run (GPU stages)."""
    if stage.gpu_phase is None:
        yield Phase(_no_lease)
        return
    from services.conductor.servers import server_pool

    outage_s = opts.redis_outage_s if opts is not None else None
    with gpu_lease(conn, stage.gpu_phase, store.run_id, outage_s=outage_s) as lease:
        with server_pool(store) as pool:
            yield Phase(lease.check, pool)


def run_stage(
    stage: Stage,
    store: RunStore,
    recipe: Recipe,
    conn: Redis,
    opts: DriveOptions,
    on_tick: Callable[[], None] | None = None,
) -> bool:
    """Enqueue the unfinished shards of `stage` and wait until all are done.

    Shard groups (`Stage.shard_groups`) run one after another, each with the servers its
    shards need (a server the next group launches the same way stays up).

    Returns:
        False when every shard was already done (nothing ran), else True.
    """
    all_shards = stage.shard_numbers(store)
    todo = [s for s in all_shards if not store.is_done(stage.name, s)]
    if not todo:
        log.info("stage %s: all %d shard(s) done, skipping", stage.name, len(all_shards))
        return False
    outage = RedisOutage(f"stage {stage.name} of {store.run_id}", opts.redis_outage_s)
    with stage_phase(stage, store, conn, opts) as phase:
        for group in stage.shard_groups(recipe, todo):
            if phase.pool is not None:
                # shard_groups never mixes server recipes: the first shard's is the group's.
                phase.pool.serve(
                    stage.server_recipe(recipe, group[0]), stage.servers(recipe, group)
                )
            for shard in group:
                timeout = stage.job_timeout(recipe, store)
                spec = JobSpec(stage.queue, store.run_id, stage.name, shard, timeout)
                outage.call(enqueue, spec, conn)
            _wait(stage, store, conn, group, opts, on_tick, outage, phase.check)
    return True


def _wait(
    stage: Stage,
    store: RunStore,
    conn: Redis,
    shards: list[int],
    opts: DriveOptions,
    on_tick: Callable[[], None] | None,
    outage: RedisOutage,
    lease_ok: Callable[[], None],
) -> None:
    last_reconcile = 0.0

    def check(pending: list[int]) -> None:
        nonlocal last_reconcile
        for s in pending:
            reason = failed_reason(conn, stage.queue, store.run_id, stage.name, s)
            if reason is not None:
                raise StageFailedError(
                    f"stage {stage.name} shard {s} of {store.run_id} failed: {reason}"
                    + _timeout_hint(stage, reason)
                )
        if time.monotonic() - last_reconcile > opts.reconcile_every_s:
            for jid in reconcile(conn, (stage.queue,), opts.stale_after_s):
                log.warning("re-enqueued abandoned job %s", jid)
            last_reconcile = time.monotonic()

    while True:
        pending = [s for s in shards if not store.is_done(stage.name, s)]
        if not pending:
            return
        lease_ok()
        # Manifests are on disk, so an outage only pauses failure checks and the reconciler.
        outage.call(check, pending)
        if on_tick:
            outage.call(on_tick)  # the demo's ticker reads job progress from Redis
        time.sleep(opts.poll_s)


def _timeout_hint(stage: Stage, reason: str) -> str:
    """What to raise when rq killed the job at its timeout ('' for other failures)."""
    if "JobTimeoutException" not in reason:
        return ""
    if stage.sized_timeout is not None:
        return (
            f" (the {stage.name} job timeout is sized from the run's work at the recipe's "
            "stated rates: raise rates.timeout_factor, or restate the rate, e.g. "
            "rates.train_tokens_per_s)"
        )
    return f" (the {stage.name} job timeout is the stage declaration's timeout_s)"


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
    timings = store.timings()
    for stage in pipeline(recipe):
        t0 = time.monotonic()
        if run_stage(stage, store, recipe, conn, opts, on_tick):
            dt = round(time.monotonic() - t0, 1)
            log.info("stage %s done in %.1fs", stage.name, dt)
            timings[stage.name] = dt
            store.write_timings(timings)
        if opts.stop_after == stage.name:
            return
