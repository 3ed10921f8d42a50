"""Preflight lint before an eagle3 server starts.

A wrong mode or flag does not crash vLLM: the server starts, answers, and accepts about
nothing (τ ≈ 1.0). One real run lost days to `"method": "eagle"` where `"eagle3"` was
meant. So before an eagle3 start Eyrie refuses, naming every problem, unless:
- the speculative method is `eagle3`;
- the draft folder passes `services.train.draft_format.lint_draft_dir` against the target's
  config.json (3 aux ids, fc width 3·H, vocab_size, draft_vocab_size == len(d2t) ==
  lm_head rows, d2t present, norm flags explicit);
- the draft's recorded verifier is the target being served.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shared.errors import ContractMismatchError
from shared.recipe import Recipe
from shared.target import target_config


def recorded_verifier(draft_dir: Path) -> str | None:
    """The target a draft folder says it was trained for, or None.

    Read from llama-style `eyrie.verifier` or speculators
    `speculators_config.verifier.name_or_path`.
    """
    cfg = json.loads((draft_dir / "config.json").read_text())
    if "speculators_config" in cfg:
        return (cfg["speculators_config"].get("verifier") or {}).get("name_or_path")
    return (cfg.get("eyrie") or {}).get("verifier")


def _same_target(a: str, b: str) -> bool:
    """Two target references match: equal strings, or the same existing folder."""
    if a == b:
        return True
    pa, pb = Path(os.path.expanduser(a)), Path(os.path.expanduser(b))
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def verifier_problems(draft_dir: Path, target: str) -> list[str]:
    """[] when the draft records `target` as its verifier, else one problem line."""
    recorded = recorded_verifier(draft_dir) if (draft_dir / "config.json").is_file() else None
    if not recorded:
        return [f"verifier: the draft records no verifier; cannot confirm it fits {target!r}"]
    if not _same_target(recorded, target):
        return [f"verifier: draft was trained for {recorded!r}, serving target is {target!r}"]
    return []


def preflight_problems(recipe: Recipe, draft_dir: Path | str, spec: dict[str, Any]) -> list[str]:
    """Every reason not to start this eagle3 server; [] when it may start.

    Args:
        recipe: the resolved recipe (target path, expected sizes).
        draft_dir: the draft folder named in the speculative config.
        spec: the `--speculative-config` dict that would be passed.
    """
    from services.train.draft_format import lint_draft_dir

    draft_dir = Path(draft_dir)
    problems = []
    if spec.get("method") != "eagle3":
        problems.append(
            f"speculative-config method: expected 'eagle3', got {spec.get('method')!r} "
            "('eagle' serves an EAGLE-3 draft with the wrong feature width: τ ≈ 1.0, no error)"
        )
    problems += lint_draft_dir(draft_dir, target_config(recipe))
    return problems + verifier_problems(draft_dir, recipe.target.path)


def preflight_eagle3(recipe: Recipe, draft_dir: Path | str, spec: dict[str, Any]) -> None:
    """Refuse an eagle3 start unless `preflight_problems` is empty.

    Raises:
        ContractMismatchError: listing every problem and the draft folder.
    """
    problems = preflight_problems(recipe, draft_dir, spec)
    if problems:
        raise ContractMismatchError(
            f"refusing to start an eagle3 server with draft {draft_dir}:\n  - "
            + "\n  - ".join(problems)
            + "\nFix the draft export (eyrie stage export) or the recipe's target."
        )
