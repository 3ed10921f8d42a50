"""The EAGLE-3 draft folder as vLLM loads it ("llama" style), its writer and its lint.

Layout (vLLM `model_executor/models/llama_eagle3.py`):
    config.json        architectures ["LlamaForCausalLMEagle3"], model_type "llama",
                       num_hidden_layers 1, vocab_size = target vocab, draft_vocab_size,
                       target_hidden_size, every norm flag written explicitly, and
                       eagle_config {eagle_aux_hidden_state_layer_ids: [3 ids],
                       use_aux_hidden_state: true}; `eyrie` holds provenance metadata.
    model.safetensors  fc.weight [H, 3·T]; midlayer.* (q/k/v take 2H); norm.weight [H];
                       lm_head.weight [draft_vocab, H]; d2t int64 [draft_vocab];
                       t2d bool [target_vocab]; optional embed_tokens.weight [V, H],
                       input_norm.weight [3·T] (norm_before_fc), fc_norm.{i}.weight [T].

The lint also reads speculators-format folders (`speculators_config` in config.json), so
the serve preflight and the export check every folder with one function.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.conventions import (
    AUX_ID_CONVENTION,
    FINAL_STATE_CONVENTION,
    NUM_AUX_LAYERS,
    SGLANG_ID_CONVENTION,
    build_d2t_t2d,
    check_d2t_t2d,
    sglang_layer_ids,
    validate_aux_layer_ids,
)
from shared.errors import ConfigError, ContractMismatchError
from shared.store import atomic_path

LLAMA_ARCH = "LlamaForCausalLMEagle3"
#: Norm flags that change the architecture; vLLM reads each with a silent default.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class DraftSpec:
    """Config-level description of a llama-style EAGLE-3 draft.

    Attributes:
        target_vocab_size: V, the target's vocab (config `vocab_size`).
        target_hidden_size: T, the target's hidden size.
        target_num_layers: N, the target's decoder layers (for aux id validation).
        aux_layer_ids: 3 Eyrie aux ids (residual entering layer i).
        draft_vocab_size: rows of lm_head.
        hidden_size: H, the draft's hidden size.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim: the decoder
            layer's shape.
        hidden_act, rms_norm_eps, max_position_embeddings: the draft layer's, as trained.
        rope_parameters: the standardized RoPE dict the draft trained with (`rope_type`,
            `rope_theta` and the type's keys; `shared.target.normalize_config`).
        norm_before_residual, norm_before_fc, fc_norm, norm_output: architecture flags.
        verifier: the target path or hub id this draft speculates for.
        meta: extra provenance (recipe hash, training summary) stored under config `eyrie`.
    """

    target_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: list[int]
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    verifier: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_layer_config(
        cls,
        layer: dict[str, Any],
        *,
        target_hidden_size: int,
        target_num_layers: int,
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        verifier: str,
        **overrides: Any,
    ) -> DraftSpec:
        """The spec of a draft whose decoder layer has config `layer`.

        Args:
            layer: the draft layer's `LlamaConfig` as a dict (a trained speculators model's
                `config.transformer_layer_config.to_dict()`, or `layer_config_from_target`);
                its `vocab_size` is the target vocab.
            overrides: other DraftSpec fields (norm flags, `meta`).
        """
        spec = cls(
            target_vocab_size=int(layer["vocab_size"]),
            target_hidden_size=target_hidden_size,
            target_num_layers=target_num_layers,
            aux_layer_ids=list(aux_layer_ids),
            draft_vocab_size=draft_vocab_size,
            hidden_size=int(layer["hidden_size"]),
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=int(layer["num_attention_heads"]),
            num_key_value_heads=int(layer["num_key_value_heads"]),
            head_dim=int(layer["head_dim"]),
            hidden_act=str(layer["hidden_act"]),
            rms_norm_eps=float(layer["rms_norm_eps"]),
            rope_parameters=standard_rope(layer["rope_parameters"]),
            max_position_embeddings=int(layer["max_position_embeddings"]),
            verifier=verifier,
        )
        for k, v in overrides.items():
            setattr(spec, k, v)
        return spec

    @classmethod
    def from_target_config(
        cls,
        cfg: dict[str, Any],
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        verifier: str,
        **overrides: Any,
    ) -> DraftSpec:
        """A draft shaped like one decoder layer of the target.

        `cfg` is the target's normalized config (`shared.target.normalize_config`).
        """
        return cls.from_layer_config(
            layer_config_from_target(cfg),
            target_hidden_size=int(cfg["hidden_size"]),
            target_num_layers=int(cfg["num_hidden_layers"]),
            aux_layer_ids=aux_layer_ids,
            draft_vocab_size=draft_vocab_size,
            verifier=verifier,
            **overrides,
        )

    def forward_config(self) -> dict[str, Any]:
        """The settings that shape the draft's forward pass (`forward_view`'s keys)."""
        return {
            "vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": standard_rope(self.rope_parameters),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            **{flag: bool(getattr(self, flag)) for flag in NORM_FLAGS},
        }

    def config_dict(self) -> dict[str, Any]:
        """The vLLM llama-style `config.json` content."""
        rope = standard_rope(self.rope_parameters)
        return {
            "architectures": [LLAMA_ARCH],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 5 (vLLM) reads `rope_parameters` (and takes
            # `rope_scaling` over it when both are set, so the two are the same dict);
            # readers on transformers 4 (older SGLang) read `rope_scaling` + `rope_theta`.
            "rope_parameters": rope,
            "rope_scaling": None if rope["rope_type"] == "default" else rope,
            "rope_theta": rope["rope_theta"],
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": self.target_vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            **{flag: bool(getattr(self, flag)) for flag in NORM_FLAGS},
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
                "norm_before_fc": bool(self.norm_before_fc),
            },
            "eyrie": {
                "verifier": self.verifier,
                "aux_id_convention": AUX_ID_CONVENTION,
                "final_state": FINAL_STATE_CONVENTION,
                "target_num_layers": self.target_num_layers,
                **self.meta,
            },
        }

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every required weight (name → shape)."""
        h, t, i = self.hidden_size, self.target_hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes = {
            "fc.weight": (h, NUM_AUX_LAYERS * t),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (q, 2 * h),
            "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (i, h),
            "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (NUM_AUX_LAYERS * t,)
        if self.fc_norm:
            for k in range(NUM_AUX_LAYERS):
                shapes[f"fc_norm.{k}.weight"] = (t,)
        return shapes


def standard_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """A copy of a RoPE dict with the legacy `type` key folded into `rope_type`."""
    out = dict(rope)
    out["rope_type"] = out.get("rope_type") or out.get("type", "default")
    out.pop("type", None)
    return out


#: The draft decoder layer's shape and forward-pass keys (RoPE apart): what the layer copies
#: from the target config and what the export lint reads back.
LAYER_SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
)


