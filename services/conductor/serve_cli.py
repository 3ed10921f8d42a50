"""The conductor's server commands: `eyrie serve` and `eyrie bench`.

    eyrie serve --mode baseline|eagle3|extract [--draft DIR] RECIPE [-o k=v]
    eyrie serve stop
    eyrie bench RECIPE [-o k=v] [--start] [--baseline-url U] [--eagle3-url U]

`serve RECIPE` starts one server (backend `serve.backend`; launch preflight first;
readiness wait), prints its URL, and stays in the foreground until Ctrl-C, until the server
exits, or until `eyrie serve stop` (from another shell) stops it. The eagle3 draft defaults
to the run's exported llama-style folder.

`bench RECIPE` runs the run's bench and report stages in this process, against servers that
are already running (the recipe's URLs, or the ones given), or with `--start` against
servers it starts: side by side when `bench.side_by_side`, else one after the other. It holds
no GPU lease: `eyrie run` does that for the pipeline's own bench stage. Heavy imports stay
inside the functions.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from shared.cli import add_override_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` and `bench` to the `eyrie` parser."""
    p = subparsers.add_parser(
        "serve",
        help="start a vLLM server (baseline | eagle3 | extract), or `serve stop`",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", metavar="RECIPE|stop", help="recipe YAML, or `stop`")
    p.add_argument(
        "--mode", choices=["baseline", "eagle3", "extract"], default="baseline", help="server mode"
    )
    p.add_argument("--draft", help="eagle3 draft folder (default: the run's export)")
    add_override_arg(p, "serve.port=8100")
    p.set_defaults(func=cmd_serve)

    b = subparsers.add_parser(
        "bench",
        help="acceptance length and speedup, baseline vs EAGLE-3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("recipe", help="recipe YAML")
    add_override_arg(b, "bench.concurrency=[1,8]")
    b.add_argument("--start", action="store_true", help="start the baseline and eagle3 servers")
    b.add_argument("--baseline-url", help="baseline server root (default: the recipe's)")
    b.add_argument("--eagle3-url", help="eagle3 server root (default: the recipe's)")
    b.set_defaults(func=cmd_bench)


def cmd_serve(args: argparse.Namespace) -> int:
    """Entry point of `eyrie serve`. Returns the exit code."""
    from services.conductor.servers import stop_recorded

    if args.recipe == "stop":
        lines = stop_recorded()
        print("\n".join(lines) if lines else "no Eyrie vLLM server is recorded as running")
        return 0
    return serve_foreground(args)


def serve_foreground(args: argparse.Namespace) -> int:
    """Start the server, then wait for Ctrl-C, its exit, or `eyrie serve stop`."""
    from services.conductor.gpu import check_gpus_free
    from services.conductor.servers import get_backend, start_server
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    recipe = resolve_recipe(args.recipe, args.override)
    store = RunStore(recipe.run_id())
    backend = get_backend(recipe.serve.backend)
    backend.prepare()
    check_gpus_free()
    draft = Path(args.draft) if args.draft else None
    handle = start_server(backend, recipe, store, args.mode, draft)
    print(f"{args.mode} server ready at {handle.url} (model {handle.model!r}); Ctrl-C stops it")
    try:
        while Path(handle.state_path).is_file() and backend.alive(handle):
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        backend.stop(handle)
    print(f"{args.mode} server at {handle.url} stopped")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Entry point of `eyrie bench`: the bench and report stages in this process."""
    from services.conductor.servers import server_pool
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe
    from shared.stage import execute, get_stage

    recipe = resolve_recipe(args.recipe, args.override)
    store = RunStore.create(recipe, command=" ".join(sys.argv))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    bench = get_stage("bench")
    urls = {m: u for m, u in (("baseline", args.baseline_url), ("eagle3", args.eagle3_url)) if u}
    shards = bench.shard_numbers(store)
    with server_pool(store) as pool:
        for group in bench.shard_groups(recipe, shards):
            started = (
                pool.serve(bench.server_recipe(recipe, group[0]), bench.servers(recipe, group))
                if args.start
                else {}
            )
            for shard in group:
                execute(bench, store, shard, force=True, urls={**urls, **started})
    execute(get_stage("report"), store, 0, force=True)
    print(store.report.markdown_path.read_text(), end="")
    print(f"\nreport: {store.report.json_path}, with its Markdown and plots beside it")
    return 0
