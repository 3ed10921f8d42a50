"""A memory model of one train step, and the micro-batch size it allows on this device.

Responsibility: estimate the bytes one optimizer step needs (draft parameters, gradients and
AdamW states, activations of the TTT unroll, the chunked loss's working set), compare it with
the memory the device has free, and pick the largest micro-batch (tokens per forward/backward,
a power-of-two fraction of `train.tokens_per_step`) that fits. A step larger than the
micro-batch runs as gradient accumulation over whole samples (`services.train.trainer`), so
`tokens_per_step`, the lr it was tuned for, and the data plan do not change.

Model (bytes; b = 2 under bf16 autocast, else 4; n = micro-batch tokens, k = TTT steps):
- parameters: every draft parameter in fp32 (4 per element, frozen ones included: the target
  embeddings and the teacher's lm_head rows live on the device);
- optimizer: per trainable element 4 (gradient) + 8 (AdamW exp_avg, exp_avg_sq), plus the
  chunked loss's fp32 `[Vd, H]` lm_head gradient;
- inputs: per token the aux states `3H` and the final state `H` (stored bf16) and their
  compute-dtype copies;
- activations: per token and TTT step, what autograd keeps for one Llama decoder layer on
  a `2H`-wide input: ~16 H-wide tensors (norms, q/k/v/o, residuals, the KV cache) in b bytes
  plus 3 fp32 RMSNorm inputs, and 4 MLP tensors of width I in b bytes;
- attention mask: CPU sdpa builds a dense bool mask `[n, k*n]`; flex attention (CUDA) a
  block mask of negligible size;
- loss: per chunk of `c = min(n, loss_chunk_tokens)` positions, 6 fp32/fp64 `[c, Vd]`
  tensors at most (the teacher softmax cached across TTT steps, its rows gathered for the
  chunk, the draft logits and softmax, the bf16 gradient; the teacher's own logits while it
  is computed).
The coefficients are upper-side estimates (measured on the CPU path, see
tests/train/test_memory.py); a 10% margin is kept on top.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Fraction of the free device memory the step may plan for (allocator slack, fragmentation).
USABLE_FRACTION = 0.9
#: The smallest micro-batch the back-off and the planner go down to (tokens).
MIN_MICRO_TOKENS = 16
#: The planner's largest micro-batch where attention uses a dense mask (CPU sdpa), when
#: `train.micro_tokens` is unset. A packed micro-batch of n positions computes attention over
#: all n x k*n pairs, the masked-out pairs across its samples included, while its samples
#: alone need only sum(L_i^2); whole-sample micro-batches of this size keep that waste small
#: at the same gradient (`services.train.loss`'s step denominators). The demo's 2-core CPU:
#: scripts/bench_train.py --profile; scripts/bench_quality.py in 600 s, 621 steps at 512
#: against 456 at 2048 and 630 at 256.
DENSE_MASK_MICRO_TOKENS = 512


@dataclass(frozen=True)
class DraftShape:
    """What the memory of a draft step depends on.

    Attributes:
        hidden: H, the target's (and draft's) hidden size.
        intermediate: I, the draft MLP width.
        draft_vocab: Vd, rows of the draft lm_head.
        target_vocab: V, rows of the (frozen) target embedding table held by the draft.
        trainable_params: elements of the trainable parameters.
        frozen_params: elements of the frozen parameters.
    """

    hidden: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    trainable_params: int
    frozen_params: int


@dataclass(frozen=True)
class StepMemory:
    """Estimated bytes of one micro-batch's forward+backward, by part."""

    params: int
    optimizer: int
    inputs: int
    activations: int
    attention_mask: int
    loss: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def step_memory(
    shape: DraftShape,
    tokens: int,
    ttt_steps: int,
    loss_chunk_tokens: int,
    compute_bytes: int,
    dense_mask: bool,
    row_multiple: int = 1,
) -> StepMemory:
    """The memory model (module docstring) for a micro-batch of `tokens` positions.

    Args:
        shape: the draft's sizes.
        tokens: positions in the micro-batch.
        ttt_steps: TTT depth k.
        loss_chunk_tokens: `train.loss_chunk_tokens`.
        compute_bytes: 2 under bf16 autocast, 4 in fp32.
        dense_mask: True when attention builds a dense `[n, k*n]` mask (CPU sdpa).
        row_multiple: the micro-batch and the loss chunk are padded up to a multiple of
            this (`services.train.runtime.row_multiple`).

    Returns:
        bytes by part.
    """
    h, i, b = shape.hidden, shape.intermediate, compute_bytes
    per_token_step = (16 * h + 4 * i) * b + 3 * 2 * h * 4
    tokens += -tokens % row_multiple
    chunk = min(tokens, loss_chunk_tokens)
    chunk += -chunk % row_multiple
    return StepMemory(
        params=4 * (shape.trainable_params + shape.frozen_params),
        optimizer=12 * shape.trainable_params + 4 * shape.draft_vocab * h,
        inputs=tokens * 4 * h * (2 + b),
        activations=tokens * ttt_steps * per_token_step,
        attention_mask=tokens * tokens * ttt_steps if dense_mask else 0,
        loss=6 * 4 * chunk * shape.draft_vocab,
    )


