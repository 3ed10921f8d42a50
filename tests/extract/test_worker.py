"""The long-lived extractor: rq's non-forking worker on the `extract` queue, real Redis.

Two shards of one run go through `eyrie worker extract`'s worker (SimpleWorker): the model is
loaded once for both, and each job's meta carries tokens/s and an ETA.
"""

from __future__ import annotations

import pytest
from rq import SimpleWorker

from services.extract import hf_backend
from shared.queue import JobSpec, connect, enqueue, make_worker
from tests.extract.conftest import make_recipe
from tests.extract.data import write_plan, write_tokenized_shard

pytestmark = pytest.mark.slow


def test_worker_loads_model_once_and_reports_progress(
    redis_url, smollm2_path, store_for, sharegpt_rows, monkeypatch
):
    recipe = make_recipe(smollm2_path, tokens_per_batch=512)
    store = store_for(recipe)
    write_plan(store, 2)
    write_tokenized_shard(
        store,
        0,
        [
            dict(r, input_ids=r["input_ids"][:40], loss_mask=r["loss_mask"][:40], seq_len=40)
            for r in sharegpt_rows[:3]
        ],
    )
    write_tokenized_shard(
        store,
        1,
        [
            dict(r, input_ids=r["input_ids"][:30], loss_mask=r["loss_mask"][:30], seq_len=30)
            for r in sharegpt_rows[3:5]
        ],
    )
    loads = []
    real_load = hf_backend._load_uncached
    monkeypatch.setattr(
        hf_backend, "_load_uncached", lambda spec: loads.append(spec) or real_load(spec)
    )
    hf_backend._CACHE.clear()  # start like a fresh worker process

    conn = connect(redis_url)
    jobs = [enqueue(JobSpec("extract", store.run_id, "extract", s, 600), conn) for s in (0, 1)]
    worker = make_worker(["extract"], conn)
    assert isinstance(worker, SimpleWorker)  # non-forking: the model stays loaded
    worker.work(burst=True)

    assert len(loads) == 1, "the model must be loaded once for both shards"
    assert store.is_done("extract", 0) and store.is_done("extract", 1)
    for job, tokens in zip(jobs, (120, 60), strict=True):
        job.refresh()
        assert job.get_status() == "finished"
        p = job.meta["progress"]
        assert p["unit"] == "tok" and p["done"] == p["total"] == tokens
        assert p["rate"] > 0 and p["eta_s"] == 0