def layer_config_from_target(cfg: dict[str, Any]) -> dict[str, Any]:
    """The draft layer's config keys copied from a normalized target config.

    The same keys `services.train.draft_model.draft_layer_config` gives the trained layer
    (with the recipe's MLP width there).
    """
    return {k: cfg[k] for k in (*LAYER_SHAPE_KEYS, "rope_parameters")}


def forward_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """A draft folder's forward-pass settings, read the way transformers 5 reads them.

    The decoder layer's keys (the top level of a llama-style config, `transformer_layer_config`
    of a speculators one) go through `LlamaConfig.from_dict`, so RoPE comes out as the
    reader sees it (`rope_scaling` over `rope_parameters`, `rope_theta` folded in,
    `original_max_position_embeddings` defaulted) and a key the file lacks comes out as the
    reader's default. Draft-level keys (draft vocab, target hidden size, norm flags) are taken
    as written; a missing one is None.

    Returns:
        The keys of `DraftSpec.forward_config`.
    """
    from transformers import LlamaConfig

    spec_fmt = "speculators_config" in cfg
    layer = dict(cfg.get("transformer_layer_config") or {}) if spec_fmt else dict(cfg)
    for key in ("architectures", "model_type", "eagle_config", "eyrie", "auto_map"):
        layer.pop(key, None)
    hf = LlamaConfig.from_dict(layer)
    keys = (*LAYER_SHAPE_KEYS, "attention_bias", "mlp_bias")
    out: dict[str, Any] = {k: getattr(hf, k, None) for k in keys}
    out["rope_parameters"] = standard_rope(dict(hf.rope_parameters or {}))
    out["draft_vocab_size"] = cfg.get("draft_vocab_size")
    out["target_hidden_size"] = cfg.get("target_hidden_size")
    for flag in NORM_FLAGS:
        out[flag] = cfg.get(flag)
    return out


