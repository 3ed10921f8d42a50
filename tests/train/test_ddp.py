"""The train stage under torchrun: TRAIN_GPUS processes (gloo on CPU), DDP, rank 0 writing.

The job itself starts torchrun (the compose trainer runs one rq worker; TRAIN_GPUS sets how
many ranks its train job uses), waits, and writes the manifest from rank 0's checkpoint.
"""

from __future__ import annotations

import json

import pytest

from tests.train.conftest import train_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_train_gpus_setting(monkeypatch):
    from services.train.stage import torchrun_command, train_gpus
    from shared.errors import ConfigError

    monkeypatch.delenv("TRAIN_GPUS", raising=False)
    assert train_gpus() == 1
    monkeypatch.setenv("TRAIN_GPUS", "8")
    assert train_gpus() == 8
    assert "--nproc-per-node=8" in torchrun_command("r", 8)
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("TRAIN_GPUS", bad)
        with pytest.raises(ConfigError, match="TRAIN_GPUS"):
            train_gpus()


def test_two_ranks_under_torchrun(make_run, smollm2_path, monkeypatch):
    from services.train.checkpoints import latest, read_state
    from services.train.packing import pack
    from tests.conftest import run_stage

    recipe = train_recipe(smollm2_path, epochs=1, step_checkpoint_every=0)
    store = make_run(recipe)
    monkeypatch.setenv("TRAIN_GPUS", "2")
    # The ranks find the run where every Eyrie process does: under EYRIE_DATA.
    monkeypatch.setenv("EYRIE_DATA", str(store.root.parent.parent))
    (m,) = run_stage(store, "train")
    assert m.extra["device"] == "torchrun x2"
    steps = [
        json.loads(line)
        for line in store.train.metrics_path.read_text().splitlines()
        if json.loads(line)["kind"] == "step"
    ]
    single_plan_steps = len(pack(*_plan_args(store, recipe)))
    # Each rank takes every second step of the shared plan: half the optimizer steps.
    assert len(steps) == single_plan_steps // 2 == m.counts["steps"]
    state = read_state(latest(store.train))
    assert state.epoch == 1 and state.validations and "tau" in state.validations[0]


def _plan_args(store, recipe):
    from services.train.packing import epoch_order
    from services.train.samples import index_samples

    refs = index_samples(store).train
    return refs, epoch_order(len(refs), recipe.train.seed, 0), recipe.train.tokens_per_step
