"""The regen stage: re-answer each shard's deduplicated conversations with the target.

Runs on rq queue `regen` while the baseline server is up (the stage declares it). Reads
`dedup/shard-N.jsonl`; writes `regen/shard-N.jsonl` (successes) and `shard-N.errors.jsonl`
(errors and skips), both sorted by row (`shared.artifacts.RegenArtifacts`).

Before generating, the shard's first conversations are tokenized locally and by the server's
`/tokenize`; a difference refuses the shard (`services.regen.tokcheck`), a match is recorded
in the manifest (`extra.tokenizer_check`).

Invariants:
- durability per row: each outcome is appended to the shard's resume files and fsynced
  before the next is counted; a resumed job skips every row found there and drops a torn
  last line;
- the server being down is not a row error: when retries are spent the job fails without a
  manifest, and its rerun resumes;
- accounting in the manifest: success + error + skipped == input (rows); with
  `regen.samples_per_prompt` > 1 a row may give several records (`sample` = draw index,
  counted in `samples`), written and fsynced together.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO

from services.regen.client import ChatClient
from services.regen.conversation import ERROR, SKIPPED, SUCCESS, Outcome, Regenerator
from services.regen.quality import AnswerPolicy
from services.regen.tokcheck import TokenizerCheck, check_tokenizer
from shared.errors import ArtifactError, ServiceUnavailableError
from shared.recipe import Recipe
from shared.records import Conversation, RegenFailure, RegenRecord
from shared.sizing import regen_request_timeout_s
from shared.stage import HOUR_S, PER_PLAN_SHARD, ShardResult, StageContext, stage
from shared.vllm import api_key, served_model_name


class RowWriter:
    """Appends one JSON line per outcome and fsyncs it (the resume point)."""

    def __init__(self, ok_path: Path, err_path: Path):
        ok_path.parent.mkdir(parents=True, exist_ok=True)
        self.ok: IO[str] = open(ok_path, "a")
        self.err: IO[str] = open(err_path, "a")

    def write(self, record: RegenRecord | RegenFailure) -> None:
        self.write_all([record])

    def write_all(self, records: list[RegenRecord | RegenFailure]) -> None:
        """Append one row's records, then fsync (a torn last line is dropped on resume)."""
        for record in records:
            f = self.ok if isinstance(record, RegenRecord) else self.err
            f.write(record.model_dump_json(exclude_none=True) + "\n")
        for f in (self.ok, self.err):
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        self.ok.close()
        self.err.close()


def success_record(
    idx: int,
    row: Conversation,
    out: Outcome,
    recipe: Recipe,
    client: ChatClient,
    sample: int = 0,
    failed_draws: list[str] | None = None,
) -> RegenRecord:
    """The `regen/shard-N.jsonl` record of one kept draw of a regenerated row."""
    first = out.results[0]
    return RegenRecord(
        row=idx,
        id=row.id,
        source=row.source,
        messages=out.messages,
        tools=row.tools,
        turns=out.turns,
        stopped=out.reason,
        resampled=out.resampled,
        sample=sample,
        failed_draws=failed_draws or [],
        sampling=client.sampling,
        chat_template_kwargs=client.kwargs,
        server={
            "model": first.model,
            "url": client.url,
            "fingerprint": first.fingerprint,
            "target": recipe.target.path,
        },
    )


def error_record(idx: int, row: Conversation, out: Outcome) -> RegenFailure:
    """The `regen/shard-N.errors.jsonl` record of a row not regenerated."""
    return RegenFailure(
        row=idx,
        id=row.id,
        status=out.status,  # type: ignore[arg-type]
        reason=out.reason,
        detail=out.detail,
    )


def make_client(recipe: Recipe, base_url: str) -> ChatClient:
    """The chat client of the baseline server at `base_url`, with the regen sampling."""
    r = recipe.regen
    return ChatClient(
        base_url,
        served_model_name(recipe),
        {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_tokens},
        recipe.target.chat_template_kwargs,
        regen_request_timeout_s(recipe),
        r.max_retries,
        api_key=api_key(),
    )


