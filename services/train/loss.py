"""The training-time-test loss without full-vocabulary logits for every TTT step at once.

Responsibility: `ttt_loss`, the same loss and metrics as speculators 0.9.0's
`Eagle3DraftModel.forward` with `verifier_last_hidden_states` (forward KL from the teacher,
restricted to the draft vocab, per TTT step j weighted by `decay**j` and normalized by the
step's trainable positions), computed so that at most one chunk of `chunk_tokens` positions
of fp32 logits over the draft vocab exists at any time.

Method. The draft's TTT forward (`services.train.ttt.ttt_states`, speculators' forward on
the rows the loss can read) gives the normed draft state `[r_j, H]` of each TTT step j, the
lm_head's input. The loss of step j is then `_ChunkedKL`: for each chunk of
positions it computes the draft logits `h @ W.T` and the teacher logits
`verifier_lm_head(verifier_norm(final))`, the KL, and, when gradients are wanted, the
gradients with respect to `h` and `W` right away (d KL / d logits = softmax(logits) - p), then
frees the chunk. Autograd keeps only `[r_j, H]` per step and one `[Vd, H]` weight gradient,
instead of speculators' `[T, Vd]` fp32 log-softmax and softmax per step until backward.
The teacher side (`Teacher`: softmax, negative entropy, argmax) is the same for every TTT
step, shifted, so when a micro-batch's teacher positions fit in one chunk it is computed once
and gathered by each step.
The element-wise work over each `[chunk, Vd]` block (everything but the matmuls) is
`_teacher_terms` and `_draft_terms`, eager or compiled by inductor (`loss_kernels`).

Alignment (speculators `align_for_step`): step j's draft logits at positions `0..T-j-1` are
scored against the teacher logits at `j..T-1`, with `loss_mask[j:]`; the chain accuracy
`prev_correct` is updated in place as speculators does. Keys of the returned metrics are
speculators' (`loss_sum`, `loss_<j>_sum`, `full_acc_<j>_sum/_total`, `cond_acc_<j>_sum/_total`),
so `services.train.metrics.step_metrics` reads either.

`denominators` lets a step be split into micro-batches (OOM back-off): each micro-batch is
normalized by the whole step's trainable-position count per TTT step, so the micro-batch
losses (and gradients) sum to the unsplit step's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

#: speculators' `_LOSS_REDUCTION_EPS`: added to the trainable-position count of a step.
REDUCTION_EPS = 1e-5
TEACHER_KEYS = ("verifier_last_hidden_states", "loss_mask")
log = logging.getLogger("eyrie.train")


def step_denominators(loss_mask: torch.Tensor, ttt_steps: int) -> list[float]:
    """Per TTT step j, the trainable positions scored at j (`loss_mask[:, j:]`) plus eps.

    Args:
        loss_mask: bool `[1, T]`.
        ttt_steps: the TTT depth.
    """
    return [float(loss_mask[:, j:].sum()) + REDUCTION_EPS for j in range(ttt_steps)]


def _teacher_terms(
    t: torch.Tensor, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p `[c, Vd]`, negative entropy `[c]`, argmax `[c]`) from teacher logits t `[c, Vd]`.

    Softmax and entropy in `acc` (fp32, or fp64 for fp64 inputs) whatever t's dtype. Written
    for `torch.compile` to fuse (`loss_kernels`): the eager form allocates more temporaries.
    """
    t = t.to(acc)
    m = t.amax(dim=-1, keepdim=True)
    e = (t - m).exp()
    s = e.sum(dim=-1, keepdim=True)
    p = e / s
    neg_entropy = (p * t).sum(dim=-1) - (m + s.log()).squeeze(-1)
    return p, neg_entropy, t.argmax(dim=-1)


