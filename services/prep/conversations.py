"""The prep stage: one shard of planned source rows → canonical conversations.

Each prep worker reads only its shard's rows (by byte range or row number, from the plan),
adapts them with the dataset's format adapter and validates them. A row that cannot become a
conversation is quarantined with its file, row, field and reason, and counted (per reason,
and per source dataset); the shard fails when it keeps less than `prep.min_kept_fraction`
(after writing its report, so the reasons can be read). A row that is not Unicode text fails
the shard at once when its dataset says `on_bad_bytes: error`.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from services.prep.formats import ADAPTERS, RowRejected, normalize
from services.prep.sources import BAD_BYTES_REASONS, RowError, read_rows
from shared.errors import InputError, TooManyBadRowsError
from shared.records import Conversation, PrepReport, QuarantinedRow
from shared.stage import HOUR_S, PER_PLAN_SHARD, ShardResult, StageContext, stage

#: Raw rows in the quarantine file are cut to this many characters.
QUARANTINE_RAW_CHARS = 2000


def _raw_text(raw: Any) -> str:
    return json.dumps(raw, ensure_ascii=False, default=str)[:QUARANTINE_RAW_CHARS]


def _read_shard(ctx: StageContext) -> list[tuple[int, int, Any]]:
    """`(dataset index, source row, raw row or RowError)` of the shard, in plan order."""
    art = ctx.store.plan
    plan = art.read()
    pairs = art.shard_rows(ctx.shard).tolist()
    raws: dict[tuple[int, int], Any] = {}
    for d in sorted({ds for ds, _ in pairs}):
        rows = [r for ds, r in pairs if ds == d]
        meta = plan.datasets[d]
        ranges = art.row_index(d) if meta.source.reader != "hf" else None
        for r, raw in zip(rows, read_rows(meta.source, ranges, rows), strict=True):
            raws[(d, r)] = raw
    return [(d, r, raws[(d, r)]) for d, r in pairs]


def _refuse_bad_bytes(ctx: StageContext, d: int, file: str, row: int, err: RowError) -> None:
    """Raise when dataset `d` asks for it (`on_bad_bytes: error`) and the row is not text."""
    if err.reason in BAD_BYTES_REASONS and ctx.recipe.datasets[d].on_bad_bytes == "error":
        raise InputError(
            f"{file}: row {row}: not Unicode text ({err.reason}, {err.detail}); "
            f"datasets[{d}].on_bad_bytes is 'error' ('quarantine' counts and skips such rows)"
        )


@stage("prep", queue="prep", timeout_s=HOUR_S, shards=PER_PLAN_SHARD, after=("plan",))
def prep_stage(ctx: StageContext) -> ShardResult:
    """Adapt and validate one shard of planned rows into canonical conversations.

    Raises:
        TooManyBadRowsError: the kept share is below `prep.min_kept_fraction`.
        InputError: a row is not Unicode text and its dataset says `on_bad_bytes: error`.
    """
    plan = ctx.store.plan.read()
    cfg = ctx.recipe.prep
    kept: list[Conversation] = []
    quarantined: list[QuarantinedRow] = []
    skipped: Counter[str] = Counter()
    by_source: dict[str, Counter[str]] = {}
    realigned: Counter[str] = Counter()
    fields: Counter[str] = Counter()
    rows = _read_shard(ctx)
    per_source: dict[str, Counter[str]] = {}
    for d, row, raw in rows:
        meta = plan.datasets[d]
        src = per_source.setdefault(meta.source.name, Counter(rows_in=0, kept=0, skipped=0))
        src["rows_in"] += 1
        try:
            if isinstance(raw, RowError):
                _refuse_bad_bytes(ctx, d, meta.load.file, row, raw)
                raise RowRejected(raw.reason, "<row>", raw.detail)
            adapted = normalize(ADAPTERS[meta.source.adapter](raw), cfg.max_turn_chars)
        except RowRejected as e:
            skipped[e.reason] += 1
            by_source.setdefault(meta.source.name, Counter())[e.reason] += 1
            src["skipped"] += 1
            shown = "" if isinstance(raw, RowError) else _raw_text(raw)
            quarantined.append(
                QuarantinedRow(
                    file=meta.load.file,
                    row=row,
                    field=e.field,
                    reason=e.reason,
                    detail=e.detail,
                    raw=shown,
                )  # fmt: skip
            )
            continue
        realigned.update(adapted.realigned)
        fields.update(adapted.fields)
        src["kept"] += 1
        kept.append(
            Conversation.model_validate(
                {
                    "id": f"{meta.source.name}:{row}",
                    "source": meta.source.name,
                    "messages": adapted.messages,
                    "tools": adapted.tools,
                }
            )
        )
    report = PrepReport(
        rows_in=len(rows),
        kept=len(kept),
        skipped=dict(sorted(skipped.items())),
        realigned=dict(sorted(realigned.items())),
        skipped_by_source={s: dict(sorted(c.items())) for s, c in sorted(by_source.items())},
        fields=dict(sorted(fields.items())),
        per_source={name: dict(c) for name, c in sorted(per_source.items())},
    )
    files = ctx.store.prep.write(ctx.shard, kept, quarantined, report)
    if rows and len(kept) / len(rows) < cfg.min_kept_fraction:
        raise TooManyBadRowsError(
            f"prep shard {ctx.shard}: kept {len(kept)}/{len(rows)} rows, below "
            f"prep.min_kept_fraction={cfg.min_kept_fraction}; reasons by dataset: "
            f"{report.skipped_by_source} "
            f"(rows in {ctx.store.prep.quarantine_path(ctx.shard)}). Fix the data or lower "
            "the threshold."
        )
    counts = {"rows_in": len(rows), "kept": len(kept), "skipped": sum(skipped.values())}
    return ShardResult(counts, files, {"report": report.model_dump()})
