"""The tokenize stage: conversations → training rows (`input_ids` + `loss_mask`).

Two inputs:
- without regeneration, the deduplicated conversations: rendered with the target's chat
  template and masked (`services.prep.template`);
- regenerated conversations: the server's own ids. `input_ids` = last turn's
  `prompt_token_ids` + `completion_token_ids`; mask 1 on the completion. Each kept draw
  of a conversation is a sample (`<id>#s<draw>` past the first draw). vLLM includes the
  stop token in `token_ids` when it stops on one; a completion ending with any of the
  target's stop ids (generation config + tokenizer + template end-of-turn: Llama-3.1's
  `<|eom_id|>` as much as `<|eot_id|>`) is kept as is, nothing appended after it; only a
  `stop` finish with no stop id at all gets the end-of-turn id appended (mask 1), counted.
  Earlier assistant turns inside the prompt get the local prefix-render mask only if the
  local render's ids equal the server's prompt ids; otherwise they get 0 (counted
  `prompt_render_mismatch`), so a local and a server tokenization are never mixed. The server
  round trip (`server_round_trip`) checks every earlier turn: where the server's next prompt
  does not hold the ids it sampled, each earlier turn is trained from its own prompt and
  completion instead.

Then truncation to `prep.max_len_tokens` (counted) and the `0 < mask.sum() < len` check
(dropped and counted per reason in the shard's report, which lists the first
`DROPPED_LISTED` dropped rows by id, reason, field and detail: the stage's quarantine).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from services.prep.formats import RowRejected
from services.prep.template import (
    Rendered,
    check_mask,
    mask_spans,
    prefix_turn,
    render_turns,
    tokenize_rendered,
    tokenize_spans,
    turn_end,
)
from shared.artifacts import TokenizedSample
from shared.records import Conversation, RegenRecord, RegenTurn
from shared.stage import HOUR_S, PER_PLAN_SHARD, ShardResult, StageContext, stage
from shared.tokenizer import load_tokenizer, stop_ids

#: Conversations rendered and tokenized per tokenizer batch call.
TOKENIZE_BATCH = 64

#: Dropped rows listed by id, reason, field and detail in a shard's report (all are counted).
DROPPED_LISTED = 200


class Tally(Counter):
    """Counts per reason, and the first `DROPPED_LISTED` dropped rows (the quarantine list)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[dict[str, str]] = []


def drop(counts: Counter, e: RowRejected, sample_id: str) -> None:
    """Count a dropped row or sample under `dropped:<reason>`, and list it in a `Tally`."""
    counts[f"dropped:{e.reason}"] += 1
    if isinstance(counts, Tally) and len(counts.dropped) < DROPPED_LISTED:
        counts.dropped.append(
            {"id": sample_id, "reason": e.reason, "field": e.field, "detail": e.detail}
        )


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


def _renders(
    tok: Any, row: Conversation, kwargs: dict, rewritten: str, counts: Counter
) -> list[tuple[str, Rendered]]:
    """`(sample id, render)` of one conversation.

    The whole conversation, and with policy 'prefix' one prefix render per turn the template
    rewrites once later turns exist.
    """
    msgs = row.chat_messages()
    whole = render_turns(tok, msgs, kwargs, row.tools)
    if whole.normalized:
        counts[whole.normalized] += 1
    out = [(row.id, whole)]
    for i in whole.rewritten:
        counts[f"rewritten_turn_{'prefix_sample' if rewritten == 'prefix' else 'masked'}"] += 1
        if rewritten == "prefix":
            turn = sum(m["role"] == "assistant" for m in msgs[:i])  # as regen numbers turns
            out.append((f"{row.id}#{turn}", prefix_turn(tok, msgs, i, kwargs, row.tools)))
    return out


def from_conversations(
    tok: Any,
    rows: list[Conversation],
    kwargs: dict,
    max_len: int,
    counts: Counter,
    rewritten: str = "prefix",
) -> list[TokenizedSample]:
    """Render, mask and tokenize conversations in one tokenizer batch.

    Each sample passes the template round trip (its trained tokens decode to show each turn's
    content, kept reasoning and tool calls). Rejected rows and samples are counted in
    `counts["dropped:<reason>"]`; turns the template rewrites follow `rewritten`
    (`prep.rewritten_turns`).
    """
    renders: list[tuple[Conversation, str, Rendered]] = []
    for row in rows:
        try:
            renders += [(row, sid, r) for sid, r in _renders(tok, row, kwargs, rewritten, counts)]
        except RowRejected as e:
            drop(counts, e, row.id)
    out = []
    done = tokenize_rendered(tok, [r for _, _, r in renders])
    for (row, sid, _), (ids, mask, problem) in zip(renders, done, strict=True):
        try:
            if problem:
                raise RowRejected(problem, sid)
            out.append(finish(TokenizedSample(sid, row.id, row.source, ids, mask), max_len, counts))
        except RowRejected as e:
            drop(counts, e, sid)
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


