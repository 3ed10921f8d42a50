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
compare` prints one report's prediction next to the other's measurement).
The linear cost is an approximation: verification of k+1 tokens on a compute-bound target
grows faster than linearly at high concurrency.

The recommended k. Choosing it by the benchmark's own speedups would tune k on the eval
prompts (issue 16's honesty rules allow only what a user could do without them). So when the
run has the draft's per-position acceptance on its held-out split (the served checkpoint's
simulated acceptance, `services.train.acceptance.simulated_tau`), k is chosen from that and
the step costs alone: held-out speedup `τ_h(k) / r(k)`, where `τ_h(k) = 1 + Σ_{i<k} h_i`
(`tau_per_k` on the held-out rates) and r(k) = S(k) / T is the step-time ratio, measured at
every served k (`τ / speedup` of that k's cell: a step count and a clock, not an acceptance
to tune on) and `1 + k·c` elsewhere. The benchmark's speedup at that k is then the check.
Without held-out rates (a draft trained elsewhere), the k with the highest speedup is
recommended: measured where it was measured, predicted elsewhere.
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
    heldout: list[float] | None = None,
) -> dict[str, Any] | None:
    """Predicted and measured speedup per k for one report row, and the k it recommends.

    Args:
        row: a report row (`per_position_rate`, `tau`, `baseline_tok_s`, `eagle3_tok_s`,
            `speedup`).
        k: the benchmarked k.
        max_k: largest k predicted; default k + 2.
        measured: the same cell's report row at other served k (`bench.measure_k`), by k.
        heldout: the served draft's per-position acceptance on the run's held-out split
            (`simulated_tau`'s `accept_rate_per_pos`, same convention as vLLM's), or None.

    Returns:
        `{"temperature", "concurrency", "k", "draft_token_cost", "target_step_ms",
        "eagle3_step_ms", "per_k": [{"k", "tau", "speedup", "extrapolated", "step_ratio",
        "heldout_tau", "heldout_speedup", "measured_speedup", "measured_tau"}],
        "recommended_k", "recommended_by", "recommended_speedup", "predicted_speedup",
        "measured_speedup"}`. `step_ratio` is r(k) = S(k) / T, measured at a served k;
        the heldout fields are None without `heldout`; the measured fields are None at a k
        not served. `recommended_by` is "held-out" (chosen by held-out speedup; see the
        module docstring), "measured" or "predicted"; `recommended_speedup` is the measured
        speedup at the recommended k where it was served, else its predicted (held-out or
        benchmark) one; `predicted_speedup` the benchmark's prediction there.
        `recommended_k` is 0 when no k is expected to beat the baseline. None when the row
        lacks counters or tok/s.
    """
    pos, tau = row.get("per_position_rate"), row.get("tau")
    b, e = row.get("baseline_tok_s"), row.get("eagle3_tok_s")
    if not pos or tau is None or not b or not e:
        return None
    c = draft_token_cost(tau, b, e, k)
    at = {**(measured or {}), k: row}
    n = max_k or k + 2
    held = tau_per_k(heldout, n) if heldout else None
    per_k = []
    for i, (t, ext) in enumerate(tau_per_k(pos, n)):
        m = at.get(i + 1)
        ratio = 1 + (i + 1) * c
        if m and m.get("tau") and m.get("speedup"):
            ratio = m["tau"] / m["speedup"]
        per_k.append(
            {
                "k": i + 1,
                "tau": t,
                "speedup": t / (1 + (i + 1) * c),
                "extrapolated": ext,
                "step_ratio": ratio,
                "heldout_tau": held[i][0] if held else None,
                "heldout_speedup": held[i][0] / ratio if held else None,
                "measured_speedup": m.get("speedup") if m else None,
                "measured_tau": m.get("tau") if m else None,
            }
        )

    def best_of(key: str) -> dict[str, Any]:
        return max(per_k, key=lambda x: float(x[key] if x[key] is not None else x["speedup"]))

    if held:
        best, by, expected = best_of("heldout_speedup"), "held-out", "heldout_speedup"
    else:
        best = best_of("measured_speedup")
        by = "measured" if best["measured_speedup"] is not None else "predicted"
        expected = "measured_speedup" if by == "measured" else "speedup"
    value = best["measured_speedup"] if best["measured_speedup"] is not None else best[expected]
    return {
        "temperature": row["temperature"],
        "concurrency": row["concurrency"],
        "k": k,
        "draft_token_cost": c,
        "target_step_ms": 1000.0 / b,
        "eagle3_step_ms": 1000.0 * tau / e,
        "per_k": per_k,
        "recommended_k": best["k"] if best[expected] > 1.0 else 0,
        "recommended_by": by,
        "recommended_speedup": value,
        "predicted_speedup": best["speedup"],
        "measured_speedup": row.get("speedup") if row.get("speedup") is not None else e / b,
    }
