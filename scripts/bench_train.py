"""Benchmark: Eyrie's training loop vs a minimal loop over speculators' own model, one run.

Both train the same `Eagle3DraftModel` (built the same way, same seed) on the same packed
batches of real SmolLM2 hidden states of real ShareGPT V3 samples (made by the pipeline's
own stages, plan → prep → dedup → split → tokenize → vocab → extract, in this process), on
CPU:
- "minimal": batches pre-collated in memory; forward (speculators' TTT loss), backward,
  AdamW step. Nothing else.
- "eyrie": `Trainer.train_epoch`, one step at a time, as the train stage runs it: reads
  each sample from the extract shards on disk, packs, adds noise, autocast, clips, steps
  AdamW and the LR schedule, logs per-step metrics to metrics.jsonl, updates the bar.
After an untimed warm-up round, the two alternate step by step on the same batch (minimal
step i, eyrie step i, ...), so swings in machine load hit both; the ratio uses the summed
time of all timed rounds.

Prints tokens/s of each, the ratio eyrie / minimal (goal >= 0.95), and the peak RSS of the
process.

Two more modes run at the CPU demo's own settings (recipes/smollm2-135m-cpu.yaml: 2048
tokens per step, precision auto, TTT 3, draft vocab 8192), on its data made by the same
stages (regen off: no vLLM here, so the dataset's answers, cut to `--max-len` tokens):
- `--profile`: one packed step of real samples at each size T in `--lengths`: seconds of
  forward and backward, the share of self time in attention (sdpa and the dense mask), the
  forward + backward with the loss's teacher recomputed per TTT step against cached once
  (`services.train.loss.Teacher`; `--pairs` alternating pairs, their time ratio), and the
  step as micro-batches of `--micro` tokens (the same gradient, services.train.memory).
- `--stage`: the whole train stage (`Trainer.run`: every epoch's steps, validation with
  simulated τ, checkpoints) under the demo's settings before (`--old` overrides, default
  `OLD`: one micro-batch per step; the loss also scores every row, `score_every_row`) and
  after (`--new`), alternating old, new, old, new in one process; prints per run the wall
  time and its split (steps, validation, checkpoints), tokens/s, the final validation loss
  and offline (simulated) τ, and the wall-time ratio. `--train-samples N` trains on the
  first N samples only (the held-out ones stay), to keep it short on 2 cores.
- `--allocator`: `--steps` training steps at the demo's settings in a fresh process with
  glibc's defaults and in one with `services.train.runtime.keep_freed_memory` (what the
  train stage sets on CPU), alternating for `--pairs` pairs; prints tokens/s of each and
  the ratio pair by pair. Separate processes, because the setting holds for a whole process.
- `--fused-loss`: the same, both sides with `keep_freed_memory`, with the loss's element-wise
  kernels eager (`train.fused_loss=false`) and compiled (`true`; `services.train.loss.
  loss_kernels`); the first step, untimed, includes the compile.
- `--row-multiple`: the same, with the packed micro-batches and the TTT steps' rows as
  they come and rounded up to 64 (`services.train.runtime.CPU_ROW_MULTIPLE`, as shipped).
- `--ttt-rows`: `--steps` training steps a side at the demo's settings with the TTT forward
  on every row (speculators' own forward) and on the rows the loss can read
  (`services.train.ttt.ttt_rows`, as shipped), in one process: each step twice in a row,
  the side going first alternating; prints tokens/s of each, their ratio and the share of
  rows the last TTT step runs on.

Usage: .venv/bin/python scripts/bench_train.py [--samples 32] [--rounds 2]
       [--tokens-per-step 384] [--precision bf16]
       .venv/bin/python scripts/bench_train.py --profile [--lengths 256 512 1024 2048]
       .venv/bin/python scripts/bench_train.py --stage [--epochs 2] [--pairs 2]
       [--train-samples 20] [--old train.precision=bf16 ...] [--new ...]
       .venv/bin/python scripts/bench_train.py --allocator [--pairs 3] [--steps 30]
       .venv/bin/python scripts/bench_train.py --fused-loss [--pairs 3] [--steps 30]
       .venv/bin/python scripts/bench_train.py --row-multiple [--pairs 3] [--steps 30]
       .venv/bin/python scripts/bench_train.py --ttt-rows [--steps 30]
       (`--data DIR` keeps the extracted data between invocations)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from scripts.benchdata import (  # noqa: E402
    SHAREGPT,
    SMOLLM2_AUX,
    run_stages,
    smollm2_path,
    smollm2_target,
)

#: The input stages the trainer reads, run before the timing.
INPUT_STAGES = ["plan", "prep", "dedup", "split", "tokenize", "vocab", "extract"]
#: The CPU demo's recipe: `--profile` and `--stage` train at its settings.
DEMO_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-cpu.yaml"


def bench_recipe(args: argparse.Namespace) -> Any:
    """A small SmolLM2 recipe: draft vocab 2048, MLP 512, one epoch, no step checkpoints."""
    from shared.recipe import resolve_recipe

    return resolve_recipe(
        {
            "name": "bench-train",
            "target": smollm2_target(smollm2_path()),
            "datasets": [{**SHAREGPT, "max_samples": args.samples}],
            "prep": {"max_len_tokens": args.max_len},
            "regen": {"enabled": False},
            "layers": SMOLLM2_AUX,
            "extract": {"backend": "hf", "device": "cpu"},
            "draft": {"draft_vocab_size": 2048, "intermediate_size": 512},
            "train": {
                "epochs": 1,
                "lr": 1e-3,
                "tokens_per_step": args.tokens_per_step,
                "val_fraction": 0.125,
                "precision": args.precision,
                "warmup_ratio": 0.1,
                "step_checkpoint_every": 0,
                "noise_std": 0.05,
                "device": "cpu",
                "seed": 0,
            },
        }
    )


#: `--stage`'s old settings (recipe overrides of the demo recipe; the old side's loss also
#: scores every row, `score_every_row`) and its new ones.
OLD: list[str] = ["train.micro_tokens=2048"]
NEW: list[str] = []


def demo_recipe(args: argparse.Namespace, overrides: list[str] | None = None) -> Any:
    """The demo recipe with inputs this machine can make: regen off (no vLLM), the dataset's
    answers cut to `--max-len` tokens, `--samples` rows, `--epochs` epochs, extraction on
    CPU in the recipe's `target.dtype` (auto: fp32 where bf16 matmuls crawl, an AVX2 CPU;
    the hidden states are stored in bf16 either way, `extract.dtype`)."""
    import yaml

    from shared.recipe import apply_overrides, resolve_recipe

    data = apply_overrides(
        yaml.safe_load(DEMO_RECIPE.read_text()),
        [
            "regen.enabled=false",
            f"prep.max_len_tokens={args.max_len}",
            f"datasets.0.max_samples={args.samples}",
            "extract.device=cpu",
            f"train.epochs={args.epochs}",
        ],
    )
    return resolve_recipe(data, overrides)


def demo_inputs(args: argparse.Namespace, root: Path) -> Any:
    """The demo's train inputs under `root` (kept: a finished shard is not run again)."""
    from shared.artifacts import RunStore

    store = RunStore.create(demo_recipe(args), root=root)
    run_stages(store, INPUT_STAGES)
    return store