def draft_shape(model: object) -> DraftShape:
    """Read a built draft's sizes (a speculators `Eagle3DraftModel`)."""
    params = list(model.named_parameters())  # type: ignore[attr-defined]
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    frozen = sum(p.numel() for _, p in params if not p.requires_grad)
    cfg = model.config.transformer_layer_config  # type: ignore[attr-defined]
    return DraftShape(
        hidden=int(cfg.hidden_size),
        intermediate=int(cfg.intermediate_size),
        draft_vocab=int(model.lm_head.weight.shape[0]),  # type: ignore[attr-defined]
        target_vocab=int(cfg.vocab_size),
        trainable_params=trainable,
        frozen_params=frozen,
    )


#: Substrings of the RuntimeError torch raises when a CPU (or older CUDA) allocation fails.
_OOM_MARKERS = ("out of memory", "can't allocate memory")


def is_oom(exc: BaseException) -> bool:
    """True when `exc` is an allocation failure (CUDA or CPU) worth retrying smaller."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)


def release_cached() -> None:
    """Return cached accelerator memory after an OOM (no-op on CPU)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def free_bytes(device: str) -> int:
    """Memory the step may use on `device`: free CUDA memory, or available host memory."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def fit_micro_tokens(
    shape: DraftShape,
    tokens_per_step: int,
    ttt_steps: int,
    loss_chunk_tokens: int,
    compute_bytes: int,
    dense_mask: bool,
    budget: int,
    row_multiple: int = 1,
) -> int:
    """The largest `tokens_per_step / 2**m` (>= MIN_MICRO_TOKENS) whose step fits `budget`.

    Nor below `row_multiple`, where padding would keep the micro-batch's size.

    Args:
        budget: bytes available (already reduced by `USABLE_FRACTION` by the caller, or not).
        row_multiple: as `step_memory`'s.

    Returns:
        micro-batch tokens; `tokens_per_step` itself when the whole step fits.

    Raises:
        MemoryError: even MIN_MICRO_TOKENS do not fit (the parameters and optimizer alone
            may exceed the budget); the message gives the estimate by part.
    """
    n = tokens_per_step
    while True:
        est = step_memory(
            shape, n, ttt_steps, loss_chunk_tokens, compute_bytes, dense_mask, row_multiple
        )
        if est.total <= budget:
            return n
        if n // 2 < max(MIN_MICRO_TOKENS, row_multiple):
            gib = {k: round(v / 2**30, 2) for k, v in est.as_dict().items()}
            raise MemoryError(
                f"a train step of {n} tokens needs ~{gib['total']} GiB ({gib}) but "
                f"{budget / 2**30:.2f} GiB are free; use a device with more memory, or lower "
                "draft.draft_vocab_size / draft.intermediate_size"
            )
        n //= 2
