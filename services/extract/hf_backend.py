"""The `hf` extraction backend: a transformers target with forward hooks.

Responsibility: load a target once per process and turn a batch of token-id lists into
per-sample hidden states `[seq_len, 3+1, H]`.

Invariants (`shared.conventions` §1–2):
- aux id i is the residual stream *entering* decoder layer i, captured by a forward pre-hook
  on `layers[k]`; this equals HF `output_hidden_states[k]` (index 0 = embedding output);
- the 4th state is the input of the model's final norm (pre-norm), not HF's last
  `output_hidden_states` entry, which has the norm applied;
- batches are right-padded; a causal model's states at real positions do not depend on the
  pads after them, so a batch equals one-at-a-time up to bf16 kernel noise;
- only the decoder runs (no lm_head): extraction never needs logits.

torch and transformers are imported inside functions: the CLI imports this package.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.extract.backend import SampleStates, base_metadata
from shared.conventions import resolve_aux_layer_ids
from shared.errors import ConfigError
from shared.recipe import Recipe
from shared.store import check_readable
from shared.target import runtime_dtype, target_config

if TYPE_CHECKING:
    import torch

_DTYPES = {"bfloat16", "float16", "float32"}
_CACHE: dict[LoadSpec, Any] = {}
_CACHE_LOCK = threading.Lock()


@dataclass(frozen=True)
class LoadSpec:
    """How to load a target; the key of the per-process model cache.

    Attributes:
        path: local HF folder (or hub id; the hub is off in tests).
        dtype: "bfloat16" | "float16" | "float32".
        device: "auto", "cpu", "cuda" or "cuda:N" ("auto" = cuda when available).
        device_map: transformers device_map (e.g. "auto") for targets spanning GPUs; None
            puts the whole model on `device`.
        trust_remote_code: allow the target's own modelling code (only if the recipe says so).
        revision: hub revision, or None.
    """

    path: str
    dtype: str = "bfloat16"
    device: str = "auto"
    device_map: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None

    @classmethod
    def from_recipe(cls, recipe: Any) -> LoadSpec:
        """The spec a recipe asks for (`target.*`, `extract.*`)."""
        return cls(
            path=recipe.target.path,
            dtype=runtime_dtype(recipe.target.dtype, recipe.extract.device),
            device=recipe.extract.device,
            device_map=recipe.extract.device_map,
            trust_remote_code=recipe.target.trust_remote_code,
            revision=recipe.target.revision,
        )


def resolve_device(device: str) -> str:
    """'auto' → 'cuda' when CUDA is available, else 'cpu'; other values pass through."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_target(spec: LoadSpec) -> Any:
    """Load (once per process) the target as a transformers causal LM, in eval mode.

    The extractor is a non-forking rq worker, so the cache keeps the model across jobs. It
    holds one target: asking for another spec drops the cached one first.

    Returns:
        the `PreTrainedModel` (not the bare decoder: `final_norm` and `lm_head` live on it).

    Raises:
        ConfigError: unknown dtype, or the folder has no loadable model.
    """
    if spec.dtype not in _DTYPES:
        raise ConfigError(f"target.dtype: must be one of {sorted(_DTYPES)} (got {spec.dtype!r})")
    with _CACHE_LOCK:
        if spec in _CACHE:
            return _CACHE[spec]
        # One target per process: a worker that moves on to another run's target frees the
        # old one first instead of holding two models in (GPU) memory.
        _CACHE.clear()
        _free_accelerator_memory()
        model = _load_uncached(spec)
        _CACHE[spec] = model
        return model


def release_models() -> None:
    """Drop the cached target and return its accelerator memory (end of an extract phase)."""
    with _CACHE_LOCK:
        _CACHE.clear()
    _free_accelerator_memory()


def _free_accelerator_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_uncached(spec: LoadSpec) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, spec.dtype),
        "trust_remote_code": spec.trust_remote_code,
        "revision": spec.revision,
    }
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    check_readable(spec.path, "target.path")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.path, **kwargs)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"target.path: cannot load a causal LM from {spec.path!r}: {e}. Check the path "
            "(scripts/convert_smollm2.py makes the demo target) or target.trust_remote_code."
        ) from e
    if not spec.device_map:
        model.to(resolve_device(spec.device))  # type: ignore[arg-type]  # transformers stub
    model.eval()
    model.requires_grad_(False)
    return model


