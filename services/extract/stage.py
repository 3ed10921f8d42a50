"""The extract stage: one tokenized shard → hidden states in the speculators offline layout.

It reads `tokenize/shard-N/`, refuses to start when the disk cannot hold the output,
batches by a token budget (halved on OOM), checks each sample and writes `extract/shard-N/`
(`shared.artifacts.ExtractArtifacts`).

Invariants:
- idempotent: a sample whose hidden-state file exists is skipped, so a killed job resumes
  where it stopped and a rerun of a finished shard writes nothing;
- rows keep the tokenized shard's numbering: the shard's rows dataset has the same rows in
  the same order, and `hs_<row>` is row `row` of it. A quarantined row has no file
  (speculators skips missing files with `on_missing=skip`) and is listed in `meta.json`;
- the stage fails only when more than `MAX_QUARANTINE_FRACTION` of the rows are bad.
"""

from __future__ import annotations

import logging
from typing import Any

from services.extract.backend import Extractor, RowTokens
from services.extract.batching import run_batches
from services.extract.writer import StateWriter, WriteResult
from shared.conventions import NUM_AUX_LAYERS
from shared.errors import ConfigError, StageFailedError
from shared.recipe import Recipe
from shared.records import ExtractMeta
from shared.stage import HOUR_S, PER_PLAN_SHARD, ShardResult, StageContext, stage
from shared.store import check_free_space, make_dirs
from shared.target import target_config

log = logging.getLogger("eyrie.extract")

#: 3 aux layers + the final pre-norm state.
NUM_SLOTS = NUM_AUX_LAYERS + 1
#: Share of a shard's rows that may be quarantined before the stage fails.
MAX_QUARANTINE_FRACTION = 0.05
_BYTES_PER_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4}


def make_extractor(recipe: Recipe, server_url: str) -> Extractor:
    """The backend `extract.backend` names.

    Args:
        server_url: where the extract-mode server answers (vllm backend only).

    Raises:
        ConfigError: unknown backend name (lists the known ones).
    """
    backend = recipe.extract.backend
    if backend == "hf":
        from services.extract.hf_backend import HFExtractor

        return HFExtractor(recipe)
    if backend == "vllm":
        from services.extract.vllm_backend import VLLMExtractor

        return VLLMExtractor(recipe, server_url)
    raise ConfigError(f"extract.backend: unknown {backend!r}; known: hf, vllm")


def bytes_needed(num_tokens: int, hidden_size: int, dtype: str) -> int:
    """Estimated output size: tokens × (3+1) × H × bytes per element."""
    return num_tokens * NUM_SLOTS * hidden_size * _BYTES_PER_ELEMENT[dtype]


def _vllm_server(recipe: Recipe, shard: int) -> str | None:
    return "extract" if recipe.extract.backend == "vllm" else None


def _release() -> None:
    from services.extract.hf_backend import release_models

    release_models()


@stage(
    "extract",
    queue="extract",
    timeout_s=2 * HOUR_S,
    shards=PER_PLAN_SHARD,
    after=("tokenize",),
    gpu_phase="extract",
    server=_vllm_server,
    release=_release,
)
def extract_stage(ctx: StageContext) -> ShardResult:
    """Extract hidden states for tokenized shard `ctx.shard`.

    Raises:
        ConfigError: not enough free disk for the estimated output (both numbers given).
        ArtifactError: the tokenized shard is missing or malformed.
        StageFailedError: too many quarantined rows, or one sample OOMs alone.
    """
    return extract_shard(ctx)


def extract_shard(ctx: StageContext, extractor: Extractor | None = None) -> ShardResult:
    """The extract stage with an optional ready extractor (a worker's, or a test's)."""
    art, shard, recipe = ctx.store.extract, ctx.shard, ctx.recipe
    tok = ctx.store.tokenize.dataset(shard)
    input_ids: list[list[int]] = [list(r) for r in tok["input_ids"]]
    ids: list[str] = list(tok["id"])
    todo = [r for r in range(len(input_ids)) if not art.hs_path(shard, r).is_file()]
    hidden = int(target_config(recipe)["hidden_size"])
    todo_tokens = sum(len(input_ids[r]) for r in todo)
    # Preflight before loading the model: a 547 GB target takes 20+ minutes to load.
    check_free_space(
        art.shard_dir(shard),
        bytes_needed(todo_tokens, hidden, recipe.extract.dtype),
        "hidden states",
    )
    data_files = art.write_data(shard, tok)
    extractor = extractor or make_extractor(recipe, ctx.server_url("extract"))
    result, stats = _extract_rows(ctx, input_ids, ids, todo, extractor)
    rows = len(input_ids)
    written = [r for r in range(rows) if art.hs_path(shard, r).is_file()]
    meta = ExtractMeta.model_validate(
        {
            **extractor.metadata(),
            "rows": rows,
            "written_rows": len(written),
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
    )
    meta_path = art.write_meta(shard, meta)
    bad = len(result.quarantined)
    if rows and bad / rows > MAX_QUARANTINE_FRACTION:
        raise StageFailedError(
            f"{art.shard_dir(shard)}: {bad} of {rows} rows quarantined (more than "
            f"{MAX_QUARANTINE_FRACTION:.0%}); reasons in {meta_path} 'quarantined'"
        )
    counts = {
        "rows": rows,
        "written": len(written),
        "quarantined": bad,
        "tokens": sum(len(input_ids[r]) for r in written),
        "bytes_this_run": result.bytes,
        "oom_retries": stats.oom_retries,
    }
    extra = {"aux_layer_ids": meta.aux_layer_ids, "final_state": meta.final_state}
    return ShardResult(counts, [*data_files, meta_path], extra)


def _extract_rows(
    ctx: StageContext,
    input_ids: list[list[int]],
    ids: list[str],
    todo: list[int],
    extractor: Extractor,
) -> tuple[WriteResult, Any]:
    import torch

    art, shard = ctx.store.extract, ctx.shard
    writer = StateWriter(
        lambda row: art.hs_path(shard, row), NUM_SLOTS, getattr(torch, ctx.recipe.extract.dtype)
    )
    # Made here, as the worker's user: the vLLM server writes its staging files into it.
    make_dirs(art.hs_dir(shard))
    # Each row carries its final file, so a backend that writes to disk writes it there.
    samples = [RowTokens(input_ids[r], art.hs_path(shard, r)) for r in todo]
    done_rows: list[int] = []
    with ctx.progress(sum(len(s) for s in samples), "tok") as progress:

        def on_result(i: int, out: Any) -> None:
            row = todo[i]
            writer.submit(row, ids[row], out.states, out.token_ids, input_ids[row], out.file)
            done_rows.append(row)
            progress.update(len(samples[i]), rows=len(done_rows))

        try:
            stats = run_batches(
                samples, ctx.recipe.extract.tokens_per_batch, extractor.extract, on_result
            )
        finally:
            result = writer.close()
    return result, stats
