"""run_vocab end to end: the eagle3-conventions.md §3 examples through real tokenized shards.

Expected values are written by hand from the rules (top counts, ties by lower id, padding by
the lowest unused ids, ascending; d2t = offsets), not computed by the code under test.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from services.train.vocab import run_vocab
from shared.errors import ArtifactError
from shared.recipe import resolve_recipe
from shared.store import RunStore
from tests.extract.data import write_tokenized_shard


@pytest.fixture
def vocab10_target(tmp_path, smollm2_path):
    """A target folder with a 10-token vocab: SmolLM2's real tokenizer, config vocab 10."""
    d = tmp_path / "target10"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, d / name)
    (d / "config.json").write_text(
        json.dumps({"vocab_size": 10, "num_hidden_layers": 30, "hidden_size": 576})
    )
    return d


def _store(data_dir, target, draft_vocab):
    recipe = resolve_recipe(
        {
            "name": "vocab-test",
            "target": {"path": str(target)},
            "datasets": [{"preset": "sharegpt-v3-wheel"}],
            "draft": {"draft_vocab_size": draft_vocab},
        }
    )
    return RunStore.create(recipe), recipe


def _row(ids, mask, rid):
    return {"input_ids": ids, "loss_mask": mask, "seq_len": len(ids), "id": rid, "source": "t"}


def test_conventions_example_through_run_vocab(data_dir, vocab10_target):
    store, recipe = _store(data_dir, vocab10_target, 4)
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
    m = run_vocab(store, recipe, 0)
    out = store.root / "vocab"
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


def test_too_few_seen_pads_with_lowest_unused_ids(data_dir, vocab10_target):
    store, recipe = _store(data_dir, vocab10_target, 4)
    write_tokenized_shard(store, 0, [_row([6, 6, 1], [1, 1, 1], "a")])
    run_vocab(store, recipe, 0)
    # Seen: 6, 1. Padded with the lowest unused ids 0, 2 -> [0, 1, 2, 6].
    d2t = np.load(store.root / "vocab" / "d2t.npy")
    assert d2t.tolist() == [0, 0, 0, 3]
    assert np.nonzero(np.load(store.root / "vocab" / "t2d.npy"))[0].tolist() == [0, 1, 2, 6]
    cov = json.loads((store.root / "vocab" / "coverage.json").read_text())
    assert cov["coverage"] == 1.0 and cov["top_left_out"] == []


def test_id_outside_target_vocab_names_shard_row_and_field(data_dir, vocab10_target):
    store, recipe = _store(data_dir, vocab10_target, 4)
    write_tokenized_shard(store, 0, [_row([1, 2], [1, 1], "a"), _row([1, 12], [1, 1], "b")])
    with pytest.raises(ArtifactError, match=r"shard-00000 row 1 field input_ids: id 12"):
        run_vocab(store, recipe, 0)