def decoder_parts(model: Any) -> tuple[Any, Any, Any]:
    """(decoder, its layers ModuleList, its final norm) of a transformers causal LM.

    Raises:
        ConfigError: the model has no `layers`/`norm` where Llama-style decoders keep them.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise ConfigError(
            f"target {type(model).__name__}: its decoder {type(decoder).__name__} has no "
            "`layers` and `norm` attributes; the hf backend hooks those. Use backend 'vllm'."
        )
    return decoder, layers, norm


def num_layers(model: Any) -> int:
    """Decoder layer count N of a loaded target."""
    return len(decoder_parts(model)[1])


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def capture_states(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_ids: Sequence[int]
) -> torch.Tensor:
    """One decoder forward that returns the aux states and the pre-norm final state.

    Args:
        model: a causal LM from `load_target`.
        input_ids: int64 `[batch, max_len]`, right-padded.
        attention_mask: int64 `[batch, max_len]`, 1 on real tokens.
        aux_ids: the 3 aux ids (residual entering layer i), validated by the caller.

    Returns:
        `[batch, max_len, len(aux_ids)+1, H]` in the model's dtype, on the device of the
        final norm. Index j < 3 is aux id `aux_ids[j]`; index 3 is the final pre-norm state.
    """
    import torch

    decoder, layers, norm = decoder_parts(model)
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def hook_for(slot: int):
        def hook(_module, args, kwargs):
            captured[slot] = _hidden_arg(args, kwargs)

        return hook

    for slot, k in enumerate(aux_ids):
        handles.append(layers[k].register_forward_pre_hook(hook_for(slot), with_kwargs=True))
    handles.append(norm.register_forward_pre_hook(hook_for(len(aux_ids)), with_kwargs=True))
    try:
        with torch.inference_mode():
            decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out_device = captured[len(aux_ids)].device
    # shape: [batch, max_len, 4, H]; slot order = aux ids in order, then pre-norm final.
    return torch.stack([captured[s].to(out_device) for s in range(len(aux_ids) + 1)], dim=2)


def pad_batch(batch_input_ids: Sequence[Sequence[int]], device: Any) -> tuple[Any, Any]:
    """Right-pad token-id lists into (input_ids, attention_mask), int64 `[batch, max_len]`."""
    import torch

    max_len = max(len(ids) for ids in batch_input_ids)
    ids = torch.zeros((len(batch_input_ids), max_len), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(batch_input_ids):
        ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


def input_device(model: Any) -> Any:
    """Device of the embedding table (where input ids must go, also under a device_map)."""
    return model.get_input_embeddings().weight.device


def extract_batch(
    model: Any, batch_input_ids: Sequence[Sequence[int]], aux_ids: Sequence[int]
) -> list[torch.Tensor]:
    """Hidden states of each sample of a batch, unpadded, on CPU.

    Args:
        model: a causal LM from `load_target`.
        batch_input_ids: token-id lists of any lengths (>= 1 each).
        aux_ids: the 3 aux layer ids (e.g. [2, 15, 27] for SmolLM2).

    Returns:
        one tensor per sample, `[len(ids_i), 3+1, H]`, model dtype (bf16 by default), CPU,
        contiguous: aux states in `aux_ids` order, then the final pre-norm state.

    Raises:
        ConfigError: an aux id is outside 1..N-1, or a sample is empty.
    """
    n = num_layers(model)
    bad = [k for k in aux_ids if not 1 <= k <= n - 1]
    if bad:
        raise ConfigError(f"layers: aux ids {bad} out of range 1..{n - 1} for this target")
    if any(len(ids) == 0 for ids in batch_input_ids):
        raise ConfigError("extract_batch: every sample needs at least one token")
    input_ids, mask = pad_batch(batch_input_ids, input_device(model))
    states = capture_states(model, input_ids, mask, aux_ids)
    return [states[i, : len(row)].to("cpu").clone() for i, row in enumerate(batch_input_ids)]


def teacher_logits(model: Any, final_pre_norm: torch.Tensor) -> torch.Tensor:
    """Teacher logits from a stored pre-norm final state: `lm_head(final_norm(h_N))`.

    Args:
        final_pre_norm: `[..., H]`, any float dtype (cast to the model's).

    Returns:
        `[..., target_vocab]` logits in the model's dtype.
    """
    import torch

    _, _, norm = decoder_parts(model)
    head = model.get_output_embeddings()
    with torch.inference_mode():
        h = final_pre_norm.to(device=head.weight.device, dtype=head.weight.dtype)
        return head(norm(h))


def model_revision(model: Any, spec: LoadSpec) -> str:
    """The target revision to record in metadata.

    The recipe's revision, else the config's hub commit hash, else `local:<abs path>` (a
    local folder has no hub revision).
    """
    rev = spec.revision or getattr(model.config, "_commit_hash", None)
    return str(rev) if rev else f"local:{Path(spec.path).resolve()}"


class HFExtractor:
    """The `hf` backend: transformers with forward hooks (`services.extract.hf_backend`).

    The model is loaded once per process and cached, so a long-lived extractor worker keeps it
    across jobs.
    """

    def __init__(self, recipe: Recipe):
        cfg = target_config(recipe)
        self.spec = LoadSpec.from_recipe(recipe)
        self.model = load_target(self.spec)
        n = num_layers(self.model)
        self.aux_ids = resolve_aux_layer_ids(recipe.layers, n)
        self.hidden_size = int(cfg["hidden_size"])
        self._meta = base_metadata(recipe, self.aux_ids, self.hidden_size)
        self._meta["target_revision"] = model_revision(self.model, self.spec)
        self._meta["num_hidden_layers"] = n

    def extract(self, batch: list[Sequence[int]]) -> list[SampleStates]:
        states = extract_batch(self.model, batch, self.aux_ids)
        return [SampleStates(s, ids) for s, ids in zip(states, batch, strict=True)]

    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)
