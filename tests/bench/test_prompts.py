"""Prompt sets: MT-Bench turns (checked against the question text itself) and held-out rows."""

from __future__ import annotations

import json

import pytest

from services.bench.prompts import heldout_messages, mtbench_messages, second_turn_messages
from shared.errors import ArtifactError, ConfigError
from shared.store import RunStore

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


def _conv(i: int, first_role: str = "user") -> dict:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": first_role, "content": f"q{i}"},
        {"role": "assistant", "content": f"a{i}"},
        {"role": "user", "content": f"follow-up {i}"},
    ]
    return {"id": f"r{i}", "source": "t", "messages": msgs, "tools": None}


def test_heldout_takes_the_last_dedup_kept_rows(tmp_path):
    store = RunStore("run-x", tmp_path)
    prep = store.stage_dir("prep")
    for shard, rows in ((0, range(0, 4)), (1, range(4, 8))):
        lines = [json.dumps(_conv(i)) for i in rows]
        (prep / f"shard-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n")
    (prep / "shard-00001.quarantine.jsonl").write_text('{"row": 9}\n')
    # dedup dropped row 7 (index 3 of shard 1)
    dedup = store.stage_dir("dedup")
    (dedup / "keep.json").write_text(json.dumps({"0": [0, 1, 2, 3], "1": [0, 1, 2]}))
    got = heldout_messages(store, 2)
    assert got == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q5"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q6"}],
    ]
    with pytest.raises(ArtifactError, match="7 usable held-out"):
        heldout_messages(store, 8)


def test_heldout_prefers_the_validation_split_in_its_order(tmp_path):
    store = RunStore("run-z", tmp_path)
    lines = [json.dumps(_conv(i)) for i in range(6)]
    (store.stage_dir("prep") / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    got = heldout_messages(store, 5, val_ids=["r4", "r1", "gone"])
    assert [m[1]["content"] for m in got] == ["q4", "q1"]


def test_heldout_without_prep_output_names_the_folder(tmp_path):
    with pytest.raises(ArtifactError, match="no prep shards"):
        heldout_messages(RunStore("run-y", tmp_path), 3)
