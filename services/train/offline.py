"""Offline τ: score a training checkpoint without a server, for model selection.

This is the trainer's own greedy-chain estimate (`services.train.acceptance.simulated_tau`)
on the run's validation split (`split/split.json`), with the run's vocab and k =
`bench.num_speculative_tokens`. Nothing is re-implemented here: this module only loads the
pieces and calls that function.

It is an estimate: exact on data the target generated greedily, a lower bound otherwise (see
`services.train.acceptance`). The served τ from `eyrie bench` is the number that counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.artifacts import RunStore
from shared.errors import ArtifactError
from shared.recipe import Recipe


def offline_tau(
    store: RunStore, recipe: Recipe, checkpoint: Path | str, max_samples: int | None = None
) -> dict[str, Any]:
    """Simulated τ of `checkpoint` on the run's validation samples.

    Args:
        store: the run (extract, split and vocab outputs are read from it).
        recipe: the run's recipe.
        checkpoint: a trainer checkpoint folder (`train/checkpoints/epoch-NNNN`).
        max_samples: score only the first this many validation samples; None = all.

    Returns:
        `simulated_tau`'s dict plus `checkpoint`, `samples` and `source: "offline"`.

    Raises:
        ArtifactError: the checkpoint, vocab or extract output is missing.
    """
    from services.train import checkpoints
    from services.train.acceptance import simulated_tau
    from services.train.draft_model import build_draft, load_trainable_state
    from services.train.samples import SampleReader, index_samples

    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise ArtifactError(
            f"{ckpt}: no such checkpoint folder (under {store.train.checkpoints_dir})"
        )
    model = build_draft(recipe, *store.vocab.read_maps(), "cpu")
    weights, _, _ = checkpoints.load(ckpt)
    load_trainable_state(model, weights)
    val = index_samples(store).val[:max_samples]
    read = SampleReader(store)
    # The stored hidden states are bf16 and the fresh draft is fp32: bf16 autocast makes
    # them meet (fp32 without it fails in fc with a dtype mismatch on CPU).
    k = recipe.bench.num_speculative_tokens
    result = simulated_tau(model, (read(ref) for ref in val), k, None, "bf16")
    return {**result, "checkpoint": str(ckpt), "samples": len(val), "source": "offline"}
