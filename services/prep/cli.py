"""`eyrie prep-stats RUN`: a run's samples, tokens, assistant tokens, and counted reasons.

Per dataset: samples, tokens, assistant tokens. Per stage: every counted reason
(quarantined rows, dropped samples, template and server round-trip failures). With regen: what
its tokenizer check compared (`services.regen.tokcheck`).

Registered through the `eyrie.commands` entry points. Imports stay inside the command (the
CLI must not import transformers or torch on --help).
"""

from __future__ import annotations

import argparse
import json


def cmd_prep_stats(args: argparse.Namespace) -> int:
    from services.prep.tokenize import regen_tokenizer_checks, run_reasons, run_stats
    from shared.artifacts import RunStore
    from shared.errors import ConfigError
    from shared.recipe import check_run_id

    store = RunStore(check_run_id(args.run))
    if not store.exists():
        raise ConfigError(f"run {args.run!r}: no such run under {store.root.parent}")
    stats = {
        **run_stats(store),
        "reasons": run_reasons(store),
        "regen_tokenizer_check": regen_tokenizer_checks(store),
    }
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(
        f"{stats['samples']} samples, {stats['tokens']} tokens, "
        f"{stats['assistant_tokens']} assistant tokens"
    )
    for src, d in sorted(stats["per_source"].items()):
        print(
            f"  {src}: {d['samples']} samples, {d['tokens']} tokens, "
            f"{d['assistant_tokens']} assistant tokens"
        )
    for src, reasons in sorted(stats["skipped_by_source"].items()):
        shown = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
        print(f"  {src}: skipped in prep: {shown}")
    check = stats["regen_tokenizer_check"]
    if check is not None:
        print(
            f"regen tokenizer check (local vs the server's /tokenize): {check['rows']} "
            f"conversations equal ({check['prompt_tokens']} prompt + {check['text_tokens']} "
            f"text tokens) in {check['shards'] - check['unchecked']} of {check['shards']} "
            f"shards; {check['rejected']} prompts rejected by the server"
        )
    print("reasons (counted, per stage):")
    for stage, counts in stats["reasons"].items():
        print(f"  {stage}: " + ("none" if not counts else ""))
        for reason, n in counts.items():
            print(f"    {reason}: {n}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `eyrie prep-stats` to the CLI."""
    p = sub.add_parser(
        "prep-stats", help="samples/tokens/assistant tokens of a run's tokenize stage, per dataset"
    )
    p.add_argument("run", help="run id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_prep_stats)
