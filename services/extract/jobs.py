"""The extract stage: one tokenized shard → hidden states in the speculators offline layout.

Responsibility: `run_extract(store, recipe, shard)`, the conductor's stage function
(`services.conductor.stages`). It reads `tokenize/shard-N/`, refuses to start when the disk
cannot hold the output, batches by a token budget (halved on OOM), checks each sample and
writes `extract/shard-N/` as `shared/artifacts.py` documents.

Invariants:
- idempotent: a sample whose `hs_<row>.safetensors` exists is skipped, so a killed job
  resumes where it stopped and a rerun of a finished shard writes nothing;
- rows keep the tokenized shard's numbering: `data/` has the same rows in the same order,
  and `hs_<row>` is row `row` of it. A quarantined row has no file (speculators skips
  missing files with `on_missing=skip`) and is listed in `meta.json`;
- the stage fails only when more than `MAX_QUARANTINE_FRACTION` of the rows are bad.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.extract.backend import Extractor, make_extractor
from services.extract.batching import run_batches
from services.extract.writer import StateWriter, hs_path
from shared.conventions import NUM_AUX_LAYERS
from shared.errors import ArtifactError, StageFailedError
from shared.progress import Progress
from shared.recipe import Recipe
from shared.store import (
    Manifest,
    RunStore,
    atomic_path,
    atomic_write_json,
    check_free_space,
    sweep_temps,
)
from shared.target import target_config

log = logging.getLogger("eyrie.extract")

STAGE = "extract"
#: 3 aux layers + the final pre-norm state.
NUM_SLOTS = NUM_AUX_LAYERS + 1
#: Share of a shard's rows that may be quarantined before the stage fails.
MAX_QUARANTINE_FRACTION = 0.05
_BYTES_PER_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4}
DATA_COLUMNS = ("input_ids", "loss_mask", "seq_len")


@dataclass
class TokenizedShard:
    """The rows of `tokenize/shard-N/` that extraction needs.

    Attributes:
        path: the shard folder.
        dataset: the HF dataset (input_ids, loss_mask, seq_len, id, source).
        input_ids: token ids per row.
        ids: sample id per row.
    """

    path: Path
    dataset: Any
    input_ids: list[list[int]]
    ids: list[str]


def load_tokenized(store: RunStore, shard: int) -> TokenizedShard:
    """Read `tokenize/shard-N/` (HF save_to_disk).

    Raises:
        ArtifactError: the folder is missing or lacks a column; the message names both.
    """
    from datasets import load_from_disk

    path = store.shard_path("tokenize", shard, "")
    if not path.is_dir():
        raise ArtifactError(f"{path}: tokenized shard {shard} not found; run the tokenize stage")
    ds = load_from_disk(str(path))
    missing = [c for c in (*DATA_COLUMNS, "id") if c not in ds.column_names]
    if missing:
        raise ArtifactError(
            f"{path}: columns {missing} missing (got {ds.column_names}); expected the layout "
            "of shared/artifacts.py tokenize/"
        )
    ds = ds.with_format(None)
    return TokenizedShard(path, ds, [list(r) for r in ds["input_ids"]], list(ds["id"]))


def bytes_needed(num_tokens: int, hidden_size: int, dtype: str) -> int:
    """Estimated output size: tokens × (3+1) × H × bytes per element."""
    return num_tokens * NUM_SLOTS * hidden_size * _BYTES_PER_ELEMENT[dtype]


def pending_rows(shard_dir: Path, num_rows: int) -> list[int]:
    """Rows without a finished `hs_<row>.safetensors` file."""
    return [r for r in range(num_rows) if not hs_path(shard_dir, r).is_file()]


def write_data_copy(tok: TokenizedShard, shard_dir: Path) -> Path:
    """`shard-N/data/`: the tokenized rows (input_ids, loss_mask, seq_len), same order."""
    data = shard_dir / "data"
    if not data.is_dir():
        with atomic_path(data) as tmp:
            tok.dataset.select_columns(list(DATA_COLUMNS)).save_to_disk(str(tmp))
    return data


def run_extract(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Stage function: extract hidden states for tokenized shard `shard`.

    Raises:
        ConfigError: not enough free disk for the estimated output (both numbers given).
        ArtifactError: the tokenized shard is missing or malformed.
        StageFailedError: too many quarantined rows, or one sample OOMs alone.
    """
    return extract_shard(store, recipe, shard)


