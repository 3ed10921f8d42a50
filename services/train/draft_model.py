"""The EAGLE-3 draft as speculators 0.9.0 builds it, configured from the target and recipe.

Responsibility: turn (recipe, target config, d2t/t2d) into an `Eagle3DraftModel`, and split
its weights into the trainable part (what checkpoints store) and the frozen part (what is
reloaded from the target every time).

Invariants:
- the draft is built with `Eagle3DraftModel.from_training_args`, so its weights and config
  are exactly what speculators' `save_pretrained` writes and vLLM loads;
- the draft decoder layer is a Llama layer with the target's attention geometry; its hidden
  size equals the target's (speculators 0.9.0 refuses anything else in
  `load_verifier_weights`);
- frozen weights (target embeddings, the draft lm_head rows copied from the target lm_head,
  the verifier lm_head and final norm used for teacher logits) are never trained and never
  stored in checkpoints: `trainable_state` returns only parameters with `requires_grad`;
- attention is sdpa on CPU (flex attention has no CPU backward); flex on CUDA.

Heavy imports (torch, transformers, speculators) live inside the functions.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.conventions import check_d2t_t2d, resolve_aux_layer_ids
from shared.errors import ConfigError, ContractMismatchError
from shared.recipe import Recipe
from shared.target import target_config

if TYPE_CHECKING:
    import torch


def draft_layer_config(recipe: Recipe, tcfg: dict[str, Any]) -> Any:
    """The draft decoder layer's `LlamaConfig`, from the target's config and the recipe.

    Args:
        recipe: the run's recipe (`draft.*` knobs).
        tcfg: the target's normalized config (`shared.target.target_config`).

    Returns:
        a transformers `LlamaConfig` with one hidden layer, the target's vocab, hidden size,
        heads, head_dim, hidden_act, rms eps, max positions and RoPE parameters (all of
        `rope_parameters`: type, theta and the scaling keys), and untied embeddings.

    Raises:
        ConfigError: `draft.hidden_size` differs from the target's hidden size.
    """
    from transformers import LlamaConfig

    hidden = int(tcfg["hidden_size"])
    if recipe.draft.hidden_size not in (None, hidden):
        raise ConfigError(
            f"draft.hidden_size: speculators 0.9.0 EAGLE-3 drafts use the target's hidden "
            f"size {hidden} (got {recipe.draft.hidden_size}); leave it unset"
        )
    heads = int(tcfg["num_attention_heads"])
    # Every forward-pass setting comes from the normalized target config, with no default
    # here: the export copies this object, so a default in one place cannot differ from
    # another place's (`shared.target.normalize_config` fills what the file lacks).
    return LlamaConfig(
        vocab_size=int(tcfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(recipe.draft.intermediate_size or tcfg["intermediate_size"]),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=int(tcfg["num_key_value_heads"]),
        head_dim=int(tcfg["head_dim"]),
        hidden_act=tcfg["hidden_act"],
        max_position_embeddings=int(tcfg["max_position_embeddings"]),
        rms_norm_eps=float(tcfg["rms_norm_eps"]),
        rope_parameters=copy.deepcopy(tcfg["rope_parameters"]),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


#: Flex attention's block size in positions (torch.nn.attention.flex_attention's
#: `_DEFAULT_SPARSE_BLOCK_SIZE`). speculators' Eagle3 draft builds one BlockMask for the packed
#: length and extends it by whole blocks per TTT step (`extend_mask_for_draft_tokens`); torch
#: (2.11 on an H200, 2.13 here) refuses a mask whose blocks overrun the batch, so a packed
#: batch under flex attention must be a whole number of blocks (speculators pads every batch
#: to its `max_len`).
FLEX_BLOCK_SIZE = 128


def attention_impl(device: str) -> str:
    """`sdpa` on CPU (flex attention has no CPU backward in torch 2.13), flex on CUDA."""
    return "simple_flex_attention" if device.startswith("cuda") else "sdpa"


def length_multiple(model: Any) -> int:
    """What a packed batch's length is padded to a multiple of, for this draft's attention.

    FLEX_BLOCK_SIZE under flex attention, else 1 (`services.train.packing.collate`'s
    `multiple`).

    Args:
        model: a speculators `Eagle3DraftModel` (not a DDP wrapper).
    """
    impl = model.config.transformer_layer_config._attn_implementation
    return FLEX_BLOCK_SIZE if impl == "simple_flex_attention" else 1


def build_draft(
    recipe: Recipe, d2t: np.ndarray, t2d: np.ndarray, device: str = "cpu"
) -> torch.nn.Module:
    """Build a fresh `Eagle3DraftModel` for the recipe's target, in fp32, on CPU.

    The caller moves it to `device` (only used here to pick the attention kernel). Frozen
    weights come from `recipe.target.path`; trainable ones are initialized with the
    current torch RNG (seed it first for a reproducible init).

    Args:
        recipe: the run's recipe.
        d2t: int64 `[draft_vocab]` offsets (target = draft + d2t[draft]).
        t2d: bool `[target_vocab]`.
        device: where training will run ('cpu', 'cuda', 'cuda:N').

    Returns:
        the draft model (speculators `Eagle3DraftModel`).

    Raises:
        ConfigError: bad draft knobs or aux ids for this target.
        ContractMismatchError: d2t/t2d break the §3 invariants or do not fit the target.
    """
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    tcfg = target_config(recipe)
    aux_ids = resolve_aux_layer_ids(recipe.layers, int(tcfg["num_hidden_layers"]))
    check_vocab(recipe, tcfg, d2t, t2d)
    layer_cfg = draft_layer_config(recipe, tcfg)
    model = Eagle3DraftModel.from_training_args(
        layer_cfg,
        t2d=torch.from_numpy(np.asarray(t2d, dtype=bool)),
        d2t=torch.from_numpy(np.asarray(d2t, dtype=np.int64)),
        verifier_name_or_path=recipe.target.path,
        trust_remote_code=recipe.target.trust_remote_code,
        draft_vocab_size=len(d2t),
        norm_before_residual=recipe.draft.norm_before_residual,
        norm_before_fc=recipe.draft.norm_before_fc,
        fc_norm=recipe.draft.fc_norm,
        norm_output=recipe.draft.norm_output,
        ttt_steps=recipe.train.ttt_steps,
        target_layer_ids=aux_ids,
        draft_attn_impl=attention_impl(device),
    )
    if recipe.draft.train_lm_head:
        model.lm_head.weight.requires_grad_(True)
    if recipe.draft.init_from_target_layer:
        init_from_target_layer(model, recipe.target.path, int(tcfg["num_hidden_layers"]))
    return model


#: Draft weight → the target weight it starts from (`{last}` = the target's last layer),
#: used when the shapes match. q/k/v read concat(embedding, hidden) (2H inputs) and fc is the
#: EAGLE-3 projection, so they have no target counterpart.
TARGET_INIT = {
    "layers.0.self_attn.o_proj.weight": "model.layers.{last}.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight": "model.layers.{last}.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "model.layers.{last}.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight": "model.layers.{last}.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight": "model.layers.{last}.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight": (
        "model.layers.{last}.post_attention_layernorm.weight"
    ),
    "norm.weight": "model.norm.weight",
}


def init_from_target_layer(model: torch.nn.Module, target: str, num_layers: int) -> list[str]:
    """Copy the target's last-layer weights into the draft where the shapes match.

    Args:
        model: a fresh draft (`build_draft`).
        target: the target folder or hub id.
        num_layers: the target's decoder layer count N (the last layer is N-1).

    Returns:
        the draft weight names copied (a `TARGET_INIT` key is skipped when its shape differs,
        e.g. a narrower `draft.intermediate_size`).
    """
    import torch
    from speculators.utils.loading import load_model_layers

    names = {k: v.format(last=num_layers - 1) for k, v in TARGET_INIT.items()}
    found = load_model_layers(list(names.values()), target)
    params = dict(model.named_parameters())
    copied = []
    with torch.no_grad():
        for mine, theirs in names.items():
            src = found.get(theirs)
            if src is not None and tuple(src.shape) == tuple(params[mine].shape):
                params[mine].copy_(src.to(params[mine].dtype))
                copied.append(mine)
    return copied


def check_vocab(recipe: Recipe, tcfg: dict[str, Any], d2t: np.ndarray, t2d: np.ndarray) -> None:
    """Check d2t/t2d against the recipe's draft vocab size and the target vocab.

    Raises:
        ContractMismatchError: a §3 invariant fails, or t2d's length is not the target vocab.
    """
    if len(t2d) != int(tcfg["vocab_size"]):
        raise ContractMismatchError(
            f"the draft vocabulary's t2d has length {len(t2d)} but the target vocab is "
            f"{tcfg['vocab_size']}; rerun the vocab stage for this target"
        )
    size = recipe.draft.draft_vocab_size
    try:
        check_d2t_t2d(d2t, t2d, len(d2t) if size == "auto" else size)
    except ContractMismatchError as e:
        raise ContractMismatchError(f"the draft vocabulary (d2t, t2d): {e}") from e


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters the optimizer trains (`requires_grad`), in module order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights only (what a checkpoint stores), detached CPU fp32 copies."""
    return {
        n: p.detach().to("cpu", copy=True).contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load checkpointed trainable weights into a freshly built draft.

    Raises:
        ContractMismatchError: the checkpoint's names differ from the model's trainables
            (a checkpoint from another draft architecture), naming the differences.
    """
    want = set(trainable_names(model))
    got = set(state)
    if want != got:
        raise ContractMismatchError(
            f"checkpoint weights do not match the draft: missing {sorted(want - got)[:5]}, "
            f"unexpected {sorted(got - want)[:5]}; was it written for another draft config?"
        )
    params = dict(model.named_parameters())
    import torch

    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
