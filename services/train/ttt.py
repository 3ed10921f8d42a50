"""The draft's training-time-test forward over only the rows the loss reads.

Responsibility: `ttt_states`, the normed draft states of every TTT step that
`services.train.loss.ttt_loss` scores, computed as speculators 0.9.0's
`Eagle3DraftModel.forward` computes them (`speculators/models/eagle3/core.py`) but with the
draft layer run at step j >= 1 on `ttt_rows(mask)[j]` only.

Why rows can be left out. At step j the draft state of position t feeds the loss of step j
(target t+j) and, through the hidden state it passes on, the same position at steps j+1...
Its keys and values at step j are read only by position t itself (speculators' attention
mask gives step j's queries the step-0 keys of their document, causal, plus the diagonal of
each later step: `extend_dense_mask_for_draft_tokens`). A step scores t only where its target
is trainable or the greedy chain at t is alive, and the chain starts alive only where
`loss_mask[t]` (`services.train.loss.scored_rows`). So a position with neither `loss_mask[t]`
nor any `loss_mask[t+j']`, j <= j' < ttt_steps, changes no loss, gradient or metric at step j
or later. On chat data those are the prompt rows: the step's layer (projections, attention,
MLP) skips them. Step 0 runs on every row: its keys and values are the context every later
step attends to.

The rows are a subset of the dense attention path only (sdpa or eager, the CPU's). Under
flex attention (CUDA) or a DDP wrapper (whose forward must run for gradient sync),
`ttt_states` runs speculators' own forward with its lm_head swapped for a recorder, on every
row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: speculators' name for its flex attention (`Eagle3DraftModel._attn_impl`).
FLEX = "simple_flex_attention"


def ttt_rows(mask: torch.Tensor, ttt_steps: int, multiple: int = 1) -> list[torch.Tensor]:
    """Per TTT step j, the positions whose step-j draft state some step j' >= j may read.

    Step 0: every position `0..n-1` (its keys and values are every later step's context).
    Step j >= 1: `t < n - j` with `mask[t]` or `mask[t + j']` for some `j <= j' < ttt_steps`
    (the module docstring gives why), then, to a count that is a multiple of `multiple`,
    the first other positions of the previous step's rows below `n - j` (or all of them,
    when fewer remain): their states are computed and read by nothing, and they keep the
    matmuls' shapes few (`services.train.runtime.CPU_ROW_MULTIPLE`). Each step's rows are
    a subset of the previous step's.

    Args:
        mask: bool `[n]`, the micro-batch's loss mask.
        ttt_steps: the TTT depth (>= 1).
        multiple: round each step j >= 1's row count up to a multiple of this (>= 1).

    Returns:
        `ttt_steps` int64 tensors of ascending positions.
    """
    import torch

    n = len(mask)
    rows = [torch.arange(n, device=mask.device)]
    for j in range(1, ttt_steps):
        need = mask[: max(n - j, 0)].clone()
        for jp in range(j, ttt_steps):
            need[: max(n - jp, 0)] |= mask[jp:]
        extra = -int(need.sum()) % multiple
        if extra:
            prev = rows[-1][rows[-1] < n - j]
            spare = prev[~need[prev]]
            need[spare[:extra]] = True
        rows.append(torch.nonzero(need).squeeze(1))
    return rows


class _RecordHead:
    """Stands in for the draft's lm_head: records its input, returns `[..., 1]` zeros."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def module(self) -> Any:
        import torch

        record = self

        class Record(torch.nn.Module):
            # speculators compiles the draft's forward on CUDA; traced, this append would
            # guard on the list's length and recompile at every TTT step.
            @torch.compiler.disable
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                record.inputs.append(x)
                return x.new_zeros(*x.shape[:-1], 1)

        return Record()


@contextmanager
def _recorded_head(draft: Any) -> Iterator[_RecordHead]:
    head = draft.lm_head
    rec = _RecordHead()
    draft.lm_head = rec.module()
    try:
        yield rec
    finally:
        draft.lm_head = head


def _step_mask(mask: torch.Tensor, rows: list[torch.Tensor], j: int) -> torch.Tensor:
    """Step j's attention mask over its rows: step 0's keys, then one diagonal per step.

    speculators' `extend_dense_mask_for_draft_tokens` restricted to the rows: query row
    `rows[j][a]` attends to the step-0 keys its full mask allows and, at each step
    1 <= i <= j, to the key of the same position (`rows[i][b] == rows[j][a]`).

    Args:
        mask: step 0's dense mask `[1, 1, n, n]`, boolean (True = attend) or additive float
            (0 = attend, -inf = blocked), as the draft built it.
        rows: `ttt_rows`'s positions; j: the step (>= 1).

    Returns:
        `[1, 1, len(rows[j]), n + sum(len(rows[i]) for 1 <= i <= j)]` in mask's dtype.
    """
    import torch

    r = rows[j]
    blocks = [mask[:, :, r, :]]
    for i in range(1, j + 1):
        diag = r[:, None] == rows[i][None, :]
        if mask.dtype.is_floating_point:
            block = torch.zeros(diag.shape, dtype=mask.dtype, device=mask.device)
            block.masked_fill_(~diag, float("-inf"))
        else:
            block = diag.to(mask.dtype)
        blocks.append(block[None, None])
    return torch.cat(blocks, dim=-1)


