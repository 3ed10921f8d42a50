"""Offline τ: score a training checkpoint without a server, for model selection.

This is the trainer's own greedy-chain estimate (`services.train.acceptance.simulated_tau`)
on the run's validation split (`services.train.samples.split_train_val` with
`train.val_fraction` and `train.seed`), with the run's vocab (`vocab/d2t.npy`,
`vocab/t2d.npy`) and k = `eval.num_speculative_tokens`. Nothing is re-implemented here: this
module only loads the pieces and calls that function.

It is an estimate: exact on data the target generated greedily, a lower bound otherwise (see
the trainer's module). The served τ from `eyrie bench` is the number that counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.errors import ArtifactError
from shared.recipe import Recipe
from shared.store import RunStore


def _vocab(store: RunStore) -> tuple[Any, Any]:
    import numpy as np

    vdir = store.root / "vocab"
    paths = [vdir / "d2t.npy", vdir / "t2d.npy"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ArtifactError(f"{', '.join(missing)}: missing; the vocab stage must run first")
    return np.load(paths[0]), np.load(paths[1])


def offline_tau(
    store: RunStore, recipe: Recipe, checkpoint: Path | str, max_samples: int | None = None
) -> dict[str, Any]:
    """Simulated τ of `checkpoint` on the run's validation samples.

    Args:
        store: the run (extract and vocab outputs are read from it).
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
    from services.train.samples import SampleReader, extract_shards, index_samples, split_train_val

    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise ArtifactError(f"{ckpt}: no such checkpoint folder (train/checkpoints/epoch-N)")
    d2t, t2d = _vocab(store)
    model = build_draft(recipe, d2t, t2d, "cpu")
    weights, _, _ = checkpoints.load(ckpt)
    load_trainable_state(model, weights)
    index = index_samples(extract_shards(store))
    _, val = split_train_val(index.refs, recipe.train.val_fraction, recipe.train.seed)
    read = SampleReader()
    samples = [read(ref) for ref in val[:max_samples]]
    # The stored hidden states are bf16 and the fresh draft is fp32: bf16 autocast makes
    # them meet (fp32 without it fails in fc with a dtype mismatch on CPU).
    result = simulated_tau(model, samples, recipe.eval.num_speculative_tokens, None, "bf16")
    return {**result, "checkpoint": str(ckpt), "samples": len(samples), "source": "offline"}
