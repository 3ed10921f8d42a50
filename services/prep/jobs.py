"""The prep-queue stage jobs: prep (per shard), dedup (single), tokenize (per shard).

Each is `fn(store, recipe, shard) -> Manifest`, idempotent: a finished shard (manifest
present) returns its manifest; outputs are written atomically and the manifest last. Files
and formats: `shared/artifacts.py`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from shared.artifacts import PREP_SUFFIX, QUARANTINE_SUFFIX, REPORT_SUFFIX
from shared.errors import ArtifactError, StageFailedError
from shared.progress import Progress
from shared.recipe import Recipe
from shared.store import Manifest, RunStore, atomic_path, atomic_write_json

log = logging.getLogger("eyrie.prep")

#: Raw rows in the quarantine file are cut to this many characters.
QUARANTINE_RAW_CHARS = 2000
#: Conversations rendered and tokenized per tokenizer batch call.
TOKENIZE_BATCH = 64


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, default=str) + "\n"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; its producing stage has not finished")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- prep ----------------------------------------------------------------------------------


def _adapt_rows(
    store: RunStore, recipe: Recipe, shard: int, plan: dict[str, Any]
) -> tuple[list[str], list[str], Counter, Counter, int]:
    from services.prep.formats import ADAPTERS, RowRejected, normalize
    from services.prep.plan import rows_path

    kept: list[str] = []
    quarantined: list[str] = []
    skipped: Counter[str] = Counter()
    realigned: Counter[str] = Counter()
    rows = _read_jsonl(rows_path(store, shard))
    for rec in rows:
        meta = plan["datasets"][rec["ds"]]
        try:
            adapted = normalize(ADAPTERS[meta["adapter"]](rec["raw"]), recipe.prep.max_turn_chars)
        except RowRejected as e:
            skipped[e.reason] += 1
            quarantined.append(
                _dump(
                    {
                        "file": meta["load"].get("file"),
                        "row": rec["row"],
                        "field": e.field,
                        "reason": e.reason,
                        "detail": e.detail,
                        "raw": json.dumps(rec["raw"], ensure_ascii=False, default=str)[
                            :QUARANTINE_RAW_CHARS
                        ],
                    }
                )
            )
            continue
        realigned.update(adapted.realigned)
        kept.append(
            _dump(
                {
                    "id": f"{meta['name']}:{rec['row']}",
                    "source": meta["name"],
                    "messages": adapted.messages,
                    "tools": adapted.tools,
                }
            )
        )
    return kept, quarantined, skipped, realigned, len(rows)


def _write_lines(path: Path, lines: list[str]) -> Path:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    return path


def run_prep(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Adapt and validate one shard of planned rows into canonical conversations.

    Bad rows are quarantined with file, row, field and reason; realignments are counted.

    Raises:
        StageFailedError: the kept share is below `prep.min_kept_fraction` (the report is
            written first, so the reasons can be read).
    """
    if store.is_done("prep", shard):
        return store.read_manifest("prep", shard)
    from services.prep.plan import read_plan

    kept, quarantined, skipped, realigned, rows_in = _adapt_rows(
        store, recipe, shard, read_plan(store)
    )
    out = _write_lines(store.shard_path("prep", shard, PREP_SUFFIX), kept)
    qpath = _write_lines(store.shard_path("prep", shard, QUARANTINE_SUFFIX), quarantined)
    report = {
        "rows_in": rows_in,
        "kept": len(kept),
        "skipped": dict(sorted(skipped.items())),
        "realigned": dict(sorted(realigned.items())),
    }
    rpath = atomic_write_json(store.shard_path("prep", shard, REPORT_SUFFIX), report)
    if rows_in and len(kept) / rows_in < recipe.prep.min_kept_fraction:
        raise StageFailedError(
            f"prep shard {shard}: kept {len(kept)}/{rows_in} rows, below "
            f"prep.min_kept_fraction={recipe.prep.min_kept_fraction}; reasons: "
            f"{report['skipped']} (rows in {qpath}). Fix the data or lower the threshold."
        )
    return store.write_manifest(
        "prep",
        shard,
        {"rows_in": rows_in, "kept": len(kept), "skipped": sum(skipped.values())},
        [out, qpath, rpath],
        extra={"report": report},
    )


# -- dedup ---------------------------------------------------------------------------------


