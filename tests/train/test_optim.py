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
from services.train.optim import (
    Optimizers,
    _newton_schulz_fp32,
    build_optimizers,
    newton_schulz_fp32_needed,
)
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

    fp32 = newton_schulz_fp32_needed("cpu")  # torch's bf16 one takes ~20 s a step on AVX2
    model, cfg = _draft(smollm2_path, optimizer="muon")
    opt = Optimizers(build_optimizers(model, cfg), lr_shape(10, 0.2, "cosine"), fp32)
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
    opt2 = Optimizers(build_optimizers(again, cfg), lr_shape(10, 0.2, "cosine"), fp32)
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


#: Keller Jordan's quintic Newton-Schulz coefficients (github.com/KellerJordan/Muon, muon.py).
NS_ABC = (3.4445, -4.7750, 2.0315)


def _newton_schulz_f64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The iteration as Keller Jordan's muon.py writes it, in float64: X <- aX + (bA + cA^2)X
    with A = X X^T, on the wide orientation, after scaling to Frobenius norm 1."""
    a, b, c = NS_ABC
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
def test_float32_newton_schulz_matches_the_iteration(shape):
    """Ours follows the float64 iteration to float32 rounding; torch's own (bf16) only to bf16
    rounding, ~100x further off: the two paths really differ in precision, not in maths."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    want = _newton_schulz_f64(g)
    ours = _newton_schulz_fp32(g, NS_ABC, 5, 1e-7)
    torch_bf16 = torch.optim._muon._zeropower_via_newtonschulz(g, NS_ABC, 5, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    err_ours = ((ours.double() - want).norm() / want.norm()).item()
    err_bf16 = ((torch_bf16.double() - want).norm() / want.norm()).item()
    assert err_ours < 1e-5
    assert 1e-3 < err_bf16 < 5e-2
    with pytest.raises(ValueError, match="2D"):
        _newton_schulz_fp32(g[0], NS_ABC, 5, 1e-7)


def test_optimizers_step_muon_in_float32_and_restore_torch():
    """A Muon step under `fp32_newton_schulz` is the float64 iteration's to float32 rounding of
    the weights, torch's bf16 one ~100x further off. param <- param (1 - lr wd) - lr 0.2
    sqrt(max(A, B)) NS(g) (torch's `match_rms_adamw`; the first step's Nesterov update is a
    multiple of g, which NS's normalization removes), NS in float64 here. torch's own function
    is back in place after the step."""
    original = torch.optim._muon._zeropower_via_newtonschulz
    errors = {}
    for fp32 in (True, False):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(96, 32))
        muon = torch.optim.Muon([w], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        opt = Optimizers([muon], lr_shape(10, 0.0, "cosine"), fp32_newton_schulz=fp32)
        g = torch.randn(96, 32, generator=torch.Generator().manual_seed(2))
        w.grad = g.clone()
        before = w.detach().double().clone()
        opt.step()
        want = before * (1 - 1e-2 * 0.1) - 1e-2 * 0.2 * 96**0.5 * _newton_schulz_f64(g)
        errors[fp32] = (w.detach().double() - want).abs().max() / (want - before).abs().max()
        assert torch.optim._muon._zeropower_via_newtonschulz is original
    assert errors[True] < 3e-4 and errors[False] > 30 * errors[True], errors


def test_newton_schulz_fp32_only_on_a_cpu_without_bf16_kernels():
    from shared.target import cpu_has_bf16_kernels

    assert newton_schulz_fp32_needed("cuda") is False
    assert newton_schulz_fp32_needed("cpu") is (not cpu_has_bf16_kernels())
