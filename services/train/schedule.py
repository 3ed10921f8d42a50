"""The learning-rate shape: linear warm-up, then cosine, linear or constant.

Responsibility: one picklable multiplier `LrShape(step) -> factor` that `torch.optim`'s
`LambdaLR` applies to the peak `train.lr`, so the scheduler's state is a plain state_dict
saved in every checkpoint.

Invariants: factor(0) = 1/(warmup+1) when warming up (never 0: step 0 trains); factor reaches
1.0 at the end of warm-up; cosine and linear decay to 0.0 at `total_steps`; steps past the end
stay at the last value. Same shape as transformers' `get_cosine_schedule_with_warmup` with
half a cycle, which speculators' trainer uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LrShape:
    """LR multiplier at an optimizer step.

    Attributes:
        total_steps: optimizer steps of the whole run (all epochs).
        warmup_steps: steps of linear warm-up.
        kind: decay after warm-up.
    """

    total_steps: int
    warmup_steps: int
    kind: Literal["cosine", "linear", "constant"]

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_shape(total_steps: int, warmup_ratio: float, kind: str) -> LrShape:
    """`LrShape` with `ceil(warmup_ratio * total_steps)` warm-up steps."""
    return LrShape(total_steps, math.ceil(warmup_ratio * total_steps), kind)  # type: ignore[arg-type]


#: Steps before `train.time_budget_s` first plans the run's end: the pace of fewer steps is
#: mostly the first step's one-time set-up (allocation, kernel selection).
BUDGET_CALIBRATION_STEPS = 4


def budget_steps(done: int, spent_s: float, pace_s: float, budget_s: float, total: int) -> int:
    """The step a time-budgeted run ends at: the steps left that fit the budget at the pace.

    Args:
        done: optimizer steps done.
        spent_s: seconds of the loop spent so far (`TrainState.loop_seconds`).
        pace_s: measured seconds per step (> 0).
        budget_s: `train.time_budget_s`.
        total: the steps of every epoch (the run never goes past them).

    Returns:
        `min(total, done + floor((budget_s - spent_s) / pace_s))`, at least `done`.

    Raises:
        ValueError: `pace_s` is not positive.
    """
    if pace_s <= 0:
        raise ValueError(f"pace_s must be > 0 (got {pace_s})")
    left = max(budget_s - spent_s, 0.0)
    return min(total, done + math.floor(left / pace_s))