def run_dedup(store: RunStore, recipe: Recipe, shard: int = 0) -> Manifest:
    """Global first-prompt dedup and MT-Bench decontamination over every prep shard.

    Writes `dedup/keep.json` and `dedup/report.json`.
    """
    if store.is_done("dedup", shard):
        return store.read_manifest("dedup", shard)
    from services.conductor.stages import num_shards
    from services.prep.dedup import select

    n = num_shards(store)
    shards = ((s, _read_jsonl(store.shard_path("prep", s, PREP_SUFFIX))) for s in range(n))
    prompts = None
    if recipe.prep.decontaminate:
        from services.bench.prompts import mtbench_first_turns

        prompts = mtbench_first_turns()
    keep, report = select(shards, recipe.prep.dedup, prompts)
    d = store.stage_dir("dedup")
    kpath = atomic_write_json(d / "keep.json", keep)
    rpath = atomic_write_json(d / "report.json", report)
    return store.write_manifest("dedup", shard, report, [kpath, rpath])


# -- tokenize ------------------------------------------------------------------------------


def _tokenizer_path(recipe: Recipe) -> str:
    return recipe.target.tokenizer or recipe.target.path


def _tokenize_rows(store: RunStore, recipe: Recipe, shard: int, tok: Any, counts: Counter):
    from services.prep import samples as S
    from services.prep.formats import RowRejected

    kwargs, max_len = recipe.target.chat_template_kwargs, recipe.prep.max_len_tokens
    if recipe.regen.enabled:
        rows = _read_jsonl(store.shard_path("regen", shard, PREP_SUFFIX))
    else:
        keep = json.loads((store.stage_dir("dedup") / "keep.json").read_text())
        prep_rows = _read_jsonl(store.shard_path("prep", shard, PREP_SUFFIX))
        rows = [prep_rows[i] for i in keep.get(str(shard), [])]
    counts["rows_in"] = len(rows)
    out: list[S.Sample] = []
    with Progress(len(rows), "rows", f"tokenize[{shard}]") as bar:
        for i in range(0, len(rows), TOKENIZE_BATCH):
            batch = rows[i : i + TOKENIZE_BATCH]
            if recipe.regen.enabled:
                for rec in batch:
                    try:
                        out.append(S.from_regen(tok, rec, kwargs, max_len, counts))
                    except RowRejected as e:
                        counts[f"dropped:{e.reason}"] += 1
            else:
                out += S.from_conversations(tok, batch, kwargs, max_len, counts)
            bar.update(len(batch))
    return out


def token_stats(samples: list[Any]) -> dict[str, Any]:
    """Samples, tokens and assistant tokens, in total and per source dataset."""
    per: dict[str, dict[str, int]] = {}
    for s in samples:
        d = per.setdefault(s.source, {"samples": 0, "tokens": 0, "assistant_tokens": 0})
        d["samples"] += 1
        d["tokens"] += len(s.input_ids)
        d["assistant_tokens"] += sum(s.loss_mask)
    total = {k: sum(d[k] for d in per.values()) for k in ("samples", "tokens", "assistant_tokens")}
    return {**total, "per_source": dict(sorted(per.items()))}


def run_tokenize(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Render, mask and tokenize one shard (from regen output, or deduped prep rows).

    Writes `tokenize/shard-N/` (HF dataset) and `tokenize/shard-N.report.json`.
    """
    if store.is_done("tokenize", shard):
        return store.read_manifest("tokenize", shard)
    from services.prep.samples import save_samples
    from services.prep.template import load_tokenizer

    tok = load_tokenizer(_tokenizer_path(recipe))
    counts: Counter = Counter()
    samples = _tokenize_rows(store, recipe, shard, tok, counts)
    out = store.shard_path("tokenize", shard, "")
    save_samples(samples, out)
    report = {
        **token_stats(samples),
        **dict(sorted(counts.items())),
        "kept": len(samples),
        "max_len_tokens": recipe.prep.max_len_tokens,
        "chat_template_kwargs": recipe.target.chat_template_kwargs,
        "input": "regen" if recipe.regen.enabled else "prep",
    }
    rpath = atomic_write_json(store.shard_path("tokenize", shard, REPORT_SUFFIX), report)
    numeric = {k: v for k, v in report.items() if isinstance(v, int)}
    return store.write_manifest(
        "tokenize", shard, numeric, [out, rpath], extra={"per_source": report["per_source"]}
    )


def run_stats(store: RunStore) -> dict[str, Any]:
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
