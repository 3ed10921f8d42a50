"""Training checkpoints: per epoch, one rolling mid-epoch checkpoint, keep-last-N and best.

Layout (`train/checkpoints/`, paths from `shared.artifacts.TrainArtifacts`):
    epoch-<EEEE>/   written after epoch E (1-based) finished and was validated
    step-latest/    rolling, every `train.step_checkpoint_every` steps (overwritten)
Each folder holds:
    draft.safetensors    the trainable draft weights only, fp32 (no target embeddings, no
                         draft/verifier lm_head rows copied from the target, no verifier norm:
                         those are reloaded from the target, so 10 checkpoints of a big
                         draft do not hold 10 copies of its embeddings)
    training_state.pt    optimizer, scheduler, counters, RNG states (`TrainState`)
    state.json           the counters and validation results, human-readable

Invariants:
- each folder is written atomically (temp folder + rename), so a SIGKILL leaves either the
  old checkpoint or the new one, never half of one;
- `latest` is the folder with the highest global step; a resumed run continues from it and
  reaches the same parameters as an uninterrupted run (same data plan, RNG states restored);
- pruning keeps the last `keep_last` epoch folders plus the best one; step-latest is removed
  once an epoch checkpoint at or past its step exists.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.artifacts import TrainArtifacts
from shared.errors import ArtifactError
from shared.store import atomic_path

WEIGHTS = TrainArtifacts.CHECKPOINT_WEIGHTS
STATE = TrainArtifacts.CHECKPOINT_STATE
STATE_JSON = TrainArtifacts.CHECKPOINT_STATE_JSON


@dataclass
class TrainState:
    """Where training is: enough to resume to the same result.

    Attributes:
        step: optimizer steps done in total.
        epoch: the epoch in progress (0-based); equals the number of finished epochs when
            `step_in_epoch` is 0.
        step_in_epoch: steps of `epoch` already done (the data position within the plan).
        best: `{"epoch", "tau", "val_loss"}` of the best validated epoch, or {}.
        validations: per finished epoch, its validation results.
        micro_tokens: tokens per forward/backward in use (None before the first step); the
            OOM back-off lowers it and a resumed run keeps the lowered value.
        oom_backoffs: `{"step", "from", "to"}` per out-of-memory halving.
        loop_seconds: wall-clock seconds of the training loop, all runs summed: optimizer
            steps, validations and checkpoints (`train.time_budget_s` counts these).
        planned_steps: the step the run ends at as `train.time_budget_s` last planned it from
            the pace so far (the lr schedule ends there too), or None: every epoch's steps.
    """

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    best: dict[str, Any] = field(default_factory=dict)
    validations: list[dict[str, Any]] = field(default_factory=list)
    micro_tokens: int | None = None
    oom_backoffs: list[dict[str, int]] = field(default_factory=list)
    loop_seconds: float = 0.0
    planned_steps: int | None = None


def save(
    folder: Path,
    weights: dict[str, Any],
    state: TrainState,
    torch_state: dict[str, Any],
) -> Path:
    """Write one checkpoint folder atomically.

    Args:
        folder: the final folder (replaced if it exists).
        weights: trainable weights, name → CPU tensor.
        state: counters and validation results.
        torch_state: optimizer/scheduler state_dicts and RNG states (tensors and numbers).
    """
    import torch
    from safetensors.torch import save_file

    with atomic_path(folder) as tmp:
        tmp.mkdir()
        save_file(weights, str(tmp / WEIGHTS))
        torch.save({**torch_state, "train_state": asdict(state)}, tmp / STATE)
        (tmp / STATE_JSON).write_text(json.dumps(asdict(state), indent=2, sort_keys=True))
    return folder


def load(folder: Path) -> tuple[dict[str, Any], TrainState, dict[str, Any]]:
    """Read a checkpoint folder: (weights, TrainState, torch_state).

    Raises:
        ArtifactError: a file is missing or unreadable.
    """
    import torch
    from safetensors.torch import load_file

    try:
        weights = load_file(str(folder / WEIGHTS))
        torch_state = torch.load(folder / STATE, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as e:
        raise ArtifactError(f"{folder}: unreadable checkpoint ({e}); delete it to restart") from e
    state = TrainState(**torch_state.pop("train_state"))
    return weights, state, torch_state


def read_state(folder: Path) -> TrainState:
    """The counters of a checkpoint (from state.json, without loading tensors)."""
    return TrainState(**json.loads((folder / STATE_JSON).read_text()))


def checkpoint_dirs(art: TrainArtifacts) -> list[Path]:
    """Complete checkpoint folders (epoch-* and step-latest)."""
    root = art.checkpoints_dir
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / STATE_JSON).is_file()
    )


def latest(art: TrainArtifacts) -> Path | None:
    """The checkpoint with the most steps done (an epoch one wins a tie), or None."""
    dirs = checkpoint_dirs(art)
    if not dirs:
        return None
    return max(dirs, key=lambda p: (read_state(p).step, p != art.step_dir))


def epoch_dirs(art: TrainArtifacts) -> list[Path]:
    """Epoch checkpoints, oldest first."""
    return [p for p in checkpoint_dirs(art) if p != art.step_dir]


def prune(art: TrainArtifacts, keep_last: int, best_epoch: int | None) -> list[Path]:
    """Delete old epoch checkpoints and a covered step checkpoint; return what was deleted.

    Keeps the last `keep_last` epoch folders plus the best one; removes step-latest once an
    epoch checkpoint at or past its step exists.
    """
    epochs = epoch_dirs(art)
    keep = set(epochs[-keep_last:])
    if best_epoch is not None:
        keep.add(art.epoch_dir(best_epoch))
    doomed = [p for p in epochs if p not in keep]
    step = art.step_dir
    if step.is_dir() and epochs and read_state(epochs[-1]).step >= read_state(step).step:
        doomed.append(step)
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def best_or_last(art: TrainArtifacts) -> Path:
    """The checkpoint export should use: the best validated epoch, else the last epoch.

    Raises:
        ArtifactError: no epoch checkpoint exists (the train stage has not finished).
    """
    epochs = epoch_dirs(art)
    if not epochs:
        raise ArtifactError(
            f"{art.checkpoints_dir}: no epoch checkpoint; the train stage must finish first"
        )
    best = read_state(epochs[-1]).best
    if best and art.epoch_dir(int(best["epoch"])).is_dir():
        return art.epoch_dir(int(best["epoch"]))
    return epochs[-1]
