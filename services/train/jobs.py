"""The train and export stage jobs (`services.conductor.stages`: queue `train`).

Both have the stage signature `fn(store, recipe, shard) -> Manifest` and are idempotent:
- train resumes from its latest checkpoint (a killed trainer loses at most
  `train.step_checkpoint_every` steps) and writes its manifest last;
- export rewrites its folders atomically from the chosen checkpoint and writes its manifest
  after the lint passed.
"""

from __future__ import annotations

from shared.recipe import Recipe
from shared.store import Manifest, RunStore, atomic_write_json


def run_train(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Train the draft on the run's extracted hidden states (single job, shard 0).

    Reads `extract/shard-*/` and `vocab/{d2t,t2d}.npy`; writes `train/checkpoints/`,
    `train/metrics.jsonl`, `train/metrics.png`, `train/best.json` and the manifest.

    Raises:
        ArtifactError: extract or vocab output is missing.
        ContractMismatchError: shards disagree with each other or with the recipe's aux ids.
    """
    from services.train.samples import extract_shards, index_samples
    from services.train.trainer import Trainer, load_vocab
    from shared.conventions import resolve_aux_layer_ids
    from shared.errors import ContractMismatchError
    from shared.target import target_config

    index = index_samples(extract_shards(store))
    want = resolve_aux_layer_ids(recipe.layers, int(target_config(recipe)["num_hidden_layers"]))
    if index.aux_layer_ids != want:
        raise ContractMismatchError(
            f"{store.root / 'extract'}: hidden states were extracted at aux ids "
            f"{index.aux_layer_ids} but the recipe trains on {want}; re-extract"
        )
    out = store.stage_dir("train")
    trainer = Trainer(recipe, index, load_vocab(store.root / "vocab"), out)
    result = trainer.run()
    if not trainer.rt.is_main:
        return Manifest(store.run_id, "train", shard)
    best = {"best": result.state.best, "validations": result.state.validations}
    atomic_write_json(out / "best.json", best)
    files = [out / "metrics.jsonl", out / "metrics.png", out / "best.json"]
    files += [
        p for p in (out / "checkpoints").iterdir() if p.is_dir() and not p.name.startswith(".")
    ]
    extra = {
        "best": result.state.best,
        "resumed_from": str(result.resumed_from) if result.resumed_from else None,
        "device": trainer.rt.device,
    }
    return store.write_manifest("train", shard, result.counts, files, extra)


def run_export(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Export the chosen checkpoint as vLLM llama-style, speculators and SGLang folders.

    Writes `export/{vllm,speculators,sglang}/` and `export/lint.json`; the SGLang folder is
    skipped (recorded in lint.json and the manifest) when the aux ids cannot be written in
    SGLang's convention (`shared.conventions.sglang_layer_ids`).

    Raises:
        ArtifactError: the train stage has not finished.
        ContractMismatchError: an exported folder fails the lint.
    """
    from services.train.export import export_all

    report = export_all(store, recipe)
    out = store.stage_dir("export")
    files = [out / "lint.json"] + [out / name for name in report.written]
    counts = {"folders": len(report.written), "lint_problems": 0}
    extra = {"checkpoint": str(report.checkpoint), "skipped": report.skipped}
    return store.write_manifest("export", shard, counts, files, extra)
