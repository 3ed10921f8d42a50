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

Checkpoint layout: `{"optimizer": state, "scheduler": state}` with one optimizer (as before
the Muon option), `{"optimizer": [states], "scheduler": [states]}` with two.
"""

from __future__ import annotations

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


class Optimizers:
    """Several optimizers stepped as one, each with its own `LambdaLR` on one lr shape.

    Attributes:
        optimizers: the optimizers, AdamW (at `train.lr`) last.
        schedulers: one `LambdaLR(optimizer, shape)` each.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], shape: LrShape):
        import torch

        self.optimizers = optimizers
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, shape) for o in optimizers]

    def lr(self) -> float:
        """The current lr of the AdamW group (`train.lr` times the shape's factor)."""
        return float(self.schedulers[-1].get_last_lr()[0])

    def step(self) -> None:
        """One optimizer step of each, then one scheduler step of each."""
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