class Clock:
    """Seconds spent in named methods of one object (wrapped in place, for this bench)."""

    def __init__(self, obj: Any, names: list[str]):
        self.s = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(obj, name, self._timed(name, getattr(obj, name)))

    def _timed(self, name: str, fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[name] += time.perf_counter() - t0

        return run


def stage_run(recipe: Any, store: Any, train_samples: int | None) -> dict[str, Any]:
    """Run the whole train stage's loop (`Trainer.run`) from scratch; time it and its parts.

    Returns:
        `{"wall_s", "step_s", "validate_s", "save_s", "tokens", "tokens_per_s",
        "step_tokens_per_s" (median of the steps), "tau", "val_loss", "micro_tokens"}`.
    """
    import shutil
    import statistics

    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    shutil.rmtree(store.train.dir, ignore_errors=True)
    t0 = time.perf_counter()
    index = index_samples(store)
    index.train = index.train[:train_samples]
    trainer = Trainer(recipe, store, index)
    clock = Clock(trainer, ["train_step", "validate", "save"])
    result = trainer.run()
    wall = time.perf_counter() - t0
    steps = [r for r in trainer.log.read() if r.get("kind") == "step"]
    tokens = sum(r["tokens"] for r in steps)
    last = result.state.validations[-1] if result.state.validations else {}
    if "tau" not in last:
        raise SystemExit("no held-out samples to validate on: raise --samples")
    return {
        "wall_s": wall,
        "step_s": clock.s["train_step"],
        "validate_s": clock.s["validate"],
        "save_s": clock.s["save"],
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "step_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "tau": last["tau"],
        "val_loss": last["val_loss"],
        "micro_tokens": trainer.micro_tokens,
    }


def score_every_row() -> None:
    """Make the loss compute logits at every position, as it did before
    `services.train.loss.scored_rows` (the old side of `--stage`, or `--all-rows`), with the
    teacher recomputed per TTT step as then (`per_step_teacher`): the cached teacher holds
    only the positions `scored_rows` can reach."""
    import torch

    from services.train import loss

    def every_row(mask: torch.Tensor, prev_correct: torch.Tensor) -> torch.Tensor:
        return torch.arange(len(mask), device=mask.device)

    loss.scored_rows = every_row
    loss.Teacher = per_step_teacher()  # type: ignore[misc]


def per_step_teacher() -> Any:
    """`services.train.loss.Teacher` without its cache: the teacher recomputed for every TTT
    step, as the loss did before (the other side of `--profile`'s teacher column)."""
    from services.train import loss

    class PerStep(loss.Teacher):
        def __init__(
            self,
            th: Any,
            tw: Any,
            matmul_dtype: Any,
            cached: Any = None,
            fused: bool = False,
            multiple: int = 1,
        ) -> None:
            super().__init__(th, tw, matmul_dtype, None, fused, multiple)

    return PerStep


def stage_main(args: argparse.Namespace, root: Path) -> None:
    """`--stage`: the demo's train stage, old settings vs new, alternating (module docstring)."""
    store = demo_inputs(args, root)
    # The inputs are made once, for the demo recipe at --epochs; each side trains on them.
    variants = {"old": demo_recipe(args, args.old), "new": demo_recipe(args, args.new)}
    print(f"old: {' '.join(args.old) or '(the recipe)'}\nnew: {' '.join(args.new)}")
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    from services.train import loss

    rows = {"new": (loss.scored_rows, loss.Teacher)}
    score_every_row()
    rows["old"] = (loss.scored_rows, loss.Teacher)
    for p in range(args.pairs):
        for name, recipe in variants.items():
            loss.scored_rows, loss.Teacher = rows[name]  # type: ignore[misc]
            r = stage_run(recipe, store, args.train_samples)
            runs[name].append(r)
            print(
                f"pair {p + 1} {name}: wall {r['wall_s']:7.1f} s (steps {r['step_s']:6.1f}, "
                f"validation {r['validate_s']:5.1f}, checkpoints {r['save_s']:4.1f}), "
                f"{r['tokens_per_s']:6.1f} tok/s overall, {r['step_tokens_per_s']:6.1f} per "
                f"step (median), micro_tokens {r['micro_tokens']}, val loss "
                f"{r['val_loss']:.4f}, offline tau {r['tau']:.3f}",
                flush=True,
            )
    wall = {k: sum(r["wall_s"] for r in v) for k, v in runs.items()}
    tok = {k: sum(r["tokens"] for r in v) for k, v in runs.items()}
    print(f"\n{'':4} {'wall s':>8} {'tok/s':>8} {'val loss':>9} {'tau':>6}")
    for k in runs:
        print(
            f"{k:4} {wall[k] / args.pairs:8.1f} {tok[k] / wall[k]:8.1f} "
            f"{runs[k][-1]['val_loss']:9.4f} {runs[k][-1]['tau']:6.3f}"
        )
    print(f"speedup old / new wall time: {wall['old'] / wall['new']:.2f}x (goal >= 2)")


def samples_within(samples: list[Any], size: int) -> list[Any]:
    """One step as the trainer packs it (`services.train.packing.greedy_groups`): the first
    group of consecutive whole samples whose lengths (`len(s.input_ids)`) sum to at most
    `size`, taken from the samples no longer than `size` (a longer one would be cut, and
    one first in line would otherwise leave no step to profile); [] when none fits."""
    from services.train.packing import greedy_groups

    fit = [s for s in samples if len(s.input_ids) <= size]
    groups = greedy_groups([len(s.input_ids) for s in fit], size)
    return [fit[i] for i in groups[0]] if groups else []


def profile_main(args: argparse.Namespace, root: Path) -> None:
    """`--profile`: forward/backward seconds and attention share of one packed step per T."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.train.loss import step_denominators
    from services.train.packing import collate
    from services.train.samples import index_samples
    from services.train.trainer import Trainer
    from shared.target import cpu_has_bf16_kernels

    store = demo_inputs(args, root)
    recipe = demo_recipe(args, [f"train.tokens_per_step={max(args.lengths)}", *args.new])
    if args.all_rows:
        score_every_row()
    trainer = Trainer(recipe, store, index_samples(store))
    samples = [trainer.read(r) for r in trainer.train_refs]
    print(
        f"threads {torch.get_num_threads()}, precision {recipe.train.precision}, CPU "
        f"{torch.backends.cpu.get_cpu_capability()}, bf16 kernels {cpu_has_bf16_kernels()}"
    )
    for dtype in (torch.float32, torch.bfloat16):  # a draft MLP matmul at 512 tokens
        a, b = torch.randn(512, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        t0 = time.perf_counter()
        a @ b
        print(f"[512, 576] @ [576, 1536] in {dtype}: {time.perf_counter() - t0:.3f} s")
    for size in args.lengths:
        step = samples_within(samples, size)
        n = sum(len(s.input_ids) for s in step)
        batch = trainer.to_device(collate(step, size))
        denoms = step_denominators(batch["loss_mask"], recipe.train.ttt_steps)
        fwd = bwd = 0.0
        for _ in range(2):  # the first is a warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                loss, _ = trainer.forward(batch, denoms)
                t1 = time.perf_counter()
                loss.backward()
                fwd, bwd = t1 - t0, time.perf_counter() - t1
            trainer.optim.zero_grad(set_to_none=True)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        attn = sum(
            e.self_cpu_time_total
            for e in events
            if "attention" in e.key or "mask" in e.key or "vmap" in e.key
        )
        line = (
            f"T {n:5d} ({len(step):2d} samples): forward {fwd:5.2f} s, backward {bwd:5.2f} s, "
            f"{n / (fwd + bwd):6.0f} tok/s, attention+mask {attn / total:4.0%} of self time"
        )
        line += f"; {teacher_ratio(trainer, batch, denoms, args.pairs)}"
        for micro in args.micro:
            if micro < n:
                trainer.state.micro_tokens = micro
                t0 = time.perf_counter()
                trainer.step_loss(step, train=True)
                dt = time.perf_counter() - t0
                line += f"; micro {micro}: {dt:5.2f} s, {n / dt:6.0f} tok/s"
        trainer.state.micro_tokens = None
        print(line, flush=True)


def teacher_ratio(trainer: Any, batch: dict[str, Any], denoms: list[float], pairs: int) -> str:
    """Forward + backward of `batch` with the teacher recomputed per TTT step (`per_step_teacher`)
    and cached (as shipped), alternating `pairs` times; the ratio of the summed times."""
    from services.train import loss

    cached = loss.Teacher
    variants = {"per step": per_step_teacher(), "cached": cached}
    spent = dict.fromkeys(variants, 0.0)
    try:
        for i in range(pairs + 1):  # the first pair is a warm-up
            for name, teacher in variants.items():
                loss.Teacher = teacher  # type: ignore[misc]  # what ttt_loss builds
                t0 = time.perf_counter()
                trainer.forward(batch, denoms)[0].backward()
                if i > 0:
                    spent[name] += time.perf_counter() - t0
                trainer.optim.zero_grad(set_to_none=True)
    finally:
        loss.Teacher = cached  # type: ignore[misc]
    return (
        f"teacher per step / cached: {spent['per step'] / pairs:5.2f} / "
        f"{spent['cached'] / pairs:5.2f} s = {spent['per step'] / spent['cached']:.2f}x"
    )


def minimal_step_s(model, opt, batch, cfg, loss_config) -> float:
    """Seconds of one bare forward + backward + AdamW step on an in-memory batch."""
    import torch

    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        _, loss, _ = model(
            **batch,
            ttt_steps=cfg.ttt_steps,
            ttt_step_loss_decay=cfg.step_loss_decay,
            loss_config=loss_config,
        )
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def eyrie_step_s(trainer, bar) -> float:
    """Seconds of the next step of `Trainer.train_epoch` (the loop body as the stage runs it)."""
    if trainer.state.step_in_epoch == len(trainer.plans[0]):
        trainer.state.epoch, trainer.state.step_in_epoch = 0, 0
    t0 = time.perf_counter()
    trainer.train_epoch(bar, max_steps=1)
    return time.perf_counter() - t0


#: `--allocator`, `--fused-loss`, `--row-multiple`: per side, (keep_freed_memory, extra
#: recipe overrides, `runtime.CPU_ROW_MULTIPLE` or None for as shipped).
PROCESS_SIDES: dict[str, dict[str, tuple[bool, list[str], int | None]]] = {
    "allocator": {
        "glibc defaults": (False, [], None),
        "keep_freed_memory": (True, [], None),
    },
    "fused-loss": {
        "eager loss": (True, ["train.fused_loss=false"], None),
        "fused loss": (True, ["train.fused_loss=true"], None),
    },
    "row-multiple": {
        "rows as they come": (True, [], 1),
        "rows to 64": (True, [], 64),
    },
}


def ttt_rows_main(args: argparse.Namespace, root: Path) -> None:
    """`--ttt-rows`: the demo's training steps with the TTT forward on every row
    (speculators' own forward, `services.train.ttt.ttt_states`' other path) and on the rows
    the loss can read (`ttt_rows`, as shipped), alternating step by step in one process.

    Both sides take the same steps (each batch twice in a row, the side that goes first
    alternating), so the batches' sizes and lengths cancel out of the ratio."""
    from services.train import ttt
    from services.train.runtime import keep_freed_memory
    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    keep_freed_memory()  # as the train stage runs
    store = demo_inputs(args, root)
    trainer = Trainer(demo_recipe(args, args.new), store, index_samples(store))
    steps = [idx for plan in trainer.plans for idx in plan]
    if len(steps) < args.steps + 1:
        sys.exit(f"{len(steps)} steps: raise --epochs or --samples for --steps + 1")
    refs = trainer.train_refs
    shipped = ttt.skips_rows
    sides = {"every row": lambda model: False, "loss's rows": shipped}
    spent, tokens = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)
    try:
        for i in range(args.steps + 1):  # the first pair is a warm-up (allocations, compiles)
            for name in list(sides)[:: 1 - 2 * (i % 2)]:
                ttt.skips_rows = sides[name]
                t0 = time.perf_counter()
                done = trainer.train_step([refs[j] for j in steps[i]])["tokens"]
                if i:
                    spent[name] += time.perf_counter() - t0
                    tokens[name] += done
    finally:
        ttt.skips_rows = shipped
    old, new = (tokens[name] / spent[name] for name in sides)
    rows = [ttt.ttt_rows(trainer.read(r).loss_mask, trainer.cfg.ttt_steps) for r in refs]
    kept = sum(len(r[-1]) for r in rows) / max(sum(len(r[0]) for r in rows), 1)
    print(
        f"{args.steps} steps a side: every row {old:7.1f} tok/s, loss's rows {new:7.1f} "
        f"tok/s, ratio {new / old:.3f} (the last TTT step runs on {kept:.0%} of the rows)",
        flush=True,
    )