def compare_forward(written: dict[str, Any], trained: dict[str, Any]) -> list[str]:
    """Key-by-key differences between a folder's `forward_view` and the trained draft.

    `trained` is the trained draft's `DraftSpec.forward_config`; one problem per differing
    key, naming both values.
    """
    return [
        f"{key}: export has {written.get(key)!r}, the trained draft has {want!r}"
        for key, want in trained.items()
        if written.get(key) != want
    ]


def write_llama_draft(
    out_dir: Path, spec: DraftSpec, weights: dict[str, Any], d2t: np.ndarray, t2d: np.ndarray
) -> Path:
    """Write a vLLM llama-style draft folder atomically and lint it.

    Args:
        out_dir: destination folder (replaced as a whole).
        spec: the draft's config.
        weights: name → torch tensor, with exactly the names of `spec.weight_shapes()`
            (plus optional `embed_tokens.weight` [V, H]); cast to bf16 on write.
        d2t: int64 [draft_vocab] offsets; t2d: bool [target_vocab].

    Raises:
        ContractMismatchError: a weight is missing or mis-shaped, or the written folder fails
            `lint_draft_dir`.
    """
    import torch
    from safetensors.torch import save_file

    validate_aux_layer_ids(spec.aux_layer_ids, spec.target_num_layers)
    check_d2t_t2d(d2t, t2d, spec.draft_vocab_size)
    expected = spec.weight_shapes()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ContractMismatchError(f"draft weights missing: {missing}")
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name not in expected and name != "embed_tokens.weight":
            raise ContractMismatchError(f"unexpected draft weight {name!r}")
        want = expected.get(name, (spec.target_vocab_size, spec.hidden_size))
        if tuple(w.shape) != want:
            raise ContractMismatchError(f"{name}: expected shape {want}, got {tuple(w.shape)}")
        tensors[name] = w.detach().to(torch.bfloat16).contiguous().cpu()
    tensors["d2t"] = torch.from_numpy(np.asarray(d2t, dtype=np.int64))
    tensors["t2d"] = torch.from_numpy(np.asarray(t2d, dtype=bool))
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(spec.config_dict(), indent=2) + "\n")
    problems = lint_draft_dir(
        out_dir,
        {
            "vocab_size": spec.target_vocab_size,
            "hidden_size": spec.target_hidden_size,
            "num_hidden_layers": spec.target_num_layers,
        },
    )
    if problems:
        raise ContractMismatchError(f"{out_dir}: written draft fails lint: {problems}")
    return Path(out_dir)


# -- lint ----------------------------------------------------------------------------------


