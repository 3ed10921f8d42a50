"""Real ShareGPT V3 rows as prep would write them, and a run store holding them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.recipe import Recipe
from shared.store import RunStore, atomic_write_json


def sharegpt_rows(n: int, skip: int = 0) -> list[dict[str, Any]]:
    """The first `n` ShareGPT V3 records (after `skip`) that prep's adapters accept."""
    from services.prep.formats import RowRejected, adapt_sharegpt, normalize
    from services.prep.sharegpt_pkg import iter_sharegpt

    rows: list[dict[str, Any]] = []
    seen = 0
    for rec in iter_sharegpt():
        try:
            a = normalize(adapt_sharegpt(rec), 200_000)
        except RowRejected:
            continue
        seen += 1
        if seen <= skip:
            continue
        rows.append(
            {"id": rec["id"], "source": "sharegpt", "messages": a.messages, "tools": a.tools}
        )
        if len(rows) == n:
            return rows
    raise AssertionError(f"ShareGPT has fewer than {n + skip} usable rows")


def store_with_prep(
    recipe: Recipe, root: Path, rows: list[dict], keep: list[int] | None = None
) -> RunStore:
    """A run store whose prep shard 0 holds `rows` and whose dedup keeps `keep` (all)."""
    store = RunStore.create(recipe, root=root)
    path = store.shard_path("prep", 0, ".jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = list(range(len(rows))) if keep is None else keep
    atomic_write_json(store.root / "dedup" / "keep.json", {"0": kept})
    return store