def _row_forward(
    draft: Any, inputs: dict[str, torch.Tensor], rows: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The TTT forward as speculators runs it (fc, embeddings, rotary, layers, norm), on rows."""
    import torch
    from transformers import DynamicCache

    hidden, ids = inputs["hidden_states"], inputs["input_ids"][0]
    doc, positions = inputs["document_ids"][0], inputs["position_ids"]
    n, device = hidden.shape[1], hidden.device
    masks: dict[str, torch.Tensor] = {}
    if draft.uses_full_attn:
        masks["full"] = draft._build_attn_mask(doc, n, device)
    if draft.uses_sliding_window_attn:
        masks["window"] = draft._build_attn_mask(doc, n, device, draft.sliding_window)
    if draft.input_norm is not None:
        hidden = draft.input_norm(hidden)
    if draft.fc_norm is not None:
        chunks = hidden.chunk(len(draft.fc_norm), dim=-1)
        hidden = torch.cat([nm(c) for nm, c in zip(draft.fc_norm, chunks, strict=True)], dim=-1)
    hidden = draft.fc(hidden)  # shape: [1, n, H]
    cache = DynamicCache()
    states: list[torch.Tensor] = []
    seen = 0  # keys in the cache so far
    for j, r in enumerate(rows):
        if not len(r):  # no row here, so none later (each step's rows are a subset)
            states += [states[-1][:0]] * (len(rows) - j)
            break
        if j:  # the previous step's states at this step's rows (a subset of its rows)
            hidden = hidden[:, torch.searchsorted(rows[j - 1], r)]
        with torch.no_grad():
            # Teacher forcing as speculators: step j reads the ground-truth token at t + j.
            embeds = draft.embed_tokens(ids[r + j]).unsqueeze(0)
        x = torch.cat([embeds, hidden], dim=-1)  # shape: [1, r, 2H]
        pos = positions[:, r] + j
        rope = draft.rotary_emb(x, pos)
        step_masks = {k: m if j == 0 else _step_mask(m, rows, j) for k, m in masks.items()}
        cache_position = torch.arange(seen, seen + len(r), device=device)
        for idx, layer in enumerate(draft.layers):
            x = layer(
                x,
                attention_mask=step_masks[
                    "window" if idx in draft.sliding_window_indices else "full"
                ],
                position_ids=pos,
                past_key_values=cache,
                cache_position=cache_position,
                position_embeddings=rope,
            )
        seen += len(r)
        if draft.config.norm_output:
            hidden = draft.norm(x)
            states.append(hidden[0])
        else:
            hidden = x
            states.append(draft.norm(x)[0])
    return states


def skips_rows(model: Any) -> bool:
    """Whether `ttt_states` runs the row forward: an unwrapped draft on dense attention."""
    from services.train.runtime import unwrap

    return model is unwrap(model) and model._attn_impl != FLEX


def ttt_states(
    model: Any, inputs: dict[str, torch.Tensor], loss_mask: torch.Tensor, ttt_steps: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The normed draft state of each TTT step at the positions the loss may read.

    Args:
        model: the draft (speculators `Eagle3DraftModel`), or a DDP wrapper of it.
        inputs: `services.train.packing.collate`'s dict without the teacher states and loss
            mask (so speculators' forward computes no loss): `hidden_states` `[1, n, A*H]`,
            `input_ids`, `document_ids` and `position_ids` `[1, n]`.
        loss_mask: bool `[1, n]`.
        ttt_steps: the TTT depth.

    Returns:
        (rows, states): per step j, ascending int64 positions `[r_j]` and the states
        `[r_j, H]` at them (the input of the draft's lm_head). On the dense attention path
        the rows are `ttt_rows(loss_mask)`, padded to `runtime.row_multiple`'s multiple;
        otherwise every position `0..n-j-1`.
    """
    import torch

    from services.train.runtime import row_multiple, unwrap

    draft: Any = unwrap(model)
    if skips_rows(model):
        multiple = row_multiple(loss_mask.device.type)
        rows = ttt_rows(loss_mask[0], ttt_steps, multiple)
        return rows, _row_forward(draft, inputs, rows)
    n = inputs["hidden_states"].shape[1]
    with _recorded_head(draft) as rec:
        model(**inputs, ttt_steps=ttt_steps)
    rows = [torch.arange(n - j, device=inputs["hidden_states"].device) for j in range(ttt_steps)]
    return rows, [rec.inputs[j][0, : n - j] for j in range(ttt_steps)]
