"""The rq job entry point. Every stage job runs `run_stage_job(run_id, stage, shard)`.

The payload is those three JSON values; the job reads the run's resolved recipe from the
volume. A shard whose manifest exists is skipped, so re-running finished work is a no-op.
"""

from __future__ import annotations

import logging

from services.conductor.stages import get_stage
from shared.store import RunStore

log = logging.getLogger("eyrie.jobs")


def run_stage_job(run_id: str, stage: str, shard: int) -> dict:
    """Run one stage shard. Returns the manifest's counts (or `{"skipped": 1}`)."""
    store = RunStore(run_id)
    if store.is_done(stage, shard):
        log.info("%s[%d] of %s already done: skipping", stage, shard, run_id)
        return {"skipped": 1}
    recipe = store.recipe()
    manifest = get_stage(stage).load()(store, recipe, int(shard))
    return dict(manifest.counts)
