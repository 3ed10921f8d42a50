"""The tokenize stage: conversations → training rows (`input_ids` + `loss_mask`).

Two inputs:
- without regeneration, the deduplicated conversations: rendered with the target's chat
  template and masked (`services.prep.template`);
- regenerated conversations: the server's own ids. `input_ids` = last turn's
  `prompt_token_ids` + `completion_token_ids`; mask 1 on the completion. Each kept draw
  of a conversation is a sample (`<id>#s<draw>` past the first draw) of that conversation. vLLM includes the
  stop token in `token_ids` when it stops on EOS; if `finish_reason == "stop"` and the
  completion does not end with the end-of-turn id, that id is appended (mask 1), counted.
  Earlier assistant turns inside the prompt get the local prefix-render mask only if the
  local render's ids equal the server's prompt ids; otherwise they get 0 (counted
  `prompt_render_mismatch`), so a local and a server tokenization are never mixed.

Then truncation to `prep.max_len_tokens` (counted) and the `0 < mask.sum() < len` check
(dropped and counted per reason in the shard's report).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from services.prep.formats import RowRejected
from services.prep.template import check_mask, mask_spans, tokenize_spans, turn_end
from shared.artifacts import TokenizedSample
from shared.records import Conversation, RegenRecord
from shared.stage import HOUR_S, PER_PLAN_SHARD, ShardResult, StageContext, stage
from shared.tokenizer import load_tokenizer

#: Conversations rendered and tokenized per tokenizer batch call.
TOKENIZE_BATCH = 64


def finish(sample: TokenizedSample, max_len: int, counts: Counter) -> TokenizedSample:
    """Truncate to `max_len` (counted) and check the mask.

    Raises:
        RowRejected: no trainable token left (e.g. after truncation), or all tokens trainable.
    """
    if len(sample.input_ids) > max_len:
        counts["truncated"] += 1
        sample.input_ids = sample.input_ids[:max_len]
        sample.loss_mask = sample.loss_mask[:max_len]
    check_mask(sample.loss_mask, sample.id)
    return sample


def from_conversations(
    tok: Any, rows: list[Conversation], kwargs: dict, max_len: int, counts: Counter
) -> list[TokenizedSample]:
    """Render, mask and tokenize conversations in one tokenizer batch.

    Rejected rows are counted in `counts["dropped:<reason>"]`.
    """
    texts, spans, kept = [], [], []
    for row in rows:
        try:
            text, sp = mask_spans(tok, row.chat_messages(), kwargs, row.tools)
        except RowRejected as e:
            counts[f"dropped:{e.reason}"] += 1
            continue
        texts.append(text)
        spans.append(sp)
        kept.append(row)
    out = []
    for row, (ids, mask) in zip(kept, tokenize_spans(tok, texts, spans), strict=True):
        try:
            out.append(
                finish(TokenizedSample(row.id, row.id, row.source, ids, mask), max_len, counts)
            )
        except RowRejected as e:
            counts[f"dropped:{e.reason}"] += 1
    return out


def _regen_prompt_mask(
    tok: Any, rec: RegenRecord, turn: int, prompt: list[int], kwargs: dict, counts: Counter
) -> list[int]:
    msgs = rec.messages
    asst = [i for i, m in enumerate(msgs) if m.role == "assistant"]
    if turn >= len(asst):
        raise RowRejected(
            "regen_turns_mismatch", "turns", f"{turn + 1} turns but {len(asst)} assistant messages"
        )
    try:
        head = [m.chat_dict() for m in msgs[: asst[turn]]]
        text, spans = mask_spans(tok, head, kwargs, rec.tools, True)
        ((ids, mask),) = tokenize_spans(tok, [text], [spans])
    except RowRejected:
        ids, mask = [], []
    if ids == prompt:
        return mask
    counts["prompt_render_mismatch"] += 1
    return [0] * len(prompt)


def from_regen(
    tok: Any, rec: RegenRecord, kwargs: dict, max_len: int, counts: Counter
) -> TokenizedSample:
    """One regenerated conversation → a sample built from the server's token ids.

    Raises:
        RowRejected: no turns, or the mask check fails.
    """
    if not rec.turns:
        raise RowRejected("regen_no_turns", "turns")
    last = rec.turns[-1]
    prompt = [int(x) for x in last.prompt_token_ids]
    completion = [int(x) for x in last.completion_token_ids]
    eot = turn_end(tok, kwargs).token_id
    if (
        last.finish_reason == "stop"
        and eot is not None
        and (not completion or completion[-1] != eot)
    ):
        completion.append(eot)
        counts["eot_appended"] += 1
    prompt_mask = _regen_prompt_mask(tok, rec, len(rec.turns) - 1, prompt, kwargs, counts)
    # Several draws of one conversation share its id (the split holds them out together).
    sid = f"{rec.id}#s{rec.sample}" if rec.sample else rec.id
    sample = TokenizedSample(
        sid, rec.id, rec.source, prompt + completion, prompt_mask + [1] * len(completion)
    )
    return finish(sample, max_len, counts)


def token_stats(samples: list[TokenizedSample]) -> dict[str, Any]:
    """Samples, tokens and assistant tokens, in total and per source dataset."""
    per: dict[str, dict[str, int]] = {}
    for s in samples:
        d = per.setdefault(s.source, {"samples": 0, "tokens": 0, "assistant_tokens": 0})
        d["samples"] += 1
        d["tokens"] += len(s.input_ids)
        d["assistant_tokens"] += sum(s.loss_mask)
    total = {k: sum(d[k] for d in per.values()) for k in ("samples", "tokens", "assistant_tokens")}
    return {**total, "per_source": dict(sorted(per.items()))}


def _samples(ctx: StageContext, tok: Any, counts: Counter) -> list[TokenizedSample]:
    recipe, store = ctx.recipe, ctx.store
    kwargs, max_len = recipe.target.chat_template_kwargs, recipe.prep.max_len_tokens
    rows: list[Any] = (
        store.regen.records(ctx.shard)
        if recipe.regen.enabled
        else store.dedup.conversations(ctx.shard)
    )
    counts["rows_in"] = len(rows)
    out: list[TokenizedSample] = []
    with ctx.progress(len(rows), "rows") as bar:
        for i in range(0, len(rows), TOKENIZE_BATCH):
            batch = rows[i : i + TOKENIZE_BATCH]
            if recipe.regen.enabled:
                for rec in batch:
                    try:
                        out.append(from_regen(tok, rec, kwargs, max_len, counts))
                    except RowRejected as e:
                        counts[f"dropped:{e.reason}"] += 1
            else:
                out += from_conversations(tok, batch, kwargs, max_len, counts)
            bar.update(len(batch))
    return out


def warm() -> None:
    """Import transformers and datasets, and load `EYRIE_PREP_TOKENIZERS`, before forking.

    rq's forking worker runs every job in a fresh fork; importing transformers and datasets
    costs 3-10 s on 2 busy cores, which every tokenize job would pay. Tokenizers named in
    `EYRIE_PREP_TOKENIZERS` (folders, separated by `os.pathsep`) go into the loader's cache,
    saving ~1-2 s per job; loading does not start the Rust thread pool, so forking is safe.
    """
    import os

    import datasets  # noqa: F401
    import transformers  # noqa: F401

    from shared.tokenizer import TokenizerSpec

    for path in filter(None, os.environ.get("EYRIE_PREP_TOKENIZERS", "").split(os.pathsep)):
        load_tokenizer(TokenizerSpec(path))


@stage(
    "tokenize",
    queue="prep",
    timeout_s=HOUR_S,
    shards=PER_PLAN_SHARD,
    after=("regen", "dedup"),
    warm=warm,
)
def tokenize_stage(ctx: StageContext) -> ShardResult:
    """Render, mask and tokenize one shard (regenerated, or deduplicated conversations)."""
    recipe = ctx.recipe
    tok = load_tokenizer(recipe)
    counts: Counter = Counter()
    samples = _samples(ctx, tok, counts)
    report = {
        **token_stats(samples),
        **dict(sorted(counts.items())),
        "kept": len(samples),
        "max_len_tokens": recipe.prep.max_len_tokens,
        "chat_template_kwargs": recipe.target.chat_template_kwargs,
        "input": "regen" if recipe.regen.enabled else "dedup",
    }
    files = ctx.store.tokenize.write(ctx.shard, samples, report)
    numeric = {k: v for k, v in report.items() if isinstance(v, int)}
    return ShardResult(numeric, files, {"per_source": report["per_source"]})


def run_stats(store: Any) -> dict[str, Any]:
    """Run-level totals over every finished tokenize shard, per source dataset too."""
    total: dict[str, Any] = {"samples": 0, "tokens": 0, "assistant_tokens": 0, "per_source": {}}
    for m in store.manifests("tokenize"):
        for k in ("samples", "tokens", "assistant_tokens"):
            total[k] += m.counts.get(k, 0)
        for src, d in m.extra.get("per_source", {}).items():
            agg = total["per_source"].setdefault(src, dict.fromkeys(d, 0))
            for k, v in d.items():
                agg[k] += v
    return total
