"""The eval and report stages (queue `eval`).

- `run_eval(store, recipe, shard)`: shard 0 benchmarks the baseline server, shard 1 the
  eagle3 server (the conductor starts them through `services.serve.launcher` before it
  enqueues); writes `eval/shard-0000N.json` (`services.bench.sweep`).
- `run_report(store, recipe, shard)`: combines both shards into `report/report.json`,
  `report.md`, `speedup.png` and `acceptance.png`, with flags (`services.bench.diagnosis`).

Both are idempotent: the manifest is written last, and the conductor skips a done shard.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from shared.conventions import resolve_aux_layer_ids
from shared.errors import ArtifactError, ConfigError
from shared.recipe import Recipe
from shared.store import Manifest, RunStore, atomic_write_bytes, atomic_write_json

log = logging.getLogger("eyrie.bench")

SHARD_MODES = {0: "baseline", 1: "eagle3"}
TURN1_FILE = "turn1-answers.json"


def _mode(shard: int) -> str:
    if shard not in SHARD_MODES:
        raise ConfigError(f"eval shard must be 0 (baseline) or 1 (eagle3) (got {shard})")
    return SHARD_MODES[shard]


def request_extras(recipe: Recipe) -> dict[str, Any]:
    """Request fields both servers get: the template kwargs regen and tokenize used."""
    kw = recipe.target.chat_template_kwargs
    return {"chat_template_kwargs": dict(kw)} if kw else {}


@contextlib.contextmanager
def measuring_alone(store: RunStore) -> Iterator[None]:
    """Hold the run's measurement lock (`eval/.measure.lock`, flock) while a sweep runs.

    Both servers may be up side by side, but two sweeps measured at once would share the
    CPU/GPU and distort each other's tok/s; so shards 0 and 1 take turns even when two
    eval workers picked them up together. The wait is bounded by the rq job timeout.
    """
    import fcntl

    path = store.stage_dir("eval") / ".measure.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def benchmark(
    store: RunStore, recipe: Recipe, mode: str, url: str, baseline_url: str
) -> dict[str, Any]:
    """Sweep the server at `url` with the recipe's prompt set; the shard JSON dict.

    Args:
        baseline_url: where the target alone answers MT-Bench turn 1 (second turn only).
    """
    from services.bench.prompts import benchmark_messages
    from services.bench.sweep import sweep_server, with_second_turns
    from shared.progress import Progress

    cfg = recipe.eval
    prompts, source = benchmark_messages(store, recipe)
    total = len(cfg.temperatures) * len(cfg.concurrency)
    with measuring_alone(store):
        if cfg.second_turn and cfg.prompt_set == "mtbench":
            turn1 = store.stage_dir("eval") / TURN1_FILE
            prompts = with_second_turns(turn1, baseline_url, prompts, cfg, request_extras(recipe))
        with Progress(total, "windows", f"eval {mode}") as bar:

            def tick(w: dict[str, Any]) -> None:
                tau = w["counters"]["tau"] or 0.0
                bar.update(1, tok_s=round(w["client"]["output_tok_s"], 1), tau=tau)

            result = sweep_server(url, mode, prompts, cfg, tick, request_extras(recipe))
    return {**result, "prompt_source": source, "second_turn": cfg.second_turn}


def run_eval(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Benchmark one server (shard 0 baseline, shard 1 eagle3) into `eval/shard-N.json`."""
    from services.serve.launcher import base_url

    mode = _mode(shard)
    return eval_at(store, recipe, shard, base_url(recipe, mode), base_url(recipe, "baseline"))


def eval_at(store: RunStore, recipe: Recipe, shard: int, url: str, baseline_url: str) -> Manifest:
    """`run_eval` against explicit server URLs (the CLI's `--baseline-url/--eagle3-url`)."""
    mode = _mode(shard)
    result = benchmark(store, recipe, mode, url, baseline_url)
    out = atomic_write_json(store.shard_path("eval", shard, ".json"), result)
    counts = {
        "windows": len(result["windows"]),
        "prompts": result["num_prompts"],
        "failed_requests": sum(w["client"]["failed"] for w in result["windows"]),
    }
    return store.write_manifest("eval", shard, counts, [out], extra={"mode": mode})


def report_meta(store: RunStore, recipe: Recipe) -> dict[str, Any]:
    """Run facts the report header shows."""
    return {
        "run_id": store.run_id,
        "target": recipe.target.path,
        "k": recipe.eval.num_speculative_tokens,
        "prompt_set": recipe.eval.prompt_set,
        "num_prompts": recipe.eval.num_prompts,
        "max_tokens": recipe.eval.max_tokens,
        "second_turn": recipe.eval.second_turn,
    }


def export_problems(store: RunStore, recipe: Recipe) -> list[str]:
    """`diagnosis.check_export` on the run's `export/vllm` against the recipe."""
    from services.bench.diagnosis import NORM_FLAGS, check_export

    export = store.root / "export" / "vllm"
    cfg_path = export / "config.json"
    if not cfg_path.is_file():
        return []
    from services.serve.launcher import target_num_layers

    ids = resolve_aux_layer_ids(recipe.layers, target_num_layers(recipe))
    flags = {f: getattr(recipe.draft, f) for f in NORM_FLAGS}
    return check_export(export, ids, flags)


def write_report(out_dir: Any, report: dict[str, Any]) -> list:
    """Write report.json, report.md and both PNGs into `out_dir`; returns their paths."""
    from services.bench.plots import plot_acceptance, plot_speedup
    from services.bench.report import to_markdown

    files = [
        atomic_write_json(out_dir / "report.json", report),
        atomic_write_bytes(out_dir / "report.md", to_markdown(report).encode()),
        plot_speedup(report, out_dir / "speedup.png"),
        plot_acceptance(report, out_dir / "acceptance.png"),
    ]
    return files


def run_report(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Combine `eval/shard-0` and `eval/shard-1` into the report folder.

    Raises:
        ArtifactError: an eval shard is missing.
    """
    from services.bench.report import build_report

    shards = []
    for s in (0, 1):
        path = store.shard_path("eval", s, ".json")
        if not path.is_file():
            raise ArtifactError(f"{path}: eval shard {s} ({SHARD_MODES[s]}) has not run")
        shards.append(json.loads(path.read_text()))
    report = build_report(
        shards[0], shards[1], report_meta(store, recipe), export_problems(store, recipe)
    )
    files = write_report(store.stage_dir("report"), report)
    for flag in report["flags"]:
        log.warning("bench flag %s: %s", flag["kind"], flag["message"])
    return store.write_manifest(
        "report",
        shard,
        {"rows": len(report["rows"]), "flags": len(report["flags"])},
        files,
        extra={"tau": report["tau"]},
    )
