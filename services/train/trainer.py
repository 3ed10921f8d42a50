"""The EAGLE-3 training loop (our own: speculators' bundled Trainer assumes CUDA).

Responsibility: drive speculators' `Eagle3DraftModel.forward` (training-time test) with the
chunked forward-KL loss of `services.train.loss` (against the teacher restricted to the draft
vocab, `decay**j` step weights), AdamW or Muon + AdamW (`services.train.optim`), warm-up +
decay, gradient clipping, optional bf16
autocast and hidden-state noise; validate and checkpoint every epoch; resume from the latest
checkpoint.

Memory: a step of `train.tokens_per_step` runs as gradient accumulation over micro-batches of
whole samples of at most `micro_tokens` positions, each normalized by the whole step's
trainable-position counts. `micro_tokens` is `train.micro_tokens`, or what
`services.train.memory` fits in the device's free memory (at most DENSE_MASK_MICRO_TOKENS
where attention builds a dense mask: CPU); an out-of-memory error halves it
and retries the step (logged, kept in the checkpoint's state and the train manifest).
Validation streams held-out samples from disk, one step's samples at a time (each step run
in micro-batches), at most `train.val_max_samples` of them.

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

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.train import checkpoints as ckpt
from services.train.acceptance import simulated_tau, teacher_head
from services.train.draft_model import (
    build_draft,
    length_multiple,
    load_trainable_state,
    trainable_state,
)
from services.train.loss import step_denominators, ttt_loss
from services.train.memory import (
    DENSE_MASK_MICRO_TOKENS,
    MIN_MICRO_TOKENS,
    USABLE_FRACTION,
    draft_shape,
    fit_micro_tokens,
    free_bytes,
    is_oom,
    release_cached,
    step_memory,
)
from services.train.metrics import MetricsLog, plot, step_metrics
from services.train.optim import Optimizers, build_optimizers, newton_schulz_fp32_needed
from services.train.packing import (
    collate,
    count_truncated,
    epoch_order,
    greedy_groups,
    loss_positions,
    pack,
)
from services.train.runtime import Runtime, resolve_runtime, row_multiple, unwrap
from services.train.samples import AlignedSample, SampleIndex, SampleReader, SampleRef
from services.train.schedule import BUDGET_CALIBRATION_STEPS, budget_steps, lr_shape
from shared.artifacts import RunStore
from shared.progress import Progress
from shared.recipe import Recipe

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eyrie.train")

#: The clock of the loop's time outside optimizer steps (validation, checkpoints, logging),
#: which `train.time_budget_s` counts with the steps' own `step_s`; tests substitute a fake.
_clock = time.perf_counter


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
        self.train_refs = index.train
        self.val_refs = index.val[: self.cfg.val_max_samples]
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
        self.attention_block = length_multiple(draft)
        self.total_steps = sum(len(p) for p in self.plans)
        self.optim = Optimizers(
            build_optimizers(draft, self.cfg),
            self._shape(self.total_steps),
            fp32_newton_schulz=newton_schulz_fp32_needed(self.rt.device_type),
        )
        self.noise = torch.Generator(device=self.rt.device).manual_seed(self.cfg.seed + 1)
        self.state = ckpt.TrainState()
        self._teacher_head: torch.Tensor | None = None
        self.memory = self._plan_memory()
        self.state.micro_tokens = self.memory["micro_tokens"]

    def _plan_memory(self) -> dict[str, Any]:
        """Pick the micro-batch size: `train.micro_tokens`, or the memory model's fit.

        The fit is at most DENSE_MASK_MICRO_TOKENS where attention builds a dense mask.

        Returns:
            `{"micro_tokens", "estimate" (bytes by part at that size), "budget" (bytes)}`.
        """
        shape = draft_shape(self.draft)
        tps, cfg = self.cfg.tokens_per_step, self.cfg
        args = (cfg.ttt_steps, cfg.loss_chunk_tokens, 2 if self.rt.autocast_dtype else 4)
        dense = self.rt.device_type == "cpu"  # sdpa's dense mask; flex on CUDA
        rows = row_multiple(self.rt.device_type)
        params = step_memory(shape, 0, *args, dense).params  # already on the device
        budget = int(free_bytes(self.rt.device) * USABLE_FRACTION) + params
        if cfg.micro_tokens is not None:
            micro = min(cfg.micro_tokens, tps)
        else:
            start = min(tps, DENSE_MASK_MICRO_TOKENS) if dense else tps
            micro = fit_micro_tokens(shape, start, *args, dense, budget, rows)
        est = step_memory(shape, micro, *args, dense, rows).as_dict()
        log.info(
            "train step memory: %d of %d tokens per micro-batch, ~%.2f GiB of %.2f GiB",
            micro,
            tps,
            est["total"] / 2**30,
            budget / 2**30,
        )
        return {"micro_tokens": micro, "estimate": est, "budget": budget}

    @property
    def done(self) -> bool:
        """Every epoch trained, or the step `train.time_budget_s` fixed reached and validated.

        A run resumed at its end step mid-epoch (its last validation was cut short) is not
        done: `run` validates and checkpoints that partial epoch.
        """
        at_end = self.state.step >= self.end_step and self.state.step_in_epoch == 0
        return self.state.epoch >= self.cfg.epochs or at_end

    @property
    def epoch_over(self) -> bool:
        """The current epoch's plan is done, or the budgeted end step is reached mid-epoch."""
        plan = self.plans[self.state.epoch]
        return self.state.step_in_epoch >= len(plan) or self._budget_over()

    def _budget_over(self) -> bool:
        planned = self.state.planned_steps
        return planned is not None and self.state.step >= planned

    @property
    def end_step(self) -> int:
        """The step the run ends at: every epoch's steps, or what `train.time_budget_s` fits."""
        planned = self.state.planned_steps
        return self.total_steps if planned is None else planned

    @property
    def micro_tokens(self) -> int:
        return self.state.micro_tokens or self.cfg.tokens_per_step

    @property
    def pad_to(self) -> int:
        """The length multiple of packed batches (`collate`'s `multiple`).

        Under flex attention (CUDA), the micro-batch size rounded up to whole attention
        blocks: every micro-batch then has one length, as speculators pads every batch to
        its `max_len`, so the draft's compiled forward compiles once instead of per length
        (past torch's recompile limit it runs flex attention unfused, materializing the
        `[T, k*T]` scores per head: seen on an H200). Under sdpa, `runtime.row_multiple`:
        64 on CPU, where every new matmul shape costs oneDNN a new kernel.
        """
        block = self.attention_block
        if block == 1:
            return row_multiple(self.rt.device_type)
        return -(-self.micro_tokens // block) * block

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
        if self.state.micro_tokens is None or self.state.micro_tokens > self.memory["micro_tokens"]:
            self.state.micro_tokens = self.memory["micro_tokens"]
        load_trainable_state(self.draft, weights)
        self.optim.load_state_dict(ts)
        if self.state.planned_steps is not None:
            self.optim.reshape(self._shape(self.state.planned_steps))
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
            {**self.optim.state_dict(), "rng": self._rng()},
        )

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train to the end of the last epoch (resuming first), validating every epoch."""
        resumed = self.resume()
        remaining = self.total_steps - self.state.step
        with Progress(max(remaining, 0), "steps", "train") as bar:
            while not self.done:
                self.train_epoch(bar)
                self.end_epoch()
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
            if self._budget_over():
                break
            record = self.train_step([self.train_refs[i] for i in idx])
            self.state.step += 1
            self.state.step_in_epoch += 1
            self._count_time(record["step_s"])
            t0 = _clock()
            bar.set_total(bar.done + 1 + max(self.end_step - self.state.step, 0))
            record.update(step=self.state.step, epoch=self.state.epoch, kind="step")
            if self.rt.is_main:
                self.log.write(record)
            bar.update(1, loss=round(record["loss"], 4), tok_s=round(record["tokens_per_s"]))
            every = self.cfg.step_checkpoint_every
            mid = self.state.step_in_epoch < len(plan) and not self._budget_over()
            if every and self.state.step % every == 0 and mid:
                self.save(self.art.step_dir)
            self.state.loop_seconds += _clock() - t0  # in the next checkpoint, not this one

    def train_step(self, refs: list[SampleRef]) -> dict[str, Any]:
        """One optimizer step on the packed samples `refs`. Returns its metrics record.

        Raises:
            MemoryError: out of memory with every micro-batch down to one sample or
                MIN_MICRO_TOKENS tokens.
        """
        import torch

        t0 = time.perf_counter()
        samples = [self.read(r) for r in refs]
        lr = self.optim.lr()
        while True:
            try:
                raw, tokens = self.step_loss(samples, train=True)
                break
            except Exception as e:
                if not is_oom(e):
                    raise
                self.back_off(e)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.draft.parameters() if p.requires_grad], self.cfg.grad_clip
        )
        self.optim.step()
        metrics = step_metrics(raw, self.cfg.ttt_steps, self.cfg.step_loss_decay)
        dt = time.perf_counter() - t0
        return {
            **metrics,
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "step_s": dt,
            "grad_norm": float(grad_norm),
            "micro_tokens": self.micro_tokens,
        }

    def _shape(self, total_steps: int) -> Any:
        return lr_shape(total_steps, self.cfg.warmup_ratio, self.cfg.scheduler)

    def _count_time(self, seconds: float) -> None:
        """Add a step's loop seconds to the run's; under `train.time_budget_s`, re-plan its end.

        From the BUDGET_CALIBRATION_STEPS-th step of the run on, after every step, the run's
        end is the steps left that fit the budget at the run's pace so far
        (`TrainState.loop_seconds / step`: validations and checkpoints amortized), and the lr
        schedule ends there. The end is a function of the saved state only, so a resumed run
        plans as the run it continues would have (rank 0's plan on every rank).
        """
        self.state.loop_seconds += seconds
        budget = self.cfg.time_budget_s
        step = self.state.step
        if budget is None or step < BUDGET_CALIBRATION_STEPS:
            return
        pace = self.state.loop_seconds / step
        planned = budget_steps(step, self.state.loop_seconds, pace, budget, self.total_steps)
        if self.rt.world_size > 1:
            import torch
            import torch.distributed as dist

            box = [planned]
            dist.broadcast_object_list(box, src=0, device=torch.device(self.rt.device))
            planned = box[0]
        if planned == self.state.planned_steps:
            return
        if self.state.planned_steps is None:
            log.info(
                "train.time_budget_s %.0f: %.2f s per step so far: the run ends at step %d "
                "of %d (re-planned after every step)",
                budget,
                pace,
                planned,
                self.total_steps,
            )
        self.state.planned_steps = planned
        self.optim.reshape(self._shape(planned))

    def back_off(self, error: BaseException) -> None:
        """After an out-of-memory error: drop the partial gradients and halve micro_tokens.

        Raises:
            MemoryError: micro_tokens is already at MIN_MICRO_TOKENS, or at the row multiple
                (`runtime.row_multiple`) below which padding keeps the micro-batch's size.
        """
        self.optim.zero_grad(set_to_none=True)
        release_cached()
        old = self.micro_tokens
        if old // 2 < max(MIN_MICRO_TOKENS, row_multiple(self.rt.device_type)):
            raise MemoryError(
                f"train step {self.state.step + 1}: out of memory at {old} tokens per "
                f"micro-batch ({error}); lower draft.draft_vocab_size or use a larger device"
            ) from error
        self.state.micro_tokens = old // 2
        self.state.oom_backoffs.append(
            {"step": self.state.step + 1, "from": old, "to": self.state.micro_tokens}
        )
        log.warning(
            "train step %d: out of memory at %d tokens per micro-batch; retrying at %d",
            self.state.step + 1,
            old,
            self.state.micro_tokens,
        )

    def step_loss(self, samples: list[AlignedSample], train: bool) -> tuple[dict[str, float], int]:
        """Loss metrics of one step's samples, over micro-batches (gradients accumulated).

        Args:
            samples: the step's samples (truncated to tokens_per_step when collated).
            train: add noise, score `train.loss_positions` and backpropagate (else: no
                noise, assistant positions, no gradients).

        Returns:
            (speculators-style raw metrics summed over micro-batches, positions).
        """
        import contextlib

        import torch

        tps, ttt = self.cfg.tokens_per_step, self.cfg.ttt_steps
        if train:
            samples = loss_positions(samples, self.cfg.loss_positions, ttt)
        masks = [s.loss_mask[:tps] for s in samples]
        denoms = step_denominators(torch.cat(masks).unsqueeze(0), ttt)
        lengths = [min(len(m), tps) for m in masks]
        groups = _micro_batches(lengths, self.micro_tokens)
        raw: dict[str, float] = {}
        if train:
            self.optim.zero_grad(set_to_none=True)
        for g, idx in enumerate(groups):
            batch = self.to_device(collate([samples[i] for i in idx], tps, self.pad_to))
            if train and self.cfg.noise_std > 0:
                hs = batch["hidden_states"]
                noise = torch.randn(hs.shape, generator=self.noise, device=hs.device)
                batch["hidden_states"] = hs + (noise * self.cfg.noise_std).to(hs.dtype)
            last = g == len(groups) - 1
            # Under DDP only the last micro-batch's backward all-reduces the gradients.
            sync = (
                contextlib.nullcontext()
                if last or not train or self.rt.world_size == 1
                else self.model.no_sync()  # type: ignore[operator]
            )
            with sync, torch.set_grad_enabled(train):
                loss, part = self.forward(batch, denoms)
                if train:
                    loss.backward()
            for k, v in part.items():
                raw[k] = raw.get(k, 0.0) + float(v)
            del batch, loss, part
        return raw, sum(lengths)

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Move a collated batch to the device; hidden states to the compute dtype."""
        import torch

        dtype = torch.bfloat16 if self.rt.autocast_dtype == "bf16" else torch.float32
        out = {}
        for k, v in batch.items():
            v = v.to(self.rt.device, non_blocking=True)
            out[k] = v.to(dtype) if v.is_floating_point() else v
        return out

    def forward(
        self, batch: dict[str, torch.Tensor], denominators: list[float] | None = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Speculators' TTT forward with the chunked loss, under the configured autocast."""
        return ttt_loss(
            self.model,
            batch,
            self.cfg.ttt_steps,
            self.cfg.step_loss_decay,
            self.cfg.loss_chunk_tokens,
            denominators,
            self.rt.autocast_dtype,
            self.rt.fused_loss,
        )

    # -- validation and epoch end ----------------------------------------------------------
    def validate(self) -> dict[str, Any]:
        """Validation loss per TTT step and the simulated acceptance length (no noise)."""
        if not self.val_refs:
            return {}
        self.model.eval()
        sums: dict[str, float] = {}
        plan = pack(self.val_refs, range(len(self.val_refs)), self.cfg.tokens_per_step)
        for idx in plan:
            # Read per step: at most one step's samples are in memory at a time.
            raw, _ = self.step_loss([self.read(self.val_refs[i]) for i in idx], train=False)
            m = step_metrics(raw, self.cfg.ttt_steps, self.cfg.step_loss_decay)
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
            self.pad_to,
        )
        return {**{f"val_{k}": v for k, v in sums.items()}, **sim}

    def end_epoch(self) -> None:
        """Validate (simulated τ included), record, checkpoint and prune after an epoch.

        Also after the partial last epoch of a time-budgeted run, named by the epoch it was in.
        """
        t0 = _clock()
        val = self.validate()
        self.state.loop_seconds += _clock() - t0
        finished = self.state.epoch + 1
        partial = self.state.step_in_epoch < len(self.plans[self.state.epoch])
        record = {"kind": "epoch", "epoch": finished, "step": self.state.step, "partial": partial}
        record.update(val)
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
            "val_samples": len(self.index.val),
            "steps": self.state.step,
            "epochs": self.state.epoch,
            "truncated_samples": count_truncated(self.train_refs, self.cfg.tokens_per_step),
            "val_samples_scored": len(self.val_refs),
            **{f"skipped_{k}": v for k, v in self.index.skipped.items()},
        }


def _better(val: dict[str, Any], best: dict[str, Any]) -> bool:
    """Higher simulated τ wins; equal τ falls back to lower validation loss."""
    return (val["tau"], -val["val_loss"]) > (best["tau"], -best["val_loss"])


def _micro_batches(lengths: list[int], micro_tokens: int) -> list[list[int]]:
    """Consecutive groups of sample indices of at most `micro_tokens` positions each.

    A sample longer than `micro_tokens` forms a group of its own (samples are never split:
    attention and the TTT shift run within a sample).
    """
    return greedy_groups(lengths, micro_tokens)
