"""The regen stage: re-answer each prep shard's conversations with the target.

Runs on rq queue `regen` while the baseline server is up. Reads `prep/shard-N.jsonl` rows
kept by `dedup/keep.json`; writes `regen/shard-N.jsonl` (successes) and
`regen/shard-N.errors.jsonl` (errors and skips), both sorted by input row, then the
manifest. Formats: `shared/artifacts.py`.

Invariants:
- durability per row: each outcome is appended to `shard-N.partial.jsonl` (successes) or
  `shard-N.partial-errors.jsonl` and fsynced before the next is counted; a resumed job
  skips every row found there and drops a torn last line;
- the server being down is not a row error: when retries are spent the job fails without a
  manifest, and its rerun resumes;
- accounting in the manifest: success + error + skipped == input.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from services.regen.client import ChatClient
from services.regen.conversation import ERROR, SKIPPED, SUCCESS, Outcome, Regenerator
from shared.errors import ArtifactError, ServiceUnavailableError
from shared.recipe import Recipe
from shared.store import Manifest, RunStore, atomic_path

STAGE = "regen"
OUT_SUFFIX = ".jsonl"
ERRORS_SUFFIX = ".errors.jsonl"
PARTIAL_SUFFIX = ".partial.jsonl"
PARTIAL_ERRORS_SUFFIX = ".partial-errors.jsonl"


def load_input(store: RunStore, shard: int) -> list[tuple[int, dict[str, Any]]]:
    """The `(row index, row)` pairs of prep shard `shard` that dedup kept.

    Raises:
        ArtifactError: the prep shard or `dedup/keep.json` is missing, or a line is not JSON.
    """
    path = store.shard_path("prep", shard, ".jsonl")
    keep_path = store.root / "dedup" / "keep.json"
    for p in (path, keep_path):
        if not p.is_file():
            raise ArtifactError(f"{p}: missing; run the prep and dedup stages first")
    keep = set(json.loads(keep_path.read_text()).get(str(shard), []))
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i not in keep:
                continue
            try:
                rows.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ArtifactError(f"{path}: row {i} is not JSON ({e})") from e
    return rows


def read_partial(path: Path) -> list[dict[str, Any]]:
    """Records of a partial file; a torn last line (hard kill mid-write) is cut off."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "rb+") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class RowWriter:
    """Appends one JSON line per outcome and fsyncs it (the resume point)."""

    def __init__(self, ok_path: Path, err_path: Path):
        self.ok = open(ok_path, "a")
        self.err = open(err_path, "a")

    def write(self, record: dict[str, Any], success: bool) -> None:
        f = self.ok if success else self.err
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        self.ok.close()
        self.err.close()


def success_record(idx: int, row: dict, out: Outcome, recipe: Recipe, client: ChatClient) -> dict:
    """The `regen/shard-N.jsonl` line of a regenerated row (format: shared/artifacts.py)."""
    first = out.results[0]
    return {
        "row": idx,
        "id": row["id"],
        "source": row.get("source", ""),
        "messages": out.messages,
        "tools": row.get("tools"),
        "turns": out.turns,
        "stopped": out.reason,
        "sampling": client.sampling,
        "chat_template_kwargs": client.kwargs,
        "server": {
            "model": first.model,
            "url": client.url,
            "fingerprint": first.fingerprint,
            "target": recipe.target.path,
        },
    }


def error_record(idx: int, row: dict, out: Outcome) -> dict:
    """The `regen/shard-N.errors.jsonl` line of a row not regenerated."""
    return {
        "row": idx,
        "id": row.get("id"),
        "status": out.status,
        "reason": out.reason,
        "detail": out.detail,
    }