def server_round_trip(turns: list[RegenTurn]) -> list[int]:
    """The server round trip: the regenerated turns whose sampled ids the next prompt lacks.

    Turn j passes when turn j+1's prompt ids (the server's own render of the conversation so
    far) start with turn j's prompt ids followed by every id turn j sampled, its stop id
    included. A turn fails where the template rewrites it (Qwen3 drops its reasoning), closes
    it with another stop id (Llama-3.1 `<|eom_id|>` re-rendered as `<|eot_id|>`), or the
    server re-tokenizes its text into other ids.

    Returns:
        Indices j < len(turns) - 1 of the failing turns, ascending.
    """
    bad = []
    for j in range(len(turns) - 1):
        sampled = [*turns[j].prompt_token_ids, *turns[j].completion_token_ids]
        if list(turns[j + 1].prompt_token_ids[: len(sampled)]) != sampled:
            bad.append(j)
    return bad


def _completion(
    turn: RegenTurn, eot: int | None, stops: frozenset[int], counts: Counter
) -> list[int]:
    """A turn's sampled ids as trained.

    Kept as the server returned them, ending with the stop id it stopped on; the end-of-turn
    id is appended only where a `stop` finish returned no stop id at all (`eot_appended`).
    """
    ids = [int(x) for x in turn.completion_token_ids]
    if ids and ids[-1] in stops:
        if ids[-1] != eot:
            counts[f"stopped_on:{ids[-1]}"] += 1
    elif turn.finish_reason == "stop" and eot is not None:
        ids.append(eot)
        counts["eot_appended"] += 1
    return ids


def from_regen(
    tok: Any,
    rec: RegenRecord,
    kwargs: dict,
    max_len: int,
    counts: Counter,
    stops: frozenset[int] = frozenset(),
) -> list[TokenizedSample]:
    """One regenerated conversation → samples built from the server's token ids only.

    The last turn's prompt + completion is one sample. Earlier turns are trained inside its
    prompt (local prefix-render mask, when the local render equals the server's prompt ids)
    if every one passes `server_round_trip`; otherwise the prompt is masked 0 and each earlier
    turn becomes its own sample `<id>#<turn>` of its prompt + completion, exactly as the
    server produced them (counted `server_round_trip_failed`, `turn_samples`).

    Args:
        stops: every id the server stops on (`shared.tokenizer.stop_ids`); the template's
            end-of-turn is among them.

    Raises:
        RowRejected: no turns, or the last sample fails the mask check. Earlier-turn samples
            that fail it are counted as dropped.
    """
    if not rec.turns:
        raise RowRejected("regen_no_turns", "turns")
    eot = turn_end(tok, kwargs).token_id
    stops = stops | ({eot} if eot is not None else set())
    last = rec.turns[-1]
    prompt = [int(x) for x in last.prompt_token_ids]
    # Several draws of one conversation share its id (the split holds them out together).
    sid = f"{rec.id}#s{rec.sample}" if rec.sample else rec.id
    completion = _completion(last, eot, stops, counts)
    bad = server_round_trip(rec.turns)
    out = []
    if bad:
        counts["server_round_trip_failed"] += len(bad)
        prompt_mask = [0] * len(prompt)
        for j, turn in enumerate(rec.turns[:-1]):
            p = [int(x) for x in turn.prompt_token_ids]
            c = _completion(turn, eot, stops, counts)
            sample = TokenizedSample(
                f"{sid}#{j}", rec.id, rec.source, p + c, [0] * len(p) + [1] * len(c)
            )
            try:
                out.append(finish(sample, max_len, counts))
                counts["turn_samples"] += 1
            except RowRejected as e:
                drop(counts, e, sample.id)
    else:
        prompt_mask = _regen_prompt_mask(tok, rec, len(rec.turns) - 1, prompt, kwargs, counts)
    sample = TokenizedSample(
        sid, rec.id, rec.source, prompt + completion, prompt_mask + [1] * len(completion)
    )
    return [finish(sample, max_len, counts), *out]


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
    stops = stop_ids(recipe, tok, turn_end(tok, kwargs).token_id)
    out: list[TokenizedSample] = []
    with ctx.progress(len(rows), "rows") as bar:
        for i in range(0, len(rows), TOKENIZE_BATCH):
            batch = rows[i : i + TOKENIZE_BATCH]
            if recipe.regen.enabled:
                for rec in batch:
                    try:
                        out += from_regen(tok, rec, kwargs, max_len, counts, stops)
                    except RowRejected as e:
                        drop(counts, e, rec.id)
            else:
                out += from_conversations(
                    tok, batch, kwargs, max_len, counts, recipe.prep.rewritten_turns
                )
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
    counts = Tally()
    samples = _samples(ctx, tok, counts)
    report = {
        **token_stats(samples),
        **dict(sorted(counts.items())),
        "dropped_rows": counts.dropped,
        "kept": len(samples),
        "max_len_tokens": recipe.prep.max_len_tokens,
        "chat_template_kwargs": recipe.target.chat_template_kwargs,
        "input": "regen" if recipe.regen.enabled else "dedup",
    }
    files = ctx.store.tokenize.write(ctx.shard, samples, report)
    numeric = {k: v for k, v in report.items() if isinstance(v, int)}
    return ShardResult(numeric, files, {"per_source": report["per_source"]})


