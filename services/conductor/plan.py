"""`eyrie plan RECIPE` and `eyrie pull RECIPE`: what a run will need, before anything runs.

The plan is arithmetic over the recipe and the target's `config.json` (`shared.sizing`):
per stage the disk it writes, the GPU memory it needs per GPU and its wall time at the
recipe's stated rates (`rates.*`), then whether this node has the disk (free space of the
data volume and of the Hugging Face cache) and the GPU memory. `eyrie run` makes the same
plan first and refuses (exit 2) a run with a problem, printing both numbers.

`eyrie pull` downloads the target into the Hugging Face cache (`shared.model.pull`), the
model step every run of a hub-id target needs before a server starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from shared.cli import add_recipe_args
from shared.errors import ConfigError
from shared.recipe import Recipe

GIB = 2**30


@dataclass
class StagePlan:
    """One row of the plan.

    Attributes:
        name: stage (or step) name.
        disk_bytes: bytes it leaves on its volume.
        gpu_bytes: peak memory per GPU in bytes, or None (no GPU).
        seconds: wall time at the stated rates, server start-ups included.
        note: how the numbers were made.
    """

    name: str
    disk_bytes: int
    gpu_bytes: int | None
    seconds: float
    note: str = ""


@dataclass
class RunPlan:
    """The whole plan of a recipe on this node.

    Attributes:
        stages: per stage rows, in pipeline order.
        samples: conversations the mix asks for (None = unknown: a dataset has no cap), or
            the samples the run's tokenize stage kept once it has finished.
        tokens: tokenized tokens: estimated (samples × `rates.mean_sample_tokens`), or
            counted by the run's tokenize stage.
        hs_bytes_per_token: hidden-state bytes stored per token.
        weight_bytes: the target's checkpoint size in bytes.
        weight_source: `local files` or `config estimate`.
        draft_params: `shared.sizing.draft_param_counts`.
        load_s: seconds one server start-up loads weights for.
        data_root, data_free: the run volume and its free bytes.
        cache_dir, cache_free, cache_needed: the HF cache, its free bytes, bytes still to
            download there.
        gpu_memory_bytes: memory of one GPU (None = unknown).
        problems: reasons the run cannot go through on this node; [] = it can.
        notes: what the estimates leave out.
    """

    stages: list[StagePlan]
    samples: int | None
    tokens: int
    hs_bytes_per_token: int
    weight_bytes: int
    weight_source: str
    draft_params: dict[str, int]
    load_s: float
    data_root: Path
    data_free: int
    cache_dir: Path
    cache_free: int
    cache_needed: int
    gpu_memory_bytes: int | None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def data_needed(self) -> int:
        """Bytes the run writes on the data volume (every stage but the model step)."""
        return sum(s.disk_bytes for s in self.stages if s.name != "model")


def mix_samples(recipe: Recipe) -> int | None:
    """Conversations the dataset mix yields before filtering.

    The sum of each dataset's `max_samples`, capped by `prep.max_samples`; None when
    uncapped and a dataset has none.
    """
    per = [d.max_samples for d in recipe.datasets]
    total = None if any(n is None for n in per) else sum(n for n in per if n is not None)
    cap = recipe.prep.max_samples
    if cap is not None:
        return cap if total is None else min(cap, total)
    return total


def _free(path: Path) -> tuple[Path, int]:
    """(nearest existing folder of `path`, its volume's free bytes)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p, shutil.disk_usage(p).free


def _hf_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _gpu_memory(recipe: Recipe) -> int | None:
    if recipe.rates.gpu_memory_gib:
        return int(recipe.rates.gpu_memory_gib * GIB)
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    import subprocess

    from services.conductor.gpu import QUERY, parse_memory_used

    res = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=30)
    usage = parse_memory_used(res.stdout) if res.returncode == 0 else {}
    return min(total for _, total in usage.values()) * 2**20 if usage else None


def _tokenized(recipe: Recipe) -> tuple[int, int] | None:
    """(samples, tokens) the run's finished tokenize stage counted, or None before that."""
    from shared.artifacts import RunStore

    store = RunStore(recipe.run_id())
    if not store.is_done("plan"):
        return None
    shards = store.plan.num_shards()
    if not shards or not all(store.is_done("tokenize", s) for s in range(shards)):
        return None
    ms = store.manifests("tokenize")
    return sum(m.counts.get("samples", 0) for m in ms), sum(m.counts.get("tokens", 0) for m in ms)


def _written_bytes(recipe: Recipe) -> int:
    """Bytes the run's folder already holds (0 for a new run)."""
    from shared.artifacts import RunStore

    folder = RunStore(recipe.run_id()).root
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _uses_gpu(device: str) -> bool:
    return device != "cpu"


