"""Exact-duplicate removal and eval decontamination, keyed by the normalized first prompt.

Normalization: Unicode NFKC, case-folded, whitespace runs collapsed to one space, stripped.
Dedup keeps the first occurrence in (shard, row) order, so the result does not depend on
which worker wrote which shard. Decontamination drops rows whose normalized first user
prompt equals a normalized eval prompt (MT-Bench first turns by default).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Any


def normalize_prompt(text: str) -> str:
    """The dedup key of a prompt: NFKC, casefold, collapsed whitespace."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def first_user_prompt(messages: list[dict[str, Any]]) -> str:
    """Content of the first user message ("" if none)."""
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def select(
    shards: Iterable[tuple[int, list[dict[str, Any]]]],
    dedup: bool,
    eval_prompts: Iterable[str] | None,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Choose the rows to keep.

    Args:
        shards: `(shard, rows)` in shard order; rows are canonical prep records.
        dedup: drop later rows whose key was seen.
        eval_prompts: prompts to decontaminate against (None = off).

    Returns:
        (`{"<shard>": [kept row indices]}`, `{"duplicates", "contaminated", "kept"}`).
    """
    banned = {normalize_prompt(p) for p in eval_prompts or []}
    seen: set[str] = set()
    keep: dict[str, list[int]] = {}
    report = {"duplicates": 0, "contaminated": 0, "kept": 0}
    for shard, rows in shards:
        kept = keep.setdefault(str(shard), [])
        for i, row in enumerate(rows):
            key = normalize_prompt(first_user_prompt(row["messages"]))
            if key in banned:
                report["contaminated"] += 1
            elif dedup and key in seen:
                report["duplicates"] += 1
            else:
                seen.add(key)
                kept.append(i)
                report["kept"] += 1
    return keep, report
