"""The split stage: the held-out conversations, chosen once per run.

Chosen from the deduplicated conversations before any target generation, with `train.seed`
and `train.val_fraction`: a seeded permutation of the conversation ids (in dedup order),
its last `round(n * val_fraction)` held out, at least one when `val_fraction > 0` and there
are two or more. The held-out conversations are regenerated and extracted like the others,
but the trainer only validates on them, `eyrie tau` scores on them, and the `heldout`
benchmark sends their first prompts (written here, cut before the first assistant turn).
"""

from __future__ import annotations

import numpy as np

from shared.records import Conversation, Split
from shared.stage import HOUR_S, ShardResult, StageContext, stage


def held_out(ids: list[str], val_fraction: float, seed: int) -> list[str]:
    """The ids held out of `ids` (see the module docstring), in permutation order."""
    perm = np.random.default_rng(seed).permutation(len(ids))
    n_val = round(len(ids) * val_fraction)
    if val_fraction > 0 and len(ids) >= 2:
        n_val = max(n_val, 1)
    return [ids[i] for i in perm[len(ids) - n_val :]] if n_val else []


def first_prompt(conv: Conversation) -> Conversation | None:
    """The conversation up to its first assistant turn; None without a user turn there."""
    head = []
    for m in conv.messages:
        if m.role == "assistant":
            break
        head.append(m)
    if not any(m.role == "user" for m in head):
        return None
    return conv.model_copy(update={"messages": head})


@stage("split", queue="prep", timeout_s=HOUR_S, after=("dedup",))
def split_stage(ctx: StageContext) -> ShardResult:
    """Choose the validation conversations; write them and their benchmark prompts."""
    store, cfg = ctx.store, ctx.recipe.train
    convs = [c for s in range(store.plan.num_shards()) for c in store.dedup.conversations(s)]
    val = held_out([c.id for c in convs], cfg.val_fraction, cfg.seed)
    by_id = {c.id: c for c in convs}
    prompts = [p for p in (first_prompt(by_id[i]) for i in val) if p is not None]
    split = Split(
        seed=cfg.seed, val_fraction=cfg.val_fraction, conversations=len(convs), val_ids=val
    )
    files = store.split.write(split, prompts)
    counts = {"conversations": len(convs), "val": len(val), "heldout_prompts": len(prompts)}
    return ShardResult(counts, files)
