"""The stage registry: name → queue, job timeout, implementation, GPU phase.

Stages run in this order. A sharded stage has one job per shard of the run's plan
(`plan.json`, written by `services.prep.plan.make_plan`); the others run as shard 0. Every
implementation has the signature `fn(store: RunStore, recipe: Recipe, shard: int) -> Manifest`
and must be idempotent: rerunning a finished shard is a no-op, and a shard killed midway
restarts from its last durable point.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from shared.errors import ArtifactError, ConfigError
from shared.recipe import Recipe
from shared.store import RunStore

H = 3600


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        name: stage and folder name under the run.
        queue: rq queue its jobs go to.
        timeout_s: rq job timeout (rq's default of 180 s would kill long jobs).
        func: dotted `module:function` implementing one shard.
        sharded: one job per plan shard; else `fixed_shards` jobs (default a single shard 0).
        gpu_phase: lease phase held while the stage runs (None = CPU only).
        enabled: whether the recipe runs this stage.
    """

    name: str
    queue: str
    timeout_s: int
    func: str
    sharded: bool
    fixed_shards: int = 1
    gpu_phase: str | None = None
    enabled: Callable[[Recipe], bool] = lambda r: True

    def load(self) -> Callable:
        mod, _, fn = self.func.partition(":")
        return getattr(importlib.import_module(mod), fn)


STAGES: dict[str, Stage] = {}


def _register(stage: Stage) -> None:
    if stage.name in STAGES:
        raise ConfigError(f"stage {stage.name!r} registered twice")
    STAGES[stage.name] = stage


for _s in [
    Stage("prep", "prep", 1 * H, "services.prep.jobs:run_prep", sharded=True),
    Stage("dedup", "prep", 1 * H, "services.prep.jobs:run_dedup", sharded=False),
    Stage(
        "regen",
        "regen",
        6 * H,
        "services.regen.jobs:run_regen",
        sharded=True,
        gpu_phase="regen",
        enabled=lambda r: r.regen.enabled,
    ),
    Stage("tokenize", "prep", 1 * H, "services.prep.jobs:run_tokenize", sharded=True),
    Stage("vocab", "prep", 1 * H, "services.train.vocab:run_vocab", sharded=False),
    Stage(
        "extract",
        "extract",
        2 * H,
        "services.extract.jobs:run_extract",
        sharded=True,
        gpu_phase="extract",
    ),
    Stage(
        "train", "train", 48 * H, "services.train.jobs:run_train", sharded=False, gpu_phase="train"
    ),
    Stage(
        "export", "train", 1 * H, "services.train.jobs:run_export", sharded=False, gpu_phase="train"
    ),
    # eval shard 0 benchmarks the baseline server, shard 1 the eagle3 server; side by side
    # when memory allows (eval.side_by_side), else one after the other under the lease.
    Stage(
        "eval",
        "eval",
        4 * H,
        "services.bench.jobs:run_eval",
        sharded=False,
        fixed_shards=2,
        gpu_phase="eval",
    ),
    Stage("report", "eval", 1 * H, "services.bench.jobs:run_report", sharded=False),
]:
    _register(_s)


def get_stage(name: str) -> Stage:
    """The named stage. Raises ConfigError listing the known names."""
    try:
        return STAGES[name]
    except KeyError:
        raise ConfigError(f"unknown stage {name!r}; known: {', '.join(STAGES)}") from None


def num_shards(store: RunStore) -> int:
    """Shard count of the run's plan (`plan.json`)."""
    path = store.root / "plan.json"
    if not path.is_file():
        raise ArtifactError(f"{path}: the run has no plan yet; `eyrie run` writes it")
    return int(json.loads(path.read_text())["num_shards"])


def shards_of(stage: Stage, store: RunStore) -> list[int]:
    """The shard numbers `stage` has in this run."""
    return list(range(num_shards(store) if stage.sharded else stage.fixed_shards))


def pipeline(recipe: Recipe) -> list[Stage]:
    """The stages this recipe runs, in order."""
    return [s for s in STAGES.values() if s.enabled(recipe)]
