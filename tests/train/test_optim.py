"""The optimizer choice: AdamW, or Muon on the draft layer's matrices with AdamW on the rest.

The expected split is written out here from the EAGLE-3 draft's parameter names (Keller
Jordan's Muon practice, which speculators follows): every trainable 2-D matrix except
embeddings and heads goes to Muon.
"""

from __future__ import annotations

import copy

import pytest
import torch

from services.train.draft_model import build_draft, trainable_names
from services.train.optim import Optimizers, build_optimizers
from services.train.schedule import lr_shape
from shared.recipe import resolve_recipe
from tests.train.test_draft_choices import _maps

MUON = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}


def _draft(smollm2_path, **train):
    recipe = resolve_recipe(
        {
            "name": "optim",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 15, 27],
            "draft": {"draft_vocab_size": 64, "train_lm_head": True},
            "train": {"lr": 1e-3, **train},
        }
    )
    torch.manual_seed(0)
    return build_draft(recipe, *_maps()), recipe.train


def _names(model, optimizer) -> set[str]:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_muon_takes_the_layer_matrices_and_adamw_the_rest(smollm2_path):
    model, cfg = _draft(smollm2_path, optimizer="muon", muon_lr=2e-2)
    muon, adamw = build_optimizers(model, cfg)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert _names(model, muon) == MUON
    trainable = set(trainable_names(model))
    # The rest: norms, lm_head (trained here); frozen ones (embeddings, teacher head) in none.
    assert _names(model, adamw) == trainable - MUON
    assert "lm_head.weight" in _names(model, adamw)
    assert muon.param_groups[0]["lr"] == 2e-2 and adamw.param_groups[0]["lr"] == 1e-3
    (only,) = build_optimizers(model, _draft(smollm2_path)[1])
    assert isinstance(only, torch.optim.AdamW) and _names(model, only) == trainable


def test_optimizers_save_and_restore_as_one(smollm2_path):
    def steps(opt: Optimizers, model, n: int) -> None:
        for _ in range(n):
            loss = sum((p.float() ** 2).sum() for p in model.parameters() if p.requires_grad)
            loss.backward()
            opt.step()
            opt.zero_grad()

    model, cfg = _draft(smollm2_path, optimizer="muon")
    opt = Optimizers(build_optimizers(model, cfg), lr_shape(10, 0.2, "cosine"))
    steps(opt, model, 3)
    saved = copy.deepcopy(opt.state_dict())  # a checkpoint: the live state moves on
    assert len(saved["optimizer"]) == len(saved["scheduler"]) == 2
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps(opt, model, 2)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}

    again, _ = _draft(smollm2_path, optimizer="muon")
    with torch.no_grad():
        for n, p in again.named_parameters():
            p.copy_(weights[n])
    opt2 = Optimizers(build_optimizers(again, cfg), lr_shape(10, 0.2, "cosine"))
    opt2.load_state_dict(saved)
    assert opt2.lr() == pytest.approx(
        opt.schedulers[-1].base_lrs[0] * lr_shape(10, 0.2, "cosine")(3)
    )
    steps(opt2, again, 2)
    for n, p in again.named_parameters():
        assert torch.equal(p, after[n]), n

    adamw, cfg_a = _draft(smollm2_path)
    with pytest.raises(ValueError, match="saved with another train.optimizer"):
        Optimizers(build_optimizers(adamw, cfg_a), lr_shape(10, 0.2, "cosine")).load_state_dict(
            saved
        )
