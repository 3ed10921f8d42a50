"""What trains: the draft lm_head frozen or trained, and the layer started from the target.

Checked on the real SmolLM2 target, against its safetensors read here with `safetensors`
(not through the code under test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from services.train.draft_model import build_draft, trainable_names, trainable_state
from shared.recipe import resolve_recipe


def _recipe(smollm2_path, **draft):
    return resolve_recipe(
        {
            "name": "draft-choices",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 15, 27],
            "draft": {"draft_vocab_size": 64, **draft},
        }
    )


def _maps():
    d2t = np.zeros(64, dtype=np.int64)
    t2d = np.zeros(49152, dtype=bool)
    t2d[:64] = True
    return d2t, t2d


def _target(smollm2_path, name: str) -> torch.Tensor:
    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
        return f.get_tensor(name).float()


def test_lm_head_is_frozen_by_default_and_trained_on_request(smollm2_path):
    frozen = build_draft(_recipe(smollm2_path), *_maps())
    assert "lm_head.weight" not in trainable_names(frozen)
    trained = build_draft(_recipe(smollm2_path, train_lm_head=True), *_maps())
    assert "lm_head.weight" in trainable_names(trained)
    assert "lm_head.weight" in trainable_state(trained)
    # Either way it starts as the target's rows of the draft ids (0..63; SmolLM2 ties
    # lm_head to the embeddings), and the teacher head stays frozen.
    want = _target(smollm2_path, "model.embed_tokens.weight")[:64]
    assert torch.allclose(trained.lm_head.weight.float(), want)
    assert "verifier_lm_head.weight" not in trainable_names(trained)


def test_layer_starts_from_the_targets_last_layer_where_shapes_match(smollm2_path):
    torch.manual_seed(0)
    model = build_draft(_recipe(smollm2_path, init_from_target_layer=True), *_maps())
    params = dict(model.named_parameters())
    for mine, theirs in [
        ("layers.0.self_attn.o_proj.weight", "model.layers.29.self_attn.o_proj.weight"),
        ("layers.0.mlp.down_proj.weight", "model.layers.29.mlp.down_proj.weight"),
        ("layers.0.input_layernorm.weight", "model.layers.29.input_layernorm.weight"),
        ("norm.weight", "model.norm.weight"),
    ]:
        assert torch.equal(params[mine].detach().float(), _target(smollm2_path, theirs)), mine
    # q_proj reads [embedding, hidden] (2H = 1152 inputs): no target counterpart.
    assert params["layers.0.self_attn.q_proj.weight"].shape == (576, 1152)
    torch.manual_seed(0)
    fresh = build_draft(_recipe(smollm2_path), *_maps())
    assert torch.equal(
        params["layers.0.self_attn.q_proj.weight"],
        dict(fresh.named_parameters())["layers.0.self_attn.q_proj.weight"],
    )


def test_a_narrower_mlp_keeps_its_random_init(smollm2_path):
    model = build_draft(
        _recipe(smollm2_path, init_from_target_layer=True, intermediate_size=512), *_maps()
    )
    params = dict(model.named_parameters())
    assert params["layers.0.mlp.up_proj.weight"].shape == (512, 576)
    assert torch.equal(
        params["layers.0.self_attn.o_proj.weight"].detach().float(),
        _target(smollm2_path, "model.layers.29.self_attn.o_proj.weight"),
    )


@pytest.mark.parametrize("flag", ["train_lm_head", "init_from_target_layer"])
def test_choices_are_off_by_default(flag, smollm2_path):
    assert getattr(_recipe(smollm2_path).draft, flag) is False
