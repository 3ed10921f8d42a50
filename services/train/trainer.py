"""The EAGLE-3 training loop (our own: speculators' bundled Trainer assumes CUDA).

Responsibility: drive speculators' `Eagle3DraftModel.forward` (training-time test, forward-KL
loss against the teacher restricted to the draft vocab, `decay**j` step weights) with AdamW,
warm-up + decay, gradient clipping, optional bf16 autocast and hidden-state noise; validate
and checkpoint every epoch; resume from the latest checkpoint.

Invariants:
- every source of randomness is seeded from `train.seed` and restored on resume (init RNG,
  the data plan, the noise generator), so a run killed after step s and resumed reaches the
  same step counter, lr and parameters (within float tolerance) as an uninterrupted run;
- the per-epoch plan is recomputed, never stored: the checkpoint's data position is
  (epoch, step_in_epoch);
- noise is added to the aux hidden states in training only, never in validation;
- only rank 0 writes files; no CUDA-only call is made on the CPU path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.train import checkpoints as ckpt
from services.train.acceptance import simulated_tau, teacher_head
from services.train.draft_model import build_draft, load_trainable_state, trainable_state
from services.train.metrics import MetricsLog, plot, step_metrics
from services.train.packing import collate, count_truncated, epoch_order, pack
from services.train.runtime import Runtime, resolve_runtime, unwrap
from services.train.samples import SampleIndex, SampleReader, SampleRef
from services.train.schedule import lr_shape
from shared.artifacts import RunStore
from shared.progress import Progress
from shared.recipe import Recipe

if TYPE_CHECKING:
    import torch


@dataclass
class TrainResult:
    """What a finished (or stopped) training run produced.

    Attributes:
        state: the final counters and validation results.
        counts: sample and token counts for the manifest.
        resumed_from: the checkpoint folder it resumed from, or None.
    """

    state: ckpt.TrainState
    counts: dict[str, int]
    resumed_from: Path | None


class Trainer:
    """One training run over an index of extracted samples.

    Args:
        recipe: the run's recipe.
        store: the run (samples, vocab and the train folder are read and written there).
        index: the usable samples by split side (`services.train.samples.index_samples`).
        runtime: device and ranks; default from the recipe and environment.
    """

    def __init__(
        self,
        recipe: Recipe,
        store: RunStore,
        index: SampleIndex,
        runtime: Runtime | None = None,
    ):
        import torch

        self.recipe, self.cfg = recipe, recipe.train
        self.art = store.train
        self.rt = runtime or resolve_runtime(recipe)
        self.log = MetricsLog(self.art.metrics_path)
        self.train_refs, self.val_refs = index.train, index.val
        self.index, self.read = index, SampleReader(store)
        self.plans = [
            self.rt.shard_steps(
                pack(
                    self.train_refs,
                    epoch_order(len(self.train_refs), self.cfg.seed, e),
                    self.cfg.tokens_per_step,
                )
            )
            for e in range(self.cfg.epochs)
        ]
        torch.manual_seed(self.cfg.seed)
        draft = build_draft(recipe, *store.vocab.read_maps(), device=self.rt.device)
        draft = draft.to(self.rt.device)
        self.model = self.rt.wrap(draft)
        params = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        self.total_steps = sum(len(p) for p in self.plans)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_shape(self.total_steps, self.cfg.warmup_ratio, self.cfg.scheduler)
        )
        self.noise = torch.Generator(device=self.rt.device).manual_seed(self.cfg.seed + 1)
        self.state = ckpt.TrainState()
        self._teacher_head: torch.Tensor | None = None
        from speculators.losses import resolve_loss_config

        # Eager loss: the fused default needs Triton, which the CPU build lacks.
        self.loss_config = resolve_loss_config("kl_div", "eager")

    @property
    def draft(self) -> torch.nn.Module:
        return unwrap(self.model)

    # -- resume ----------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the latest checkpoint, if any; truncate metrics to it. Returns its folder."""
        folder = ckpt.latest(self.art)
        if folder is None:
            return None
        weights, self.state, ts = ckpt.load(folder)
        load_trainable_state(self.draft, weights)
        self.optimizer.load_state_dict(ts["optimizer"])
        self.scheduler.load_state_dict(ts["scheduler"])
        self._set_rng(ts["rng"])
        if self.rt.is_main:
            self.log.truncate_after(self.state.step)
        return folder

    def _rng(self) -> dict[str, Any]:
        import torch

        rng = {"torch": torch.get_rng_state(), "noise": self.noise.get_state()}
        if self.rt.device_type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.rt.device)
        return rng

    def _set_rng(self, rng: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(rng["torch"])
        self.noise.set_state(rng["noise"])
        if "cuda" in rng and self.rt.device_type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.rt.device)

    def save(self, folder: Path) -> None:
        if not self.rt.is_main:
            return
        ckpt.save(
            folder,
            trainable_state(self.draft),
            self.state,
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": self._rng(),
            },
        )

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to the end of the last epoch (resuming first), validating every epoch."""
        resumed = self.resume()
        remaining = self.total_steps - self.state.step
        with Progress(max(remaining, 0), "steps", "train") as bar:
            while self.state.epoch < self.cfg.epochs:
                self.train_epoch(bar)
                self._end_epoch()
        if self.rt.is_main:
            plot(self.log.read(), self.art.plot_path, self.cfg.ttt_steps)
        return TrainResult(self.state, self._counts(), resumed)

    def train_epoch(self, bar: Progress, max_steps: int | None = None) -> None:
        """Run the rest of the current epoch's plan (from the saved data position).

        Args:
            bar: the progress bar to advance.
            max_steps: stop after this many steps (the bench interleaves single steps).
        """
        plan = self.plans[self.state.epoch]
        self.model.train()
        stop = len(plan) if max_steps is None else self.state.step_in_epoch + max_steps
        for idx in plan[self.state.step_in_epoch : stop]:
            record = self.train_step([self.train_refs[i] for i in idx])
            self.state.step += 1
            self.state.step_in_epoch += 1
            record.update(step=self.state.step, epoch=self.state.epoch, kind="step")
            if self.rt.is_main:
                self.log.write(record)
            bar.update(1, loss=round(record["loss"], 4), tok_s=round(record["tokens_per_s"]))
            every = self.cfg.step_checkpoint_every
            if every and self.state.step % every == 0 and self.state.step_in_epoch < len(plan):
                self.save(self.art.step_dir)

    def train_step(self, refs: list[SampleRef]) -> dict[str, Any]:
        """One optimizer step on the packed samples `refs`. Returns its metrics record."""
        import torch

        t0 = time.perf_counter()
        batch = self.to_device(collate([self.read(r) for r in refs], self.cfg.tokens_per_step))
        if self.cfg.noise_std > 0:
            hs = batch["hidden_states"]
            noise = torch.randn(hs.shape, generator=self.noise, device=hs.device)
            batch["hidden_states"] = hs + (noise * self.cfg.noise_std).to(hs.dtype)
        lr = self.scheduler.get_last_lr()[0]
        loss, raw = self.forward(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.draft.parameters() if p.requires_grad], self.cfg.grad_clip
        )
        self.optimizer.step()
        self.scheduler.step()
        tokens = int(batch["input_ids"].shape[1])
        metrics = step_metrics(
            {k: float(v) for k, v in raw.items()}, self.cfg.ttt_steps, self.cfg.step_loss_decay
        )
        dt = time.perf_counter() - t0
        return {
            **metrics,
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "grad_norm": float(grad_norm),
        }

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move a collated batch to the device; hidden states to the compute dtype."""
        import torch

        dtype = torch.bfloat16 if self.rt.autocast_dtype == "bf16" else torch.float32
        out = {}
        for k, v in batch.items():
            v = v.to(self.rt.device, non_blocking=True)
            out[k] = v.to(dtype) if v.is_floating_point() else v
        return out

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Run speculators' TTT forward under the configured autocast: (loss, metrics)."""
        import torch

        with torch.autocast(
            self.rt.device_type, dtype=torch.bfloat16, enabled=self.rt.autocast_dtype == "bf16"
        ):
            _, loss, raw = self.model(
                **batch,
                ttt_steps=self.cfg.ttt_steps,
                ttt_step_loss_decay=self.cfg.step_loss_decay,
                loss_config=self.loss_config,
            )
        return loss, raw

    # -- validation and epoch end ----------------------------------------------------------
    def validate(self) -> dict[str, Any]:
        """Validation loss per TTT step and the simulated acceptance length (no noise)."""
        import torch

        if not self.val_refs:
            return {}
        self.model.eval()
        sums: dict[str, float] = {}
        plan = pack(self.val_refs, range(len(self.val_refs)), self.cfg.tokens_per_step)
        with torch.no_grad():
            for idx in plan:
                batch = collate(
                    [self.read(self.val_refs[i]) for i in idx], self.cfg.tokens_per_step
                )
                _, raw = self.forward(self.to_device(batch))
                m = step_metrics(
                    {k: float(v) for k, v in raw.items()},
                    self.cfg.ttt_steps,
                    self.cfg.step_loss_decay,
                )
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + v / len(plan)
        self.model.train()
        if self._teacher_head is None:
            self._teacher_head = teacher_head(self.draft)
        sim = simulated_tau(
            self.draft,
            (self.read(r) for r in self.val_refs),
            self.recipe.bench.num_speculative_tokens,
            self._teacher_head,
            self.rt.autocast_dtype,
        )
        return {**{f"val_{k}": v for k, v in sums.items()}, **sim}

    def _end_epoch(self) -> None:
        val = self.validate()
        finished = self.state.epoch + 1
        record = {"kind": "epoch", "epoch": finished, "step": self.state.step, **val}
        self.state.validations.append(record)
        if val and (not self.state.best or _better(val, self.state.best)):
            self.state.best = {"epoch": finished, "tau": val["tau"], "val_loss": val["val_loss"]}
        self.state.epoch, self.state.step_in_epoch = finished, 0
        if self.rt.is_main:
            self.log.write(record)
            self.save(self.art.epoch_dir(finished))
            best = self.state.best.get("epoch")
            ckpt.prune(self.art, self.cfg.keep_last, best)

    def _counts(self) -> dict[str, int]:
        return {
            "train_samples": len(self.train_refs),
            "val_samples": len(self.val_refs),
            "steps": self.state.step,
            "epochs": self.state.epoch,
            "truncated_samples": count_truncated(self.train_refs, self.cfg.tokens_per_step),
            **{f"skipped_{k}": v for k, v in self.index.skipped.items()},
        }


def _better(val: dict[str, Any], best: dict[str, Any]) -> bool:
    """Higher simulated τ wins; equal τ falls back to lower validation loss."""
    return (val["tau"], -val["val_loss"]) > (best["tau"], -best["val_loss"])
