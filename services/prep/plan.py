"""The run's plan: which source rows each prep shard reads.

`make_plan` runs once in the conductor at `eyrie run` time. It loads every dataset, samples
rows with the recipe seed, deals them into shards of `prep.shard_rows`, and writes
- `plan/rows-NNNNN.jsonl`: the raw rows of shard N, `{"ds", "row", "raw"}` per line, so a
  prep worker on any host reads only its shard (no re-parsing of the source, no hub access);
- `plan.json` (last, atomically): `{"num_shards", "datasets", "shards", "recipe_hash"}`,
  where `shards[N]` lists `[dataset_idx, row_idx]` pairs in the shard's row order.

Invariants:
- deterministic: the same recipe gives byte-identical plan files;
- idempotent: an existing plan for the same recipe hash is reused;
- sampling: per dataset, a seeded permutation (seed, dataset index); `max_samples` keeps its
  head; `prep.max_samples` caps the mix, split by `weight` (largest remainder); the union is
  shuffled with the seed so every shard mixes every dataset.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from services.prep.formats import detect_format
from services.prep.loaders import Loaded, load_dataset_spec
from shared.errors import InputError
from shared.recipe import Recipe
from shared.store import RunStore, atomic_path, atomic_write_json

log = logging.getLogger("eyrie.prep.plan")


def plan_path(store: RunStore) -> Any:
    """`<run>/plan.json`."""
    return store.root / "plan.json"


def rows_path(store: RunStore, shard: int) -> Any:
    """`<run>/plan/rows-NNNNN.jsonl`: raw rows of one shard."""
    return store.root / "plan" / f"rows-{shard:05d}.jsonl"


def resolve_adapter(loaded: Loaded) -> str:
    """The adapter of a dataset; 'auto' becomes the format of its first recognizable row.

    Rows of another format are then rejected by the adapter and counted (`format_mismatch`).

    Raises:
        InputError: no row looks like any known format.
    """
    if loaded.adapter != "auto":
        return loaded.adapter
    for row in loaded.rows:
        fmt = detect_format(row)
        if fmt is not None:
            return fmt
    raise InputError(
        f"{loaded.report.get('file')}: no row has `conversations`, `messages` or "
        "`instruction`/`output`; set datasets[].format explicitly"
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


def sample_rows(recipe: Recipe, sizes: list[int]) -> list[tuple[int, int]]:
    """Seeded `(dataset_idx, row_idx)` selection over datasets of `sizes` rows, shuffled."""
    perms = [
        np.random.default_rng([recipe.prep.seed, i]).permutation(n) for i, n in enumerate(sizes)
    ]
    takes = [min(spec.max_samples or n, n) for spec, n in zip(recipe.datasets, sizes, strict=True)]
    cap = recipe.prep.max_samples
    if cap is not None and sum(takes) > cap:
        takes = weighted_quotas(cap, [d.weight for d in recipe.datasets], takes)
    chosen = [(i, int(r)) for i, p in enumerate(perms) for r in sorted(p[: takes[i]])]
    order = np.random.default_rng([recipe.prep.seed, len(sizes)]).permutation(len(chosen))
    return [chosen[j] for j in order]


def _existing(store: RunStore, recipe: Recipe) -> int | None:
    path = plan_path(store)
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if plan.get("recipe_hash") != recipe.recipe_hash():
        return None
    return int(plan["num_shards"])


def make_plan(store: RunStore, recipe: Recipe) -> int:
    """Write `plan.json` and the per-shard raw rows, unless a plan for this recipe exists.

    Returns:
        the number of prep shards.

    Raises:
        ConfigError: unknown preset. InputError: unreadable or unrecognizable dataset, or
            nothing selected.
    """
    found = _existing(store, recipe)
    if found is not None:
        return found
    loaded = [load_dataset_spec(spec) for spec in recipe.datasets]
    for ld in loaded:
        ld.adapter = resolve_adapter(ld)
        if ld.report.get("truncated"):
            log.warning(
                "%s: input is damaged, kept %d complete records: %s",
                ld.name,
                len(ld.rows),
                {k: v for k, v in ld.report.items() if k != "bad_lines"},
            )
    picks = sample_rows(recipe, [len(ld.rows) for ld in loaded])
    if not picks:
        raise InputError("datasets: no rows selected (every dataset is empty)")
    size = recipe.prep.shard_rows
    shards = [picks[i : i + size] for i in range(0, len(picks), size)]
    for n, shard in enumerate(shards):
        with atomic_path(rows_path(store, n)) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for ds, row in shard:
                rec = {"ds": ds, "row": row, "raw": loaded[ds].rows[row]}
                f.write(json.dumps(rec, ensure_ascii=False, default=str, sort_keys=True) + "\n")
    datasets = [
        {
            "name": ld.name,
            "adapter": ld.adapter,
            "rows": len(ld.rows),
            "selected": sum(1 for d, _ in picks if d == i),
            "load": ld.report,
        }
        for i, ld in enumerate(loaded)
    ]
    atomic_write_json(
        plan_path(store),
        {
            "num_shards": len(shards),
            "datasets": datasets,
            "recipe_hash": recipe.recipe_hash(),
            "shards": [[[d, r] for d, r in s] for s in shards],
        },
    )
    return len(shards)


def read_plan(store: RunStore) -> dict[str, Any]:
    """The run's plan.

    Raises:
        InputError: the plan is missing (run `eyrie run` or `eyrie stage`, which write it).
    """
    path = plan_path(store)
    if not path.is_file():
        raise InputError(f"{path}: the run has no plan; `eyrie run` writes it")
    return json.loads(path.read_text())
