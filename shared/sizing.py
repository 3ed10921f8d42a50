"""Sizes and durations of a run, from the target's config and the recipe's stated rates.

One home for the arithmetic that `eyrie plan` prints and the sized timeouts use, so a
timeout and the plan cannot disagree. Everything here is an estimate from config-level
shapes (no weights are read, nothing is imported beyond the standard library):

- hidden states stored per token: `(3 aux + 1 final) * hidden_size * dtype bytes` (the
  extract contract: aux ids `[a, b, c, N]`, `shared.vllm.speculative_config`);
- the target's weight bytes, from its safetensors index when there is a local copy, else
  counted from `config.json` (dense or DeepSeek-V3-style MLA + MoE, a ViT tower when the
  config has one, compressed-tensors int-N group quantization honoured);
- the draft's parameters: `shared.draft.DraftSpec.weight_shapes` plus the target embedding
  the exported draft carries;
- timeouts: work / stated rate, times `rates.timeout_factor`, plus a margin.

The rates live in the recipe (`rates.*`, defaults from the known Kimi-K2.5 run on one
8×H200 node); each sized timeout's error message names the setting that overrides it.
"""

from __future__ import annotations

import re
from typing import Any

from shared.conventions import resolve_aux_layer_ids
from shared.recipe import Recipe

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Floor of the sized regen request timeout in seconds (the former fixed default).
MIN_REQUEST_TIMEOUT_S = 300.0
#: Seconds of request overhead (queueing, prefill) added to the decode time of a request.
REQUEST_MARGIN_S = 60.0
#: Floor of a sized job timeout in seconds.
MIN_JOB_TIMEOUT_S = 3600
#: fp32 master weight + fp32 grad + two fp32 AdamW moments, bytes per trainable parameter.
TRAIN_BYTES_PER_PARAM = 16
#: fp32 weight + two fp32 AdamW moments: what a checkpoint stores per trainable parameter.
CHECKPOINT_BYTES_PER_PARAM = 12


def hidden_state_bytes_per_token(recipe: Recipe, cfg: dict[str, Any]) -> int:
    """Bytes the extract stage stores per token: `(len(aux ids) + 1) * H * dtype bytes`.

    Kimi-K2.5 (H 7168, bf16, 3 aux ids + the final state): 4 * 7168 * 2 = 57,344 B (56 KiB).
    """
    n = int(cfg["num_hidden_layers"])
    aux = resolve_aux_layer_ids(recipe.layers, n)
    return (len(aux) + 1) * int(cfg["hidden_size"]) * DTYPE_BYTES[recipe.extract.dtype]


# -- target weights from config.json ---------------------------------------------------------


def _quant(cfg: dict[str, Any]) -> tuple[float, list[str]] | None:
    """(bytes per quantized weight, ignore patterns) of a compressed-tensors int-N config."""
    q = cfg.get("quantization_config") or {}
    groups = (q.get("config_groups") or {}).values()
    for g in groups:
        w = g.get("weights") or {}
        bits, group = w.get("num_bits"), w.get("group_size")
        if bits:
            # One bf16 scale per group (symmetric: no zero point).
            per_param = bits / 8 + (2 / group if group else 0)
            return per_param, list(q.get("ignore") or [])
    return None


