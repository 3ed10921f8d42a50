"""Flags on a benchmark result, with the likely causes of each.

A draft that accepts tokens can still make serving slower (one real run: τ 2.1, yet 82.3 tok/s
against a 90 tok/s baseline). So two things are flagged:
- τ < `shared.conventions.TAU_MISCONFIG_THRESHOLD`: a misconfiguration until proven otherwise
  (EAGLE-3 conventions §7);
- speedup < 1 at any concurrency: the draft costs more than it saves there.

Each flag lists the usual causes. Where the run's export exists, the causes that can be
checked on disk (aux layer ids, `d2t`, norm flags, the speculative method) are checked, and
the list says which were found wrong and which still need a look.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shared.conventions import TAU_MISCONFIG_THRESHOLD, check_d2t_t2d
from shared.draft import NORM_FLAGS
from shared.errors import ContractMismatchError

LOW_TAU_CAUSES = [
    'mode: the server must run --speculative-config with method "eagle3"; "eagle" uses '
    "one feature layer and accepts ~nothing, with no error",
    "layer ids: eagle_aux_hidden_state_layer_ids in the draft config must equal the ids the "
    "draft was trained on (id i = residual entering layer i)",
    "d2t: model.safetensors must hold d2t as offsets (target = draft + d2t[draft]); without "
    "it vLLM treats draft id i as target id i",
    "norm flags: norm_before_residual / norm_before_fc / fc_norm / norm_output written in the "
    "draft config must match training (the llama format defaults norm_before_residual=false)",
    "prompts: raw (untemplated) prompts or a target other than the one the draft was trained for",
]

SLOW_CAUSES = [
    "the draft's forward plus verification costs more than the tokens it saves: try fewer "
    "num_speculative_tokens, or a smaller draft vocab/head",
    "at high concurrency the target is compute-bound and speculation stops paying off",
    "low acceptance at later positions: see the per-position acceptance plot",
]


def check_export(export_dir: Path, aux_ids: list[int], draft_flags: dict[str, bool]) -> list[str]:
    """Problems found in a llama-style draft folder against what the recipe trained.

    Args:
        export_dir: `export/vllm/` (config.json + model.safetensors).
        aux_ids: the run's resolved aux layer ids.
        draft_flags: the recipe's norm flags (`NORM_FLAGS`).

    Returns:
        One line per problem; empty when the folder matches (or does not exist).
    """
    cfg_path = export_dir / "config.json"
    if not cfg_path.is_file():
        return []
    cfg = json.loads(cfg_path.read_text())
    found = []
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids != list(aux_ids):
        found.append(f"layer ids: {cfg_path} has {ids}, the run trained on {list(aux_ids)}")
    for flag in NORM_FLAGS:
        if flag in draft_flags and cfg.get(flag, None) != draft_flags[flag]:
            found.append(
                f"norm flags: {cfg_path} has {flag}={cfg.get(flag)!r}, "
                f"training used {draft_flags[flag]!r}"
            )
    found += _check_d2t(export_dir / "model.safetensors", cfg)
    return found


def _check_d2t(weights: Path, cfg: dict[str, Any]) -> list[str]:
    if not weights.is_file():
        return [f"d2t: {weights} is missing"]
    from safetensors import safe_open

    with safe_open(str(weights), "np") as f:
        keys = set(f.keys())
        draft_vocab = int(cfg.get("draft_vocab_size") or cfg.get("vocab_size") or 0)
        if "d2t" not in keys:
            if draft_vocab != cfg.get("vocab_size"):
                return [f"d2t: {weights} has no d2t, so vLLM maps draft id i to target id i"]
            return []
        d2t = f.get_tensor("d2t")
        t2d = f.get_tensor("t2d") if "t2d" in keys else None
    if t2d is None:
        t2d = np.zeros(int(cfg.get("vocab_size", 0)), dtype=bool)
        ids = np.arange(len(d2t)) + d2t
        t2d[ids[(ids >= 0) & (ids < len(t2d))]] = True
    try:
        check_d2t_t2d(d2t, t2d, draft_vocab)
    except ContractMismatchError as e:
        return [f"d2t: {weights}: {e}"]
    return []


def flags_for(tau: float | None, speedups: dict[str, float], problems: list[str]) -> list[dict]:
    """The report's flags.

    Args:
        tau: τ of the eagle3 server at temperature 0 over all concurrencies (None = no drafts).
        speedups: "T=<t> c=<c>" → eagle3 tok/s ÷ baseline tok/s.
        problems: `check_export` findings, shown as confirmed causes.

    Returns:
        `[{"kind": "low_tau"|"slower", "message": str, "likely_causes": [str],
        "confirmed": [str]}]`, empty when nothing is flagged.
    """
    flags = []
    if tau is None or tau < TAU_MISCONFIG_THRESHOLD:
        shown = "no drafts counted" if tau is None else f"tau {tau:.3f}"
        flags.append(
            {
                "kind": "low_tau",
                "message": f"{shown} < {TAU_MISCONFIG_THRESHOLD}: a misconfiguration until proven "
                "otherwise (EAGLE-3 conventions §7)",
                "likely_causes": LOW_TAU_CAUSES,
                "confirmed": problems,
            }
        )
    slow = {k: v for k, v in speedups.items() if v < 1.0}
    if slow:
        worst = ", ".join(f"{k}: {v:.2f}x" for k, v in slow.items())
        flags.append(
            {
                "kind": "slower",
                "message": f"eagle3 is slower than the baseline at {worst}",
                "likely_causes": (LOW_TAU_CAUSES if tau is not None and tau < 1.5 else [])
                + SLOW_CAUSES,
                "confirmed": problems,
            }
        )
    return flags
