"""The vocab stage: loss-masked token counts → the draft vocabulary (d2t / t2d) + coverage.

It reads every tokenized shard, counts the target ids under `loss_mask == 1` in the
training split (held-out conversations are not counted: nothing of them reaches training),
selects the draft vocabulary and writes `vocab/` (`shared.artifacts.VocabArtifacts`).

Invariants: the selection, the d2t/t2d construction and the checks are `shared.conventions`
(§3): top `draft_vocab_size` by count, ties by lower id, padded with the lowest unused ids,
ascending; d2t holds offsets. `draft.draft_vocab_size: auto` takes the fewest ids reaching
`draft.vocab_coverage` with the tokenizer's special ids pinned
(`shared.conventions.auto_draft_vocab_size`); the manifest counts the head rows and weights
saved against a full-vocabulary head. Nothing here re-implements them. Only loss-masked tokens are
counted: the draft predicts assistant tokens.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from shared.artifacts import RunStore
from shared.conventions import (
    auto_draft_vocab_size,
    build_d2t_t2d,
    check_d2t_t2d,
    coverage,
    select_draft_vocab,
)
from shared.errors import ArtifactError
from shared.records import Coverage, LeftOutToken
from shared.stage import HOUR_S, ShardResult, StageContext, stage
from shared.target import target_config
from shared.tokenizer import load_tokenizer

log = logging.getLogger("eyrie.vocab")

#: How many of the most frequent left-out tokens the coverage report lists.
TOP_LEFT_OUT = 20


def count_shard(store: RunStore, shard: int, target_vocab: int, skip: set[str]) -> np.ndarray:
    """int64 `[target_vocab]` counts of the ids under `loss_mask == 1` in one shard.

    Args:
        skip: conversation ids not to count (the held-out split).

    Raises:
        ArtifactError: a row's ids and mask differ in length, or an id is outside the target
            vocab; the message names the shard, the row and the field.
    """
    path = store.tokenize.dataset_path(shard)
    ds = store.tokenize.dataset(shard)
    picked: list[np.ndarray] = []
    for row, item in enumerate(ds):
        if item["conversation_id"] in skip:
            continue
        ids, mask = np.asarray(item["input_ids"]), np.asarray(item["loss_mask"])
        if ids.shape != mask.shape:
            raise ArtifactError(
                f"{path} row {row}: loss_mask has {mask.shape[0]} entries but input_ids has "
                f"{ids.shape[0]}; re-run the tokenize stage"
            )
        sel = ids[mask.astype(bool)].astype(np.int64)
        if sel.size and (sel.min() < 0 or sel.max() >= target_vocab):
            bad = int(sel.max()) if sel.max() >= target_vocab else int(sel.min())
            raise ArtifactError(
                f"{path} row {row} field input_ids: id {bad} is outside the target vocab "
                f"[0, {target_vocab}); the shard was tokenized with another tokenizer"
            )
        picked.append(sel)
    # One bincount per shard: a per-row bincount would allocate a full vocab array per row.
    all_ids = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
    return np.bincount(all_ids, minlength=target_vocab).astype(np.int64)


def count_tokens(store: RunStore, target_vocab: int) -> np.ndarray:
    """Loss-masked token counts of the training split over every shard, `[target_vocab]`."""
    skip = store.split.val_ids()
    freq = np.zeros(target_vocab, dtype=np.int64)
    for shard in range(store.plan.num_shards()):
        freq += count_shard(store, shard, target_vocab, skip)
    return freq


def coverage_report(
    freq: np.ndarray, t2d: np.ndarray, tokenizer: Any | None, top: int = TOP_LEFT_OUT
) -> Coverage:
    """The coverage report: the share covered, sizes, and the most frequent left-out tokens.

    Args:
        freq: int64 `[target_vocab]` loss-masked counts.
        t2d: bool `[target_vocab]` draft-vocab mask.
        tokenizer: decodes left-out ids to text; None leaves `text` out.
        top: how many left-out tokens to list.

    Returns:
        shares are fractions of assistant-token occurrences.
    """
    total = int(freq.sum())
    left = np.where(~t2d & (freq > 0))[0]
    order = left[np.lexsort((left, -freq[left]))][:top]
    return Coverage(
        coverage=coverage(freq, t2d),
        target_vocab=int(freq.shape[0]),
        draft_vocab=int(t2d.sum()),
        assistant_tokens=total,
        distinct_seen=int((freq > 0).sum()),
        left_out_tokens=int(freq[left].sum()),
        left_out_distinct=int(left.size),
        top_left_out=[
            LeftOutToken(
                id=int(i),
                text=tokenizer.decode([int(i)]) if tokenizer is not None else None,
                count=int(freq[i]),
                share=float(freq[i] / total) if total else 0.0,
            )
            for i in order
        ],
    )


@stage("vocab", queue="prep", timeout_s=HOUR_S, after=("tokenize", "split"))
def vocab_stage(ctx: StageContext) -> ShardResult:
    """Build the draft vocabulary from the training split's assistant tokens.

    Raises:
        ArtifactError: a tokenized shard is missing or malformed.
        ConfigError: draft.draft_vocab_size exceeds the target vocab.
        ContractMismatchError: d2t/t2d break an invariant (a bug, never user input).
    """
    recipe = ctx.recipe
    tcfg = target_config(recipe)
    target_vocab = int(tcfg["vocab_size"])
    freq = count_tokens(ctx.store, target_vocab)
    tok = load_tokenizer(recipe)
    pinned: list[int] = []
    if recipe.draft.draft_vocab_size == "auto":
        pinned = sorted(i for i in set(tok.all_special_ids) if 0 <= i < target_vocab)
        draft_vocab = auto_draft_vocab_size(freq, recipe.draft.vocab_coverage, pinned)
    else:
        draft_vocab = recipe.draft.draft_vocab_size
    d2t, t2d = build_d2t_t2d(select_draft_vocab(freq, draft_vocab, pinned).tolist(), target_vocab)
    check_d2t_t2d(d2t, t2d, draft_vocab)
    report = coverage_report(freq, t2d, tok)
    log.info(
        "draft vocab %d of %d covers %.4f of %d assistant tokens",
        draft_vocab,
        target_vocab,
        report.coverage,
        report.assistant_tokens,
    )
    files = ctx.store.vocab.write(freq, d2t, t2d, report)
    counts = {
        "assistant_tokens": report.assistant_tokens,
        "distinct_seen": report.distinct_seen,
        "target_vocab": target_vocab,
        "draft_vocab": draft_vocab,
        "covered_tokens": report.assistant_tokens - report.left_out_tokens,
        "pinned_special_tokens": len(pinned),
        # The draft head is [draft_vocab, H]: each row left out saves H weights and 2H
        # FLOPs per drafted token against a full-vocabulary head.
        "head_rows_saved": target_vocab - draft_vocab,
        "head_params_saved": (target_vocab - draft_vocab) * int(tcfg["hidden_size"]),
    }
    return ShardResult(counts, files, {"coverage": report.coverage})