def tokenizer_check(recipe: Recipe, rows: list[Conversation], client: ChatClient) -> TokenizerCheck:
    """The shard's check of the local tokenizer against the server's `/tokenize`.

    Raises:
        ConfigError: the two tokenize differently (`services.regen.tokcheck`).
        ServiceUnavailableError: the server cannot be reached.
    """
    from shared.tokenizer import load_tokenizer

    t = recipe.target
    return check_tokenizer(load_tokenizer(recipe), rows, client, t.tokenizer or t.path)


def answer_policy(recipe: Recipe) -> tuple[AnswerPolicy, int]:
    """The regen answer checks and the resample attempts (0 at temperature 0).

    The target tokenizer's special ids are the stop ids stripped before judging repetition.
    """
    from shared.tokenizer import load_tokenizer

    r = recipe.regen
    policy = AnswerPolicy(
        r.max_repeat_share,
        r.repeat_ngram_tokens,
        r.length_cut,
        frozenset(load_tokenizer(recipe).all_special_ids),
    )
    return policy, r.resample_attempts if r.temperature > 0 else 0


def prompt_counter(recipe: Recipe) -> Callable[[list[dict], list | None], int]:
    """`(messages, tools) -> tokens` of the rendered prompt, as the server renders it."""
    from shared.chat import render_ids
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(recipe)
    kwargs = recipe.target.chat_template_kwargs
    return lambda messages, tools: len(render_ids(tok, messages, kwargs, True, tools))


def max_prompt_tokens(recipe: Recipe) -> int:
    """`regen.max_prompt_tokens`, default half of `prep.max_len_tokens` (room to answer)."""
    return recipe.regen.max_prompt_tokens or recipe.prep.max_len_tokens // 2


def row_records(
    idx: int, row: Conversation, outs: list[Outcome], recipe: Recipe, client: ChatClient
) -> list[RegenRecord | RegenFailure]:
    """The records of one row's draws: one per kept draw, or the first draw's failure.

    Draws that failed while another was kept are listed (reasons) on the first kept record.
    """
    kept = [(k, o) for k, o in enumerate(outs) if o.status == SUCCESS]
    if not kept:
        return [error_record(idx, row, outs[0])]
    failed = [o.reason for o in outs if o.status != SUCCESS]
    return [
        success_record(idx, row, o, recipe, client, k, failed if i == 0 else None)
        for i, (k, o) in enumerate(kept)
    ]


async def regenerate_rows(
    todo: list[tuple[int, Conversation]],
    regen: Regenerator,
    on_done: Callable[[int, Conversation, list[Outcome]], None],
    concurrency: int,
    samples: int = 1,
) -> None:
    """Run `regen` over `todo` with at most `concurrency` conversations in flight.

    `on_done(idx, row, outcomes)` is called once per row (its `samples` draws, or one when
    the first draw's skip would repeat), in completion order.

    Raises:
        ServiceUnavailableError: the server is down; the other requests are cancelled.
    """
    sem = asyncio.Semaphore(concurrency)

    async def one(idx: int, row: Conversation) -> None:
        async with sem:
            on_done(idx, row, await regen.run_samples(row, samples))

    try:
        async with asyncio.TaskGroup() as tg:
            for idx, row in todo:
                tg.create_task(one(idx, row))
    except* ServiceUnavailableError as eg:
        raise eg.exceptions[0] from None


def _count(counts: Counter, rec: RegenRecord | RegenFailure) -> None:
    if isinstance(rec, RegenRecord):
        counts["samples"] += 1
        for reason in rec.failed_draws:
            counts[f"draw_quarantined:{reason}"] += 1
        counts["turns"] += len(rec.turns)
        for t in rec.turns:
            counts["prompt_tokens"] += len(t.prompt_token_ids)
            counts["completion_tokens"] += len(t.completion_token_ids)
            counts["finish_length"] += t.finish_reason == "length"
        counts["resampled"] += rec.resampled
        if rec.stopped:
            counts[f"stopped:{rec.stopped}"] += 1
    else:
        counts[rec.status] += 1
        counts[f"{rec.status}:{rec.reason}"] += 1


