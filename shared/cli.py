"""What every `eyrie` subcommand shares: recipe arguments and dotted overrides.

Commands live with their service (each service's `cli.py` registers its own through the
`eyrie.commands` entry points); the arguments they have in common are defined here once.
"""

from __future__ import annotations

import argparse


def add_override_arg(p: argparse.ArgumentParser, example: str = "train.lr=1e-4") -> None:
    """Add `-o/--override KEY=VALUE` (repeatable): dotted recipe overrides, parsed as YAML."""
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted recipe override, e.g. {example} (repeatable)",
    )


def add_recipe_args(p: argparse.ArgumentParser, example: str = "train.lr=1e-4") -> None:
    """Add the positional RECIPE and `-o/--override`."""
    p.add_argument("recipe", help="recipe YAML file")
    add_override_arg(p, example)