def _read_weights_meta(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, np.ndarray]]:
    """Shapes of every tensor in model.safetensors, and the d2t/t2d values if present."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    small: dict[str, np.ndarray] = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            shapes[name] = tuple(f.get_slice(name).get_shape())
            if name in ("d2t", "t2d"):
                small[name] = f.get_tensor(name).numpy()
    return shapes, small


def _view(cfg: dict[str, Any]) -> dict[str, Any]:
    """Normalize llama-style and speculators configs to one view for the lint."""
    if "speculators_config" in cfg:
        tl = cfg.get("transformer_layer_config", {})
        verifier = (cfg["speculators_config"].get("verifier") or {}).get("name_or_path")
        return {
            "format": "speculators",
            "arch_ok": cfg.get("speculators_model_type") == "eagle3",
            "aux_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
            "vocab_size": tl.get("vocab_size"),
            "draft_vocab_size": cfg.get("draft_vocab_size"),
            "hidden_size": tl.get("hidden_size"),
            "target_hidden_size": cfg.get("target_hidden_size") or tl.get("hidden_size"),
            "num_layers": tl.get("num_hidden_layers"),
            "flags": cfg,
            "verifier": verifier,
            "prefix": "layers.0.",
        }
    ec = cfg.get("eagle_config") or {}
    return {
        "format": "llama",
        "arch_ok": cfg.get("architectures") in ([LLAMA_ARCH], ["Eagle3LlamaForCausalLM"])
        and cfg.get("model_type") == "llama",
        "aux_ids": ec.get("eagle_aux_hidden_state_layer_ids"),
        "use_aux": ec.get("use_aux_hidden_state"),
        "vocab_size": cfg.get("vocab_size"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "hidden_size": cfg.get("hidden_size"),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "num_layers": cfg.get("num_hidden_layers"),
        "flags": cfg,
        "verifier": (cfg.get("eyrie") or {}).get("verifier"),
        "prefix": "midlayer.",
    }


def _check_config(v: dict[str, Any], target: dict[str, Any]) -> list[str]:
    p: list[str] = []
    if not v["arch_ok"]:
        p.append(f"architectures/model_type: not an EAGLE-3 llama draft ({v['format']} format)")
    if v["num_layers"] != 1:
        p.append(f"num_hidden_layers: expected 1, got {v['num_layers']}")
    if v.get("use_aux") is False:
        p.append("eagle_config.use_aux_hidden_state: must be true for EAGLE-3")
    ids = v["aux_ids"]
    if not isinstance(ids, list) or len(ids) != NUM_AUX_LAYERS:
        p.append(
            f"eagle_aux_hidden_state_layer_ids: need exactly 3 ids, got {ids} "
            "(a 4th id makes vLLM expect fc width 4·H)"
        )
    elif "num_hidden_layers" in target:
        try:
            validate_aux_layer_ids(ids, target["num_hidden_layers"])
        except ConfigError as e:
            p.append(f"eagle_aux_hidden_state_layer_ids: {e}")
    if v["vocab_size"] != target["vocab_size"]:
        p.append(f"vocab_size: {v['vocab_size']} != target vocab {target['vocab_size']}")
    if v["target_hidden_size"] is None:
        p.append("target_hidden_size: not written")
    elif v["target_hidden_size"] != target["hidden_size"]:
        p.append(
            f"target_hidden_size: {v['target_hidden_size']} != target hidden "
            f"{target['hidden_size']}"
        )
    missing = [f for f in NORM_FLAGS if f not in v["flags"]]
    if missing:
        p.append(f"norm flags not written explicitly: {missing} (vLLM defaults them silently)")
    return p


def _check_weights(
    v: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    small: dict[str, np.ndarray],
    target: dict[str, Any],
) -> list[str]:
    p: list[str] = []
    h, t = v["hidden_size"], target["hidden_size"]
    fc = shapes.get("fc.weight")
    if fc is None or fc != (h, NUM_AUX_LAYERS * t):
        p.append(f"fc.weight: expected [{h}, {NUM_AUX_LAYERS}·{t}={NUM_AUX_LAYERS * t}], got {fc}")
    q = shapes.get(v["prefix"] + "self_attn.q_proj.weight")
    if q is None or q[1] != 2 * h:
        p.append(f"{v['prefix']}self_attn.q_proj.weight: input width must be 2·H={2 * h}, got {q}")
    lm = shapes.get("lm_head.weight")
    dv = v["draft_vocab_size"]
    if lm is None or lm[0] != dv:
        p.append(f"lm_head.weight: expected {dv} rows (draft_vocab_size), got {lm}")
    if "d2t" not in small:
        p.append("d2t: missing from model.safetensors (vLLM would map draft id i to target id i)")
    if "t2d" not in small:
        p.append("t2d: missing from model.safetensors")
    if "d2t" in small and "t2d" in small and isinstance(dv, int):
        try:
            check_d2t_t2d(small["d2t"], small["t2d"], dv, None if lm is None else lm[0])
        except ContractMismatchError as e:
            p.append(f"d2t/t2d: {e}")
        if len(small["t2d"]) != target["vocab_size"]:
            p.append(f"t2d: length {len(small['t2d'])} != target vocab {target['vocab_size']}")
    flags = v["flags"]
    if bool(flags.get("norm_before_fc")) != ("input_norm.weight" in shapes):
        p.append("norm_before_fc flag and input_norm.weight disagree")
    if bool(flags.get("fc_norm")) != any(k.startswith("fc_norm.") for k in shapes):
        p.append("fc_norm flag and fc_norm.* weights disagree")
    emb = shapes.get("embed_tokens.weight")
    if emb is None and h != t:
        p.append(f"embed_tokens.weight: required when draft hidden {h} != target hidden {t}")
    if emb is not None and emb != (target["vocab_size"], h):
        p.append(f"embed_tokens.weight: expected [{target['vocab_size']}, {h}], got {emb}")
    return p


def _check_aux_ids(cfg: dict[str, Any], v: dict[str, Any], expect: list[int]) -> list[str]:
    """The config's aux ids against the ids the draft was trained on (§1).

    A folder whose `eyrie.aux_id_convention` is SGLang's must hold `i-1` for each trained id
    (and record the trained ids); any other folder must hold the trained ids themselves.
    """
    eyrie = cfg.get("eyrie") or {}
    if eyrie.get("aux_id_convention") == SGLANG_ID_CONVENTION:
        if eyrie.get("eyrie_aux_layer_ids") != list(expect):
            return [
                f"eyrie.eyrie_aux_layer_ids: {eyrie.get('eyrie_aux_layer_ids')} != trained "
                f"ids {list(expect)}"
            ]
        try:
            want = sglang_layer_ids(expect)
        except ContractMismatchError as e:
            return [f"eagle_aux_hidden_state_layer_ids: {e}"]
    else:
        want = list(expect)
    if v["aux_ids"] != want:
        return [
            f"eagle_aux_hidden_state_layer_ids: {v['aux_ids']} but the draft was trained "
            f"on Eyrie ids {list(expect)}; this folder's convention needs {want}"
        ]
    return []


def lint_draft_dir(
    path: Path | str,
    target_config: dict[str, Any],
    expect_verifier: str | None = None,
    expect_aux_ids: list[int] | None = None,
    expect_forward: dict[str, Any] | None = None,
) -> list[str]:
    """Check a draft folder against every §3/§6 invariant; return the problems found.

    Args:
        path: a llama-style or speculators-style draft folder.
        target_config: the target's `config.json` as a dict (vocab_size, hidden_size,
            num_hidden_layers are read).
        expect_verifier: if given, the draft's recorded verifier must equal it.
        expect_aux_ids: if given, the Eyrie aux ids the draft was trained on; the config must
            hold them, or `i-1` each in a folder marked with SGLang's convention (§1).
        expect_forward: if given, the trained draft's `DraftSpec.forward_config`; the
            folder's `forward_view` must equal it key by key (RoPE, head_dim, eps, act, ...).

    Returns:
        Human-readable problems, each naming the key or weight; empty when the draft is sound.
    """
    path = Path(path)
    cfg_path, w_path = path / "config.json", path / "model.safetensors"
    if not cfg_path.is_file():
        return [f"{cfg_path}: missing"]
    if not w_path.is_file():
        return [f"{w_path}: missing"]
    v = _view(json.loads(cfg_path.read_text()))
    problems = _check_config(v, target_config)
    shapes, small = _read_weights_meta(w_path)
    problems += _check_weights(v, shapes, small, target_config)
    if expect_aux_ids is not None:
        problems += _check_aux_ids(json.loads(cfg_path.read_text()), v, expect_aux_ids)
    if expect_forward is not None:
        problems += compare_forward(forward_view(json.loads(cfg_path.read_text())), expect_forward)
    if expect_verifier is not None and v["verifier"] != expect_verifier:
        problems.append(
            f"verifier: draft was trained for {v['verifier']!r}, "
            f"serving target is {expect_verifier!r}"
        )
    return problems


# -- test and fixture drafts ---------------------------------------------------------------


def random_llama_draft(
    target_dir: Path | str,
    out_dir: Path | str,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    seed: int = 0,
    selected_ids: list[int] | None = None,
    zero_lm_head: bool = False,
    **spec_overrides: Any,
) -> DraftSpec:
    """Write a valid, randomly initialised llama-style draft for the target in `target_dir`.

    A random draft is a real artifact for serving tests: vLLM loads it and accepts almost
    nothing (τ ≈ 1). With `zero_lm_head`, every draft logit is 0 so greedy drafting always
    proposes draft id 0 (target id `selected_ids[0]`, keep it 0 for the all-accept fixture).

    Args:
        selected_ids: ascending target ids of the draft vocab; default the first
            `draft_vocab_size` ids.
    """
    import torch

    from shared.target import normalize_config

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    cfg = normalize_config(json.loads((target_dir / "config.json").read_text()), str(target_dir))
    spec = DraftSpec.from_target_config(
        cfg, aux_layer_ids, draft_vocab_size, verifier=str(target_dir), **spec_overrides
    )
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in spec.weight_shapes().items():
        if "norm" in name:
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * 0.02
    if zero_lm_head:
        weights["lm_head.weight"] = torch.zeros(spec.weight_shapes()["lm_head.weight"])
    ids = selected_ids if selected_ids is not None else list(range(draft_vocab_size))
    d2t, t2d = build_d2t_t2d(ids, spec.target_vocab_size)
    write_llama_draft(out_dir, spec, weights, d2t, t2d)
    return spec


def spec_summary(spec: DraftSpec) -> dict[str, Any]:
    """A JSON-serializable dict of the spec (for reports and metadata)."""
    return asdict(spec)
