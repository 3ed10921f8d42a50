"""Packing samples into optimizer steps of at most `train.tokens_per_step` positions.

Responsibility: a deterministic plan of steps per epoch (which samples go into which step),
and the collation of one step's samples into the `[1, T]` packed batch speculators'
`Eagle3DraftModel.forward` takes (documents separated by `document_ids`, so attention never
crosses samples).

Invariants:
- the plan of epoch e depends only on (seed, e, the sample list, tokens_per_step): a resumed
  run recomputes it and skips the steps already done, which is what "data position" means in
  a checkpoint;
- every sample appears exactly once per epoch; a sample longer than tokens_per_step is
  truncated to it (counted by `count_truncated`), never dropped;
- no padding, except up to the attention kernel's length multiple (`length_multiple`: flex
  attention's 128-position blocks on CUDA): T is the sum of the step's sample lengths, rounded
  up to that multiple with one padding document (`document_ids` -1, loss mask off);
- `train.loss_positions` is applied here (`loss_positions`), in training only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from services.train.samples import AlignedSample, SampleRef

if TYPE_CHECKING:
    import torch


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Seeded shuffle of `range(n)` for one epoch (torch's RNG, independent of global state)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()


def greedy_groups(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive groups of indices into `sizes` whose sizes sum to at most `budget`.

    Greedy: an item joins the current group while it fits; an item larger than `budget`
    forms a group of its own (items are never split).
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def pack(refs: Sequence[SampleRef], order: Sequence[int], tokens_per_step: int) -> list[list[int]]:
    """Greedy first-fit in `order`: consecutive samples share a step while they fit.

    Args:
        refs: the samples.
        order: the visiting order (indices into refs).
        tokens_per_step: the budget of aligned positions per step.

    Returns:
        one list of sample indices per step.
    """
    sizes = [min(refs[i].positions, tokens_per_step) for i in order]
    return [[order[j] for j in g] for g in greedy_groups(sizes, tokens_per_step)]


def count_truncated(refs: Sequence[SampleRef], tokens_per_step: int) -> int:
    """Samples longer than one step's budget (their tail is not trained)."""
    return sum(r.positions > tokens_per_step for r in refs)


def all_positions_mask(n: int, ttt_steps: int) -> torch.Tensor:
    """The positions of an n-position sample that the loss can score in a packed row.

    Every position except:
    - the last: it predicts the token after the sequence (`shared.conventions.shift_mask_left`
      leaves it untrained too), and the sample has no such token;
    - the first `ttt_steps - 1`: TTT step j scores position p against the draft state of
      position p - j (`services.train.loss.ttt_loss`, speculators' `align_for_step`), which
      for p < j lies in the previous sample of the packed row. (Assistant masks never start
      with a trained position: a conversation opens with its prompt.)

    Returns:
        bool `[n]`.
    """
    import torch

    mask = torch.ones(n, dtype=torch.bool)
    mask[: ttt_steps - 1] = False
    if n:
        mask[-1] = False
    return mask


def loss_positions(
    samples: Sequence[AlignedSample], positions: Literal["assistant", "all"], ttt_steps: int
) -> list[AlignedSample]:
    """The samples with the loss mask of `train.loss_positions` (applied in training only).

    Args:
        samples: samples with their assistant loss masks (`services.train.samples`).
        positions: 'assistant' keeps them; 'all' scores every position `all_positions_mask`
            allows, against the target's own next-token distribution (the KL teacher).
        ttt_steps: the TTT depth.
    """
    if positions == "assistant":
        return list(samples)
    return [replace(s, loss_mask=all_positions_mask(len(s.loss_mask), ttt_steps)) for s in samples]


def collate(
    samples: Sequence[AlignedSample], tokens_per_step: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Pack samples into one speculators batch.

    Args:
        samples: the step's samples, each truncated to `tokens_per_step`.
        tokens_per_step: the most positions one sample keeps.
        multiple: pad T up to a multiple of this: 1 under sdpa; under flex attention a
            multiple of its block (`services.train.draft_model.length_multiple`), the
            trainer's fixed batch length (`Trainer.pad_to`). The padding is laid out as
            speculators' own collator lays it out (`speculators.train.data`): zeros,
            `document_ids` -1 (attends to nothing), loss mask off.

    Returns:
        dict with `hidden_states` `[1, T, 3H]` (stored dtype), `input_ids` int64 `[1, T]`,
        `verifier_last_hidden_states` `[1, T, H]`, `loss_mask` bool `[1, T]`,
        `position_ids` int64 `[1, T]`, `document_ids` int64 `[1, T]` (sample index in the
        step, -1 on padding), where T = sum of the (truncated) sample lengths, rounded up to
        `multiple`.
    """
    import torch

    parts = [s.truncated(tokens_per_step) for s in samples]
    doc = torch.cat(
        [torch.full((len(p.input_ids),), i, dtype=torch.long) for i, p in enumerate(parts)]
    )
    pad = -len(doc) % multiple

    def cat(field: Callable[[AlignedSample], torch.Tensor]) -> torch.Tensor:
        first = field(parts[0])
        tail = first.new_zeros((pad, *first.shape[1:]))
        return torch.cat([*(field(p) for p in parts), tail]).unsqueeze(0)

    return {
        "hidden_states": cat(lambda p: p.aux),
        "input_ids": cat(lambda p: p.input_ids),
        "verifier_last_hidden_states": cat(lambda p: p.final),
        "loss_mask": cat(lambda p: p.loss_mask),
        "position_ids": cat(lambda p: p.position_ids),
        "document_ids": torch.cat([doc, doc.new_full((pad,), -1)]).unsqueeze(0),
    }
