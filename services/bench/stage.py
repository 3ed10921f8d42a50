"""The bench and report stages (queue `bench`).

- `bench`: each shard sweeps one server (`bench_plan`): for each k served (the recipe's
  `num_speculative_tokens`, then `measure_k`) and each of `rounds` rounds, a baseline shard
  and an eagle3 shard, so with the default one k and one round shard 0 is the baseline and
  shard 1 eagle3. The conductor starts the servers each k's group needs (keeping the
  baseline, the same for every k) and enqueues its shards in order: side by side, the rounds
  alternate; one server at a time, each server runs its rounds in a row. Each writes
  `bench/shard-N.json` (`services.bench.sweep`);
- `report`: combines all shards into `report/` (report.json, report.md, speedup.png,
  acceptance.png), with flags (`services.bench.diagnosis`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shared.artifacts import RunStore
from shared.conventions import resolve_aux_layer_ids
from shared.errors import ConfigError, StageFailedError
from shared.recipe import Recipe
from shared.stage import HOUR_S, ShardResult, StageContext, stage
from shared.store import atomic_write_bytes, atomic_write_json, make_dirs
from shared.vllm import target_num_layers

log = logging.getLogger("eyrie.bench")


@dataclass(frozen=True)
class BenchShard:
    """What one bench shard measures.

    Attributes:
        k: the eagle3 server's draft tokens per step in this shard's group.
        round: the round (0-based) within that k's group.
        mode: "baseline" or "eagle3".
    """

    k: int
    round: int
    mode: str


def bench_plan(recipe: Recipe) -> list[BenchShard]:
    """Every bench shard in order, per k served.

    Side by side, each round of each k is a baseline then an eagle3 shard, so the rounds
    alternate. Otherwise (one server at a time) every k's baseline rounds come first, then
    each k's eagle3 rounds: the baseline server, which no k changes, starts once for all of
    them (`services.conductor.servers.ServerPool`), and each k's eagle3 server once.
    """
    b = recipe.bench
    ks = b.served_ks()
    if b.side_by_side:
        order = [(k, r, m) for k in ks for r in range(b.rounds) for m in ("baseline", "eagle3")]
    else:
        order = [(k, r, m) for m in ("baseline", "eagle3") for k in ks for r in range(b.rounds)]
    return [BenchShard(k, r, m) for k, r, m in order]


def bench_shard(recipe: Recipe, shard: int) -> BenchShard:
    """Shard `shard` of `bench_plan`.

    Raises:
        ConfigError: no such shard in this recipe's plan.
    """
    plan = bench_plan(recipe)
    if not 0 <= shard < len(plan):
        raise ConfigError(f"bench shard must be 0..{len(plan) - 1} for this recipe (got {shard})")
    return plan[shard]


def shard_mode(recipe: Recipe, shard: int) -> str:
    """The server mode bench shard `shard` measures ("baseline" or "eagle3")."""
    return bench_shard(recipe, shard).mode


def server_recipe(recipe: Recipe, shard: int) -> Recipe:
    """The recipe the servers of bench shard `shard` start with: its group's k."""
    k = bench_shard(recipe, shard).k
    if k == recipe.bench.num_speculative_tokens:
        return recipe
    bench = recipe.bench.model_copy(update={"num_speculative_tokens": k})
    return recipe.model_copy(update={"bench": bench})


def _side_by_side(recipe: Recipe) -> bool:
    return recipe.bench.side_by_side


def request_extras(recipe: Recipe) -> dict[str, Any]:
    """Request fields both servers get: the template kwargs regen and tokenize used."""
    kw = recipe.target.chat_template_kwargs
    return {"chat_template_kwargs": dict(kw)} if kw else {}


@contextlib.contextmanager
def measuring_alone(store: RunStore) -> Iterator[None]:
    """Hold the run's measurement lock (flock) while a sweep runs.

    Both servers may be up side by side, but two sweeps measured at once would share the
    CPU/GPU and distort each other's tok/s; so shards 0 and 1 take turns even when two
    bench workers picked them up together. The wait is bounded by the rq job timeout.
    """
    path = store.bench.lock_path
    make_dirs(path.parent)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@stage(
    "bench",
    queue="bench",
    timeout_s=4 * HOUR_S,
    shards=lambda recipe: len(bench_plan(recipe)),
    after=("export", "split"),
    gpu_phase="bench",
    server=shard_mode,
    side_by_side=_side_by_side,
    server_recipe=server_recipe,
)
def bench_stage(ctx: StageContext) -> ShardResult:
    """Sweep the server of `bench_plan`'s shard into `bench/shard-N.json`.

    Raises:
        StageFailedError: the eagle3 server drafts another k than the shard measures (a
            server started by hand for `eyrie bench` without `--start`).
    """
    from services.bench.prompts import benchmark_messages
    from services.bench.sweep import sweep_server, with_second_turns

    store, cfg = ctx.store, ctx.recipe.bench
    plan = bench_shard(ctx.recipe, ctx.shard)
    mode = plan.mode
    url = ctx.server_url(mode)
    extras = request_extras(ctx.recipe)
    prompts, source = benchmark_messages(store, ctx.recipe)
    with measuring_alone(store):
        if cfg.second_turn and cfg.prompt_set == "mtbench":
            baseline = ctx.server_url("baseline")
            prompts = with_second_turns(store.bench.turn1_path, baseline, prompts, cfg, extras)
        with ctx.progress(len(cfg.temperatures) * len(cfg.concurrency), "windows") as bar:

            def tick(w: dict[str, Any]) -> None:
                tau = w["counters"]["tau"] or 0.0
                bar.update(1, tok_s=round(w["client"]["output_tok_s"], 1), tau=tau)

            result = sweep_server(url, mode, prompts, cfg, tick, extras)
    if mode == "eagle3":
        check_served_k(result, plan.k)
    result = {
        **result,
        "k": plan.k,
        "round": plan.round,
        "prompt_source": source,
        "second_turn": cfg.second_turn,
    }
    out = store.bench.write_shard(ctx.shard, result)
    counts = {
        "windows": len(result["windows"]),
        "prompts": result["num_prompts"],
        "failed_requests": sum(w["client"]["failed"] for w in result["windows"]),
    }
    return ShardResult(counts, [out], {"mode": mode})


