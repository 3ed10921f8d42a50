"""Fixtures for extraction tests: the real SmolLM2 target, its tokenizer, real ShareGPT rows."""

from __future__ import annotations

import os

import pytest

from scripts.benchdata import smollm2_target
from shared.artifacts import RunStore
from shared.recipe import resolve_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_extract(store, shard, extractor=None):
    """One extract shard in this process with a ready extractor (the stage body's
    `extract_shard`), then its manifest, as `shared.stage.execute` writes it. Returns it."""
    from services.extract.stage import extract_shard
    from shared.stage import StageContext, get_stage

    ctx = StageContext(store, store.recipe(), get_stage("extract"), shard)
    result = extract_shard(ctx, extractor)
    return store.write_manifest("extract", shard, result.counts, result.files, result.extra)


def make_recipe(smollm2_path, **extract):
    """A SmolLM2 recipe with default layers and the given `extract.*` settings."""
    return resolve_recipe(
        {
            "name": "extract-test",
            "target": smollm2_target(smollm2_path),
            "datasets": [{"preset": "sharegpt-v3-wheel"}],
            "extract": {"backend": "hf", "device": "cpu", **extract},
        }
    )


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """SmolLM2 in bf16 on CPU, loaded once (the backend's per-process cache)."""
    from services.extract.hf_backend import LoadSpec, load_target

    return load_target(LoadSpec(str(smollm2_path), "bfloat16", "cpu"))


@pytest.fixture(scope="session")
def sharegpt_rows(smollm2_tok):
    """12 real tokenized ShareGPT rows, at most 160 tokens each (lengths vary)."""
    from tests.extract.data import tokenized_rows

    return tokenized_rows(smollm2_tok, 12, 160)


@pytest.fixture
def store_for(data_dir):
    """Build a RunStore for a recipe (writes recipe.json, which manifests hash)."""

    def make(recipe):
        return RunStore.create(recipe)

    return make
