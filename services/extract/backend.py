"""The extraction interface both backends implement: `hf` (transformers + hooks) and `vllm`.

An `Extractor` maps a batch of token-id lists to per-sample hidden states `[seq_len, 3+1, H]`
plus the token ids the backend actually ran (checked against the tokenized shard by the
writer). The backends live in `hf_backend` and `vllm_backend`; the stage picks one.

Invariants: every backend uses Eyrie's aux-id convention (id i = residual entering layer i,
`shared.conventions.AUX_ID_CONVENTION`) and stores the final state before the final norm
(`FINAL_STATE_CONVENTION`); `metadata()` records both, the layer ids and the target revision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared.conventions import AUX_ID_CONVENTION, FINAL_STATE_CONVENTION
from shared.recipe import Recipe


@dataclass
class SampleStates:
    """One sample's extraction.

    Attributes:
        states: `[seq_len, 3+1, H]` tensor: aux states in id order, then the pre-norm final.
        token_ids: the token ids the backend ran, `[seq_len]` (list or 1-D tensor).
        file: where the backend already wrote exactly these states and token ids (a staging
            name next to the final file), or None; the writer then renames instead of
            writing again.
    """

    states: Any
    token_ids: Sequence[int] | Any
    file: Path | None = None


class RowTokens(list):
    """One row's token ids (a list), with the file its states should end up in.

    A backend that can write straight to disk (vLLM extract mode) writes a staging file next
    to `dest`; others ignore `dest` and return the states.
    """

    def __init__(self, ids: Sequence[int], dest: Path | None = None):
        super().__init__(ids)
        self.dest = dest


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
