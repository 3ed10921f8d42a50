"""`eyrie compare A B`: two runs' benchmark reports side by side.

Registered through the `eyrie.commands` entry points. (`eyrie bench`, which starts and
measures servers, is the conductor's: it drives this service's stages.)
"""

from __future__ import annotations

import argparse


def cmd_compare(args: argparse.Namespace) -> int:
    from services.bench.report import compare_markdown, load_report

    print(compare_markdown(load_report(args.a), load_report(args.b)), end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `eyrie compare` to the CLI."""
    p = sub.add_parser("compare", help="compare two runs' bench reports, window by window")
    p.add_argument("a", metavar="A", help="run id, run folder or report.json")
    p.add_argument("b", metavar="B", help="run id, run folder or report.json")
    p.set_defaults(func=cmd_compare)
