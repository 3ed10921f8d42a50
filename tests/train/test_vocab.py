"""The vocab stage end to end: the shared/conventions.py §3 examples through real tokenized
shards, counting only the training split.

Expected values are written by hand from the rules (top counts, ties by lower id, padding by
the lowest unused ids, ascending; d2t = offsets; held-out conversations are not counted), not
computed by the code under test.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from shared.artifacts import RunStore
from shared.errors import ArtifactError
from shared.recipe import resolve_recipe
from tests.conftest import run_stage
from tests.extract.data import write_plan, write_split, write_tokenized_shard


@pytest.fixture
def vocab10_target(tmp_path, smollm2_path):
    """A target folder with a 10-token vocab: SmolLM2's real tokenizer and chat template,
    config vocab 10."""
    d = tmp_path / "target10"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_path / name, d / name)
    (d / "config.json").write_text(
        json.dumps({"vocab_size": 10, "num_hidden_layers": 30, "hidden_size": 576})
    )
    return d


def _store(data_dir, target, draft_vocab, shards=2, val_ids=(), **draft):
    """A run of `shards` tokenized shards (written by each test) holding out `val_ids`."""
    recipe = resolve_recipe(
        {
            "name": "vocab-test",
            "target": {"path": str(target)},
            "datasets": [{"preset": "sharegpt-v3-wheel"}],
            "draft": {"draft_vocab_size": draft_vocab, **draft},
        }
    )
    store = RunStore.create(recipe)
    write_plan(store, shards)
    write_split(store, [], list(val_ids))
    return store


def _row(ids, mask, rid):
    return {"input_ids": ids, "loss_mask": mask, "id": rid, "source": "t"}


def _vocab(store):
    (manifest,) = run_stage(store, "vocab")
    return manifest


def test_conventions_example_through_the_vocab_stage(data_dir, vocab10_target):
    store = _store(data_dir, vocab10_target, 4)
    # Masked counts: 7 x5, 3 x4, then a tie at 3 between 0, 2 and 5 (lower ids win: 0, 2).
    # Id 9 appears 100 times but never under the mask, so it is not counted.
    write_tokenized_shard(
        store,
        0,
        [
            _row([9] * 50 + [7, 7, 7, 3, 3, 0], [0] * 50 + [1] * 6, "a"),
            _row([7, 7, 3, 3, 0, 0], [1] * 6, "b"),
        ],
    )
    write_tokenized_shard(
        store,
        1,
        [
            _row([9] * 50 + [2, 2, 2, 5, 5, 5], [0] * 50 + [1] * 6, "c"),
        ],
    )
    m = _vocab(store)
    out = store.vocab.dir
    d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    assert d2t.dtype == np.int64 and d2t.tolist() == [0, 1, 1, 4]
    assert t2d.dtype == bool and t2d.astype(int).tolist() == [1, 0, 1, 1, 0, 0, 0, 1, 0, 0]
    freq = np.load(out / "token_freq.npy")
    assert freq.tolist() == [3, 0, 3, 4, 0, 3, 0, 5, 0, 0]
    assert torch.load(out / "token_freq.pt", weights_only=True) == {0: 3, 2: 3, 3: 4, 5: 3, 7: 5}
    cov = json.loads((out / "coverage.json").read_text())
    assert cov["coverage"] == pytest.approx(15 / 18)
    assert cov["target_vocab"] == 10 and cov["draft_vocab"] == 4
    assert cov["assistant_tokens"] == 18 and cov["distinct_seen"] == 5
    assert [(t["id"], t["count"]) for t in cov["top_left_out"]] == [(5, 3)]
    assert cov["top_left_out"][0]["text"] == "<file_sep>"  # tokenizer.json added_tokens id 5
    assert m.counts["assistant_tokens"] == 18 and store.is_done("vocab", 0)


def test_held_out_conversations_are_not_counted(data_dir, vocab10_target):
    # Conversation "b" gives two samples (two turns); holding it out removes both.
    store = _store(data_dir, vocab10_target, 2, shards=1, val_ids=["b"])
    rows = [
        _row([1, 1, 4], [1, 1, 1], "a"),
        dict(_row([3, 3, 3, 3, 2], [1, 1, 1, 1, 1], "b#0"), conversation_id="b"),
        dict(_row([3, 3, 3, 2], [1, 1, 1, 1], "b#1"), conversation_id="b"),
        _row([4, 8, 8], [0, 1, 1], "c"),
    ]
    write_tokenized_shard(store, 0, rows)
    m = _vocab(store)
    out = store.vocab.dir
    # Counted: a -> 1 x2, 4 x1; c -> 8 x2 (the masked 4 is not). Top 2: 1 and 8 (2 each).
    assert np.load(out / "token_freq.npy").tolist() == [0, 2, 0, 0, 1, 0, 0, 0, 2, 0]
    assert np.nonzero(np.load(out / "t2d.npy"))[0].tolist() == [1, 8]
    assert m.counts["assistant_tokens"] == 5


def test_too_few_seen_pads_with_lowest_unused_ids(data_dir, vocab10_target):
    store = _store(data_dir, vocab10_target, 4, shards=1)
    write_tokenized_shard(store, 0, [_row([6, 6, 1], [1, 1, 1], "a")])
    _vocab(store)
    # Seen: 6, 1. Padded with the lowest unused ids 0, 2 -> [0, 1, 2, 6].
    out = store.vocab.dir
    d2t = np.load(out / "d2t.npy")
    assert d2t.tolist() == [0, 0, 0, 3]
    assert np.nonzero(np.load(out / "t2d.npy"))[0].tolist() == [0, 1, 2, 6]
    cov = json.loads((out / "coverage.json").read_text())
    assert cov["coverage"] == 1.0 and cov["top_left_out"] == []


def test_id_outside_target_vocab_names_shard_row_and_field(data_dir, vocab10_target):
    store = _store(data_dir, vocab10_target, 4, shards=1)
    write_tokenized_shard(store, 0, [_row([1, 2], [1, 1], "a"), _row([1, 12], [1, 1], "b")])
    with pytest.raises(ArtifactError, match=r"shard-00000 row 1 field input_ids: id 12"):
        _vocab(store)
    assert not store.is_done("vocab")


@pytest.mark.parametrize(
    ("coverage", "ids", "covered"),
    [
        # Pinned special ids 0, 1, 2 (SmolLM2's tokenizer) cover 6 of 18 tokens.
        # 50%: 9 tokens, 3 more needed: 7 (5). 90%: 16.2, 10.2 more: 7, 3, 5 (12).
        (0.5, [0, 1, 2, 7], 11),
        (0.9, [0, 1, 2, 3, 5, 7], 18),
    ],
)
def test_auto_vocab_reaches_the_coverage_with_special_tokens_pinned(
    data_dir, vocab10_target, coverage, ids, covered
):
    store = _store(data_dir, vocab10_target, "auto", shards=1, vocab_coverage=coverage)
    write_tokenized_shard(
        store,
        0,
        [
            _row([9] * 50 + [7, 7, 7, 3, 3, 0], [0] * 50 + [1] * 6, "a"),
            _row([7, 7, 3, 3, 0, 0], [1] * 6, "b"),
            _row([2, 2, 2, 5, 5, 5], [1] * 6, "c"),
        ],
    )
    m = _vocab(store)
    out = store.vocab.dir
    assert np.nonzero(np.load(out / "t2d.npy"))[0].tolist() == ids
    cov = json.loads((out / "coverage.json").read_text())
    assert cov["coverage"] == pytest.approx(covered / 18)
    assert m.counts["draft_vocab"] == len(ids) and m.counts["pinned_special_tokens"] == 3
    assert m.counts["head_rows_saved"] == 10 - len(ids)
    assert m.counts["head_params_saved"] == (10 - len(ids)) * 576
