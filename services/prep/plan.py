"""The plan stage: which source rows each prep shard reads.

It runs once, on a prep worker, and reads only what cutting shards needs: the row index of
each source (`services.prep.sources`: byte ranges, no JSON parsing) and a few rows to detect
an `auto` format. It samples rows with the recipe seed, deals them into shards of
`prep.shard_rows` and writes `plan/` (`shared.artifacts.PlanArtifacts`): the prep workers
then read and parse their own rows in parallel.

Invariants:
- deterministic: the same recipe gives byte-identical plan files;
- sampling: per dataset, a seeded permutation (seed, dataset index); `max_samples` keeps its
  head; `prep.max_samples` caps the mix, split by `weight` (largest remainder); the union is
  shuffled with the seed so every shard mixes every dataset;
- a truncated source is refused unless its recipe entry allows it (`allow_truncated`).
"""

from __future__ import annotations

import logging

import numpy as np

from services.prep.formats import detect_format
from services.prep.sources import first_rows, index_source, resolve_source
from shared.artifacts import write_model, write_npy
from shared.errors import InputError
from shared.recipe import Recipe
from shared.records import DatasetLoad, DataSource, Plan, PlanDataset
from shared.stage import HOUR_S, ShardResult, StageContext, stage

log = logging.getLogger("eyrie.prep.plan")


def resolve_adapter(source: DataSource, ranges: np.ndarray | None) -> str:
    """The adapter of a source; `auto` becomes the format of its first recognizable row.

    Rows of another format are then rejected by the adapter and counted (`format_mismatch`).

    Raises:
        InputError: none of the first rows looks like a known format.
    """
    if source.adapter != "auto":
        return source.adapter
    for row in first_rows(source, ranges):
        fmt = detect_format(row)
        if fmt is not None:
            return fmt
    raise InputError(
        f"{source.path}: no row has `conversations`, `messages` or `instruction`/`output`; "
        "set datasets[].format explicitly"
    )


def weighted_quotas(cap: int, weights: list[float], available: list[int]) -> list[int]:
    """Split `cap` rows by `weights`, each quota capped at what the dataset has.

    Largest-remainder rounding; ties go to the lower dataset index.
    """
    total = sum(weights)
    exact = [cap * w / total for w in weights]
    quotas = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: cap - sum(quotas)]:
        quotas[i] += 1
    return [min(q, a) for q, a in zip(quotas, available, strict=True)]


def sample_rows(recipe: Recipe, sizes: list[int]) -> np.ndarray:
    """Seeded `(dataset index, row)` selection over datasets of `sizes` rows, shuffled.

    Returns:
        int64 `[selected, 2]`.
    """
    perms = [
        np.random.default_rng([recipe.prep.seed, i]).permutation(n) for i, n in enumerate(sizes)
    ]
    takes = [min(spec.max_samples or n, n) for spec, n in zip(recipe.datasets, sizes, strict=True)]
    cap = recipe.prep.max_samples
    if cap is not None and sum(takes) > cap:
        takes = weighted_quotas(cap, [d.weight for d in recipe.datasets], takes)
    chosen = [(i, int(r)) for i, p in enumerate(perms) for r in sorted(p[: takes[i]])]
    order = np.random.default_rng([recipe.prep.seed, len(sizes)]).permutation(len(chosen))
    return np.asarray([chosen[j] for j in order], dtype=np.int64).reshape(-1, 2)


def _check_truncation(recipe: Recipe, i: int, load: DatasetLoad) -> None:
    if not load.truncated:
        return
    if not recipe.datasets[i].allow_truncated:
        raise InputError(
            f"{load.file}: truncated at byte {load.error_byte_offset} ({load.error}); "
            f"{load.rows} complete rows before it. Set datasets[{i}].allow_truncated: true "
            "to use them."
        )
    log.warning(
        "%s: truncated at byte %s, keeping its %d complete rows (allow_truncated)",
        load.file,
        load.error_byte_offset,
        load.rows,
    )


@stage("plan", queue="prep", timeout_s=HOUR_S)
def plan_stage(ctx: StageContext) -> ShardResult:
    """Index every dataset, sample the rows and cut them into prep shards.

    Raises:
        ConfigError: unknown preset or a missing local path. InputError: an unreadable,
            unrecognizable or (unless allowed) truncated source, or nothing selected.
    """
    recipe, art = ctx.recipe, ctx.store.plan
    sources = [resolve_source(spec, i) for i, spec in enumerate(recipe.datasets)]
    indexed = [index_source(s) for s in sources]
    adapters = [resolve_adapter(s, ranges) for s, (ranges, _) in zip(sources, indexed, strict=True)]
    for i, (_, load) in enumerate(indexed):
        _check_truncation(recipe, i, load)
    selection = sample_rows(recipe, [load.rows for _, load in indexed])
    if not len(selection):
        raise InputError("datasets: no rows selected (every dataset is empty)")
    files = []
    for i, (ranges, _) in enumerate(indexed):
        if ranges is not None:
            files.append(write_npy(art.index_path(i), ranges))
    files.append(write_npy(art.selection_path, selection))
    size = recipe.prep.shard_rows
    counts = np.bincount(selection[:, 0], minlength=len(sources))
    plan = Plan(
        recipe_hash=recipe.recipe_hash(),
        num_shards=-(-len(selection) // size),
        shard_rows=size,
        selected=len(selection),
        datasets=[
            PlanDataset(
                source=s.model_copy(update={"adapter": a}),
                rows=load.rows,
                selected=int(c),
                load=load,
            )
            for s, (_, load), a, c in zip(sources, indexed, adapters, counts, strict=True)
        ],
    )
    files.append(write_model(art.plan_path, plan))
    return ShardResult(
        {"datasets": len(sources), "selected": plan.selected, "shards": plan.num_shards}, files
    )
