"""Trainer fixtures: real SmolLM2 hidden states of real ShareGPT samples, made once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from shared.recipe import Recipe, resolve_recipe
from shared.store import RunStore
from tests.conftest import smollm2_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train_recipe(smollm2_path: Path, **train: Any) -> Recipe:
    """A small SmolLM2 recipe: draft vocab 2048, MLP 512, 192-token bf16 steps, 2 epochs."""
    return resolve_recipe(
        {
            "name": "train-test",
            "target": smollm2_target(smollm2_path),
            "datasets": [{"preset": "sharegpt-v3-wheel"}],
            "layers": [2, 15, 27],
            "draft": {"draft_vocab_size": 2048, "intermediate_size": 512},
            "train": {
                "epochs": 2,
                "lr": 1e-3,
                "tokens_per_step": 192,
                "val_fraction": 0.125,
                "precision": "bf16",
                "warmup_ratio": 0.1,
                "step_checkpoint_every": 5,
                "device": "cpu",
                "seed": 0,
                **train,
            },
            "eval": {"num_speculative_tokens": 3},
        }
    )


@pytest.fixture(scope="session")
def extract_data(smollm2_path, tmp_path_factory) -> Path:
    """32 real samples (<= 96 tokens) in 2 extract shards, plus vocab/ (2048 draft ids)."""
    from tests.train.data import make_extract_data

    return make_extract_data(tmp_path_factory.mktemp("extract-data"), smollm2_path)


@pytest.fixture
def make_run(extract_data, tmp_path):
    """A fresh run store for a recipe whose extract/ and vocab/ are the shared real data."""

    def make(recipe: Recipe) -> RunStore:
        store = RunStore.create(recipe, root=tmp_path / "data")
        for name in ("extract", "vocab"):
            (store.root / name).symlink_to(extract_data / name)
        return store

    return make


@pytest.fixture(scope="session")
def reference_run(extract_data, smollm2_path, tmp_path_factory) -> RunStore:
    """The test recipe trained to the end once (2 epochs), in its own run store."""
    from services.train.jobs import run_train

    recipe = train_recipe(smollm2_path)
    store = RunStore.create(recipe, root=tmp_path_factory.mktemp("reference") / "data")
    for name in ("extract", "vocab"):
        (store.root / name).symlink_to(extract_data / name)
    run_train(store, recipe, 0)
    return store


@pytest.fixture(scope="session")
def exported_run(reference_run) -> RunStore:
    """The reference run exported (vllm, speculators, sglang folders + lint.json)."""
    from services.train.jobs import run_export

    run_export(reference_run, reference_run.recipe(), 0)
    return reference_run