def run_stats(store: Any) -> dict[str, Any]:
    """Run-level totals over every finished tokenize shard, per source dataset too.

    `skipped_by_source` adds up the prep shards' skip reasons per source dataset (rows
    quarantined by prep: not UTF-8, bad JSON, no assistant turn, ...).
    """
    total: dict[str, Any] = {
        "samples": 0,
        "tokens": 0,
        "assistant_tokens": 0,
        "per_source": {},
        "skipped_by_source": {},
    }
    for m in store.manifests("prep"):
        for src, reasons in m.extra.get("report", {}).get("skipped_by_source", {}).items():
            agg = total["skipped_by_source"].setdefault(src, {})
            for reason, n in reasons.items():
                agg[reason] = agg.get(reason, 0) + n
    for m in store.manifests("tokenize"):
        for k in ("samples", "tokens", "assistant_tokens"):
            total[k] += m.counts.get(k, 0)
        for src, d in m.extra.get("per_source", {}).items():
            agg = total["per_source"].setdefault(src, dict.fromkeys(d, 0))
            for k, v in d.items():
                agg[k] += v
    return total


def regen_tokenizer_checks(store: Any) -> dict[str, int] | None:
    """The regen shards' tokenizer checks (local vs the server's `/tokenize`), summed.

    Returns:
        `{shards, unchecked, rows, prompt_tokens, text_tokens, rejected}` over the finished
        regen shards (`unchecked`: shards whose manifest has no check, i.e. made before it
        existed), or None when no regen shard has finished. A shard whose check failed has
        no manifest: it is not here.
    """
    manifests = store.manifests("regen")
    if not manifests:
        return None
    out = dict.fromkeys(
        ("shards", "unchecked", "rows", "prompt_tokens", "text_tokens", "rejected"), 0
    )
    for m in manifests:
        check = m.extra.get("tokenizer_check")
        out["shards"] += 1
        if check is None:
            out["unchecked"] += 1
            continue
        out["rows"] += len(check["rows"])
        out["rejected"] += len(check["rejected"])
        out["prompt_tokens"] += check["prompt_tokens"]
        out["text_tokens"] += check["text_tokens"]
    return out


#: Tokenize report counts that are totals or settings, not reasons.
_NOT_REASONS = frozenset(
    {"samples", "tokens", "assistant_tokens", "kept", "rows_in", "max_len_tokens"}
)


def run_reasons(store: Any) -> dict[str, dict[str, int]]:
    """Every counted reason of a run, per stage, summed over shards.

    - prep: rows quarantined per reason, realignments, and message fields read under an
      alias or not known (`PrepReport`);
    - regen: rows not regenerated per status and reason, early stops, length-cut turns;
    - tokenize: samples dropped per reason (template cannot render tool calls, template
      round trip, mask checks), truncations, rewritten turns, server round-trip failures,
      stop ids other than the end-of-turn, content forms normalized.

    Returns:
        `{stage: {reason: count}}` with only non-zero counts, keys sorted.
    """
    out: dict[str, Counter] = {"prep": Counter(), "regen": Counter(), "tokenize": Counter()}
    for m in store.manifests("prep"):
        rep = m.extra.get("report", {})
        for group in ("skipped", "realigned", "fields"):
            out["prep"].update({f"{group}:{k}": v for k, v in rep.get(group, {}).items()})
    for m in store.manifests("regen"):
        out["regen"].update({k: v for k, v in m.counts.items() if ":" in k or k == "finish_length"})
    for m in store.manifests("tokenize"):
        out["tokenize"].update({k: v for k, v in m.counts.items() if k not in _NOT_REASONS})
    return {st: {k: v for k, v in sorted(c.items()) if v} for st, c in out.items()}
