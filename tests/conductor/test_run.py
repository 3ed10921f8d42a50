"""`eyrie run` with `eyrie worker`: a real run moves through real Redis and real workers."""

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from services.conductor.processes import start_worker, stop_process
from shared.artifacts import RunStore
from shared.recipe import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "fixtures" / "samples" / "sharegpt_fastchat_dummy.json"


@pytest.mark.slow
def test_eyrie_run_moves_jobs_through_workers(redis_url, data_dir, smollm2_path, tmp_path):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "run-test",
                "target": {"path": str(smollm2_path)},
                "datasets": [{"path": str(SAMPLES), "format": "sharegpt", "max_samples": 30}],
                "prep": {"shard_rows": 10, "max_len_tokens": 512},
                "regen": {"enabled": False},
            }
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with ExitStack() as stack:
        for i in range(2):
            w = start_worker(["prep"], f"run-test-{i}", env, monitor_interval_s=2)
            stack.callback(stop_process, w)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.conductor.cli",
                "run",
                str(recipe_file),
                "--stop-after",
                "tokenize",
                "--poll-s",
                "0.2",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    store = RunStore(resolve_recipe(recipe_file).run_id(), data_dir)
    assert store.is_done("plan") and store.plan.num_shards() == 3
    assert [store.is_done("prep", s) for s in range(3)] == [True] * 3
    assert store.is_done("dedup") and store.is_done("split")
    assert all(store.is_done("tokenize", s) for s in range(3))
    assert not store.is_done("vocab")  # --stop-after tokenize
    kept = sum(store.read_manifest("prep", s).counts["kept"] for s in range(3))
    rows_in = sum(store.read_manifest("prep", s).counts["rows_in"] for s in range(3))
    assert rows_in == 30 and 0 < kept <= 30
    # every conversation kept by dedup was tokenized (none of these is over 512 tokens),
    # the held-out ones too: they are only kept out of training
    dedup_ids = [c.id for s in range(3) for c in store.dedup.conversations(s)]
    tok_ids = [i for s in range(3) for i in store.tokenize.dataset(s)["conversation_id"]]
    assert tok_ids == dedup_ids and store.split.val_ids() <= set(tok_ids)
    assert len(store.split.val_ids()) == max(1, round(len(dedup_ids) * 0.05))
    timings = json.loads(store.timings_path.read_text())
    assert set(timings) == {"plan", "prep", "dedup", "split", "tokenize"}