def make_client(recipe: Recipe) -> ChatClient:
    """The chat client of the run's baseline server, with the recipe's sampling params."""
    from services.serve.launcher import auth_headers, base_url, served_model_name

    r = recipe.regen
    return ChatClient(
        base_url(recipe, "baseline"),
        served_model_name(recipe),
        {"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_tokens},
        recipe.target.chat_template_kwargs,
        r.request_timeout_s,
        r.max_retries,
        concurrency=r.concurrency,
        headers=auth_headers(),
    )


def prompt_counter(recipe: Recipe):
    """`(messages, tools) -> tokens` of the rendered prompt, as the server renders it."""
    from services.prep.template import load_tokenizer, render_ids

    tok = load_tokenizer(recipe.target.tokenizer or recipe.target.path)
    kwargs = recipe.target.chat_template_kwargs
    return lambda messages, tools: len(render_ids(tok, messages, kwargs, True, tools))


def max_prompt_tokens(recipe: Recipe) -> int:
    """`regen.max_prompt_tokens`, default half of `prep.max_len_tokens` (room to answer)."""
    return recipe.regen.max_prompt_tokens or recipe.prep.max_len_tokens // 2


async def regenerate_rows(
    todo: list[tuple[int, dict]], regen: Regenerator, on_done, concurrency: int
) -> None:
    """Run `regen` over `todo` with at most `concurrency` conversations in flight.

    `on_done(idx, row, outcome)` is called once per row, in completion order.

    Raises:
        ServiceUnavailableError: the server is down; the other requests are cancelled.
    """
    sem = asyncio.Semaphore(concurrency)

    async def one(idx: int, row: dict) -> None:
        async with sem:
            on_done(idx, row, await regen.run(row))

    try:
        async with asyncio.TaskGroup() as tg:
            for idx, row in todo:
                tg.create_task(one(idx, row))
    except* ServiceUnavailableError as eg:
        raise eg.exceptions[0] from None


def _count(counts: Counter, rec: dict, success: bool) -> None:
    if success:
        counts[SUCCESS] += 1
        counts["turns"] += len(rec["turns"])
        for t in rec["turns"]:
            counts["prompt_tokens"] += len(t["prompt_token_ids"])
            counts["completion_tokens"] += len(t["completion_token_ids"])
            counts["finish_length"] += t["finish_reason"] == "length"
        if rec["stopped"]:
            counts[f"stopped:{rec['stopped']}"] += 1
    else:
        counts[rec["status"]] += 1
        counts[f"{rec['status']}:{rec['reason']}"] += 1


def _write_sorted(path: Path, records: list[dict]) -> Path:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for rec in sorted(records, key=lambda r: r["row"]):
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def finalize(
    store: RunStore, shard: int, n_input: int, ok: list[dict], bad: list[dict]
) -> Manifest:
    """Write the sorted outputs and the manifest; check the accounting.

    Raises:
        ArtifactError: success + error + skipped != input (a row lost or doubled).
    """
    counts: Counter = Counter({"input": n_input, SUCCESS: 0, ERROR: 0, SKIPPED: 0})
    for rec in ok:
        _count(counts, rec, True)
    for rec in bad:
        _count(counts, rec, False)
    rows = [r["row"] for r in ok + bad]
    if len(set(rows)) != len(rows) or counts[SUCCESS] + counts[ERROR] + counts[SKIPPED] != n_input:
        raise ArtifactError(
            f"{store.stage_dir(STAGE)}: shard {shard} accounting broken: success "
            f"{counts[SUCCESS]} + error {counts[ERROR]} + skipped {counts[SKIPPED]} != input "
            f"{n_input} (or a row is doubled); delete the partial files and rerun"
        )
    out = _write_sorted(store.shard_path(STAGE, shard, OUT_SUFFIX), ok)
    err = _write_sorted(store.shard_path(STAGE, shard, ERRORS_SUFFIX), bad)
    m = store.write_manifest(STAGE, shard, dict(counts), [out, err])
    for suffix in (PARTIAL_SUFFIX, PARTIAL_ERRORS_SUFFIX):
        store.shard_path(STAGE, shard, suffix).unlink(missing_ok=True)
    return m


def run_regen(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Regenerate prep shard `shard` through the baseline server; resumable.

    Raises:
        ArtifactError: missing inputs, or broken accounting.
        ServiceUnavailableError: the server stayed down through the retries (rerun resumes).
    """
    from shared.progress import Progress

    if store.is_done(STAGE, shard):
        return store.read_manifest(STAGE, shard)
    rows = load_input(store, shard)
    ok_path = store.shard_path(STAGE, shard, PARTIAL_SUFFIX)
    err_path = store.shard_path(STAGE, shard, PARTIAL_ERRORS_SUFFIX)
    ok, bad = read_partial(ok_path), read_partial(err_path)
    done = {r["row"] for r in ok + bad}
    todo = [(i, row) for i, row in rows if i not in done]
    client = make_client(recipe)
    regen = Regenerator(
        client, prompt_counter(recipe), recipe.regen.max_turns, max_prompt_tokens(recipe)
    )
    writer = RowWriter(ok_path, err_path)

    def on_done(idx: int, row: dict, outcome: Outcome) -> None:
        success = outcome.status == SUCCESS
        rec = (
            success_record(idx, row, outcome, recipe, client)
            if success
            else error_record(idx, row, outcome)
        )
        writer.write(rec, success)
        (ok if success else bad).append(rec)
        bar.update(1, ok=len(ok), bad=len(bad))

    with Progress(len(rows), "rows", f"regen[{shard}]") as bar:
        bar.update(len(done))
        try:
            asyncio.run(_run(todo, regen, on_done, recipe.regen.concurrency, client))
        finally:
            writer.close()
    return finalize(store, shard, len(rows), ok, bad)


async def _run(todo, regen: Regenerator, on_done, concurrency: int, client: ChatClient) -> None:
    try:
        await regenerate_rows(todo, regen, on_done, concurrency)
    finally:
        await client.aclose()
