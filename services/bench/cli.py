"""`eyrie bench`: benchmark a run's draft against its baseline, compare runs, offline τ.

    eyrie bench RECIPE [-o k=v] [--start] [--baseline-url U] [--eagle3-url U]
    eyrie bench --compare A B          (run ids or report.json paths)
    eyrie bench offline RECIPE --checkpoint DIR

`eyrie bench RECIPE` measures servers that are already running (the launcher's URLs, or the
ones given); `--start` starts them through `services.serve.launcher` first: side by side when
`eval.side_by_side`, else one after the other. It holds no GPU lease: `eyrie run` does that
for the pipeline's own eval stage. Heavy imports stay inside the functions.
"""

from __future__ import annotations

import argparse
import logging
import sys

from services.conductor.cli import add_override_arg
from shared.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand to the `eyrie` parser."""
    p = subparsers.add_parser(
        "bench",
        help="acceptance length and speedup, baseline vs EAGLE-3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "args",
        nargs="*",
        metavar="RECIPE",
        help="recipe YAML; or `offline RECIPE` for offline tau on a checkpoint",
    )
    add_override_arg(p, "eval.concurrency=[1,8]")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="compare two runs' reports (run ids or report.json paths)",
    )
    p.add_argument(
        "--start",
        action="store_true",
        help="start the baseline and eagle3 servers through the serve launcher",
    )
    p.add_argument("--baseline-url", help="baseline server root (default: the launcher's)")
    p.add_argument("--eagle3-url", help="eagle3 server root (default: the launcher's)")
    p.add_argument("--checkpoint", help="offline: checkpoint folder to score")
    p.add_argument(
        "--max-samples", type=int, help="offline: score only this many validation samples"
    )
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Dispatch `eyrie bench` to compare, offline or a live benchmark."""
    if args.compare:
        return _compare(*args.compare)
    if args.args[:1] == ["offline"]:
        return _offline(args)
    if len(args.args) != 1:
        raise ConfigError(
            "eyrie bench: give one RECIPE, `--compare A B`, or `offline RECIPE --checkpoint DIR`"
        )
    return _live(args, args.args[0])


def _compare(a: str, b: str) -> int:
    from services.bench.report import compare_markdown, load_report

    print(compare_markdown(load_report(a), load_report(b)), end="")
    return 0


def _live(args: argparse.Namespace, recipe_file: str) -> int:
    import contextlib

    from services.bench.jobs import eval_at, run_report
    from services.serve.launcher import base_url, serving
    from shared.recipe import resolve_recipe
    from shared.store import RunStore

    recipe = resolve_recipe(recipe_file, args.override)
    store = RunStore.create(recipe, command=" ".join(sys.argv))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    urls = {
        "baseline": args.baseline_url or base_url(recipe, "baseline"),
        "eagle3": args.eagle3_url or base_url(recipe, "eagle3"),
    }
    groups = [["baseline", "eagle3"]] if recipe.eval.side_by_side else [["baseline"], ["eagle3"]]
    for modes in groups:
        ctx: contextlib.AbstractContextManager[dict[str, str]] = (
            serving(recipe, store, modes) if args.start else contextlib.nullcontext({})
        )
        with ctx as started:
            urls.update(started or {})
            for mode in modes:
                shard = 0 if mode == "baseline" else 1
                eval_at(store, recipe, shard, urls[mode], urls["baseline"])
    run_report(store, recipe, 0)
    out = store.root / "report"
    print((out / "report.md").read_text(), end="")
    print(f"\nreport: {out}/report.json, report.md, speedup.png, acceptance.png")
    return 0


def _offline(args: argparse.Namespace) -> int:
    import json

    from services.bench.offline import offline_tau
    from shared.recipe import resolve_recipe
    from shared.store import RunStore

    if len(args.args) != 2 or not args.checkpoint:
        raise ConfigError(
            "eyrie bench offline: usage `eyrie bench offline RECIPE --checkpoint DIR`"
        )
    recipe = resolve_recipe(args.args[1], args.override)
    store = RunStore(recipe.run_id())
    result = offline_tau(store, recipe, args.checkpoint, args.max_samples)
    print(json.dumps(result, indent=2))
    return 0
