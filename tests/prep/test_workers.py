"""A 2-worker run through real rq (ephemeral Redis) is byte-identical to a 1-process run."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from rq import Worker

from services.conductor.processes import start_worker
from services.prep import jobs
from services.prep.plan import make_plan
from shared.queue import JobSpec, connect, enqueue, get_queue, job_id
from shared.recipe import resolve_recipe
from shared.store import RunStore, sha256_tree

SAMPLES = Path(__file__).parents[1] / "fixtures" / "samples"
ROOT = Path(__file__).parents[2]


def _recipe(smollm2_path):
    return resolve_recipe(
        {
            "name": "prep-workers",
            "target": {"path": str(smollm2_path)},
            "datasets": [
                {"path": str(SAMPLES / "alpaca_en_demo.json"), "max_samples": 10},
                {"path": str(SAMPLES / "sharegpt_fastchat_dummy.json"), "max_samples": 10},
            ],
            "prep": {"shard_rows": 4, "max_len_tokens": 256, "seed": 3},
            "regen": {"enabled": False},
        }
    )


def _start_workers(n: int, data: Path, redis_url: str) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "EYRIE_DATA": str(data),
        "EYRIE_REDIS_URL": redis_url,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return [start_worker(["prep"], f"prep-test-{i}", env) for i in range(n)]


def _wait_done(store: RunStore, stage: str, shards, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(store.is_done(stage, s) for s in shards):
        assert time.monotonic() < deadline, f"{stage} did not finish in {timeout_s} s"
        time.sleep(0.2)


def _outputs(store: RunStore, n: int) -> dict[str, str]:
    files = {
        "plan.json": store.root / "plan.json",
        "dedup/keep.json": store.root / "dedup/keep.json",
    }
    for s in range(n):
        for suffix in (".jsonl", ".quarantine.jsonl", ".report.json"):
            files[f"prep{s}{suffix}"] = store.shard_path("prep", s, suffix)
        files[f"tok{s}"] = store.shard_path("tokenize", s, "")
        files[f"tok{s}.report"] = store.shard_path("tokenize", s, ".report.json")
    return {k: sha256_tree(v) for k, v in files.items()}


@pytest.mark.slow
@pytest.mark.e2e
def test_two_rq_workers_match_one_process(tmp_path, redis_url, smollm2_path):
    recipe = _recipe(smollm2_path)
    single = RunStore.create(recipe, root=tmp_path / "single")
    n = make_plan(single, recipe)
    for s in range(n):
        jobs.run_prep(single, recipe, s)
    jobs.run_dedup(single, recipe, 0)
    for s in range(n):
        jobs.run_tokenize(single, recipe, s)

    data = tmp_path / "multi"
    multi = RunStore.create(recipe, root=data)
    assert make_plan(multi, recipe) == n == 5
    conn = connect(redis_url)
    procs = _start_workers(2, data, redis_url)
    try:
        deadline = time.monotonic() + 120
        while len(Worker.all(connection=conn)) < 2:  # both listening before any job exists
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.2)
        for stage, shards in (("prep", range(n)), ("dedup", [0]), ("tokenize", range(n))):
            for s in shards:
                enqueue(JobSpec("prep", multi.run_id, stage, s, 600, retries=0), conn)
            _wait_done(multi, stage, shards)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    q = get_queue("prep", conn)
    names = {
        q.fetch_job(job_id(multi.run_id, st, s)).worker_name
        for st in ("prep", "tokenize")
        for s in range(n)
    }
    assert names == {"prep-test-0", "prep-test-1"}  # both workers really took jobs
    assert _outputs(multi, n) == _outputs(single, n)
    assert [m.files for m in multi.manifests("tokenize")] == [
        m.files for m in single.manifests("tokenize")
    ]
