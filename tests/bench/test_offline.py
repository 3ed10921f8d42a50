"""`eyrie bench offline`: the trainer's greedy-chain τ on a checkpoint, without a server.

A small real run is built on SmolLM2: a tokenized shard of 2 chat samples, real HF
extraction, the draft vocab, and a checkpoint of a freshly initialised draft.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from services.conductor.cli import main
from shared.recipe import resolve_recipe
from shared.store import RunStore
from tests.conftest import FIXTURES

K = 3
CONVS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colors.", "Red, blue and yellow are the three primary colors."),
]


def _tokenized(tok, store: RunStore) -> list[list[int]]:
    """Write tokenize/shard-00000 with assistant-only masks; return each row's mask."""
    from datasets import Dataset

    rows = {"input_ids": [], "loss_mask": [], "seq_len": [], "id": [], "source": []}
    for i, (q, a) in enumerate(CONVS):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids_p = tok(prompt, add_special_tokens=False)["input_ids"]
        ids_a = tok(a + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows["input_ids"].append(ids_p + ids_a)
        rows["loss_mask"].append([0] * len(ids_p) + [1] * len(ids_a))
        rows["seq_len"].append(len(ids_p) + len(ids_a))
        rows["id"].append(f"s{i}")
        rows["source"].append("test")
    Dataset.from_dict(rows).save_to_disk(str(store.shard_path("tokenize", 0, "")))
    return rows["loss_mask"]


@pytest.mark.slow
def test_offline_tau_of_a_checkpoint(tmp_path, data_dir, smollm2_path, capsys):
    import torch
    from transformers import AutoTokenizer

    from services.extract.jobs import run_extract
    from services.train import checkpoints
    from services.train.draft_model import build_draft, trainable_state
    from shared.conventions import build_d2t_t2d, select_draft_vocab

    data = {
        "name": "bench-offline",
        "target": {"path": str(smollm2_path)},
        "datasets": [{"path": str(FIXTURES / "samples" / "sharegpt_fastchat_dummy.json")}],
        "layers": [2, 15, 27],
        "draft": {"draft_vocab_size": 256},
        "train": {"val_fraction": 0.5, "seed": 0},
        "eval": {"num_speculative_tokens": K},
        "extract": {"device": "cpu"},
    }
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(data))
    recipe = resolve_recipe(recipe_file)
    store = RunStore.create(recipe)
    masks = _tokenized(AutoTokenizer.from_pretrained(smollm2_path), store)
    run_extract(store, recipe, 0)
    freq = np.zeros(49152, dtype=np.int64)
    d2t, t2d = build_d2t_t2d(select_draft_vocab(freq, 256), 49152)
    np.save(store.stage_dir("vocab") / "d2t.npy", d2t)
    np.save(store.stage_dir("vocab") / "t2d.npy", t2d)
    torch.manual_seed(0)
    model = build_draft(recipe, d2t, t2d)
    ckpt = checkpoints.save(
        tmp_path / "epoch-0001", trainable_state(model), checkpoints.TrainState(), {}
    )

    assert main(["bench", "offline", str(recipe_file), "--checkpoint", str(ckpt)]) == 0
    out = json.loads(capsys.readouterr().out)
    # One of the two samples is held out; its anchors are its trainable positions: the
    # mask shifted left by one for next-token targets, minus the last position.
    shifted = [sum(m[1:]) for m in masks]
    assert out["samples"] == 1
    assert out["k"] == K
    assert out["anchors"] in shifted
    assert out["tau"] == pytest.approx(1 + out["accepted"] / out["anchors"])
    assert 1.0 <= out["tau"] <= K + 1
    assert len(out["accept_rate_per_pos"]) == K


def test_offline_without_a_checkpoint_is_a_clear_error(tmp_path, data_dir, capsys):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "bench-offline",
                "target": {"path": str(tmp_path)},
                "datasets": [{"path": "x.json"}],
            }
        )
    )
    code = main(["bench", "offline", str(recipe_file), "--checkpoint", str(tmp_path / "none")])
    assert code == 1
    assert "no such checkpoint folder" in capsys.readouterr().err
