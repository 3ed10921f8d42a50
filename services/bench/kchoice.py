"""Choosing k (draft tokens per step) from one benchmark's measurements.

Model (per benchmark cell, i.e. one temperature and concurrency):
- tokens per eagle3 step at k: `τ(k) = 1 + Σ_{i<k} p_i`, where `p_i` is vLLM's per-position
  acceptance (`accepted_per_position[i] / drafts`: the share of steps whose first i+1 draft
  tokens were all accepted). Positions below the measured k are exact: the draft proposes
  the same chain whatever k is. Positions beyond it are extrapolated with the last measured
  ratio `p_{k-1} / p_{k-2}` (capped at 1) and marked `extrapolated`.
- time per eagle3 step at k: `S(k) = T · (1 + k · c)`, where T is the target's step time and
  c the cost of one drafted token (its draft forward plus its share of verification) in
  target steps. T and c are measured on the serving backend by the benchmark itself:
  T = 1 / baseline tok/s and S(k_bench) = τ(k_bench) / eagle3 tok/s, both output tok/s of
  the same client and prompts, so `c = (S(k_bench) / T - 1) / k_bench`.
- predicted speedup at k: `τ(k) / (1 + k · c)`.

At the benchmarked k the prediction equals the measurement by construction (c is fitted
there); the prediction at any other k is tested by serving that k too (`bench.measure_k`:
its measured speedup and τ sit next to the prediction) or by another run at that k (`eyrie
compare` prints one report's prediction next to the other's measurement). The recommended k
is the one with the highest speedup, measured where it was measured, predicted elsewhere.
The linear cost is an approximation: verification of k+1 tokens on a compute-bound target
grows faster than linearly at high concurrency.
"""

from __future__ import annotations

from typing import Any


def tau_per_k(per_position: list[float], max_k: int) -> list[tuple[float, bool]]:
    """`(τ(k), extrapolated)` for k = 1..max_k from per-position acceptance `p_0..p_{K-1}`.

    Raises:
        ValueError: `per_position` is empty or `max_k` < 1.
    """
    if not per_position or max_k < 1:
        raise ValueError("need at least one measured position and max_k >= 1")
    p = [float(x) for x in per_position]
    ratio = min(1.0, p[-1] / p[-2]) if len(p) >= 2 and p[-2] > 0 else 0.0
    out, tau = [], 1.0
    for k in range(1, max_k + 1):
        i = k - 1
        if i < len(p):
            pi = p[i]
        else:
            pi = p[-1] * ratio ** (i - len(p) + 1)
        tau += pi
        out.append((tau, i >= len(p)))
    return out


def draft_token_cost(tau: float, baseline_tok_s: float, eagle3_tok_s: float, k: int) -> float:
    """c: one drafted token's cost in target steps (see the module docstring).

    Args:
        tau: measured τ at the benchmarked k.
        baseline_tok_s, eagle3_tok_s: output tok/s of the same cell.
        k: the benchmarked k.

    Raises:
        ValueError: a non-positive throughput or k.
    """
    if baseline_tok_s <= 0 or eagle3_tok_s <= 0 or k < 1:
        raise ValueError("throughputs and k must be positive")
    step_ratio = (tau / eagle3_tok_s) * baseline_tok_s  # S(k) / T
    return (step_ratio - 1.0) / k


def k_plan(
    row: dict[str, Any],
    k: int,
    max_k: int | None = None,
    measured: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """Predicted and measured speedup per k for one report row, and the k it recommends.

    Args:
        row: a report row (`per_position_rate`, `tau`, `baseline_tok_s`, `eagle3_tok_s`,
            `speedup`).
        k: the benchmarked k.
        max_k: largest k predicted; default k + 2.
        measured: the same cell's report row at other served k (`bench.measure_k`), by k.

    Returns:
        `{"temperature", "concurrency", "k", "draft_token_cost", "target_step_ms",
        "eagle3_step_ms", "per_k": [{"k", "tau", "speedup", "extrapolated", "measured_speedup",
        "measured_tau"}], "recommended_k", "recommended_by", "recommended_speedup",
        "predicted_speedup", "measured_speedup"}` (`recommended_by`: "measured" or
        "predicted", where `recommended_speedup` comes from); the
        measured fields are None at a k not served; `recommended_k` is 0 when no k is
        measured or predicted to beat the baseline. None when the row lacks counters or tok/s.
    """
    pos, tau = row.get("per_position_rate"), row.get("tau")
    b, e = row.get("baseline_tok_s"), row.get("eagle3_tok_s")
    if not pos or tau is None or not b or not e:
        return None
    c = draft_token_cost(tau, b, e, k)
    at = {**(measured or {}), k: row}
    per_k = []
    for i, (t, ext) in enumerate(tau_per_k(pos, max_k or k + 2)):
        m = at.get(i + 1)
        per_k.append(
            {
                "k": i + 1,
                "tau": t,
                "speedup": t / (1 + (i + 1) * c),
                "extrapolated": ext,
                "measured_speedup": m.get("speedup") if m else None,
                "measured_tau": m.get("tau") if m else None,
            }
        )

    def value(x: dict[str, Any]) -> float:
        return float(x["measured_speedup"] if x["measured_speedup"] is not None else x["speedup"])

    best = max(per_k, key=value)
    return {
        "temperature": row["temperature"],
        "concurrency": row["concurrency"],
        "k": k,
        "draft_token_cost": c,
        "target_step_ms": 1000.0 / b,
        "eagle3_step_ms": 1000.0 * tau / e,
        "per_k": per_k,
        "recommended_k": best["k"] if value(best) > 1.0 else 0,
        "recommended_by": "measured" if best["measured_speedup"] is not None else "predicted",
        "recommended_speedup": value(best),
        "predicted_speedup": best["speedup"],
        "measured_speedup": row.get("speedup") if row.get("speedup") is not None else e / b,
    }