def process_child(args: argparse.Namespace, root: Path) -> None:
    """One side of a process comparison: time `--steps` demo steps after one warm-up step."""
    from services.train import runtime
    from services.train.runtime import keep_freed_memory
    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    keep, overrides, multiple = PROCESS_SIDES[args.compare][args.side]
    if multiple is not None:
        if not hasattr(runtime, "CPU_ROW_MULTIPLE"):
            sys.exit("services.train.runtime.CPU_ROW_MULTIPLE is gone: update --row-multiple")
        runtime.CPU_ROW_MULTIPLE = multiple
    if keep and not keep_freed_memory():
        sys.exit("keep_freed_memory: mallopt refused (not glibc?)")
    store = demo_inputs(args, root)
    trainer = Trainer(demo_recipe(args, [*args.new, *overrides]), store, index_samples(store))
    steps = [idx for plan in trainer.plans for idx in plan][: args.steps + 1]
    if len(steps) <= args.steps:
        sys.exit(f"only {len(steps) - 1} steps after the warm-up: raise --epochs or --samples")
    refs = trainer.train_refs
    t0 = time.perf_counter()
    trainer.train_step([refs[i] for i in steps[0]])  # first-call allocations, compiles
    warm = time.perf_counter() - t0
    t0, tokens = time.perf_counter(), 0
    for idx in steps[1:]:
        tokens += trainer.train_step([refs[i] for i in idx])["tokens"]
    print(f"RATE {tokens / (time.perf_counter() - t0):.1f} {warm:.1f}", flush=True)


