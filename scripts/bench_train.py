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

Usage: .venv/bin/python scripts/bench_train.py [--samples 32] [--rounds 2]
       [--tokens-per-step 384] [--precision bf16]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--samples", type=int, default=32, help="ShareGPT rows planned (prep/tokenize drop some)"
    )
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens-per-step", type=int, default=384)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()

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
