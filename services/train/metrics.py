"""Training metrics: `train/metrics.jsonl` and the per-run loss/accuracy plot.

Record kinds (one JSON object per line):
    {"kind": "step", "step", "epoch", "lr", "loss", "loss_<j>", "acc_<j>", "cond_acc_<j>",
     "tokens", "tokens_per_s", "grad_norm"}
        loss_<j>: forward KL at TTT step j, unweighted (the optimized loss is
        sum_j decay**j * loss_<j>); acc_<j>: share of trainable positions whose draft argmax
        equals the teacher argmax at steps 0..j (the chance j+1 tokens are accepted);
        cond_acc_<j>: the same given steps 0..j-1 were right.
    {"kind": "epoch", "epoch", "step", "partial", "val_loss", "val_loss_<j>", "val_acc_<j>",
     "tau", "accept_rate_per_pos", ...}   (`services.train.acceptance.simulated_tau`)
        partial: the epoch was cut short by `train.time_budget_s` (its plan not all trained).

Invariants: a resumed run first truncates the file to the records at or before its
checkpoint's step (`truncate_after`), so a killed run never leaves duplicated steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.store import atomic_write_bytes


class MetricsLog:
    """Append-only JSONL writer (flushed per record)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Keep the records of steps <= `step` (what the resumed checkpoint has seen)."""
        keep = [r for r in self.read() if r["step"] <= step]
        atomic_write_bytes(
            self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode()
        )


def step_metrics(raw: dict[str, float], ttt_steps: int, decay: float) -> dict[str, float]:
    """Per-TTT-step loss and accuracies from speculators' `Eagle3DraftModel.forward` metrics.

    Args:
        raw: `{name: value}` from forward's metrics dict (`loss_<j>_sum` is decay**j-weighted,
            `full_acc_<j>_sum/_total`, `cond_acc_<j>_sum/_total`), already `.item()`-ed.
        ttt_steps: the TTT depth.
        decay: `train.step_loss_decay`.
    """
    out: dict[str, float] = {"loss": raw["loss_sum"]}
    for j in range(ttt_steps):
        out[f"loss_{j}"] = raw[f"loss_{j}_sum"] / decay**j
        out[f"acc_{j}"] = _ratio(raw, f"full_acc_{j}")
        out[f"cond_acc_{j}"] = _ratio(raw, f"cond_acc_{j}")
    return out


def _ratio(raw: dict[str, float], name: str) -> float:
    total = raw[f"{name}_total"]
    return raw[f"{name}_sum"] / total if total > 0 else 0.0


def plot(records: list[dict[str, Any]], out: Path, ttt_steps: int) -> Path:
    """Loss and accuracy per TTT step against the step, plus validation τ, as one PNG.

    Returns:
        `out` (written atomically).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r["kind"] == "step"]
    # An epoch without held-out samples has no validation record, hence no tau.
    epochs = [r for r in records if r["kind"] == "epoch" and "tau" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xs = [r["step"] for r in steps]
    for j in range(ttt_steps):
        axes[0].plot(xs, [r[f"loss_{j}"] for r in steps], label=f"loss_{j}")
        axes[1].plot(xs, [r[f"acc_{j}"] for r in steps], label=f"acc_{j}")
    for ax, title in zip(
        axes[:2], ["train KL per TTT step", "train accuracy (chain)"], strict=True
    ):
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.legend()
    if epochs:
        axes[2].plot([r["epoch"] for r in epochs], [r["tau"] for r in epochs], marker="o")
    axes[2].set_xlabel("epoch")
    axes[2].set_title("validation: simulated acceptance length")
    fig.tight_layout()
    with_png = out.with_suffix(".png")
    from shared.store import atomic_path

    with atomic_path(with_png) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)
    return with_png
