"""Token-budget batching with out-of-memory back-off.

Responsibility: group samples into forward batches by a token budget (padded tokens, i.e.
`len(batch) * longest`), not by a sample count, and keep going when a batch runs out of
memory: halve the budget, re-plan the rest of the shard, retry. A single sample longer than
the budget goes alone.

Invariants:
- samples are sorted by length, longest first, so padding is small and an OOM shows up on
  the first (largest) batch rather than at the end of a shard;
- every sample handed in is either passed to `on_result` exactly once or the run raises;
  an OOM never drops a sample;
- the budget only shrinks. The real Kimi-K2.5 run died of OOM on its first try with a batch
  of 2,000 samples (issue 5); a token budget with back-off is the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shared.errors import StageFailedError

log = logging.getLogger("eyrie.extract")

#: Substrings of the RuntimeError messages torch raises when an allocation fails on CPU
#: (`DefaultCPUAllocator: can't allocate memory`) or on older CUDA builds.
_OOM_MARKERS = ("out of memory", "can't allocate memory")


def is_oom(exc: BaseException) -> bool:
    """True when `exc` is an allocation failure (CUDA or CPU) worth retrying smaller."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)


def plan_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Split sample indices into batches of at most `budget` padded tokens.

    Args:
        lengths: token count of each sample (index i = sample i).
        budget: max `len(batch) * max(lengths in batch)`; a longer single sample goes alone.

    Returns:
        lists of indices into `lengths`, longest samples first; each index appears once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@dataclass
class BatchStats:
    """What happened while running a shard's batches.

    Attributes:
        batches: forward batches that succeeded.
        oom_retries: batches that ran out of memory and were retried smaller.
        start_budget, final_budget: the token budget at the start and at the end.
    """

    batches: int = 0
    oom_retries: int = 0
    start_budget: int = 0
    final_budget: int = 0


def _free_accelerator_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_batches(
    samples: Sequence[Sequence[int]],
    budget: int,
    forward: Callable[[list[Sequence[int]]], list[Any]],
    on_result: Callable[[int, Any], None],
) -> BatchStats:
    """Run `forward` over token-budget batches, halving the budget on out-of-memory.

    Args:
        samples: token-id lists; index i is passed back to `on_result`.
        budget: starting token budget per batch (`extract.tokens_per_batch`).
        forward: batch of token-id lists → one result per sample, in order.
        on_result: called as `on_result(i, result_i)` for every sample exactly once.

    Returns:
        BatchStats with the retry count and the final budget.

    Raises:
        StageFailedError: one sample alone still runs out of memory; the message names its
            length and the budget. Samples already passed to `on_result` stay done.
    """
    lengths = [len(s) for s in samples]
    stats = BatchStats(start_budget=budget, final_budget=budget)
    pending = plan_batches(lengths, budget)
    while pending:
        batch = pending.pop(0)
        try:
            results = forward([samples[i] for i in batch])
        except Exception as e:
            if not is_oom(e):
                raise
            _free_accelerator_cache()
            if len(batch) == 1:
                raise StageFailedError(
                    f"one sample of {lengths[batch[0]]} tokens runs out of memory alone "
                    f"(budget {stats.final_budget} tokens): lower prep.max_len_tokens or use "
                    "more devices (extract.device_map)"
                ) from e
            stats.oom_retries += 1
            stats.final_budget = max(1, stats.final_budget // 2)
            log.warning(
                "out of memory on a batch of %d samples (%d padded tokens): budget halved to "
                "%d tokens, retrying",
                len(batch),
                len(batch) * lengths[batch[0]],
                stats.final_budget,
            )
            rest = batch + [i for b in pending for i in b]
            pending = [
                [rest[j] for j in b]
                for b in plan_batches([lengths[i] for i in rest], stats.final_budget)
            ]
            continue
        for i, r in zip(batch, results, strict=True):
            on_result(i, r)
        stats.batches += 1
    return stats
