"""The draft trains and is exported with exactly the target's RoPE, head_dim, rms_norm_eps and
hidden_act (issue 15, faults 5 and 6), and vLLM's own config loader reads the export back
with the same forward-pass settings (export round trip).

One case per RoPE kind, each on a real target config: SmolLM2 (default RoPE, transformers 5
spelling `rope_parameters`), Llama-3.1-8B-Instruct (`rope_scaling` llama3, transformers 4
spelling) and Qwen2.5-7B-Instruct with its model card's YaRN block (legacy `type: yarn`).
Expected RoPE tables are computed by transformers' own rotary classes from the target's
config as `AutoConfig` loads it, independently of Eyrie's normalization.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.draft import DraftSpec, compare_forward, forward_view, lint_draft_dir
from shared.recipe import resolve_recipe
from shared.target import normalize_config, target_config

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "target-configs"
LLAMA31 = FIX / "llama-3.1-8b-instruct"
QWEN_YARN = FIX / "qwen2.5-7b-instruct-yarn"

#: RoPE kind → (target folder or None for SmolLM2, the rope dict the file declares, head_dim).
CASES: dict[str, tuple[Path | None, dict[str, Any], int]] = {
    "default": (None, {"rope_type": "default", "rope_theta": 100000.0}, 64),
    "llama3": (
        LLAMA31,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        128,
    ),
    "yarn": (
        QWEN_YARN,
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
        128,  # Qwen2 has no head_dim key: 3584 / 28
    ),
}


def _recipe(path: Path):
    return resolve_recipe(
        {
            "name": "t",
            "target": {"path": str(path)},
            "datasets": [{"path": "/d"}],
            "draft": {"draft_vocab_size": 64},
        }
    )


def _path(kind: str, smollm2_path: Path) -> Path:
    return CASES[kind][0] or Path(smollm2_path)


def _rope_table(cfg: Any) -> tuple[Any, float]:
    """(inv_freq, attention_scaling) as transformers' rotary embedding computes them."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cls = Qwen2RotaryEmbedding if cfg.model_type == "qwen2" else LlamaRotaryEmbedding
    rot = cls(cfg)
    return rot.inv_freq.clone(), float(rot.attention_scaling)


def _spec(layer: Any, tcfg: dict[str, Any]) -> DraftSpec:
    return DraftSpec.from_layer_config(
        layer.to_dict(),
        target_hidden_size=int(tcfg["hidden_size"]),
        target_num_layers=int(tcfg["num_hidden_layers"]),
        aux_layer_ids=[2, 10, int(tcfg["num_hidden_layers"]) - 3],
        draft_vocab_size=64,
        verifier="t",
    )


