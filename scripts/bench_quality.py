"""Benchmark: Eyrie's trainer vs speculators 0.9.0's own `Trainer`, same data, same wall clock.

Goal 1 of issue 16: on the same extracted data and the same wall-clock training budget,
Eyrie's draft should reach a higher offline τ on the same held-out samples than the
reference trainer (>= 1.15x its τ).

Data: real SmolLM2-135M hidden states of real ShareGPT V3 samples, made in this process by
the pipeline's own stages (plan → prep → dedup → split → tokenize → vocab → extract;
regeneration is off here: it needs a vLLM server). The held-out split is cut in two halves:
- "select": what Eyrie's trainer validates on each epoch and picks its checkpoint by (as the
  train stage does with the whole split);
- "score": never seen by either side; both drafts' final offline τ is measured on it with
  one function (`services.train.acceptance.simulated_tau`, k = bench.num_speculative_tokens).

Sides (one process tree, alternating chunk by chunk so load swings hit both; each side's
clock runs only while it trains or validates, and each stops when its budget is spent):
- "eyrie": `services.train.trainer.Trainer` as the train stage runs it, with the demo's
  optimizer (Muon at `--lr`; `-o train.optimizer=adamw` for AdamW), warm-up + decay, packing,
  per-epoch validation with simulated τ and checkpoint selection. `-o train.time_budget_s=S`
  makes its lr schedule end when S seconds of its loop (steps, validations) are spent, and
  validates the partial last epoch; that last validation is not in S, so leave it room under
  `--budget-s` (about 30 s for 15 samples on a 2-core AVX2 CPU, 10 s with AMX).
- "reference": `speculators.train.trainer.Trainer` as shipped, on the same draft
  architecture and init (`build_draft`), with the library's defaults for the rest: Muon
  (2-D weights) + AdamW, lr 1e-3, linear schedule, weight decay 0.01, 2,048-token packed
  rows, TTT 3 steps of equal weight (its `LossArgs` defaults, whatever Eyrie's recipe
  says), and speculators' `get_trainer_kwargs` (eager kl_div loss). Its loader yields the
  same packed batches Eyrie builds (`services.train.packing`), plus `error_records`.
  Patches needed to run it on CPU, and nothing else:
    1. `speculators.train.trainer.get_local_rank` → "cpu" (it moves the model to a CUDA rank);
    2. `Trainer.device_type` → "cpu" (autocast device; it falls back to "cuda");
    3. `torch.accelerator.synchronize` → no-op when there is no accelerator (its step timer);
    4. `speculators.train.checkpointer.get_current_device` → "cpu" (checkpoint loading);
    5. on a CPU without bf16 matmul kernels only (AVX2): torch's Muon Newton-Schulz in
       float32 (`services.train.optim.newton_schulz_float32`, as Eyrie's side there), not
       bf16, whose matmuls there made a reference step ~20 s slower.
  (speculators' CLI would also take `--draft-attn-impl sdpa --loss-implementation eager`;
  here the draft is built by `build_draft`, whose attention is sdpa, and the loss is eager.)

The process keeps freed heap memory (`services.train.runtime.keep_freed_memory`, which the
train stage sets on CPU): it is process-wide, so both sides run with it.

`--data DIR` keeps the run (the input stages' output) in DIR: a later run with the same
data arguments (--samples, --max-len, --draft-vocab, --val-fraction, --epochs, --lr,
--tokens-per-step: they name the run) finds every stage's shards done and skips them, so runs
that differ only in `-o` overrides compare on the same samples; Eyrie's train folder there is
cleared first. `--no-reference` trains and scores Eyrie's side only (ablations).
`--precision fp32` runs everything in fp32 (the target's forward in extract, both trainers
and the scoring; hidden states are still stored bf16), for CPUs without native bf16 matmuls
(AVX2 only: torch's bf16 matmul there runs ~45x slower than fp32). The reference side takes
it through its own config (`TrainerConfig.hidden_states_dtype`), not a patch.

Usage: .venv/bin/python scripts/bench_quality.py [--samples 320] [--budget-s 600]
       [--chunk-steps 4] [--epochs 5] [--data DIR] [--no-reference] [--precision fp32]
       [-o key=value ...]
e.g.   .venv/bin/python scripts/bench_quality.py \
       -o train.lr=1e-2 -o train.time_budget_s=570 -o train.ttt_steps=2   (the demo's loop)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
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

INPUT_STAGES = ["plan", "prep", "dedup", "split", "tokenize", "vocab", "extract"]

#: speculators 0.9.0's training defaults (train/config/schema.py) the reference side keeps.
REFERENCE_TOKENS_PER_STEP = 2048
#: `--precision` → (the target's dtype in extract, `train.precision`).
PRECISIONS = {"bf16": ("bfloat16", "bf16"), "fp32": ("float32", "fp32")}


def bench_recipe(args: argparse.Namespace, overrides: list[str] | None = None) -> Any:
    """The demo's draft and training settings on a ShareGPT sample of `args.samples` rows.

    `overrides` (`key.path=value`) change Eyrie's side only, e.g. `draft.train_lm_head=true`.
    """
    from shared.recipe import resolve_recipe

    target_dtype, precision = PRECISIONS[args.precision]
    return resolve_recipe(
        {
            "name": "bench-quality",
            "target": {**smollm2_target(smollm2_path()), "dtype": target_dtype},
            "datasets": [{**SHAREGPT, "max_samples": args.samples}],
            "prep": {"max_len_tokens": args.max_len},
            "regen": {"enabled": False},
            "layers": SMOLLM2_AUX,
            "extract": {"backend": "hf", "device": "cpu", "tokens_per_batch": 4096},
            "draft": {"draft_vocab_size": args.draft_vocab},
            "train": {
                "epochs": args.epochs,
                "optimizer": "muon",
                "lr": args.lr,
                "tokens_per_step": args.tokens_per_step,
                "val_fraction": args.val_fraction,
                "precision": precision,
                "step_checkpoint_every": 0,
                "device": "cpu",
                "seed": 0,
            },
            "bench": {"num_speculative_tokens": 3},
        },
        overrides,
    )


def patch_speculators_for_cpu() -> None:
    """The four patches listed in the module docstring (CPU only; nothing else changes)."""
    import speculators.train.checkpointer as sp_ckpt
    import speculators.train.trainer as sp_trainer
    import torch

    sp_trainer.get_local_rank = lambda: "cpu"  # type: ignore[assignment,return-value]
    sp_ckpt.get_current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None  # type: ignore[assignment]


class PackedSteps:
    """A map-style dataset over a window of one epoch's packed steps (the reference's data).

    Item i is the collated batch of step `start + i` of epoch `epoch`'s plan (Eyrie's
    seeded per-epoch order and packing, at the reference's step size). The window lets the
    reference trainer run a few steps per turn while its own loop stays as shipped; before
    the first turn the window is the whole first epoch, so the library sizes its LR schedule
    from the true steps per epoch.
    """

    def __init__(self, refs, read, tokens_per_step: int, seed: int, dtype):
        self.refs, self.read, self.tokens, self.seed = refs, read, tokens_per_step, seed
        self.dtype = dtype
        self.set_window(0, 0, None)

    def plan(self, epoch: int) -> list[list[int]]:
        from services.train.packing import epoch_order, pack

        return pack(self.refs, epoch_order(len(self.refs), self.seed, epoch), self.tokens)

    def set_window(self, epoch: int, start: int, stop: int | None) -> None:
        self.steps = self.plan(epoch)[start:stop]

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> dict[str, Any]:

        from services.train.packing import collate

        batch = collate([self.read(self.refs[j]) for j in self.steps[i]], self.tokens)
        batch = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in batch.items()}
        return {**batch, "error_records": 0}


def reference_trainer(recipe, store, train_refs, save_dir: Path, epochs: int):
    """speculators' Trainer over `train_refs`, patched for CPU, with its defaults."""
    import torch
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.config.schema import LossArgs
    from speculators.train.trainer import Trainer as SpTrainer
    from speculators.train.trainer import TrainerConfig

    from services.train.draft_model import build_draft
    from services.train.samples import SampleReader

    patch_speculators_for_cpu()
    torch.manual_seed(recipe.train.seed)
    d2t, t2d = store.vocab.read_maps()
    model = build_draft(recipe, d2t, t2d, device="cpu")
    dtype = torch.bfloat16 if recipe.train.precision == "bf16" else torch.float32
    data = PackedSteps(
        train_refs, SampleReader(store), REFERENCE_TOKENS_PER_STEP, recipe.train.seed, dtype
    )
    loader: Any = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)  # type: ignore[arg-type]
    # The library's own TTT defaults, not Eyrie's recipe: `-o train.ttt_steps=...` changes
    # Eyrie's side only.
    shipped = LossArgs()
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div",
        loss_implementation="eager",
        ttt_steps=shipped.ttt_steps,
        ttt_step_loss_decay=shipped.ttt_step_loss_decay,
    )
    cfg = TrainerConfig(
        lr=1e-3,
        num_epochs=epochs,
        save_path=str(save_dir),
        resume_from_checkpoint=False,
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        optimizer="muon",
        weight_decay=0.01,
        muon_lr=1e-3,
        hidden_states_dtype=dtype,
    )
    trainer = SpTrainer(model, cfg, loader, None)  # type: ignore[arg-type]
    trainer.device_type = "cpu"  # patch 2
    return trainer, model, data