def process_main(args: argparse.Namespace, root: Path) -> None:
    """`--allocator` / `--fused-loss` / `--row-multiple`: two process-wide settings in
    alternating processes."""
    import statistics
    import subprocess

    demo_inputs(args, root)  # made once here; each child reuses them
    base = [sys.executable, __file__, "--data", str(root), "--samples", str(args.samples)]
    base += ["--max-len", str(args.max_len), "--epochs", str(args.epochs)]
    base += ["--steps", str(args.steps), "--compare", args.compare, "--new", *args.new]
    a, b = list(PROCESS_SIDES[args.compare])
    ratios = []
    for p in range(args.pairs):
        rate, warm = {}, {}
        for side in (a, b):
            out = subprocess.run(
                [*base, "--side", side], capture_output=True, text=True, check=True
            ).stdout
            rate[side], warm[side] = map(float, out.split("RATE ")[-1].split()[:2])
        ratios.append(rate[b] / rate[a])
        print(
            f"pair {p + 1}: {a} {rate[a]:7.1f} tok/s (first step {warm[a]:.1f} s), {b} "
            f"{rate[b]:7.1f} tok/s (first step {warm[b]:.1f} s), ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(f"median ratio {b} / {a}: {statistics.median(ratios):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--samples", type=int, default=32, help="ShareGPT rows planned (prep/tokenize drop some)"
    )
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens-per-step", type=int, default=384)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--profile", action="store_true", help="the demo's step, by length")
    ap.add_argument("--stage", action="store_true", help="the demo's train stage, old vs new")
    ap.add_argument("--data", type=Path, help="keep the demo's inputs here (else a temp dir)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--micro", type=int, nargs="*", default=[256, 512])
    ap.add_argument("--old", nargs="*", default=OLD, help="recipe overrides of the old run")
    ap.add_argument("--train-samples", type=int, help="--stage: train on the first N only")
    ap.add_argument("--all-rows", action="store_true", help="--profile the old loss")
    ap.add_argument("--new", nargs="*", default=NEW, help="recipe overrides of the new run")
    ap.add_argument("--allocator", action="store_true", help="glibc defaults vs kept memory")
    ap.add_argument("--fused-loss", action="store_true", help="eager vs compiled loss kernels")
    ap.add_argument("--row-multiple", action="store_true", help="matmul rows as-is vs to 64")
    ap.add_argument("--ttt-rows", action="store_true", help="TTT forward: every row vs ttt_rows")
    ap.add_argument("--compare", choices=list(PROCESS_SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per process or side")
    args = ap.parse_args()
    compare = {
        "allocator": args.allocator,
        "fused-loss": args.fused_loss,
        "row-multiple": args.row_multiple,
    }
    if args.profile or args.stage or any(compare.values()) or args.ttt_rows or args.side:
        if args.samples == 32:
            args.samples = 128
        if args.max_len == 160:
            args.max_len = 256
        if args.side:
            process_child(args, args.data)
            return
        mode = profile_main if args.profile else ttt_rows_main if args.ttt_rows else stage_main
        if any(compare.values()):
            args.compare = next(k for k, on in compare.items() if on)
            mode = process_main
        with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            mode(args, args.data or Path(tmp))
        return

    import torch

    from services.train.draft_model import build_draft
    from services.train.packing import collate
    from services.train.samples import index_samples
    from services.train.trainer import Trainer
    from shared.artifacts import RunStore
    from shared.progress import Progress

    recipe = bench_recipe(args)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        store = RunStore.create(recipe, root=Path(tmp))
        run_stages(store, INPUT_STAGES)
        index = index_samples(store)
        vocab = store.vocab.read_maps()
        trainer = Trainer(recipe, store, index)
        plan = trainer.plans[0]
        batches = [
            collate(
                [trainer.read(trainer.train_refs[i]) for i in idx], recipe.train.tokens_per_step
            )
            for idx in plan
        ]
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        batches = [
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()} for b in batches
        ]
        torch.manual_seed(recipe.train.seed)
        minimal = build_draft(recipe, *vocab, device="cpu")
        from speculators.losses import resolve_loss_config

        loss_config = resolve_loss_config("kl_div", "eager")
        opt = torch.optim.AdamW(
            [p for p in minimal.parameters() if p.requires_grad], lr=recipe.train.lr
        )
        tokens = [b["input_ids"].shape[1] for b in batches]
        t_min = t_eye = 0.0
        with Progress(len(plan) * (args.rounds + 1), "steps", "bench") as bar:
            # Round 0 is an untimed warm-up (first-call allocations, lazy inits). Then the
            # two loops alternate step by step on the same batch, so load swings hit both.
            for r in range(args.rounds + 1):
                for batch in batches:
                    dm = minimal_step_s(minimal, opt, batch, recipe.train, loss_config)
                    de = eyrie_step_s(trainer, bar)
                    if r:
                        t_min, t_eye = t_min + dm, t_eye + de
                n = sum(tokens) * r
                if r:
                    print(
                        f"round {r}: minimal {n / t_min:.1f} tok/s, eyrie {n / t_eye:.1f} "
                        f"tok/s (cumulative)",
                        flush=True,
                    )
        n_min = n_eye = sum(tokens) * args.rounds
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\nsamples {len(index.train)} (+{len(index.val)} held out), steps/epoch {len(plan)}, "
        f"tokens/step <= {args.tokens_per_step}, precision {args.precision}, "
        f"rounds {args.rounds}"
    )
    print(f"minimal speculators loop: {n_min / t_min:8.1f} tokens/s")
    print(f"eyrie trainer loop:       {n_eye / t_eye:8.1f} tokens/s")
    print(f"ratio eyrie / minimal:    {(n_eye / t_eye) / (n_min / t_min):8.3f}  (goal >= 0.95)")
    print(f"peak RSS:                 {peak:8.0f} MiB")


if __name__ == "__main__":
    main()