def _ignored(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def target_param_groups(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of the target's weight groups, from its (text) `config.json`.

    Keys are representative module names (the names quantization ignore-lists match):
    attention, dense MLP, routed experts, shared experts, embeddings, lm_head, vision.

    Covers dense decoders (Llama, Qwen) and DeepSeek-V3-style MLA + MoE (Kimi-K2); norms
    and biases are left out (well under 0.1 % of the total).
    """
    h = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    v = int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        vd, kvr, qr = int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"]), cfg.get("q_lora_rank")
        q = h * qr + qr * heads * (nope + rope) if qr else h * heads * (nope + rope)
        attn = q + h * (kvr + rope) + kvr * heads * (nope + vd) + heads * vd * h
    else:
        hd = int(cfg.get("head_dim") or h // heads)
        kv = int(cfg.get("num_key_value_heads") or heads)
        attn = 2 * h * heads * hd + 2 * h * kv * hd
    routed = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    moe_i = int(cfg.get("moe_intermediate_size") or 0)
    dense_layers = n
    if routed and moe_i:
        first = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        moe_layers = sum(1 for i in range(first, n) if (i - first) % freq == 0)
        dense_layers = n - moe_layers
    else:
        moe_layers = 0
    shared_n = int(cfg.get("n_shared_experts") or 0)
    groups = {
        "model.layers.0.self_attn.q_proj": n * attn,
        "model.layers.0.mlp.gate_proj": dense_layers * 3 * h * int(cfg["intermediate_size"]),
        "model.layers.1.mlp.experts.0.gate_proj": moe_layers * routed * 3 * h * moe_i,
        "model.layers.1.mlp.shared_experts.gate_proj": moe_layers * shared_n * 3 * h * moe_i,
        "model.layers.1.mlp.gate": moe_layers * routed * h,
        "model.embed_tokens": v * h,
        "lm_head": 0 if cfg.get("tie_word_embeddings") else v * h,
    }
    return {k: val for k, val in groups.items() if val}


def _vision_params(vc: dict[str, Any], text_hidden: int) -> int:
    """A ViT tower plus a patch-merger projector (Kimi's MoonViT layout), from its config."""
    vh = int(vc.get("vt_hidden_size") or vc.get("hidden_size") or 0)
    layers = int(vc.get("vt_num_hidden_layers") or vc.get("num_hidden_layers") or 0)
    vi = int(vc.get("vt_intermediate_size") or vc.get("intermediate_size") or 0)
    if not (vh and layers and vi):
        return 0
    merge = vc.get("merge_kernel_size") or [1, 1]
    merged = vh * int(merge[0]) * int(merge[1])
    return layers * (4 * vh * vh + 2 * vh * vi) + merged * merged + merged * text_hidden


def estimate_target_weight_bytes(full_cfg: dict[str, Any]) -> int:
    """Bytes of the target's checkpoint, counted from its `config.json`.

    `full_cfg` is the root config (a multimodal wrapper with `text_config`, or a plain text
    config).

    Unquantized groups count at the config's dtype (bf16 default); with a compressed-tensors
    int-N config, every group the ignore list does not match counts at N/8 bytes plus one
    bf16 scale per group. Kimi-K2.5 (int4 routed experts, group 32): about 593 GB, against
    547 GB of the real checkpoint's files.
    """
    text = full_cfg.get("text_config") or full_cfg
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    wbytes = DTYPE_BYTES.get(dtype, 2)
    quant = _quant(text) or _quant(full_cfg)
    total = 0.0
    for name, count in target_param_groups(text).items():
        if quant is not None and not _ignored(name, quant[1]):
            total += count * quant[0]
        else:
            total += count * wbytes
    vision = full_cfg.get("vision_config")
    if isinstance(vision, dict) and "text_config" in full_cfg:
        total += _vision_params(vision, int(text["hidden_size"])) * wbytes
    return int(total)


# -- the draft ---------------------------------------------------------------------------------


def draft_param_counts(recipe: Recipe, cfg: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of the draft.

    `trainable` (fc, decoder layer, norms), `lm_head` (draft vocab rows), `embed` (the
    target embedding the exported draft carries) and `total` of those three, plus
    `verifier_head` (the target lm_head kept frozen for teacher logits during training, not
    exported).

    Kimi-K2.5 with a 32,000-token draft vocab: total ≈ 2.3B (the known run reported 2.5B).
    """
    from shared.draft import DraftSpec

    n = int(cfg["num_hidden_layers"])
    spec = DraftSpec.from_target_config(
        cfg,
        resolve_aux_layer_ids(recipe.layers, n),
        recipe.draft.vocab_bound(int(cfg["vocab_size"])),
        recipe.target.path,
        norm_before_fc=recipe.draft.norm_before_fc,
        fc_norm=recipe.draft.fc_norm,
    )
    if recipe.draft.hidden_size:
        spec.hidden_size = recipe.draft.hidden_size
    if recipe.draft.intermediate_size:
        spec.intermediate_size = recipe.draft.intermediate_size
    sizes = {k: _prod(s) for k, s in spec.weight_shapes().items()}
    lm_head = sizes.pop("lm_head.weight")
    trainable = sum(sizes.values())
    embed = int(cfg["vocab_size"]) * spec.hidden_size
    return {
        "trainable": trainable,
        "lm_head": lm_head,
        "embed": embed,
        "total": trainable + lm_head + embed,
        "verifier_head": int(cfg["vocab_size"]) * int(cfg["hidden_size"]),
    }


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def train_memory_bytes(recipe: Recipe, cfg: dict[str, Any], tokens_per_step: int) -> int:
    """Peak GPU memory of one training process, in bytes (a model, not a measurement).

    Terms: trainable params at 16 B (fp32 weight, grad, 2 AdamW moments); frozen params
    (draft lm_head, embedding, verifier head) at the target dtype; per token: the teacher's
    fp32 logits over the target vocab and softmax over the draft vocab, plus per TTT step
    the draft logits with their gradient (fp32, draft vocab) and ~24 hidden-size fp32
    activations of the decoder layer kept for backward.
    Kimi-K2.5 at 500 tokens per step: about 20 GB (the known run measured 17.7 GB).
    """
    p = draft_param_counts(recipe, cfg)
    wb = DTYPE_BYTES.get(recipe.target.dtype, 2)  # 'auto' is bf16 on the GPU node
    h, v = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    d = recipe.draft.vocab_bound(v)
    steps = recipe.train.ttt_steps
    static = p["trainable"] * TRAIN_BYTES_PER_PARAM
    static += (p["lm_head"] + p["embed"] + p["verifier_head"]) * wb
    per_token = 4 * (v + d) + steps * 4 * (2 * d + 24 * h)
    return int(static + per_token * tokens_per_step)


# -- timeouts ---------------------------------------------------------------------------------


def startup_timeout_s(recipe: Recipe, weight_bytes: int | None) -> float:
    """Seconds to wait for a vLLM server to become ready.

    `serve.startup_timeout_s` when set; else `weight_bytes / rates.load_bytes_per_s *
    rates.timeout_factor + rates.startup_margin_s` (600 s when the size is unknown).
    Kimi-K2.5 (547 GB at 405 MB/s): 22.5 min of loading, a 72.5 min timeout.
    """
    if recipe.serve.startup_timeout_s is not None:
        return float(recipe.serve.startup_timeout_s)
    r = recipe.rates
    if not weight_bytes:
        return 600.0
    return weight_bytes / r.load_bytes_per_s * r.timeout_factor + r.startup_margin_s


def regen_request_timeout_s(recipe: Recipe) -> float:
    """Per-request timeout of regen in seconds.

    `regen.request_timeout_s` when set; else `max_tokens / rates.decode_tokens_per_s` plus
    60 s of queueing and prefill, at least 300 s. Kimi (4096 at 5 tok/s): 879 s.
    """
    if recipe.regen.request_timeout_s is not None:
        return float(recipe.regen.request_timeout_s)
    decode = recipe.regen.max_tokens / recipe.rates.decode_tokens_per_s
    return max(MIN_REQUEST_TIMEOUT_S, decode + REQUEST_MARGIN_S)


def job_timeout_s(work: float, rate: float, recipe: Recipe) -> int:
    """The rq job timeout for `work` units at `rate` units/s.

    The estimated seconds times `rates.timeout_factor`, at least an hour.
    """
    return int(max(MIN_JOB_TIMEOUT_S, work / rate * recipe.rates.timeout_factor))


def train_estimate_s(recipe: Recipe, train_tokens: int) -> float:
    """Seconds of the training loop the train stage is expected to run.

    `train_tokens * epochs / rates.train_tokens_per_s`, or `train.time_budget_s` when that
    is smaller (the trainer cuts its run to the steps that fit the budget).
    """
    seconds = train_tokens * recipe.train.epochs / recipe.rates.train_tokens_per_s
    budget = recipe.train.time_budget_s
    return seconds if budget is None else min(seconds, budget)


def train_timeout_s(recipe: Recipe, train_tokens: int) -> int:
    """The rq timeout of the train job in seconds.

    `train_estimate_s` times `rates.timeout_factor`, at least an hour.
    """
    return job_timeout_s(train_estimate_s(recipe, train_tokens), 1.0, recipe)