def accounting(shard: int, n_input: int, ok: list[RegenRecord], bad: list[RegenFailure]) -> Counter:
    """The manifest counts; success + error + skipped must equal the input (in rows).

    `success` counts rows with at least one kept draw, `samples` the kept draws.

    Raises:
        ArtifactError: a row lost or doubled.
    """
    counts: Counter = Counter({"input": n_input, SUCCESS: 0, ERROR: 0, SKIPPED: 0})
    records: list[RegenRecord | RegenFailure] = [*ok, *bad]
    for rec in records:
        _count(counts, rec)
    ok_rows = {r.row for r in ok}
    counts[SUCCESS] = len(ok_rows)
    draws = [(r.row, r.sample) for r in ok]
    bad_rows = [r.row for r in bad]
    doubled = (
        len(set(draws)) != len(draws)
        or len(set(bad_rows)) != len(bad_rows)
        or bool(ok_rows & set(bad_rows))
    )
    if doubled or counts[SUCCESS] + counts[ERROR] + counts[SKIPPED] != n_input:
        raise ArtifactError(
            f"regen shard {shard}: accounting broken: success {counts[SUCCESS]} + error "
            f"{counts[ERROR]} + skipped {counts[SKIPPED]} != input {n_input} (or a row is "
            "doubled); delete the shard's partial files and rerun"
        )
    return counts


def _enabled(recipe: Recipe) -> bool:
    return recipe.regen.enabled


def _baseline(recipe: Recipe, shard: int) -> str:
    return "baseline"


@stage(
    "regen",
    queue="regen",
    timeout_s=6 * HOUR_S,
    shards=PER_PLAN_SHARD,
    after=("dedup",),
    gpu_phase="regen",
    enabled=_enabled,
    server=_baseline,
)
def regen_stage(ctx: StageContext) -> ShardResult:
    """Regenerate one shard through the baseline server; resumable.

    Raises:
        ArtifactError: missing inputs, or broken accounting.
        ConfigError: the local tokenizer does not tokenize as the server does.
        ServiceUnavailableError: the server stayed down through the retries (rerun resumes).
    """
    store, recipe, shard = ctx.store, ctx.recipe, ctx.shard
    art = store.regen
    rows = list(enumerate(store.dedup.conversations(shard)))
    ok, bad = art.read_resume(shard)
    done = {r.row for r in ok} | {r.row for r in bad}
    todo = [(i, row) for i, row in rows if i not in done]
    client = make_client(recipe, ctx.server_url("baseline"))
    check = tokenizer_check(recipe, [row for _, row in rows], client)
    policy, attempts = answer_policy(recipe)
    # Draws at temperature 0 repeat each other: one per conversation.
    samples = recipe.regen.samples_per_prompt if recipe.regen.temperature > 0 else 1
    regen = Regenerator(
        client,
        prompt_counter(recipe),
        recipe.regen.max_turns,
        max_prompt_tokens(recipe),
        policy,
        attempts,
    )
    writer = RowWriter(art.partial_path(shard), art.partial_errors_path(shard))

    def on_done(idx: int, row: Conversation, outcomes: list[Outcome]) -> None:
        recs = row_records(idx, row, outcomes, recipe, client)
        for rec in recs:
            (ok if isinstance(rec, RegenRecord) else bad).append(rec)  # type: ignore[arg-type]
        writer.write_all(recs)
        bar.update(1, ok=len(ok), bad=len(bad))

    with ctx.progress(len(rows), "rows") as bar:
        bar.update(len(done))
        try:
            asyncio.run(_run(todo, regen, on_done, recipe.regen.concurrency, client, samples))
        finally:
            writer.close()
    counts = accounting(shard, len(rows), ok, bad)
    files = art.write(shard, ok, bad)
    # The finished files now hold everything the resume files held (a job killed before
    # its manifest resumes from them).
    art.remove_partial(shard)
    return ShardResult(dict(counts), files, {"tokenizer_check": check.record()})


async def _run(
    todo, regen: Regenerator, on_done, concurrency: int, client: ChatClient, samples: int
) -> None:
    try:
        await regenerate_rows(todo, regen, on_done, concurrency, samples)
    finally:
        await client.aclose()
