"""`eyrie tau RECIPE --checkpoint DIR`: offline (simulated) τ of a training checkpoint.

Registered through the `eyrie.commands` entry points; heavy imports stay inside.
"""

from __future__ import annotations

import argparse
import json

from shared.cli import add_recipe_args


def cmd_tau(args: argparse.Namespace) -> int:
    from services.train.offline import offline_tau
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    recipe = resolve_recipe(args.recipe, args.override)
    store = RunStore(recipe.run_id())
    print(json.dumps(offline_tau(store, recipe, args.checkpoint, args.max_samples), indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `eyrie tau` to the CLI."""
    p = sub.add_parser(
        "tau", help="offline (simulated) tau of a checkpoint on the run's held-out split"
    )
    add_recipe_args(p)
    p.add_argument(
        "--checkpoint", required=True, help="a checkpoint folder of the run's train stage"
    )
    p.add_argument("--max-samples", type=int, help="score only this many validation samples")
    p.set_defaults(func=cmd_tau)
