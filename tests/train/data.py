"""Real extracted hidden states for trainer tests.

Real ShareGPT V3 conversations (first user turn + answer), rendered with SmolLM2's real
ChatML template and masked by the prep stage's own rule (`services.prep.template.
assistant_mask`), written as tokenized shards, then run through the real extract stage (hf
backend, SmolLM2 bf16 on CPU) and the real vocab stage of a run store. The held-out split is
chosen by the split stage's rule (`services.prep.split.held_out`) over the rows' ids.

The trainer tests link these stage folders into their own runs (`make_run` in conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.artifacts import RunStore
from shared.recipe import Recipe
from tests.conftest import run_stage
from tests.extract.data import write_plan, write_split, write_tokenized_shard

#: The stage folders a trainer run reads (and the tests link into their own runs).
INPUT_STAGES = ("plan", "tokenize", "split", "extract", "vocab")


def sharegpt_rows(tok: Any, n: int, max_len: int) -> list[dict[str, Any]]:
    """`n` tokenized ShareGPT conversations (first user turn + answer), <= max_len tokens."""
    from services.prep.formats import RowRejected, adapt_sharegpt
    from services.prep.sharegpt_pkg import iter_sharegpt
    from services.prep.template import assistant_mask

    rows = []
    for rec in iter_sharegpt():
        try:
            msgs = adapt_sharegpt(rec).messages[:2]
            if [m["role"] for m in msgs] != ["user", "assistant"]:
                continue
            ids, mask = assistant_mask(tok, msgs, {})
        except RowRejected:
            continue
        ids, mask = ids[:max_len], mask[:max_len]
        if sum(mask[2:]) < 8:
            continue
        sid = f"sharegpt:{rec['id']}"
        rows.append({"input_ids": ids, "loss_mask": mask, "id": sid, "source": "sharegpt-v3"})
        if len(rows) == n:
            return rows
    raise RuntimeError(f"ShareGPT ran out after {len(rows)} usable rows")


def make_extract_data(
    root: Path, recipe: Recipe, n: int = 32, max_len: int = 96, shards: int = 2
) -> RunStore:
    """A run under `root` whose tokenize, split, extract and vocab stages hold `n` samples
    in `shards` shards. Returns its store."""
    from services.prep.split import held_out
    from shared.tokenizer import load_tokenizer

    store = RunStore.create(recipe, root=root)
    rows = sharegpt_rows(load_tokenizer(recipe), n, max_len)
    per = (n + shards - 1) // shards
    for s in range(shards):
        write_tokenized_shard(store, s, rows[s * per : (s + 1) * per])
    write_plan(store, shards, per)
    ids = [r["id"] for r in rows]
    write_split(store, ids, held_out(ids, recipe.train.val_fraction, recipe.train.seed))
    run_stage(store, "extract")
    run_stage(store, "vocab")
    return store


def link_inputs(store: RunStore, data: RunStore, stages: tuple[str, ...] = INPUT_STAGES) -> None:
    """Make `store`'s input stage folders symlinks to `data`'s (shared, never copied)."""
    for name in stages:
        store.stage_dir(name).symlink_to(data.stage_dir(name))