def make_plan(recipe: Recipe, recipe_path: str = "RECIPE") -> RunPlan:
    """The plan of `recipe` on this node (see the module docstring).

    Args:
        recipe: the resolved recipe.
        recipe_path: how the recipe is named in fix commands (`eyrie pull PATH`).

    Raises:
        ConfigError: the target has no local folder or cached snapshot (the message names
            `eyrie pull`), or its config cannot be read.
    """
    from shared import sizing
    from shared.model import local_snapshot, plan_problems, weight_bytes
    from shared.store import data_root
    from shared.target import raw_target_config, target_config

    problems = plan_problems(recipe, recipe_path)
    snap = local_snapshot(recipe)
    if snap is None:
        # Nothing local to size the run from, and the hub is not for a plan to reach.
        raise ConfigError(f"{recipe_path}: cannot plan the run: " + "; ".join(problems))
    cfg = target_config(recipe)
    full = raw_target_config(recipe)
    rates = recipe.rates

    local_bytes = weight_bytes(snap) if snap is not None else 0
    if local_bytes and not problems:
        wbytes, wsource = local_bytes, "local files"
    else:
        wbytes, wsource = sizing.estimate_target_weight_bytes(full), "config estimate"
    load_s = wbytes / rates.load_bytes_per_s

    samples = mix_samples(recipe)
    per_sample = min(rates.mean_sample_tokens, recipe.prep.max_len_tokens)
    tokens = (samples or 0) * per_sample
    counted = _tokenized(recipe)
    if counted is not None:  # a resumed run: its tokenize stage counted them
        samples, tokens = counted
        per_sample = tokens // max(samples, 1)
    train_tokens = int(tokens * (1 - recipe.train.val_fraction))
    hs_tok = sizing.hidden_state_bytes_per_token(recipe, cfg)
    dp = sizing.draft_param_counts(recipe, cfg)
    tp = recipe.serve.tensor_parallel_size
    serve_gpu = wbytes // tp
    # Conversations, token ids and masks, several copies across prep stages: ~64 B/token.
    prep_disk = tokens * 64
    ckpts = recipe.train.keep_last + 2  # + best + the rolling step checkpoint
    ckpt_disk = dp["trainable"] * sizing.CHECKPOINT_BYTES_PER_PARAM * ckpts
    # speculators and llama exports, bf16 trainables + lm_head + embedding.
    export_disk = 2 * 2 * dp["total"]
    train_gpu = sizing.train_memory_bytes(recipe, cfg, recipe.train.tokens_per_step)
    regen_s = load_s + tokens / rates.regen_tokens_per_s if recipe.regen.enabled else 0.0
    # One baseline server for every k, an eagle3 server per k (services.bench.stage.bench_plan,
    # services.conductor.servers.ServerPool); per k and round, a sweep of each.
    bench_starts = 1 + len(recipe.bench.served_ks())
    bench_tokens = (
        recipe.bench.num_prompts
        * recipe.bench.max_tokens
        * len(recipe.bench.concurrency)
        * len(recipe.bench.temperatures)
        * recipe.bench.rounds
        * 2
        * len(recipe.bench.served_ks())
    )
    to_download = 0 if (snap is not None and not problems) else wbytes
    stages = [
        StagePlan("model", to_download, None, 0.0, f"target weights, {wsource}"),
        StagePlan("prep", prep_disk, None, 0.0, f"{samples} samples × {per_sample} tokens"),
    ]
    if recipe.regen.enabled:
        stages.append(
            StagePlan("regen", 0, serve_gpu, regen_s, f"1 server start + {tokens} tokens generated")
        )
    stages += [
        StagePlan(
            "extract",
            tokens * hs_tok,
            serve_gpu if recipe.extract.backend == "vllm" else None,
            load_s + tokens / rates.extract_tokens_per_s,
            f"{tokens} tokens × {hs_tok} B/token",
        ),
        StagePlan(
            "train",
            ckpt_disk,
            train_gpu if _uses_gpu(recipe.train.device) else None,
            sizing.train_estimate_s(recipe, train_tokens),
            f"{ckpts} checkpoints of {dp['trainable']} trainable params; "
            f"{recipe.train.tokens_per_step} tokens/step",
        ),
        StagePlan("export", export_disk, None, 0.0, f"draft of {dp['total']} params, bf16"),
        StagePlan(
            "bench",
            0,
            serve_gpu,
            bench_starts * load_s + bench_tokens / rates.regen_tokens_per_s,
            f"{bench_starts} server starts",
        ),
    ]

    root, data_free = _free(data_root())
    written = _written_bytes(recipe)
    cache_dir, cache_free = _free(_hf_cache())
    gpu_mem = _gpu_memory(recipe)
    plan = RunPlan(
        stages, samples, tokens, hs_tok, wbytes, wsource, dp, load_s, root, data_free,
        cache_dir, cache_free, to_download, gpu_mem, problems,
    )  # fmt: skip
    same_volume = os.stat(root).st_dev == os.stat(cache_dir).st_dev
    # A resumed run has part of its output on disk already; only the rest needs room.
    need_data = max(0, plan.data_needed - written) + (to_download if same_volume else 0)
    if need_data > data_free:
        plan.problems.append(
            f"disk: the run needs an estimated {need_data / GIB:,.1f} GiB on {root} "
            f"but {data_free / GIB:,.1f} GiB are free"
        )
    if not same_volume and to_download > cache_free:
        plan.problems.append(
            f"disk: the target needs {to_download / GIB:,.1f} GiB in the Hugging Face cache "
            f"{cache_dir} but {cache_free / GIB:,.1f} GiB are free"
        )
    if samples is None:
        plan.notes.append(
            "datasets: a dataset has no max_samples and prep.max_samples is unset, so the "
            "data-dependent sizes are left out (set prep.max_samples to plan them)"
        )
    if gpu_mem is not None:
        usable = int(gpu_mem * recipe.serve.gpu_memory_utilization)
        if serve_gpu > usable:
            plan.problems.append(
                f"gpu: the target's weights need {serve_gpu / GIB:,.1f} GiB per GPU at "
                f"tensor-parallel {tp} but {usable / GIB:,.1f} GiB are usable "
                "(serve.gpu_memory_utilization); raise serve.tensor_parallel_size"
            )
        if _uses_gpu(recipe.train.device) and train_gpu > gpu_mem:
            plan.problems.append(
                f"gpu: training at train.tokens_per_step={recipe.train.tokens_per_step} needs "
                f"an estimated {train_gpu / GIB:,.1f} GiB per GPU but a GPU has "
                f"{gpu_mem / GIB:,.1f} GiB; lower train.tokens_per_step"
            )
    return plan