def check_served_k(sweep: dict[str, Any], k: int) -> None:
    """Raise StageFailedError unless the eagle3 sweep's counters show `k` draft positions.

    vLLM exports one `accepted_per_position` series per drafted position, so its length is
    the server's `num_speculative_tokens`.
    """
    for w in sweep["windows"]:
        pos = w["counters"].get("accepted_per_position")
        if pos and len(pos) != k:
            raise StageFailedError(
                f"{sweep['url']}: the eagle3 server drafts {len(pos)} tokens per step, this "
                f"bench shard measures k={k}; serve that k, or let `eyrie bench --start` "
                "start the servers"
            )


def report_meta(store: RunStore, recipe: Recipe) -> dict[str, Any]:
    """Run facts the report header shows."""
    b = recipe.bench
    return {
        "run_id": store.run_id,
        "target": recipe.target.path,
        "k": b.num_speculative_tokens,
        "measure_k": b.measure_k,
        "rounds": b.rounds,
        "prompt_set": b.prompt_set,
        "num_prompts": b.num_prompts,
        "max_tokens": b.max_tokens,
        "second_turn": b.second_turn,
    }


def export_checks(store: RunStore, recipe: Recipe) -> list[dict[str, Any]]:
    """`diagnosis.export_checks` on the run's served draft against the recipe."""
    from services.bench.diagnosis import export_checks as checks
    from shared.draft import NORM_FLAGS
    from shared.vllm import speculative_config

    ids = resolve_aux_layer_ids(recipe.layers, target_num_layers(recipe))
    flags = {f: getattr(recipe.draft, f) for f in NORM_FLAGS}
    draft = store.export.vllm_draft
    spec = speculative_config(recipe, "eagle3", draft) or {}
    return checks(draft, ids, flags, str(spec.get("method")), recipe.target.path)


def offline_tau(store: RunStore) -> dict[str, Any] | None:
    """The best validated epoch (the one export serves) on the held-out split, or None.

    Returns:
        `{"tau", "epoch", "per_position"}`: its simulated τ and per-position acceptance
        (`accept_rate_per_pos` of that epoch's validation record; None in a run validated
        before it was recorded).
    """
    from shared.records import BestCheckpoint

    path = store.train.best_path
    if not path.is_file():
        return None
    rec = BestCheckpoint.model_validate_json(path.read_text())
    best = rec.best
    if not best:
        return None
    val = next((v for v in rec.validations if v.get("epoch") == best.get("epoch")), {})
    return {
        "tau": best.get("tau"),
        "epoch": best.get("epoch"),
        "per_position": val.get("accept_rate_per_pos"),
    }


def regen_counts(store: RunStore) -> dict[str, int] | None:
    """The regen manifests' counts summed over shards; None when the run did not regenerate.

    Rows kept, quarantined by reason, stopped early, answers redrawn and cut at max_tokens.
    """
    manifests = store.manifests("regen")
    if not manifests:
        return None
    total: dict[str, int] = {}
    for m in manifests:
        for key, value in m.counts.items():
            if isinstance(value, int):
                total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def vocab_counts(store: RunStore) -> dict[str, Any] | None:
    """The vocab manifest's sizes, head savings and coverage; None without a vocab stage."""
    manifests = store.manifests("vocab")
    if not manifests:
        return None
    m = manifests[0]
    return {**m.counts, "coverage": m.extra.get("coverage")}


@stage("report", queue="bench", timeout_s=HOUR_S, after=("bench",))
def report_stage(ctx: StageContext) -> ShardResult:
    """Combine every bench shard into the report folder.

    Raises:
        ArtifactError: a bench shard is missing.
    """
    from services.bench.plots import plot_acceptance, plot_speedup
    from services.bench.report import build_report, to_markdown

    store, art = ctx.store, ctx.store.report
    shards = [store.bench.read_shard(s) for s in range(len(bench_plan(ctx.recipe)))]
    report = build_report(
        shards,
        report_meta(store, ctx.recipe),
        export_checks(store, ctx.recipe),
        offline_tau(store),
    )
    report["regen"] = regen_counts(store)
    report["vocab"] = vocab_counts(store)
    files = [
        atomic_write_json(art.json_path, report),
        atomic_write_bytes(art.markdown_path, to_markdown(report).encode()),
        plot_speedup(report, art.speedup_plot),
        plot_acceptance(report, art.acceptance_plot),
    ]
    for flag in report["flags"]:
        log.warning("bench flag %s: %s", flag["kind"], flag["message"])
    counts = {"rows": len(report["rows"]), "flags": len(report["flags"])}
    return ShardResult(counts, files, {"tau": report["tau"]})
