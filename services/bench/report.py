"""The benchmark report: baseline and eagle3 sweeps side by side, as JSON and Markdown.

`build_report` takes every bench shard (`services.bench.stage.bench_plan`: per k served, per
round, a baseline sweep and an eagle3 sweep) and pairs the windows by (temperature,
concurrency) within each round. A cell's speedup is the median over rounds of eagle3 output
tok/s ÷ baseline output tok/s of the same round, both measured by the same client on the same
prompts; its tok/s and latencies are the rounds' medians. τ is reported per cell from the
counter deltas of its windows, summed over rounds (τ = 1 + accepted / drafts,
`shared.conventions.mean_acceptance_length`); the pooled τ per temperature (every
concurrency's deltas summed) is kept for the acceptance plot. The rows are the recipe's k;
the other k served (`bench.measure_k`) add their measured speedup and τ to the k plans.

report.json layout: `{"run_id", "target", "k", "measure_k", "rounds", "prompt_set",
"num_prompts", "max_tokens", "rows": [Row], "tau": {"<T>": pooled τ}, "acceptance_rate":
{"<T>": r}, "per_position_rate": {"<T>": [k floats]}, "checks": [Check], "offline": {"tau",
"epoch", "per_position"} | None, "k_plans": [Plan], "flags": [Flag], "regen": {count: n} |
None, "vocab": {count: n} | None}` (Row: one cell, with `speedups`, the per-round ratios;
regen: the regen manifests' counts summed; vocab: the vocab manifest's counts and coverage;
both added by the report stage) (Check: `diagnosis.export_checks`; Plan: `kchoice.k_plan`,
one per row with counters; Flag: `diagnosis.flags_for`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from shared.conventions import draft_acceptance_rate, mean_acceptance_length
from shared.errors import ArtifactError


def _key(w: dict[str, Any]) -> tuple[float, int]:
    return float(w["temperature"]), int(w["concurrency"])


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _pool(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """Counter deltas summed over windows, with τ and the rates recomputed from the sums.

    Drafts, draft tokens, accepted and accepted per position are summed; τ, acceptance rate
    and per-position rate are None without drafts.
    """
    drafts = sum(c.get("drafts") or 0.0 for c in counters)
    draft_tokens = sum(c.get("draft_tokens") or 0.0 for c in counters)
    accepted = sum(c.get("accepted") or 0.0 for c in counters)
    pos: list[float] = []
    for c in counters:
        p = c.get("accepted_per_position") or []
        pos = [a + b for a, b in zip(pos or [0.0] * len(p), p, strict=True)]
    return {
        "drafts": drafts or None,
        "draft_tokens": draft_tokens or None,
        "accepted": accepted if drafts else None,
        "accepted_per_position": pos or None,
        "tau": mean_acceptance_length(accepted, drafts) if drafts else None,
        "acceptance_rate": draft_acceptance_rate(accepted, draft_tokens) if draft_tokens else None,
        "per_position_rate": [a / drafts for a in pos] if drafts and pos else None,
    }


def _row(bases: list[dict[str, Any]], eags: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its windows, round by round (`bases[r]` and `eags[r]` ran in round r)."""
    ratios = [
        e["client"]["output_tok_s"] / b["client"]["output_tok_s"]
        for b, e in zip(bases, eags, strict=True)
        if b["client"]["output_tok_s"]
    ]
    ctr = _pool([e["counters"] for e in eags])

    def med(side: list[dict[str, Any]], field: str) -> float | None:
        xs = [w["client"][field] for w in side if w["client"][field] is not None]
        return _median(xs) if xs else None

    return {
        "temperature": float(eags[0]["temperature"]),
        "concurrency": int(eags[0]["concurrency"]),
        "rounds": len(eags),
        "baseline_tok_s": med(bases, "output_tok_s"),
        "eagle3_tok_s": med(eags, "output_tok_s"),
        "speedup": _median(ratios) if ratios else None,
        "speedups": ratios,
        "baseline_ttft_s": med(bases, "ttft_s_mean"),
        "eagle3_ttft_s": med(eags, "ttft_s_mean"),
        "baseline_itl_s": med(bases, "itl_s_mean"),
        "eagle3_itl_s": med(eags, "itl_s_mean"),
        "baseline_tpot_s": med(bases, "tpot_s_mean"),
        "eagle3_tpot_s": med(eags, "tpot_s_mean"),
        "failed": sum(w["client"]["failed"] for w in bases + eags),
        "tau": ctr["tau"],
        "acceptance_rate": ctr["acceptance_rate"],
        "per_position_rate": ctr["per_position_rate"],
    }


def _windows(sweep: dict[str, Any]) -> dict[tuple[float, int], dict[str, Any]]:
    return {_key(w): w for w in sweep["windows"]}