def score(model, refs, read, k: int, precision: str) -> dict[str, Any]:
    """Offline τ of `model` on `refs`, in `train.precision` like the trainer."""
    from services.train.acceptance import simulated_tau

    return simulated_tau(model, (read(r) for r in refs), k, None, precision)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=320, help="ShareGPT rows planned")
    ap.add_argument("--max-len", type=int, default=1024, help="prep.max_len_tokens")
    ap.add_argument("--budget-s", type=float, default=600, help="training seconds per side")
    ap.add_argument("--chunk-steps", type=int, default=4, help="steps per side per turn")
    ap.add_argument("--epochs", type=int, default=5, help="Eyrie epochs (and reference's)")
    ap.add_argument("--lr", type=float, default=1e-3, help="Eyrie's lr (the demo's, Muon)")
    ap.add_argument("--tokens-per-step", type=int, default=2048, help="Eyrie's step size")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        help="recipe override for Eyrie's side only (repeatable), e.g. "
        "draft.train_lm_head=true or draft.init_from_target_layer=true; the data, split and "
        "reference side are unchanged, so runs with different overrides compare on the same "
        "held-out samples (the data stages, draft vocabulary included, use the base recipe)",
    )
    ap.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="bf16",
        help="compute precision of extract, both trainers and scoring (fp32 on CPUs without "
        "native bf16)",
    )
    ap.add_argument(
        "--data",
        type=Path,
        help="data root to keep the extracted run in and reuse (default: a temporary folder)",
    )
    ap.add_argument("--no-reference", action="store_true", help="train and score Eyrie's side only")
    args = ap.parse_args()

    import torch

    from services.train.optim import newton_schulz_float32, newton_schulz_fp32_needed
    from services.train.runtime import keep_freed_memory
    from services.train.samples import SampleReader, index_samples
    from services.train.trainer import Trainer
    from shared.artifacts import RunStore
    from shared.progress import Progress

    base = bench_recipe(args)
    recipe = bench_recipe(args, args.override)
    k = recipe.bench.num_speculative_tokens
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        # The input stages run under the base recipe; Eyrie's trainer reads them with its own
        # (an override of the draft or the loop does not change the data).
        store = RunStore.create(base, root=args.data or Path(tmp))
        # A kept run's checkpoints are an earlier run's: this one's best must be its own.
        shutil.rmtree(store.train.dir, ignore_errors=True)
        t0 = time.perf_counter()
        run_stages(store, INPUT_STAGES)
        print(f"data: input stages in {time.perf_counter() - t0:.0f}s", flush=True)
        index = index_samples(store)
        half = len(index.val) // 2
        select, held = index.val[:half], index.val[half:]
        if not select or not held:
            raise SystemExit(f"need >= 2 held-out samples (got {len(index.val)})")
        index.val = select
        read = SampleReader(store)
        eyrie = Trainer(recipe, store, index)
        keep_freed_memory()
        if not args.no_reference:
            ref, ref_model, ref_data = reference_trainer(
                base, store, index.train, Path(tmp) / "reference", args.epochs
            )
            ref_per_epoch = len(ref_data.plan(0))
        spent = {"eyrie": 0.0, "reference": 0.0}
        ref_pos = {"epoch": 0, "step": 0, "total": 0}
        ref_newton_schulz = (
            newton_schulz_float32 if newton_schulz_fp32_needed("cpu") else contextlib.nullcontext
        )

        def eyrie_chunk(bar) -> bool:
            if eyrie.done:
                return False
            t = time.perf_counter()
            eyrie.train_epoch(bar, max_steps=args.chunk_steps)
            if eyrie.epoch_over:
                eyrie.end_epoch()  # validation, simulated τ, checkpoint selection
            spent["eyrie"] += time.perf_counter() - t
            return True

        def ref_chunk() -> bool:
            if args.no_reference or ref_pos["epoch"] >= args.epochs:
                return False
            t = time.perf_counter()
            start = ref_pos["step"]
            stop = min(start + args.chunk_steps, ref_per_epoch)
            ref_data.set_window(ref_pos["epoch"], start, stop)
            with ref_newton_schulz():  # patch 5
                ref.train_epoch(ref_pos["epoch"])
            ref_pos["total"] += stop - start
            ref_pos["step"] = stop
            if stop >= ref_per_epoch:
                ref_pos["epoch"], ref_pos["step"] = ref_pos["epoch"] + 1, 0
            spent["reference"] += time.perf_counter() - t
            return True

        with Progress(0, "steps", "bench-quality") as bar:
            while True:
                moved = False
                if spent["eyrie"] < args.budget_s:
                    moved |= eyrie_chunk(bar)
                if spent["reference"] < args.budget_s:
                    moved |= ref_chunk()
                if not moved:
                    break
                print(
                    f"eyrie {spent['eyrie']:.0f}s step {eyrie.state.step} | reference "
                    f"{spent['reference']:.0f}s step {ref_pos['total']}",
                    flush=True,
                )
        from services.train import checkpoints as ckpt
        from services.train.draft_model import load_trainable_state

        best = ckpt.best_or_last(store.train) if ckpt.latest(store.train) else None
        if best is not None:
            load_trainable_state(eyrie.draft, ckpt.load(best)[0])
        with torch.no_grad():
            p = base.train.precision
            e = score(eyrie.draft, held, read, k, p)
            r = None if args.no_reference else score(ref_model, held, read, k, p)
            s = score(eyrie.draft, select, read, k, p)
    print(
        f"\nsamples: train {len(index.train)}, select {len(select)}, score {len(held)}; "
        f"budget {args.budget_s:.0f}s per side; k={k}"
    )
    print(
        f"eyrie:     tau {e['tau']:.3f}  ({eyrie.state.step} steps of <= "
        f"{eyrie.cfg.tokens_per_step} tokens, {spent['eyrie']:.0f}s, checkpoint "
        f"{best.name if best else 'in memory'})"
    )
    print(f"eyrie on the select half: tau {s['tau']:.3f}")
    if r is None:
        return
    print(
        f"reference: tau {r['tau']:.3f}  ({ref_pos['total']} steps of <= "
        f"{REFERENCE_TOKENS_PER_STEP} tokens, {spent['reference']:.0f}s)"
    )
    print(f"ratio eyrie / reference: {e['tau'] / r['tau']:.3f}  (goal >= 1.15)")


if __name__ == "__main__":
    main()
