"""The draft's optimizer: AdamW, or Muon on the layer's matrices with AdamW on the rest.

Responsibility: build the optimizer(s) `train.optimizer` names with one `LambdaLR` each on
the same lr shape (`services.train.schedule`), and step, zero, save and restore them as one.

- `adamw`: `torch.optim.AdamW` over the trainable parameters at `train.lr`.
- `muon`: speculators 0.9's default optimizer, built by the library itself
  (`speculators.train.optimizers.build_optimizers`): `torch.optim.Muon` over the 2-D weight
  matrices (the decoder layer's projections and the `fc` that fuses the aux hidden states) at
  `train.muon_lr` (default `train.lr`), with speculators' Muon defaults (momentum 0.95,
  weight decay 0.1, 5 Newton-Schulz steps, `match_rms_adamw` lr adjustment), and AdamW at
  `train.lr` over everything else (norms, biases, embeddings, lm_head; frozen ones excluded).

On a CPU without bf16 matmul kernels (AVX2 only), Muon's Newton-Schulz iteration runs in
float32 (`newton_schulz_float32`): torch casts it to bf16, which there cost ~30 s per demo step.

Checkpoint layout: `{"optimizer": state, "scheduler": state}` with one optimizer (as before
the Muon option), `{"optimizer": [states], "scheduler": [states]}` with two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from services.train.schedule import LrShape
    from shared.recipe import TrainConfig

#: speculators 0.9.0's Muon settings (`train/config/schema.py`, `OptimizerArgs`).
MUON_MOMENTUM, MUON_WEIGHT_DECAY, MUON_NS_STEPS = 0.95, 0.1, 5
MUON_ADJUST_LR_FN = "match_rms_adamw"


def build_optimizers(draft: torch.nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """`train.optimizer`'s optimizers over `draft`'s trainable parameters (AdamW last).

    Raises:
        ValueError: no trainable parameter.
    """
    import torch

    if cfg.optimizer == "adamw":
        params = [p for p in draft.parameters() if p.requires_grad]
        if not params:
            raise ValueError("No trainable parameters found to optimize.")
        return [torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)]
    from speculators.train.optimizers import build_optimizers as speculators_optimizers

    config = SimpleNamespace(
        optimizer="muon",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        muon_lr=cfg.muon_lr or cfg.lr,
        muon_momentum=MUON_MOMENTUM,
        muon_weight_decay=MUON_WEIGHT_DECAY,
        muon_ns_steps=MUON_NS_STEPS,
        muon_adjust_lr_fn=MUON_ADJUST_LR_FN,
    )
    return speculators_optimizers(draft, config)


def newton_schulz_fp32_needed(device_type: str) -> bool:
    """Whether Muon's Newton-Schulz iteration should run in float32 on `device_type`.

    True on a CPU without bf16 matmul kernels (`shared.target.cpu_has_bf16_kernels`), where
    torch's bf16 path is tens of times slower than fp32. CUDA and bf16-capable CPUs keep
    torch's bf16 as shipped.
    """
    from shared.target import cpu_has_bf16_kernels

    return device_type == "cpu" and not cpu_has_bf16_kernels()


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """Torch 2.13's Muon orthogonalization in float32 instead of bfloat16.

    `torch.optim._muon._zeropower_via_newtonschulz`: Keller Jordan's quintic iteration, with
    the same coefficients, normalization and orientation.

    Args:
        grad: a 2-D update `[A, B]`, any float dtype.
        ns_coefficients: (a, b, c) of the quintic.
        ns_steps: iterations.
        eps: floor of the Frobenius norm the update is divided by.

    Returns:
        float32 `[A, B]`: the approximately orthogonalized update (singular values ~0.5-1.5).
    """
    import torch

    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def newton_schulz_float32() -> Iterator[None]:
    """Run `torch.optim.Muon` steps taken inside this block with a float32 Newton-Schulz.

    torch's Muon casts each update to bf16 for its 5 Newton-Schulz iterations and offers no
    option. On a 2-core AVX2 CPU the 8 matrices of the SmolLM2 draft layer took 22.2 s in bf16
    against 0.54 s in fp32, and a demo step ~31 s against ~5 s. The module function is
    swapped for the block and restored after it (the trainer is single-threaded).
    """
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


class Optimizers:
    """Several optimizers stepped as one, each with its own `LambdaLR` on one lr shape.

    Attributes:
        optimizers: the optimizers, AdamW (at `train.lr`) last.
        schedulers: one `LambdaLR(optimizer, shape)` each.
        fp32_newton_schulz: step Muon under `newton_schulz_float32`
            (`newton_schulz_fp32_needed` of the trainer's device).
    """

    def __init__(
        self,
        optimizers: list[torch.optim.Optimizer],
        shape: LrShape,
        fp32_newton_schulz: bool = False,
    ):
        import torch

        self.optimizers = optimizers
        self.fp32_newton_schulz = fp32_newton_schulz
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, shape) for o in optimizers]

    def reshape(self, shape: LrShape) -> None:
        """Give every scheduler a new lr shape, the next step's lr included.

        A time-budgeted run fixes its length after its first steps
        (`services.train.schedule.budget_steps`).
        """
        for s in self.schedulers:
            s.lr_lambdas = [shape] * len(s.lr_lambdas)
            for group, base in zip(s.optimizer.param_groups, s.base_lrs, strict=True):
                group["lr"] = base * shape(s.last_epoch)

    def lr(self) -> float:
        """The current lr of the AdamW group (`train.lr` times the shape's factor)."""
        return float(self.optimizers[-1].param_groups[0]["lr"])

    def step(self) -> None:
        """One optimizer step of each, then one scheduler step of each."""
        with newton_schulz_float32() if self.fp32_newton_schulz else contextlib.nullcontext():
            for o in self.optimizers:
                o.step()
        for s in self.schedulers:
            s.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint entries (layout in the module docstring)."""
        opt = [o.state_dict() for o in self.optimizers]
        sch = [s.state_dict() for s in self.schedulers]
        if len(opt) == 1:
            return {"optimizer": opt[0], "scheduler": sch[0]}
        return {"optimizer": opt, "scheduler": sch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s entries.

        Raises:
            ValueError: the checkpoint holds another number of optimizers (it was saved with
                another `train.optimizer`).
        """
        opt, sch = state["optimizer"], state["scheduler"]
        opt, sch = (opt, sch) if isinstance(opt, list) else ([opt], [sch])
        if len(opt) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(opt)} optimizer state(s), this run builds "
                f"{len(self.optimizers)}: it was saved with another train.optimizer"
            )
        for optimizer, o_state in zip(self.optimizers, opt, strict=True):
            optimizer.load_state_dict(o_state)
        for scheduler, s_state in zip(self.schedulers, sch, strict=True):
            scheduler.load_state_dict(s_state)
