"""The dedup stage: exact-duplicate removal and eval decontamination, over every prep shard.

The key is the normalized first user prompt: Unicode NFKC, case-folded, whitespace runs
collapsed to one space, stripped. Dedup keeps the first occurrence in (shard, row) order, so
the result does not depend on which worker wrote which shard. Decontamination drops rows
whose first prompt equals an MT-Bench first turn (the benchmark's prompts never enter
training data). The kept conversations are written once, per prep shard, for every later
reader.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

from shared.mtbench import mtbench_first_turns
from shared.records import Conversation, DedupReport
from shared.stage import HOUR_S, ShardResult, StageContext, stage


def normalize_prompt(text: str) -> str:
    """The dedup key of a prompt: NFKC, casefold, collapsed whitespace."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def first_user_prompt(conv: Conversation) -> str:
    """Content of the first user message ("" if none)."""
    return next((m.content or "" for m in conv.messages if m.role == "user"), "")


def select(
    shards: Iterable[tuple[int, list[Conversation]]],
    dedup: bool,
    eval_prompts: Iterable[str] | None,
) -> tuple[dict[int, list[Conversation]], DedupReport]:
    """Choose the conversations to keep.

    Args:
        shards: `(shard, conversations)` in shard order.
        dedup: drop later rows whose key was seen.
        eval_prompts: prompts to decontaminate against (None = off).

    Returns:
        (`{shard: kept conversations}`, counts).
    """
    banned = {normalize_prompt(p) for p in eval_prompts or []}
    seen: set[str] = set()
    keep: dict[int, list[Conversation]] = {}
    report = DedupReport(duplicates=0, contaminated=0, kept=0)
    for shard, rows in shards:
        kept = keep.setdefault(shard, [])
        for row in rows:
            key = normalize_prompt(first_user_prompt(row))
            if key in banned:
                report.contaminated += 1
            elif dedup and key in seen:
                report.duplicates += 1
            else:
                seen.add(key)
                kept.append(row)
                report.kept += 1
    return keep, report


@stage("dedup", queue="prep", timeout_s=HOUR_S, after=("prep",))
def dedup_stage(ctx: StageContext) -> ShardResult:
    """First-prompt dedup and MT-Bench decontamination over every prep shard."""
    store, cfg = ctx.store, ctx.recipe.prep
    n = store.plan.num_shards()
    shards = ((s, store.prep.conversations(s)) for s in range(n))
    keep, report = select(shards, cfg.dedup, mtbench_first_turns() if cfg.decontaminate else None)
    files = store.dedup.write(keep, report)
    return ShardResult(report.model_dump(), files)