def pair_rows(bases: list[dict[str, Any]], eags: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (temperature, concurrency) cell from each server's sweeps, one per round.

    Raises:
        ArtifactError: the sweeps did not all run the same windows, or the rounds differ in
            number.
    """
    if len(bases) != len(eags) or not bases:
        raise ArtifactError(
            f"bench: {len(bases)} baseline rounds against {len(eags)} eagle3 rounds; rerun bench"
        )
    b, e = [_windows(x) for x in bases], [_windows(x) for x in eags]
    cells = set(b[0])
    for name, side in (("baseline", b), ("eagle3", e)):
        for r, windows in enumerate(side):
            if set(windows) != cells:
                raise ArtifactError(
                    f"bench: {name} windows {sorted(windows)} of round {r} differ from "
                    f"baseline windows {sorted(cells)}; every shard must run the same recipe "
                    "(rerun bench)"
                )
    return [_row([x[c] for x in b], [x[c] for x in e]) for c in sorted(cells)]


def pooled_acceptance(sweeps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per temperature: τ, acceptance rate and per-position rate over all eagle3 windows."""
    by_t: dict[str, list[dict[str, Any]]] = {}
    for sweep in sweeps:
        for w in sweep["windows"]:
            if w["counters"].get("drafts") is not None:
                by_t.setdefault(str(float(w["temperature"])), []).append(w["counters"])
    out = {}
    for t, counters in by_t.items():
        p = _pool(counters)
        out[t] = {k: p[k] for k in ("tau", "acceptance_rate", "per_position_rate")}
    return out


def by_k(shards: list[dict[str, Any]], k: int) -> dict[int, tuple[list[dict], list[dict]]]:
    """Shard sweeps grouped as `{k: (baseline rounds, eagle3 rounds)}` in round order.

    A sweep without `k` (written before `bench.measure_k` existed) counts as the recipe's
    `k`, round 0.
    """
    out: dict[int, tuple[list[dict], list[dict]]] = {}
    for sw in sorted(shards, key=lambda s: (s.get("k", k), s.get("round", 0))):
        pair = out.setdefault(int(sw.get("k", k)), ([], []))
        pair[0 if sw["mode"] == "baseline" else 1].append(sw)
    return out


def build_report(
    shards: list[dict[str, Any]],
    meta: dict[str, Any],
    checks: list[dict[str, Any]],
    offline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Combine the bench shards' sweeps into the report dict (layout in the module docstring).

    Args:
        shards: every `bench/shard-N.json`, each with its `mode`, `k` and `round`.
        meta: run facts copied into the report (run_id, target, k, prompt_set, ...).
        checks: `diagnosis.export_checks` results.
        offline: `{"tau", "epoch", "per_position"}` of the served checkpoint on the held-out
            split (per_position: its per-position acceptance, which chooses the recommended
            k; see `kchoice`), or None.

    Raises:
        ArtifactError: the recipe's k has no baseline and eagle3 sweeps, or they differ.
    """
    from services.bench.diagnosis import flags_for
    from services.bench.kchoice import k_plan

    k = int(meta.get("k") or 0)
    groups = by_k(shards, k)
    if k not in groups:
        raise ArtifactError(f"bench: no sweep at the recipe's k={k} (have k={sorted(groups)})")
    rows = pair_rows(*groups[k])
    measured = {
        other: {(r["temperature"], r["concurrency"]): r for r in pair_rows(*sides)}
        for other, sides in groups.items()
        if other != k
    }
    pooled = pooled_acceptance(groups[k][1])
    plans = []
    heldout = (offline or {}).get("per_position")
    for r in rows if k else []:
        cell = (r["temperature"], r["concurrency"])
        at_k = {o: m[cell] for o, m in measured.items() if cell in m}
        plan = k_plan(r, k, max(k + 2, *at_k) if at_k else None, at_k, heldout)
        if plan:
            plans.append(plan)
    return {
        **meta,
        "rows": rows,
        "tau": {t: p["tau"] for t, p in pooled.items()},
        "acceptance_rate": {t: p["acceptance_rate"] for t, p in pooled.items()},
        "per_position_rate": {t: p["per_position_rate"] for t, p in pooled.items()},
        "checks": checks,
        "offline": offline,
        "k_plans": plans,
        "flags": flags_for(rows, checks, offline, plans),
    }


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _speedup(r: dict[str, Any]) -> str:
    """The median speedup, with the rounds' range when there were several."""
    rounds = r.get("speedups") or []
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{_f(r['speedup'])}x{spread}"


def to_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: a summary line, the per-window table, then the flags."""
    lines = [
        f"# EAGLE-3 benchmark: {report.get('run_id', '?')}",
        "",
        f"target `{report.get('target', '?')}`, k={report.get('k', '?')}, "
        f"{report.get('num_prompts', '?')} {report.get('prompt_set', '?')} prompts, "
        f"max_tokens {report.get('max_tokens', '?')}; tok/s and speedup: median of "
        f"{report.get('rounds', 1)} round(s), the rounds' range in brackets",
        "",
        "| T | conc | baseline tok/s | eagle3 tok/s | speedup | τ | accept rate | "
        "per-position | TTFT ms (b/e) | ITL ms (b/e) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        pos = " ".join(_f(p) for p in r["per_position_rate"] or []) or "-"
        lines.append(
            f"| {r['temperature']:g} | {r['concurrency']} | {_f(r['baseline_tok_s'], '.1f')} | "
            f"{_f(r['eagle3_tok_s'], '.1f')} | {_speedup(r)} | {_f(r['tau'], '.3f')} | "
            f"{_f(r['acceptance_rate'], '.3f')} | {pos} | "
            f"{_ms(r['baseline_ttft_s'])}/{_ms(r['eagle3_ttft_s'])} | "
            f"{_ms(r['baseline_itl_s'])}/{_ms(r['eagle3_itl_s'])} |"
        )
    lines.append("")
    off = report.get("offline")
    if off and off.get("tau") is not None:
        lines += [
            f"Offline τ of the served checkpoint on the held-out split: {off['tau']:.3f} "
            f"(epoch {off.get('epoch', '?')}).",
            "",
        ]
    lines += _k_lines(report) + _regen_lines(report.get("regen"))
    lines += _vocab_lines(report.get("vocab"))
    checks = report.get("checks") or []
    if checks:
        lines.append(
            "Checked and passed: "
            + ("; ".join(f"{c['check']} ({c['detail']})" for c in checks if c["passed"]) or "none")
        )
        lines.append("")
    for flag in report["flags"]:
        lines += [f"**FLAG ({flag['kind']})**: {flag['message']}", ""]
        lines += [f"- confirmed: {c}" for c in flag["confirmed"]]
        lines += [f"- open: {c['cause']} — {c['evidence']}" for c in flag["open_causes"]]
        lines.append("")
    if not report["flags"]:
        lines.append("No flags: τ and speedup are above their thresholds.")
    return "\n".join(lines) + "\n"


def _regen_lines(counts: dict[str, int] | None) -> list[str]:
    """One line on the regenerated training data: kept, quarantined by reason, redrawn."""
    if not counts:
        return []
    quarantined = ", ".join(
        f"{k.split(':', 1)[1]} {v}"
        for k, v in counts.items()
        if k.startswith(("skipped:", "error:")) and v
    )
    stopped = ", ".join(
        f"{k.split(':', 1)[1]} {v}" for k, v in counts.items() if k.startswith("stopped:") and v
    )
    draws = ", ".join(
        f"{k.split(':', 1)[1]} {v}"
        for k, v in counts.items()
        if k.startswith("draw_quarantined:") and v
    )
    samples = counts.get("samples", counts.get("success", 0))
    return [
        f"Regenerated data: {counts.get('input', 0)} conversations, {counts.get('success', 0)} "
        f"kept as {samples} samples ({counts.get('turns', 0)} answers, "
        f"{counts.get('completion_tokens', 0)} tokens); not kept: {quarantined or 'none'}; "
        f"extra draws not kept: {draws or 'none'}; stopped early: {stopped or 'none'}; "
        f"redrawn answers: {counts.get('resampled', 0)}; kept answers cut at max_tokens: "
        f"{counts.get('finish_length', 0)}.",
        "",
    ]


def _vocab_lines(counts: dict[str, Any] | None) -> list[str]:
    """One line on the draft vocabulary: size, coverage, head rows and weights saved."""
    if not counts or "draft_vocab" not in counts:
        return []
    cov = counts.get("coverage")
    saved = counts.get("head_params_saved")
    return [
        f"Draft vocabulary: {counts['draft_vocab']} of {counts.get('target_vocab', '?')} target "
        f"tokens, covering {'-' if cov is None else format(cov, '.4f')} of "
        f"{counts.get('assistant_tokens', '?')} assistant tokens; head rows saved "
        f"{counts.get('head_rows_saved', '-')}"
        + ("" if saved is None else f" ({saved:,} weights, {2 * saved:,} FLOPs per drafted token)")
        + ".",
        "",
    ]


def _k_lines(report: dict[str, Any]) -> list[str]:
    """Per cell and k: predicted and (where served) measured speedup and τ; the k to serve."""
    plans = report.get("k_plans") or []
    if not plans:
        return []
    ks = [p["k"] for p in plans[0]["per_k"]]
    lines = [
        f"Speedup per k, predicted / measured (services.bench.kchoice; fitted at the "
        f"benchmarked k={report.get('k')}; measured at k = "
        f"{', '.join(str(k) for k in [report.get('k'), *(report.get('measure_k') or [])])}, "
        f"median of {report.get('rounds', 1)} round(s); * = extrapolated acceptance; "
        "τ measured in brackets; held-out: predicted from the served checkpoint's acceptance "
        "on the held-out split and the measured step costs, which chooses the recommended k):",
        "",
        "| T | conc | cost/draft token | "
        + " | ".join(f"k={k}" for k in ks)
        + " | recommended k |",
        "|---|---|---|" + "---|" * len(ks) + "---|",
    ]

    def cell(x: dict[str, Any]) -> str:
        out = f"{x['speedup']:.2f}x{'*' if x['extrapolated'] else ''}"
        if x.get("heldout_speedup") is not None:
            out += f", held-out {x['heldout_speedup']:.2f}x"
        if x.get("measured_speedup") is not None:
            out += f" / {x['measured_speedup']:.2f}x"
            if x.get("measured_tau") is not None:
                out += f" (τ {x['measured_tau']:.2f})"
        return out

    for p in plans:
        rk = p["recommended_k"] or "none pays"
        if p["recommended_k"]:
            at = next(x for x in p["per_k"] if x["k"] == p["recommended_k"])
            got = at.get("measured_speedup")
            rk = f"{rk} ({p.get('recommended_by', 'predicted')}" + (
                f"; measured {got:.2f}x)" if got is not None else ")"
            )
        lines.append(
            f"| {p['temperature']:g} | {p['concurrency']} | {p['draft_token_cost']:.3f} | "
            + " | ".join(cell(x) for x in p["per_k"])
            + f" | {rk} |"
        )
    return [*lines, ""]


def load_report(ref: str | Path, data_root: Path | None = None) -> dict[str, Any]:
    """A report by path (report.json, or a run folder) or by run id under the data root.

    Raises:
        ArtifactError: nothing found.
    """
    from shared.artifacts import RunStore

    p = Path(ref)
    if p.is_file():
        report: dict[str, Any] = json.loads(p.read_text())
        return report
    store = RunStore.at(p) if p.is_dir() else RunStore(str(ref), data_root)
    try:
        return store.report.read()
    except ArtifactError:
        raise ArtifactError(
            f"{ref}: no report (looked for {store.report.json_path}); run `eyrie bench` on it first"
        ) from None


def _prediction_check(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """A's predicted speedup at B's k next to B's measured one, per cell (k must differ)."""
    if a.get("k") == b.get("k"):
        return []
    plans = {(p["temperature"], p["concurrency"]): p for p in a.get("k_plans") or []}
    out = []
    for r in b["rows"]:
        p = plans.get((r["temperature"], r["concurrency"]))
        pred = next((x for x in p["per_k"] if x["k"] == b.get("k")), None) if p else None
        if pred is None or r["speedup"] is None:
            continue
        out.append(
            f"| {r['temperature']:g} | {r['concurrency']} | {pred['speedup']:.2f}x"
            f"{'*' if pred['extrapolated'] else ''} | {r['speedup']:.2f}x |"
        )
    if not out:
        return []
    head = [
        "",
        f"{a.get('run_id', '?')} (k={a.get('k')}) predicted vs {b.get('run_id', '?')} "
        f"(k={b.get('k')}) measured:",
        "",
        "| T | conc | predicted | measured |",
        "|---|---|---|---|",
    ]
    return head + out


def compare_markdown(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Markdown comparing two reports window by window (speedup and τ of A vs B)."""
    ra = {(r["temperature"], r["concurrency"]): r for r in a["rows"]}
    rb = {(r["temperature"], r["concurrency"]): r for r in b["rows"]}
    lines = [
        f"# Compare A = {a.get('run_id', '?')} vs B = {b.get('run_id', '?')}",
        "",
        "| T | conc | speedup A | speedup B | τ A | τ B | eagle3 tok/s A | eagle3 tok/s B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(set(ra) | set(rb)):
        x, y = ra.get(key, {}), rb.get(key, {})
        lines.append(
            f"| {key[0]:g} | {key[1]} | {_f(x.get('speedup'))} | {_f(y.get('speedup'))} | "
            f"{_f(x.get('tau'), '.3f')} | {_f(y.get('tau'), '.3f')} | "
            f"{_f(x.get('eagle3_tok_s'), '.1f')} | {_f(y.get('eagle3_tok_s'), '.1f')} |"
        )
    lines += _prediction_check(a, b) + _prediction_check(b, a)
    for name, rep in (("A", a), ("B", b)):
        for flag in rep.get("flags", []):
            lines.append(f"\n{name} FLAG ({flag['kind']}): {flag['message']}")
    return "\n".join(lines) + "\n"
