"""Prompt sets: MT-Bench turns (checked against the question text itself) and the held-out
prompts the split stage writes (read back through the real plan → prep → dedup → split)."""

from __future__ import annotations

import json

import pytest

from services.bench.prompts import (
    benchmark_messages,
    heldout_messages,
    mtbench_messages,
    second_turn_messages,
)
from shared.artifacts import RunStore
from shared.errors import ArtifactError, ConfigError
from shared.recipe import resolve_recipe
from shared.records import Split
from tests.conftest import run_stage

Q81_T1 = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
    "cultural experiences and must-see attractions."
)
Q81_T2 = "Rewrite your previous response. Start every sentence with the letter A."


def test_mtbench_first_turns_are_user_messages():
    msgs = mtbench_messages(80)
    assert len(msgs) == 80
    assert msgs[0] == [{"role": "user", "content": Q81_T1}]
    assert len(mtbench_messages(5)) == 5


def test_second_turn_follows_the_targets_own_answer():
    first = mtbench_messages(2)
    conv = second_turn_messages(first, ["ANSWER-1", "ANSWER-2"])
    assert conv[0] == [
        {"role": "user", "content": Q81_T1},
        {"role": "assistant", "content": "ANSWER-1"},
        {"role": "user", "content": Q81_T2},
    ]
    assert conv[1][1]["content"] == "ANSWER-2"
    with pytest.raises(ConfigError, match="2 prompts but 1 answers"):
        second_turn_messages(first, ["only one"])


def _conv(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
            {"role": "user", "content": f"follow-up {i}"},
            {"role": "assistant", "content": f"b{i}"},
        ]
    }


def _run(tmp_path, n: int, **bench) -> tuple[RunStore, object]:
    """A run over `n` conversations q0..q{n-1} after plan, prep, dedup and split."""
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(_conv(i)) + "\n" for i in range(n)))
    recipe = resolve_recipe(
        {
            "name": "prompts",
            "target": {"path": str(tmp_path)},
            "datasets": [{"path": str(data)}],
            "prep": {"shard_rows": 4},
            "train": {"val_fraction": 0.5, "seed": 3},
            "bench": {"prompt_set": "heldout", "num_prompts": 2, **bench},
        }
    )
    store = RunStore.create(recipe, root=tmp_path / "data")
    for stage in ("plan", "prep", "dedup", "split"):
        run_stage(store, stage)
    return store, recipe


def test_heldout_prompts_are_the_validation_conversations_cut_before_the_answer(tmp_path):
    store, recipe = _run(tmp_path, 6)
    val = store.split.read().val_ids
    assert len(val) == 3  # half of 6
    by_id = {c.id: c for s in range(store.plan.num_shards()) for c in store.dedup.conversations(s)}
    want = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": q}]
        for q in (by_id[i].messages[1].content for i in val)
    ]
    assert heldout_messages(store, 10) == want  # every one there is, in split order
    assert heldout_messages(store, 2) == want[:2]
    assert benchmark_messages(store, recipe) == (want[:2], "heldout")


def test_mtbench_is_the_default_set(tmp_path):
    store, recipe = _run(tmp_path, 4, prompt_set="mtbench", num_prompts=3)
    assert benchmark_messages(store, recipe) == (mtbench_messages(3), "mtbench")


def test_heldout_without_a_usable_prompt_says_what_to_change(tmp_path):
    store = RunStore("run-x", tmp_path)
    store.split.write(Split(seed=0, val_fraction=0.0, conversations=5, val_ids=[]), [])
    with pytest.raises(ArtifactError, match="no usable prompt; raise train.val_fraction"):
        heldout_messages(store, 3)


def test_heldout_before_the_split_stage_names_the_file(tmp_path):
    store = RunStore("run-y", tmp_path)
    with pytest.raises(ArtifactError, match=r"split/heldout\.jsonl: missing"):
        heldout_messages(store, 3)