def _draft_terms(
    z: torch.Tensor,
    p: torch.Tensor,
    neg_entropy: torch.Tensor,
    wc: torch.Tensor,
    grad_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One chunk's weighted KL from draft logits, and its gradient with respect to them.

    Args:
        z: `[c, Vd]` draft logits (any float dtype; computed in p's dtype).
        p, neg_entropy: the teacher's `[c, Vd]` probabilities and `[c]` negative entropy.
        wc: `[c]` per-position weight, in p's dtype.
        grad_dtype: dtype of the returned gradient (the matmuls'), or None for none.

    Returns:
        (sum_i wc_i KL_i (scalar), `wc * (softmax(z) - p)` `[c, Vd]` or None, argmax `[c]`).
    """
    z = z.to(p.dtype)
    m = z.amax(dim=-1, keepdim=True)
    e = (z - m).exp()
    s = e.sum(dim=-1, keepdim=True)
    # KL(p || q) = sum_v p_v log p_v - sum_v p_v z_v + lse(z)
    kl = neg_entropy - (z * p).sum(dim=-1) + (m + s.log()).squeeze(-1)
    loss = (kl * wc).sum()
    arg = z.argmax(dim=-1)
    if grad_dtype is None:
        return loss, None, arg
    # d/dlogits of sum_v p_v (log p_v - log q_v) is q - p (p sums to 1).
    return loss, ((e / s - p) * wc[:, None]).to(grad_dtype), arg


class LossKernels(NamedTuple):
    """The loss's element-wise work over `[chunk, Vd]`: `_teacher_terms`, `_draft_terms`."""

    teacher: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    draft: Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]


_EAGER = LossKernels(_teacher_terms, _draft_terms)
_fused: LossKernels | None = None


def loss_kernels(fused: bool) -> LossKernels:
    """The element-wise kernels, eager or fused by `torch.compile` (inductor).

    Eager, each max, exp, sum, product, cast and argmax is its own pass over the fp32
    `[chunk, Vd]` logits, several times the logits matmul's time on a CPU; inductor fuses
    them into a few loops (on the demo's 2-core AMX CPU, 1.12x the training tokens/s:
    `scripts/bench_train.py --fused-loss`). Shapes are dynamic (chunks differ in rows), so
    one build serves every chunk. The first build costs ~13 s of the first step there
    (teacher and training kernels) and a few more at the first validation; later processes
    load it from inductor's on-disk cache, after the files a killed build left torn there are
    removed (`services.train.kernel_cache`). Building needs a C++ compiler on CPU (Triton on
    CUDA): where a kernel's call fails to build (at its first call or a later rebuild), that
    kernel runs eager for the rest of the process and one line is logged (the kernels change no
    input in place, so the call is simply repeated eager).

    Args:
        fused: use the compiled kernels (built on their first call).
    """
    global _fused
    if not fused:
        return _EAGER
    if _fused is None:
        from services.train.kernel_cache import purge_torn_kernels

        # Before the process's first build: inductor caches what it learns from the cache
        # in memory (a CPU ISA whose test library fails to load is taken as unsupported).
        torn = purge_torn_kernels()
        if torn:
            log.warning(
                "train: removed %d torn compiled kernel file(s) from inductor's cache (left by "
                "a killed build; they are built again), e.g. %s",
                len(torn),
                torn[0],
            )
        _fused = LossKernels(*(_Compiled(f) for f in _EAGER))
    return _fused


class _Compiled:
    """`torch.compile(fn)`, or `fn` itself once a compiled call failed.

    Any call may build: the first, and every later one whose inputs break a guard (another
    dtype, grad mode, a new dynamic-shape range), e.g. the first validation after training
    steps. A failed build falls back to eager for the rest of the process: the kernels change
    no input in place, so the call is repeated eager, and an error that is not the build's is
    raised again by the eager call. Out of memory is the exception: it is raised as is, and
    the compiled kernel kept, for the trainer's OOM back-off to retry a smaller micro-batch
    at full speed.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        import torch

        self.eager, self.fn = fn, torch.compile(fn, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        if self.fn is self.eager:
            return self.eager(*args)
        import torch

        try:
            return self.fn(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001  inductor's build errors share no base class
            log.warning(
                "train: fused loss kernel %s not built, running eager: %s",
                self.eager.__name__,
                (str(e).strip().splitlines() or [type(e).__name__])[0][:200],
            )
            self.fn = self.eager
            return self.eager(*args)


def padded_rows(c: int, multiple: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Row indices `0..c-1`, then `c-1` repeated up to a multiple of `multiple` (int64).

    A matmul over `x[padded_rows(len(x), m)]` has one of few row counts; the caller weighs
    the repeats at 0 or drops their results.
    """
    import torch

    idx = torch.arange(c + (-c % multiple), device=device)
    return idx.clamp_(max=max(c - 1, 0))


class Teacher:
    """The teacher distribution over the draft vocab, read by position.

    `p = softmax(th @ tw.T)` in fp32 (fp64 for fp64 inputs), with its negative entropy
    `sum_v p_v log p_v` and argmax: everything the KL needs from the teacher. TTT step j
    scores the teacher at positions `j..T-1`, so with `cached` positions the teacher is
    computed once per micro-batch and gathered by every step (step 1 of TTT 2 then costs one
    matmul and one softmax fewer); without them it is recomputed for each chunk read.

    Args:
        th: `[n, H]` normed teacher states (no gradient).
        tw: `[Vd, H]` teacher lm_head rows of the draft vocab (no gradient).
        matmul_dtype: dtype of the logits matmul (bf16 under autocast).
        cached: int64 `[m]` positions to compute up front (every position `at` will be asked
            for), or None. The cache is `[m, Vd]` fp32: callers bound m by the loss chunk.
        fused: compute with the compiled kernels (`loss_kernels`).
        multiple: the logits matmuls' row counts, here and in `chunked_kl`'s chunks, are
            rounded up to a multiple of this with repeats of the last row that weigh
            nothing (`services.train.runtime.row_multiple`: on CPU every new matmul shape
            costs oneDNN a new kernel).
    """

    def __init__(
        self,
        th: torch.Tensor,
        tw: torch.Tensor,
        matmul_dtype: torch.dtype,
        cached: torch.Tensor | None = None,
        fused: bool = False,
        multiple: int = 1,
    ) -> None:
        import torch

        self.th, self.twm, self.matmul_dtype = th, tw.to(matmul_dtype), matmul_dtype
        self.fused, self.multiple = fused, multiple
        self.acc = torch.float64 if th.dtype == torch.float64 else torch.float32
        self.slot: torch.Tensor | None = None
        if cached is not None:
            self.cache = self._compute(cached[padded_rows(len(cached), multiple, th.device)])
            self.slot = torch.full((th.shape[0],), -1, dtype=torch.long, device=th.device)
            self.slot[cached] = torch.arange(len(cached), device=th.device)

    def _compute(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.th[pos].to(self.matmul_dtype) @ self.twm.T  # shape: [c, Vd]
        return loss_kernels(self.fused).teacher(t, self.acc)

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p `[c, Vd]`, negative entropy `[c]`, argmax `[c]`) at positions `pos` (int64 `[c]`).

        Raises:
            IndexError: a position outside the cached ones.
        """
        if self.slot is None:
            return self._compute(pos)
        idx = self.slot[pos]
        if bool((idx < 0).any()):
            raise IndexError("teacher position outside the cached ones")
        p, neg_entropy, arg = self.cache
        return p[idx], neg_entropy[idx], arg[idx]


def _kl_and_grad(
    h: torch.Tensor,
    w: torch.Tensor,
    teacher: Teacher,
    pos: torch.Tensor,
    weight: torch.Tensor,
    chunk_tokens: int,
    want_h: bool,
    want_w: bool,
    matmul_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Sum over positions of `weight * KL(p_teacher || q_draft)`, chunk by chunk.

    Args:
        h: `[n, H]` normed draft states; w: `[Vd, H]` draft lm_head.
        teacher: the teacher distribution (its `fused` picks the kernels for the draft side
            too); `pos` int64 `[n]`: the teacher position scored by each row of h.
        weight: `[n]` per-position weight (mask * decay**j / denominator).
        chunk_tokens: positions per chunk.
        want_h, want_w: compute the gradient with respect to `h` / `w`.
        matmul_dtype: dtype of the matmuls (bf16 under autocast); softmax and KL run in
            fp32 (fp64 when the inputs are fp64).

    Returns:
        (loss, grad_h or None, grad_w or None, draft argmax `[n]`, teacher argmax `[n]`).
    """
    import torch

    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    n, multiple = h.shape[0], teacher.multiple
    loss = torch.zeros((), dtype=acc, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if want_w else None
    pred = torch.empty(n, dtype=torch.long, device=h.device)
    teach = torch.empty(n, dtype=torch.long, device=h.device)
    wm = w.to(matmul_dtype)
    draft_terms = loss_kernels(teacher.fused).draft
    want = matmul_dtype if want_h or want_w else None
    for s in range(0, n, chunk_tokens):
        e = min(s + chunk_tokens, n)
        # Rows past e - s repeat the last one at weight 0: no loss, no gradient.
        pad = (e - s) % multiple != 0
        rows = s + padded_rows(e - s, multiple, h.device) if pad else slice(s, e)
        p, neg_entropy, arg = teacher.at(pos[rows])
        teach[s:e] = arg[: e - s]
        hc = h[rows].to(matmul_dtype)
        wc = weight[rows].to(acc)
        wc[e - s :] = 0
        chunk_loss, g, arg = draft_terms(hc @ wm.T, p, neg_entropy, wc, want)
        pred[s:e] = arg[: e - s]
        loss += chunk_loss
        if g is not None:  # shape: [c, Vd]
            if grad_h is not None:
                grad_h[s:e] = (g @ wm)[: e - s].to(h.dtype)
            if grad_w is not None:
                grad_w += (g.T @ hc).to(acc)
        del p, g
    return loss, grad_h, grad_w, pred, teach


class _ChunkedKL:
    """Holder for the autograd Function (built lazily: torch is imported inside functions)."""

    fn: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls.fn is None:
            import torch

            class ChunkedKL(torch.autograd.Function):
                @staticmethod
                def forward(ctx, h, w, teacher, pos, weight, chunk_tokens, matmul_dtype):  # type: ignore[override]
                    loss, gh, gw, pred, teach = _kl_and_grad(
                        h,
                        w,
                        teacher,
                        pos,
                        weight,
                        chunk_tokens,
                        ctx.needs_input_grad[0],
                        ctx.needs_input_grad[1],
                        matmul_dtype,
                    )
                    ctx.save_for_backward(
                        gh if gh is not None else h.new_empty(0),
                        gw.to(w.dtype) if gw is not None else w.new_empty(0),
                    )
                    ctx.mark_non_differentiable(pred, teach)
                    return loss, pred, teach

                @staticmethod
                def backward(ctx, grad_loss, _gp, _gt):  # type: ignore[override]
                    gh, gw = ctx.saved_tensors
                    dh = gh * grad_loss.to(gh.dtype) if ctx.needs_input_grad[0] else None
                    dw = gw * grad_loss.to(gw.dtype) if ctx.needs_input_grad[1] else None
                    return dh, dw, None, None, None, None, None

            cls.fn = ChunkedKL
        return cls.fn


def chunked_kl(
    h: torch.Tensor,
    w: torch.Tensor,
    teacher: Teacher,
    pos: torch.Tensor,
    weight: torch.Tensor,
    chunk_tokens: int,
    matmul_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sum_i weight_i * KL(p_teacher[pos_i] || softmax(h_i @ w.T))`, differentiable in h, w.

    Args:
        h: `[n, H]` normed draft states (any float dtype).
        w: `[Vd, H]` draft lm_head weight.
        teacher: the teacher distribution over the draft vocab (`Teacher`).
        pos: int64 `[n]`, the teacher position each row of h is scored against.
        weight: `[n]` per-position weight.
        chunk_tokens: positions per chunk (> 0): the fp32 `[chunk, Vd]` working set.
        matmul_dtype: dtype of the matmuls; default `h.dtype`.

    Returns:
        (scalar loss in fp32 or fp64, draft argmax `[n]`, teacher argmax `[n]`).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive (got {chunk_tokens})")
    import torch

    dtype = matmul_dtype or h.dtype
    if not (torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)):
        # Validation: no gradient is computed, nothing is kept.
        loss, _, _, pred, teach = _kl_and_grad(
            h, w, teacher, pos, weight, chunk_tokens, False, False, dtype
        )
        return loss, pred, teach
    return _ChunkedKL.get().apply(h, w, teacher, pos, weight, chunk_tokens, dtype)


def teacher_positions(mask: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """Every teacher position some TTT step may score: int64 `[m]`, ascending.

    Step j scores position p against the teacher at p+j when `mask[p+j]` or the chain at p
    is alive, and a chain is alive only where `mask[p]` (`scored_rows`), so the teacher is
    read at i only if `mask[i - j]` for some j < ttt_steps.

    Args:
        mask: bool `[n]`, the micro-batch's loss mask.
        ttt_steps: the TTT depth.
    """
    import torch

    need = mask.clone()
    for j in range(1, min(ttt_steps, len(mask))):
        need[j:] |= mask[:-j]
    return torch.nonzero(need).squeeze(1)


def scored_rows(mask: torch.Tensor, prev_correct: torch.Tensor) -> torch.Tensor:
    """Positions of one TTT step whose draft logits change the loss or a metric.

    A position p of step j counts when its target p+j is trainable (`mask`, weight > 0) or
    its greedy chain is still alive (`prev_correct`, the conditional accuracy's
    denominator). Elsewhere the loss weight is 0 (no loss, no gradient) and the chain is
    already broken, so skipping those rows leaves the loss, the gradients and every metric
    as they are: on chat data most positions are prompt tokens (loss mask 0), and their
    `[positions, draft_vocab]` logits are most of the loss's work.

    Args:
        mask: bool `[n]`, the loss mask at the step's targets (`loss_mask[j:]`).
        prev_correct: bool `[n]`, speculators' `prev_correct` for the step's positions.

    Returns:
        int64 `[r]` position indices, ascending.
    """
    import torch

    return torch.nonzero(mask | prev_correct).squeeze(1)


def ttt_loss(
    model: Any,
    batch: dict[str, torch.Tensor],
    ttt_steps: int,
    decay: float,
    chunk_tokens: int,
    denominators: list[float] | None = None,
    autocast_dtype: str | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The TTT forward and its loss, chunked over tokens per TTT step.

    Args:
        model: the draft (speculators `Eagle3DraftModel`), or a DDP wrapper of it.
        batch: `services.train.packing.collate`'s dict on the model's device, with
            `verifier_last_hidden_states` and `loss_mask`.
        ttt_steps: TTT depth.
        decay: `train.step_loss_decay` (step j weighs decay**j).
        chunk_tokens: positions per loss chunk.
        denominators: per-step normalizers; default this batch's (`step_denominators`).
        autocast_dtype: 'bf16' to run under bf16 autocast (matmuls of the loss in bf16).
        fused: the loss's element-wise work through the compiled kernels (`loss_kernels`).

    Returns:
        (loss, metrics) as speculators' forward returns them (see the module docstring).
    """
    import torch

    from services.train.runtime import row_multiple, unwrap
    from services.train.ttt import ttt_states

    draft: Any = unwrap(model)
    mask = batch["loss_mask"]
    denoms = denominators or step_denominators(mask, ttt_steps)
    device_type = batch["hidden_states"].device.type
    # Without the teacher states speculators computes no loss (and no [T, Vd] targets).
    inputs = {k: v for k, v in batch.items() if k not in TEACHER_KEYS}
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast_dtype == "bf16"):
        state_rows, states = ttt_states(model, inputs, mask, ttt_steps)
    mm_dtype = torch.bfloat16 if autocast_dtype == "bf16" else None
    with torch.no_grad():
        final = batch["verifier_last_hidden_states"][0]
        teacher_h = draft.verifier_norm(final.to(draft.verifier_norm.weight.dtype))
    w, tw = draft.lm_head.weight, draft.verifier_lm_head.weight
    n = mask.shape[1]
    # One [m, Vd] cache within the loss chunk's working set, shared by the TTT steps (at
    # TTT 1 there is nothing to share); a longer micro-batch recomputes per chunk.
    cached = teacher_positions(mask[0], ttt_steps) if ttt_steps > 1 else None
    if cached is not None and len(cached) > chunk_tokens:
        cached = None
    with torch.no_grad():
        multiple = row_multiple(device_type)
        teacher = Teacher(teacher_h, tw, mm_dtype or states[0].dtype, cached, fused, multiple)
    prev_correct = mask[0].clone()
    # A target in the padding (`collate`'s, at the end) ends the chain, as the micro-batch's
    # end does unpadded: no step scores or counts it.
    real = batch["document_ids"][0] >= 0
    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = {}
    for j in range(ttt_steps):
        m = mask[0, j:]
        prev = prev_correct[: n - j]
        prev &= real[j:]
        rows = scored_rows(m, prev)
        at = torch.searchsorted(state_rows[j], rows).clamp_(max=len(state_rows[j]) - 1)
        if not torch.equal(state_rows[j][at], rows):
            raise RuntimeError(f"TTT step {j} scores a position its forward skipped (ttt_rows)")
        h = states[j][at]
        wdtype = torch.float64 if h.dtype == torch.float64 else torch.float32
        weight = m[rows].to(wdtype) * (decay**j / denoms[j])
        s_loss, pred_r, teach_r = chunked_kl(
            h, w, teacher, rows + j, weight, chunk_tokens, mm_dtype or h.dtype
        )
        # Rows left out have `prev` False, so their (never equal) placeholders change no
        # metric.
        pred = torch.full((n - j,), -1, dtype=torch.long, device=mask.device)
        teach = torch.full((n - j,), -2, dtype=torch.long, device=mask.device)
        pred[rows], teach[rows] = pred_r, teach_r
        loss = s_loss if loss is None else loss + s_loss
        cond_total = prev.sum().float()
        correct = torch.logical_and(prev, pred == teach, out=prev)
        correct_sum = correct[m].float().sum()
        metrics[f"loss_{j}_sum"] = s_loss.detach().clone()
        metrics[f"loss_{j}_total"] = torch.ones((), device=mask.device)
        metrics[f"full_acc_{j}_sum"] = correct_sum
        metrics[f"full_acc_{j}_total"] = m.sum().float()
        metrics[f"cond_acc_{j}_sum"] = correct_sum.clone()
        metrics[f"cond_acc_{j}_total"] = cond_total
    assert loss is not None  # ttt_steps > 0 (recipe validation)
    metrics["loss_sum"] = loss.detach().clone()
    metrics["loss_total"] = torch.ones((), device=mask.device)
    return loss, metrics
