"""One extraction interface, two backends: `hf` (transformers + hooks) and `vllm`.

Responsibility: turn a recipe into an `Extractor` that maps a batch of token-id lists to
per-sample hidden states `[seq_len, 3+1, H]` plus the token ids the backend actually ran
(checked against the tokenized shard by the writer).

Invariants: every backend uses Eyrie's aux-id convention (id k = residual entering layer k,
`shared.conventions.AUX_ID_CONVENTION`) and stores the final state before the final norm
(`FINAL_STATE_CONVENTION`); `metadata()` records both, the layer ids and the target revision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.conventions import AUX_ID_CONVENTION, FINAL_STATE_CONVENTION, resolve_aux_layer_ids
from shared.errors import ConfigError
from shared.recipe import Recipe
from shared.target import target_config


@dataclass
class SampleStates:
    """One sample's extraction.

    Attributes:
        states: `[seq_len, 3+1, H]` tensor: aux states in id order, then the pre-norm final.
        token_ids: the token ids the backend ran, `[seq_len]` (list or 1-D tensor).
    """

    states: Any
    token_ids: Sequence[int] | Any


class Extractor(Protocol):
    """What `services.extract.jobs` needs from a backend."""

    aux_ids: list[int]
    hidden_size: int

    def extract(self, batch: list[Sequence[int]]) -> list[SampleStates]:
        """Hidden states of each sample of `batch`, in order."""
        ...

    def metadata(self) -> dict[str, Any]:
        """Aux ids, conventions, target, revision, hidden size, backend name."""
        ...


def base_metadata(recipe: Recipe, aux_ids: list[int], hidden_size: int) -> dict[str, Any]:
    """The metadata fields every backend writes into `meta.json`."""
    return {
        "aux_layer_ids": list(aux_ids),
        "aux_id_convention": AUX_ID_CONVENTION,
        "final_state": FINAL_STATE_CONVENTION,
        "pre_norm": True,
        "slots": [f"aux:{k}" for k in aux_ids] + ["final:pre_norm"],
        "target": recipe.target.path,
        "hidden_size": hidden_size,
        "dtype": recipe.extract.dtype,
        "backend": recipe.extract.backend,
    }


class HFExtractor:
    """The `hf` backend: transformers with forward hooks (`services.extract.hf_backend`).

    The model is loaded once per process and cached, so a long-lived extractor worker keeps it
    across jobs.
    """

    def __init__(self, recipe: Recipe):
        from services.extract import hf_backend

        cfg = target_config(recipe)
        self.spec = hf_backend.LoadSpec.from_recipe(recipe)
        self.model = hf_backend.load_target(self.spec)
        n = hf_backend.num_layers(self.model)
        self.aux_ids = resolve_aux_layer_ids(recipe.layers, n)
        self.hidden_size = int(cfg["hidden_size"])
        self._meta = base_metadata(recipe, self.aux_ids, self.hidden_size)
        self._meta["target_revision"] = hf_backend.model_revision(self.model, self.spec)
        self._meta["num_hidden_layers"] = n

    def extract(self, batch: list[Sequence[int]]) -> list[SampleStates]:
        from services.extract.hf_backend import extract_batch

        states = extract_batch(self.model, batch, self.aux_ids)
        return [SampleStates(s, ids) for s, ids in zip(states, batch, strict=True)]

    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)


def _vllm_extractor(recipe: Recipe) -> Extractor:
    from services.extract.vllm_backend import VLLMExtractor

    return VLLMExtractor(recipe)


BACKENDS: dict[str, Callable[[Recipe], Extractor]] = {
    "hf": HFExtractor,
    "vllm": _vllm_extractor,
}


def make_extractor(recipe: Recipe) -> Extractor:
    """The backend `extract.backend` names.

    Raises:
        ConfigError: unknown backend name (lists the known ones).
    """
    try:
        factory = BACKENDS[recipe.extract.backend]
    except KeyError:
        raise ConfigError(
            f"extract.backend: unknown {recipe.extract.backend!r}; known: {', '.join(BACKENDS)}"
        ) from None
    return factory(recipe)
