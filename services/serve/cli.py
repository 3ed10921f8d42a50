"""`eyrie serve`: start one vLLM server in the foreground, or stop the recorded ones.

    eyrie serve --mode baseline|eagle3|extract [--draft DIR] RECIPE [-o k=v]
    eyrie serve stop

`serve RECIPE` starts the server through the launcher (backend `serve.backend`; preflight
before eagle3; readiness wait), prints its URL, and stays in the foreground until Ctrl-C,
until the server exits, or until `eyrie serve stop` (from another shell) stops it. The eagle3
draft defaults to the run's `export/vllm`. Heavy imports stay inside the functions.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from services.conductor.cli import add_override_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `eyrie` parser."""
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
    p.add_argument("--draft", help="eagle3 draft folder (default: <run>/export/vllm)")
    add_override_arg(p, "serve.port=8100")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Entry point of `eyrie serve`. Returns the exit code."""
    if args.recipe == "stop":
        from services.serve.backends import stop_recorded

        lines = stop_recorded()
        print("\n".join(lines) if lines else "no Eyrie vLLM server is recorded as running")
        return 0
    return serve_foreground(args)


def serve_foreground(args: argparse.Namespace) -> int:
    """Start the server, then wait for Ctrl-C, its exit, or `eyrie serve stop`."""
    from services.serve.backends import get_backend
    from services.serve.gpu import check_gpus_free
    from services.serve.launcher import draft_dir_of
    from shared.recipe import resolve_recipe
    from shared.store import RunStore

    recipe = resolve_recipe(args.recipe, args.override)
    store = RunStore(recipe.run_id())
    draft = Path(args.draft) if args.draft else draft_dir_of(store)
    backend = get_backend(recipe.serve.backend)
    backend.prepare()
    check_gpus_free()
    handle = backend.start(
        recipe,
        args.mode,
        store.root / "serve",
        draft if args.mode == "eagle3" else None,
        store.root / "extract" / "vllm-hidden-states" if args.mode == "extract" else None,
    )
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