def extract_shard(
    store: RunStore, recipe: Recipe, shard: int, extractor: Extractor | None = None
) -> Manifest:
    """`run_extract` with an optional ready extractor (a worker's, or a test's wrapper)."""
    tok = load_tokenized(store, shard)
    shard_dir = store.shard_path(STAGE, shard, "")
    if shard_dir.is_dir():
        sweep_temps(shard_dir)
    todo = pending_rows(shard_dir, len(tok.input_ids))
    hidden = int(target_config(recipe)["hidden_size"])
    todo_tokens = sum(len(tok.input_ids[r]) for r in todo)
    # Preflight before loading the model: a 547 GB target takes 20+ minutes to load.
    check_free_space(
        shard_dir, bytes_needed(todo_tokens, hidden, recipe.extract.dtype), "hidden states"
    )
    write_data_copy(tok, shard_dir)
    extractor = extractor or make_extractor(recipe)
    result, stats = _extract_rows(tok, todo, extractor, recipe, shard_dir, shard)
    return _finish(store, recipe, shard, tok, shard_dir, extractor, result, stats, todo)


def _extract_rows(
    tok: TokenizedShard,
    todo: list[int],
    extractor: Extractor,
    recipe: Recipe,
    shard_dir: Path,
    shard: int,
) -> tuple[Any, Any]:
    import torch

    writer = StateWriter(shard_dir, NUM_SLOTS, getattr(torch, recipe.extract.dtype))
    samples = [tok.input_ids[r] for r in todo]
    total = sum(len(s) for s in samples)
    done_rows: list[int] = []
    with Progress(total, "tok", f"extract[{shard}]") as progress:

        def on_result(i: int, out: Any) -> None:
            row = todo[i]
            writer.submit(row, tok.ids[row], out.states, out.token_ids, tok.input_ids[row])
            done_rows.append(row)
            progress.update(len(samples[i]), rows=len(done_rows))

        try:
            stats = run_batches(
                samples, recipe.extract.tokens_per_batch, extractor.extract, on_result
            )
        finally:
            result = writer.close()
    return result, stats


def _finish(
    store: RunStore,
    recipe: Recipe,
    shard: int,
    tok: TokenizedShard,
    shard_dir: Path,
    extractor: Extractor,
    result: Any,
    stats: Any,
    todo: list[int],
) -> Manifest:
    rows = len(tok.input_ids)
    done_rows = rows - len(pending_rows(shard_dir, rows))
    meta = {
        **extractor.metadata(),
        "rows": rows,
        "written_rows": done_rows,
        "quarantined": result.quarantined,
        "this_run": {
            "rows": len(todo),
            "written": result.written,
            "tokens": result.tokens,
            "bytes": result.bytes,
            "batches": stats.batches,
            "oom_retries": stats.oom_retries,
            "start_budget_tokens": stats.start_budget,
            "final_budget_tokens": stats.final_budget,
        },
    }
    meta_path = atomic_write_json(shard_dir / "meta.json", meta)
    bad = len(result.quarantined)
    if rows and bad / rows > MAX_QUARANTINE_FRACTION:
        raise StageFailedError(
            f"{shard_dir}: {bad} of {rows} rows quarantined (more than "
            f"{MAX_QUARANTINE_FRACTION:.0%}); reasons in {meta_path} 'quarantined'"
        )
    counts = {
        "rows": rows,
        "written": done_rows,
        "quarantined": bad,
        "tokens": sum(
            len(tok.input_ids[r]) for r in range(rows) if hs_path(shard_dir, r).is_file()
        ),
        "bytes_this_run": result.bytes,
        "oom_retries": stats.oom_retries,
    }
    return store.write_manifest(
        STAGE,
        shard,
        counts,
        files=[shard_dir / "data", meta_path],
        extra={"aux_layer_ids": meta["aux_layer_ids"], "final_state": meta["final_state"]},
    )
