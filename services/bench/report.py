"""The benchmark report: baseline and eagle3 sweeps side by side, as JSON and Markdown.

`build_report` pairs the windows of the two servers by (temperature, concurrency); speedup
is eagle3 output tok/s ÷ baseline output tok/s, both measured by the same client on the same
prompts. τ is reported per (temperature, concurrency) cell from that window's counter deltas
(τ = 1 + accepted / drafts, `shared.conventions.mean_acceptance_length`); the pooled τ per
temperature (every concurrency's deltas summed) is kept for the acceptance plot.

report.json layout: `{"run_id", "target", "k", "prompt_set", "num_prompts", "max_tokens",
"rows": [Row], "tau": {"<T>": pooled τ}, "acceptance_rate": {"<T>": r},
"per_position_rate": {"<T>": [k floats]}, "checks": [Check], "offline": {"tau", "epoch"} |
None, "k_plans": [Plan], "flags": [Flag], "regen": {count: n} | None, "vocab": {count: n} |
None}` (regen: the regen manifests' counts summed; vocab: the vocab manifest's counts and
coverage; both added by the report stage) (Check: `diagnosis.export_checks`; Plan:
`kchoice.k_plan`, one per row with counters; Flag: `diagnosis.flags_for`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.conventions import draft_acceptance_rate, mean_acceptance_length
from shared.errors import ArtifactError


def _key(w: dict[str, Any]) -> tuple[float, int]:
    return float(w["temperature"]), int(w["concurrency"])


def _row(base: dict[str, Any], eag: dict[str, Any]) -> dict[str, Any]:
    b, e, ctr = base["client"], eag["client"], eag["counters"]
    return {
        "temperature": float(eag["temperature"]),
        "concurrency": int(eag["concurrency"]),
        "baseline_tok_s": b["output_tok_s"],
        "eagle3_tok_s": e["output_tok_s"],
        "speedup": e["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else None,
        "baseline_ttft_s": b["ttft_s_mean"],
        "eagle3_ttft_s": e["ttft_s_mean"],
        "baseline_itl_s": b["itl_s_mean"],
        "eagle3_itl_s": e["itl_s_mean"],
        "baseline_tpot_s": b["tpot_s_mean"],
        "eagle3_tpot_s": e["tpot_s_mean"],
        "failed": b["failed"] + e["failed"],
        "tau": ctr["tau"],
        "acceptance_rate": ctr["acceptance_rate"],
        "per_position_rate": ctr["per_position_rate"],
    }


def pair_rows(baseline: dict[str, Any], eagle3: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (temperature, concurrency) window both servers ran.

    Raises:
        ArtifactError: the two sweeps did not run the same windows.
    """
    b = {_key(w): w for w in baseline["windows"]}
    e = {_key(w): w for w in eagle3["windows"]}
    if set(b) != set(e):
        raise ArtifactError(
            f"bench: baseline windows {sorted(b)} differ from eagle3 windows {sorted(e)}; "
            "both shards must run the same recipe (rerun bench)"
        )
    return [_row(b[k], e[k]) for k in sorted(b)]


def pooled_acceptance(eagle3: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per temperature: τ, acceptance rate and per-position rate over all its windows."""
    pools: dict[str, dict[str, Any]] = {}
    for w in eagle3["windows"]:
        c = w["counters"]
        if c.get("drafts") is None:
            continue
        p = pools.setdefault(
            str(float(w["temperature"])),
            {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "pos": []},
        )
        p["drafts"] += c["drafts"]
        p["draft_tokens"] += c["draft_tokens"] or 0.0
        p["accepted"] += c["accepted"] or 0.0
        pos = c.get("accepted_per_position") or []
        p["pos"] = [a + b for a, b in zip(p["pos"] or [0.0] * len(pos), pos, strict=True)]
    out = {}
    for t, p in pools.items():
        d = p["drafts"]
        out[t] = {
            "tau": mean_acceptance_length(p["accepted"], d) if d else None,
            "acceptance_rate": draft_acceptance_rate(p["accepted"], p["draft_tokens"])
            if p["draft_tokens"]
            else None,
            "per_position_rate": [a / d for a in p["pos"]] if d else None,
        }
    return out


def build_report(
    baseline: dict[str, Any],
    eagle3: dict[str, Any],
    meta: dict[str, Any],
    checks: list[dict[str, Any]],
    offline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Combine both shards' sweeps into the report dict (layout in the module docstring).

    Args:
        baseline, eagle3: `bench/shard-00000.json` and `bench/shard-00001.json` contents.
        meta: run facts copied into the report (run_id, target, k, prompt_set, ...).
        checks: `diagnosis.export_checks` results.
        offline: `{"tau", "epoch"}` of the served checkpoint on the held-out split, or None.
    """
    from services.bench.diagnosis import flags_for
    from services.bench.kchoice import k_plan

    rows = pair_rows(baseline, eagle3)
    pooled = pooled_acceptance(eagle3)
    k = int(meta.get("k") or 0)
    plans = [p for p in (k_plan(r, k) for r in rows) if p] if k else []
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


def to_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: a summary line, the per-window table, then the flags."""
    lines = [
        f"# EAGLE-3 benchmark: {report.get('run_id', '?')}",
        "",
        f"target `{report.get('target', '?')}`, k={report.get('k', '?')}, "
        f"{report.get('num_prompts', '?')} {report.get('prompt_set', '?')} prompts, "
        f"max_tokens {report.get('max_tokens', '?')}",
        "",
        "| T | conc | baseline tok/s | eagle3 tok/s | speedup | τ | accept rate | "
        "per-position | TTFT ms (b/e) | ITL ms (b/e) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        pos = " ".join(_f(p) for p in r["per_position_rate"] or []) or "-"
        lines.append(
            f"| {r['temperature']:g} | {r['concurrency']} | {_f(r['baseline_tok_s'], '.1f')} | "
            f"{_f(r['eagle3_tok_s'], '.1f')} | {_f(r['speedup'])}x | {_f(r['tau'], '.3f')} | "
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
    """The predicted speedup per k per cell, with the measured one and the recommended k."""
    plans = report.get("k_plans") or []
    if not plans:
        return []
    ks = [p["k"] for p in plans[0]["per_k"]]
    lines = [
        f"Predicted speedup per k (services.bench.kchoice; fitted at the benchmarked "
        f"k={report.get('k')}, * = extrapolated acceptance):",
        "",
        "| T | conc | cost/draft token | "
        + " | ".join(f"k={k}" for k in ks)
        + " | measured | recommended k |",
        "|---|---|---|" + "---|" * len(ks) + "---|---|",
    ]
    for p in plans:
        cells = " | ".join(
            f"{x['speedup']:.2f}x{'*' if x['extrapolated'] else ''}" for x in p["per_k"]
        )
        rk = p["recommended_k"] or "none pays"
        lines.append(
            f"| {p['temperature']:g} | {p['concurrency']} | {p['draft_token_cost']:.3f} | "
            f"{cells} | {p['measured_speedup']:.2f}x | {rk} |"
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
