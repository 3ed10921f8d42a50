"""The trainer on real SmolLM2 hidden states: loss falls, checkpoints hold only trainable
weights, a SIGKILLed run resumes to the same result, validation reports simulated τ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.conftest import train_recipe

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(store, kind):
    lines = store.train.metrics_path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_loss_decreases(reference_run):
    steps = _records(reference_run, "step")
    assert len(steps) >= 24  # a few dozen optimizer steps
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
    # Untrained, the KL per TTT step is ~log-ratio of a random head: ~8 nats per step.
    assert first > 20
    assert last < 0.75 * first
    for k in range(3):
        assert steps[-1][f"acc_{k}"] >= 0 and f"loss_{k}" in steps[-1]
    assert all(r["tokens"] <= 192 and r["tokens_per_s"] > 0 for r in steps)


def test_lr_warms_up_then_decays_to_zero(reference_run):
    lrs = [r["lr"] for r in _records(reference_run, "step")]
    n, peak = len(lrs), 1e-3
    warm = -(-n // 10)  # ceil(0.1 * n) warm-up steps
    assert lrs[0] == pytest.approx(peak / (warm + 1))
    assert max(lrs) == pytest.approx(peak)
    assert lrs[-1] < 0.01 * peak  # cosine ends near 0


def test_checkpoints_hold_only_trainable_weights(reference_run):
    from safetensors import safe_open

    art = reference_run.train
    assert sorted(p.name for p in art.checkpoints_dir.iterdir()) == ["epoch-0001", "epoch-0002"]
    weights = art.epoch_dir(2) / "draft.safetensors"
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    # Frozen weights are reloaded from the target, never stored (issue: 89 GB of copies).
    assert not {n for n in names if n.startswith(("embed_tokens", "verifier_", "lm_head"))}
    size = weights.stat().st_size
    assert size < 49152 * 576 * 4  # smaller than one fp32 copy of the embeddings


def test_epoch_validation_and_plot(reference_run):
    epochs = _records(reference_run, "epoch")
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert [r["partial"] for r in epochs] == [False, False]  # no time budget: whole epochs
    for r in epochs:
        assert r["k"] == 3 and r["anchors"] > 0
        assert 1.0 <= r["tau"] <= 4.0
        rates = r["accept_rate_per_pos"]
        assert rates == sorted(rates, reverse=True)  # a chain: later positions accept less
        assert r["tau"] == pytest.approx(1 + sum(rates))
    best = json.loads(reference_run.train.best_path.read_text())["best"]
    assert best["tau"] == max(r["tau"] for r in epochs)
    png = reference_run.train.plot_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert reference_run.is_done("train")
    # Validation is the held-out split: round(32 x 0.125) = 4 conversations, one sample each.
    counts = reference_run.read_manifest("train").counts
    assert (counts["train_samples"], counts["val_samples"]) == (28, 4)


CHILD = """
import sys
from pathlib import Path
from shared.artifacts import RunStore
from tests.conftest import run_stage
run_stage(RunStore(sys.argv[1], Path(sys.argv[2])), "train")
"""


def test_sigkill_then_resume_matches_uninterrupted(reference_run, make_run, smollm2_path):
    from safetensors.torch import load_file

    from tests.conftest import run_stage

    recipe = train_recipe(smollm2_path)
    store = make_run(recipe)
    art = store.train
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, store.run_id, str(store.root.parent.parent)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    state = art.step_dir / "state.json"
    deadline = time.monotonic() + 600
    while not (state.is_file() and json.loads(state.read_text())["step"] >= 10):
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    saved = json.loads(state.read_text())
    assert saved["step"] == 10 and saved["epoch"] == 0  # mid-epoch 1
    assert not store.is_done("train")

    (manifest,) = run_stage(store, "train")
    assert manifest.extra["resumed_from"].endswith("step-latest")
    ref_steps, steps = _records(reference_run, "step"), _records(store, "step")
    assert [r["step"] for r in steps] == list(range(1, len(ref_steps) + 1))  # no duplicates
    assert steps[-1]["lr"] == pytest.approx(ref_steps[-1]["lr"], rel=1e-9)
    a = load_file(str(reference_run.train.epoch_dir(2) / "draft.safetensors"))
    b = load_file(str(art.epoch_dir(2) / "draft.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= 1e-5, name
    assert json.loads((art.epoch_dir(2) / "state.json").read_text())["step"] == len(ref_steps)


def test_plot_draws_a_run_whose_epochs_had_no_held_out_samples(tmp_path):
    """An epoch record without validation (no held-out samples) carries no tau: the plot
    skips it instead of failing the run at its end."""
    from services.train.metrics import plot

    steps = [
        {"kind": "step", "step": s, "loss_0": 2.0 / s, "acc_0": 0.1 * s, "epoch": 0} for s in (1, 2)
    ]
    epochs = [{"kind": "epoch", "epoch": 1, "step": 2, "partial": False}]
    out = plot(steps + epochs, tmp_path / "curves.png", ttt_steps=1)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