def _hms(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}m" if seconds else "-"


def format_plan(plan: RunPlan) -> str:
    """The plan as a table plus the node check, for the terminal."""
    gb = 1e9
    dp = plan.draft_params
    lines = [
        f"target weights: {plan.weight_bytes / gb:,.1f} GB ({plan.weight_source}); one "
        f"server start loads for {plan.load_s / 60:.1f} min",
        f"data: {plan.samples} samples, ~{plan.tokens:,} tokens; hidden states "
        f"{plan.hs_bytes_per_token:,} B/token ({plan.hs_bytes_per_token / 1024:.0f} KiB)",
        f"draft: {dp['total'] / 1e9:.2f}B params ({dp['trainable'] / 1e9:.2f}B trainable)",
        "",
        f"{'stage':<8} {'disk GB':>10} {'GPU GiB':>9} {'time':>9}  note",
    ]
    for s in plan.stages:
        gpu = f"{s.gpu_bytes / GIB:,.1f}" if s.gpu_bytes is not None else "-"
        lines.append(
            f"{s.name:<8} {s.disk_bytes / gb:>10,.1f} {gpu:>9} {_hms(s.seconds):>9}  {s.note}"
        )
    total_s = sum(s.seconds for s in plan.stages)
    lines += [
        f"{'total':<8} {plan.data_needed / gb:>10,.1f} {'':>9} {_hms(total_s):>9}",
        "",
        f"node: {plan.data_free / gb:,.1f} GB free on {plan.data_root} (needs "
        f"{plan.data_needed / gb:,.1f} GB); {plan.cache_free / gb:,.1f} GB free in the HF "
        f"cache {plan.cache_dir} (needs {plan.cache_needed / gb:,.1f} GB); GPU memory "
        + (f"{plan.gpu_memory_bytes / GIB:,.0f} GiB" if plan.gpu_memory_bytes else "unknown"),
    ]
    lines += [f"note: {n}" for n in plan.notes]
    if plan.problems:
        lines += ["", "cannot run on this node:"] + [f"  - {p}" for p in plan.problems]
    else:
        lines += ["", "fits this node"]
    return "\n".join(lines)


def refuse_unless_fits(recipe: Recipe, recipe_path: str) -> RunPlan:
    """`eyrie run`'s gate: the plan, or ConfigError listing its problems (exit 2).

    Raises:
        ConfigError: the plan has problems, or cannot be made (`make_plan`).
    """
    plan = make_plan(recipe, recipe_path)
    if plan.problems:
        raise ConfigError(
            f"{recipe_path}: refusing to start the run:\n  - " + "\n  - ".join(plan.problems)
        )
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    from shared.recipe import resolve_recipe

    recipe = resolve_recipe(args.recipe, args.override)
    plan = make_plan(recipe, args.recipe)
    print(format_plan(plan))
    return 2 if plan.problems else 0


def cmd_pull(args: argparse.Namespace) -> int:
    from shared.model import pull
    from shared.recipe import resolve_recipe

    recipe = resolve_recipe(args.recipe, args.override)
    folder = pull(recipe, local_files_only=args.local_files_only, max_workers=args.max_workers)
    print(f"{recipe.target.path}: complete at {folder}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `eyrie plan` and `eyrie pull`."""
    p = sub.add_parser(
        "plan", help="per-stage disk, GPU memory and time of a recipe, and whether it fits"
    )
    add_recipe_args(p)
    p.set_defaults(func=cmd_plan)
    pl = sub.add_parser("pull", help="download the recipe's target into the HF cache and check it")
    add_recipe_args(pl)
    pl.add_argument(
        "--local-files-only", action="store_true", help="check the cached copy, no network"
    )
    pl.add_argument("--max-workers", type=int, default=8, help="parallel file downloads")
    pl.set_defaults(func=cmd_pull)
