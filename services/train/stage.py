"""The train and export stages (queue `train`, GPU phase `train`).

- train's job timeout is sized from the run's tokenized tokens × epochs at
  `rates.train_tokens_per_s` (`shared.sizing.train_timeout_s`);
- train resumes from its latest checkpoint (a killed trainer loses at most
  `train.step_checkpoint_every` steps) and validates on the held-out split every epoch;
- export rewrites its folders atomically from the chosen checkpoint; its manifest follows a
  clean lint.
"""

from __future__ import annotations

from shared.artifacts import RunStore
from shared.conventions import resolve_aux_layer_ids
from shared.errors import ContractMismatchError
from shared.recipe import Recipe
from shared.records import BestCheckpoint
from shared.sizing import train_timeout_s
from shared.stage import HOUR_S, ShardResult, StageContext, stage
from shared.target import target_config


def _release() -> None:
    import gc
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _train_timeout_s(recipe: Recipe, store: RunStore) -> int:
    """The train job's timeout: the run's tokenized tokens × epochs at the stated rate."""
    tokens = sum(m.counts.get("tokens", 0) for m in store.manifests("tokenize"))
    return train_timeout_s(recipe, tokens)


@stage(
    "train",
    queue="train",
    timeout_s=48 * HOUR_S,
    after=("extract", "vocab", "split"),
    gpu_phase="train",
    release=_release,
    sized_timeout=_train_timeout_s,
)
def train_stage(ctx: StageContext) -> ShardResult:
    """Train the draft on the run's extracted hidden states (single job).

    Raises:
        ArtifactError: extract, split or vocab output is missing.
        ContractMismatchError: shards disagree with each other or with the recipe's aux ids.
    """
    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    store, recipe = ctx.store, ctx.recipe
    index = index_samples(store)
    want = resolve_aux_layer_ids(recipe.layers, int(target_config(recipe)["num_hidden_layers"]))
    if index.aux_layer_ids != want:
        raise ContractMismatchError(
            f"{store.extract.dir}: hidden states were extracted at aux ids "
            f"{index.aux_layer_ids} but the recipe trains on {want}; re-extract"
        )
    trainer = Trainer(recipe, store, index)
    result = trainer.run()
    art = store.train
    if not trainer.rt.is_main:
        return ShardResult({})
    files = [
        art.metrics_path,
        art.plot_path,
        art.write_best(
            BestCheckpoint(best=result.state.best, validations=result.state.validations)
        ),
    ]
    from services.train.checkpoints import checkpoint_dirs

    extra = {
        "best": result.state.best,
        "resumed_from": str(result.resumed_from) if result.resumed_from else None,
        "device": trainer.rt.device,
    }
    return ShardResult(result.counts, files + checkpoint_dirs(art), extra)


@stage("export", queue="train", timeout_s=HOUR_S, after=("train",), gpu_phase="train")
def export_stage(ctx: StageContext) -> ShardResult:
    """Export the chosen checkpoint as vLLM llama-style, speculators and SGLang folders.

    The SGLang folder is skipped (recorded in export.json and the manifest) when the aux ids
    cannot be written in SGLang's convention (`shared.conventions.sglang_layer_ids`).

    Raises:
        ArtifactError: the train stage has not finished.
        ContractMismatchError: an exported folder fails the lint.
    """
    from services.train.export import export_all

    report = export_all(ctx.store, ctx.recipe)
    art = ctx.store.export
    files = [art.lint_path, art.summary_path] + [art.folder(n) for n in report.written]
    counts = {"folders": len(report.written), "lint_problems": 0}
    extra = {"checkpoint": str(report.checkpoint), "skipped": report.skipped}
    return ShardResult(counts, files, extra)