def _write_config(folder: Path, cfg: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


@pytest.mark.parametrize("kind", list(CASES))
def test_target_config_has_the_files_rope_local_and_hub_alike(kind, smollm2_path):
    from transformers import AutoConfig

    path = _path(kind, smollm2_path)
    tcfg = target_config(_recipe(path))
    _, rope, head_dim = CASES[kind]
    assert tcfg["rope_parameters"] == rope
    assert tcfg["rope_theta"] == rope["rope_theta"]
    assert "rope_scaling" not in tcfg
    assert tcfg["head_dim"] == head_dim
    # The hub route hands over AutoConfig's dict; both routes give the same forward keys.
    hub = normalize_config(AutoConfig.from_pretrained(path).to_dict(), str(path))
    keys = ("rope_parameters", "head_dim", "rms_norm_eps", "hidden_act", "num_key_value_heads")
    assert {k: hub[k] for k in keys} == {k: tcfg[k] for k in keys}


@pytest.mark.parametrize("kind", list(CASES))
def test_draft_layer_and_vllm_export_compute_the_targets_rope(kind, smollm2_path, tmp_path):
    import torch
    from transformers import AutoConfig, LlamaConfig

    from services.train.draft_model import draft_layer_config

    path = _path(kind, smollm2_path)
    target = AutoConfig.from_pretrained(path)
    want_freq, want_scale = _rope_table(target)
    tcfg = target_config(_recipe(path))
    layer = draft_layer_config(_recipe(path), tcfg)
    got_freq, got_scale = _rope_table(layer)
    assert torch.equal(got_freq, want_freq) and got_scale == want_scale
    # The exported llama-style config, read back by transformers, gives the same table.
    out = _write_config(tmp_path / "vllm", _spec(layer, tcfg).config_dict())
    exp_freq, exp_scale = _rope_table(AutoConfig.from_pretrained(out))
    assert torch.equal(exp_freq, want_freq) and exp_scale == want_scale
    if kind != "default":  # the scaling really changes the table (so the check can fail)
        plain = LlamaConfig(
            head_dim=tcfg["head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": tcfg["rope_theta"]},
        )
        assert not torch.equal(_rope_table(plain)[0], want_freq)


def test_target_without_eps_and_act_exports_what_the_draft_trained_with(tmp_path):
    from transformers import AutoConfig

    from services.train.draft_model import draft_layer_config

    raw = json.loads((LLAMA31 / "config.json").read_text())
    del raw["rms_norm_eps"], raw["hidden_act"]
    path = _write_config(tmp_path / "target", raw)
    loaded = AutoConfig.from_pretrained(path)  # what the target itself runs with
    tcfg = target_config(_recipe(path))
    assert (tcfg["rms_norm_eps"], tcfg["hidden_act"]) == (loaded.rms_norm_eps, loaded.hidden_act)
    assert (tcfg["rms_norm_eps"], tcfg["hidden_act"]) == (1e-6, "silu")  # LlamaConfig's
    layer = draft_layer_config(_recipe(path), tcfg)
    assert (layer.rms_norm_eps, layer.hidden_act) == (1e-6, "silu")
    spec = _spec(layer, tcfg)
    cfg = spec.config_dict()
    assert (cfg["rms_norm_eps"], cfg["hidden_act"]) == (1e-6, "silu")
    assert compare_forward(forward_view(cfg), spec.forward_config()) == []


@pytest.mark.parametrize("kind", list(CASES))
def test_vllm_reads_the_export_with_the_trained_settings(kind, smollm2_path, tmp_path):
    """Export round trip: vLLM's config loader (`get_config`, then the `EAGLEConfig` wrap its
    SpeculativeConfig applies to eagle3 drafts) reads the llama-style and SGLang-style
    configs with the draft layer's forward-pass settings."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    from services.train.draft_model import draft_layer_config
    from shared.conventions import sglang_layer_ids

    path = _path(kind, smollm2_path)
    tcfg = target_config(_recipe(path))
    layer = draft_layer_config(_recipe(path), tcfg)
    spec = _spec(layer, tcfg)
    folders = {
        "vllm": spec.config_dict(),
        "sglang": DraftSpec(
            **{**spec.__dict__, "aux_layer_ids": sglang_layer_ids(spec.aux_layer_ids)}
        ).config_dict(),
    }
    for name, cfg in folders.items():
        out = _write_config(tmp_path / name, cfg)
        eagle = EAGLEConfig(
            get_config(str(out), trust_remote_code=False), method="eagle3", model_type="eagle"
        )
        m = eagle.model
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
        ):
            assert getattr(m, key) == getattr(layer, key), (name, key)
        got_rope = {k: v for k, v in m.rope_parameters.items() if k != "type"}
        assert got_rope == CASES[kind][1] | _filled_defaults(kind, layer), name
        assert m.draft_vocab_size == 64 and m.target_hidden_size == tcfg["hidden_size"]
        # Readers on transformers 4 (SGLang) take rope_scaling + rope_theta.
        assert cfg["rope_theta"] == CASES[kind][1]["rope_theta"]
        assert cfg["rope_scaling"] == (None if kind == "default" else m.rope_parameters)


def _filled_defaults(kind: str, layer: Any) -> dict[str, Any]:
    """Keys transformers adds when it standardizes a RoPE dict (none for these files)."""
    return {k: v for k, v in layer.rope_parameters.items() if k not in CASES[kind][1]}


def test_lint_compares_export_with_the_trained_draft_key_by_key(smollm2_path, tmp_path):
    from shared.draft import random_llama_draft

    aux = [2, 15, 27]
    out = tmp_path / "draft"
    spec = random_llama_draft(smollm2_path, out, aux, 64, seed=0)
    tcfg = target_config(_recipe(smollm2_path))
    want = spec.forward_config()
    assert lint_draft_dir(out, tcfg, expect_aux_ids=aux, expect_forward=want) == []
    edits = {
        "rope_parameters": lambda c: (c.pop("rope_parameters"), c.update(rope_theta=10000.0)),
        "rms_norm_eps": lambda c: c.update(rms_norm_eps=1e-5),
        "hidden_act": lambda c: c.update(hidden_act="gelu"),
        "head_dim": lambda c: c.update(head_dim=32),
    }
    original = (out / "config.json").read_text()
    for key, edit in edits.items():
        cfg = json.loads(original)
        edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
        problems = lint_draft_dir(out, tcfg, expect_forward=want)
        assert [p.split(":")[0] for p in problems] == [key], (key, problems)
