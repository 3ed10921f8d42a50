"""The rq job entry point. Every stage job runs `run_stage_job(run_id, stage, shard)`.

The payload is those three JSON values; the job reads the run's resolved recipe from the
volume. A shard whose manifest exists is skipped, so re-running finished work is a no-op.
"""

from __future__ import annotations

import gc
import logging
import sys

from rq import get_current_job

from services.conductor.stages import get_stage
from shared.queue import get_queue
from shared.store import RunStore

log = logging.getLogger("eyrie.jobs")


def run_stage_job(run_id: str, stage: str, shard: int) -> dict:
    """Run one stage shard. Returns the manifest's counts (or `{"skipped": 1}`)."""
    store = RunStore(run_id)
    if store.is_done(stage, shard):
        log.info("%s[%d] of %s already done: skipping", stage, shard, run_id)
        return {"skipped": 1}
    recipe = store.recipe()
    spec = get_stage(stage)
    manifest = spec.load()(store, recipe, int(shard))
    if spec.gpu_phase is not None:
        _release_if_idle(spec.queue)
    return dict(manifest.counts)


def _release_if_idle(queue: str) -> None:
    """Free the GPU when this worker's queue is drained, i.e. its phase is over.

    Extract and train workers are non-forking and keep their model between jobs of a phase;
    the next phase's GPU-free check must not find that memory still held.
    """
    job = get_current_job()
    if job is None or len(get_queue(queue, job.connection)) > 0:
        return
    hf = sys.modules.get("services.extract.hf_backend")
    if hf is not None:
        hf.release_models()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        log.info("queue %s drained: released accelerator memory", queue)
