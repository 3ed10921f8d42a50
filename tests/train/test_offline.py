"""`eyrie tau`: the trainer's greedy-chain τ of a checkpoint on the held-out split, no server.

A small real run is built on SmolLM2: 2 chat conversations through the real plan → prep →
dedup → split stages (one held out), a tokenized shard with assistant-only masks computed
here, real HF extraction, the draft vocab, and a checkpoint of a freshly initialised draft.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from scripts.benchdata import smollm2_target
from services.conductor.cli import main
from shared.artifacts import RunStore, TokenizedSample, write_npy
from shared.recipe import resolve_recipe
from tests.conftest import run_stage

K = 3
CONVS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name three primary colors.", "Red, blue and yellow are the three primary colors."),
]


def _tokenized(tok, store: RunStore) -> dict[str, list[int]]:
    """Write tokenize/shard-00000 with assistant-only masks; return each conversation's mask."""
    samples, masks = [], {}
    for conv in store.dedup.conversations(0):
        q, a = (m.content for m in conv.messages)
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids_p = tok(prompt, add_special_tokens=False)["input_ids"]
        ids_a = tok(a + "<|im_end|>", add_special_tokens=False)["input_ids"]
        mask = [0] * len(ids_p) + [1] * len(ids_a)
        samples.append(TokenizedSample(conv.id, conv.id, conv.source, ids_p + ids_a, mask))
        masks[conv.id] = mask
    store.tokenize.write(0, samples, {"kept": len(samples)})
    return masks


@pytest.mark.slow
def test_offline_tau_of_a_checkpoint(tmp_path, data_dir, smollm2_path, capsys):
    import torch
    from transformers import AutoTokenizer

    from services.train import checkpoints
    from services.train.draft_model import build_draft, trainable_state
    from shared.conventions import build_d2t_t2d, select_draft_vocab

    data_file = tmp_path / "convs.jsonl"
    data_file.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for q, a in CONVS
        )
    )
    data = {
        "name": "train-offline",
        "target": smollm2_target(smollm2_path),
        "datasets": [{"path": str(data_file)}],
        "layers": [2, 15, 27],
        "regen": {"enabled": False},
        "draft": {"draft_vocab_size": 256},
        "train": {"val_fraction": 0.5, "seed": 0},
        "bench": {"num_speculative_tokens": K},
        "extract": {"device": "cpu"},
    }
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(data))
    recipe = resolve_recipe(recipe_file)
    store = RunStore.create(recipe)
    for stage in ("plan", "prep", "dedup", "split"):
        run_stage(store, stage)
    masks = _tokenized(AutoTokenizer.from_pretrained(smollm2_path), store)
    run_stage(store, "extract")
    freq = np.zeros(49152, dtype=np.int64)
    d2t, t2d = build_d2t_t2d(select_draft_vocab(freq, 256), 49152)
    write_npy(store.vocab.d2t_path, d2t)
    write_npy(store.vocab.t2d_path, t2d)
    torch.manual_seed(0)
    model = build_draft(recipe, d2t, t2d)
    ckpt = checkpoints.save(
        store.train.epoch_dir(1), trainable_state(model), checkpoints.TrainState(), {}
    )

    assert main(["tau", str(recipe_file), "--checkpoint", str(ckpt)]) == 0
    out = json.loads(capsys.readouterr().out)
    # One of the two conversations is held out; its anchors are its trainable positions:
    # the mask shifted left by one for next-token targets, minus the last position.
    (val_id,) = store.split.val_ids()
    assert out["samples"] == 1 and out["source"] == "offline"
    assert out["checkpoint"] == str(ckpt)
    assert out["k"] == K
    assert out["anchors"] == sum(masks[val_id][1:])
    assert out["tau"] == pytest.approx(1 + out["accepted"] / out["anchors"])
    assert 1.0 <= out["tau"] <= K + 1
    assert len(out["accept_rate_per_pos"]) == K
    assert 0.0 <= out["teacher_in_draft_vocab"] <= 1.0


def test_offline_without_a_checkpoint_is_a_clear_error(tmp_path, data_dir, capsys):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "train-offline",
                "target": {"path": str(tmp_path)},
                "datasets": [{"path": "x.json"}],
            }
        )
    )
    code = main(["tau", str(recipe_file), "--checkpoint", str(tmp_path / "none")])
    assert code == 1
    assert "no such checkpoint folder" in capsys.readouterr().err
