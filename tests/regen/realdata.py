"""Real ShareGPT V3 conversations, and a run store whose dedup stage kept exactly them.

The store is made the way a run makes it: the rows are written as an OpenAI-messages JSONL
dataset and the real plan → prep → dedup stages turn it into `dedup/shard-00000.jsonl`,
the regen stage's input.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from shared.artifacts import RunStore
from shared.recipe import Recipe, resolve_recipe
from tests.conftest import run_stage


def sharegpt_rows(n: int, skip: int = 0) -> list[dict[str, Any]]:
    """The first `n` ShareGPT V3 records (after `skip`) that prep's adapters accept.

    Each is `{"id", "messages", "tools"}` with canonical messages; rows whose first user
    prompt repeats an earlier one's (dedup would drop them) are passed over.
    """
    from services.prep.dedup import normalize_prompt
    from services.prep.formats import RowRejected, adapt_sharegpt, normalize
    from services.prep.sharegpt_pkg import iter_sharegpt
    from shared.mtbench import mtbench_first_turns

    seen = {normalize_prompt(t) for t in mtbench_first_turns()}
    rows: list[dict[str, Any]] = []
    usable = 0
    for rec in iter_sharegpt():
        try:
            a = normalize(adapt_sharegpt(rec), 200_000)
        except RowRejected:
            continue
        first = next(m["content"] for m in a.messages if m["role"] == "user")
        if normalize_prompt(first) in seen:
            continue
        seen.add(normalize_prompt(first))
        usable += 1
        if usable <= skip:
            continue
        rows.append({"id": rec["id"], "messages": a.messages, "tools": a.tools})
        if len(rows) == n:
            return rows
    raise AssertionError(f"ShareGPT has fewer than {n + skip} usable rows")


def store_with_dedup(
    recipe_dict: dict[str, Any], root: Path, rows: list[dict[str, Any]]
) -> tuple[RunStore, Recipe]:
    """A run over `rows` (one dataset, one shard) after its plan, prep and dedup stages.

    Returns:
        the store and its recipe (`recipe_dict` with the dataset replaced).

    Raises:
        AssertionError: dedup did not keep every row (the regen input must be `rows`).
    """
    root.mkdir(parents=True, exist_ok=True)
    data = root / "sharegpt-rows.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for r in rows:
            line = {"messages": r["messages"], **({"tools": r["tools"]} if r["tools"] else {})}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    d = copy.deepcopy(recipe_dict)
    d["datasets"] = [{"path": str(data), "format": "openai"}]
    d["prep"] = {**d.get("prep", {}), "shard_rows": max(len(rows), 1)}
    recipe = resolve_recipe(d)
    store = RunStore.create(recipe, root=root)
    for name in ("plan", "prep", "dedup"):
        run_stage(store, name)
    kept = store.dedup.conversations(0)
    assert store.plan.num_shards() == 1 and len(kept) == len(rows), "dedup dropped rows"
    return store, recipe


def source_row(conversation_id: str) -> int:
    """The line of the dataset file a conversation came from (`<dataset>:<row>`)."""
    return int(conversation_id.rsplit(":", 1)[1])
