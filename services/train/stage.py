"""The train and export stages (queue `train`, GPU phase `train`).

- train's job timeout is sized from the run's tokenized tokens × epochs at
  `rates.train_tokens_per_s` (`shared.sizing.train_timeout_s`);
- train resumes from its latest checkpoint (a killed trainer loses at most
  `train.step_checkpoint_every` steps) and validates on the held-out split every epoch;
- export rewrites its folders atomically from the chosen checkpoint; its manifest follows a
  clean lint.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from shared.artifacts import RunStore
from shared.conventions import resolve_aux_layer_ids
from shared.errors import ConfigError, ContractMismatchError, StageFailedError
from shared.recipe import Recipe
from shared.records import BestCheckpoint
from shared.sizing import train_timeout_s
from shared.stage import HOUR_S, ShardResult, StageContext, stage
from shared.target import target_config

log = logging.getLogger("eyrie.train")


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

    With `TRAIN_GPUS` > 1 (the trainer container's setting) and not already under torchrun,
    the job runs `torchrun --nproc-per-node TRAIN_GPUS -m services.train.ddp RUN_ID` and
    waits: one rank per GPU, DDP, rank 0 writing (`services.train.runtime`). The rq worker
    stays the single process that takes jobs from the queue.

    Raises:
        ArtifactError: extract, split or vocab output is missing.
        ContractMismatchError: shards disagree with each other or with the recipe's aux ids.
        StageFailedError: the torchrun group exited non-zero.
    """
    gpus = train_gpus()
    if gpus > 1 and "WORLD_SIZE" not in os.environ:
        return _train_under_torchrun(ctx, gpus)
    return run_training(ctx.store, ctx.recipe)


def train_gpus() -> int:
    """`TRAIN_GPUS` (trainer processes, one per GPU; default 1).

    Raises:
        ConfigError: not a positive integer.
    """
    raw = os.environ.get("TRAIN_GPUS", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"TRAIN_GPUS: must be a positive integer (got {raw!r})")
    return int(raw)


def torchrun_command(run_id: str, gpus: int) -> list[str]:
    """The command the train job runs for `gpus` processes on this node.

    The ranks inherit the job's environment, so they find the run under the same
    `EYRIE_DATA`.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        "-m",
        "services.train.ddp",
        run_id,
    ]


def _train_under_torchrun(ctx: StageContext, gpus: int) -> ShardResult:
    from services.train.checkpoints import latest, read_state
    from services.train.samples import index_samples

    cmd = torchrun_command(ctx.store.run_id, gpus)
    log.info("train: %s", " ".join(cmd))
    proc = subprocess.run(cmd, check=False)
    if proc.returncode != 0:
        raise StageFailedError(
            f"train: torchrun with {gpus} processes exited {proc.returncode}; its ranks' "
            "output is in this worker's log (lower TRAIN_GPUS to 1 to train in one process)"
        )
    art = ctx.store.train
    folder = latest(art)
    if folder is None:
        raise StageFailedError(f"train: torchrun finished but {art.checkpoints_dir} is empty")
    state = read_state(folder)
    index = index_samples(ctx.store)
    counts = {
        "train_samples": len(index.train),
        "val_samples": len(index.val),
        "steps": state.step,
        "epochs": state.epoch,
        **{f"skipped_{k}": v for k, v in index.skipped.items()},
    }
    return _result(ctx.store, state, counts, None, f"torchrun x{gpus}", {})


def run_training(store: RunStore, recipe: Recipe) -> ShardResult:
    """Train in this process (rank `RANK` of `WORLD_SIZE` under torchrun, else alone)."""
    from services.train.runtime import keep_freed_memory
    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    index = index_samples(store)
    want = resolve_aux_layer_ids(recipe.layers, int(target_config(recipe)["num_hidden_layers"]))
    if index.aux_layer_ids != want:
        raise ContractMismatchError(
            f"{store.extract.dir}: hidden states were extracted at aux ids "
            f"{index.aux_layer_ids} but the recipe trains on {want}; re-extract"
        )
    trainer = Trainer(recipe, store, index)
    if trainer.rt.device_type == "cpu" and not keep_freed_memory():
        log.info("train: not glibc, so freed loss buffers go back to the kernel (slower steps)")
    result = trainer.run()
    if not trainer.rt.is_main:
        return ShardResult({})
    return _result(
        store, result.state, result.counts, result.resumed_from, trainer.rt.device, trainer.memory
    )


def _result(
    store: RunStore,
    state: Any,
    counts: dict[str, int],
    resumed_from: Path | None,
    device: str,
    memory: dict[str, Any],
) -> ShardResult:
    from services.train.checkpoints import checkpoint_dirs

    art = store.train
    files = [
        art.metrics_path,
        art.plot_path,
        art.write_best(BestCheckpoint(best=state.best, validations=state.validations)),
    ]
    extra = {
        "best": state.best,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "device": device,
        "memory": {
            **memory,
            "micro_tokens": state.micro_tokens,
            "oom_backoffs": state.oom_backoffs,
        },
    }
    return ShardResult(counts, files + checkpoint_dirs(art), extra)


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
