"""Token-budget batching and OOM back-off, with hand-computed batches (no model)."""

from __future__ import annotations

import pytest
import torch

from services.extract.batching import is_oom, plan_batches, run_batches
from shared.errors import StageFailedError


def test_plan_batches_sorts_longest_first_and_respects_budget():
    lengths = [5, 10, 3, 10, 7]
    # Order by length desc (ties by index): 1(10), 3(10), 4(7), 0(5), 2(3).
    # Budget 20 padded tokens: [1,3] = 2x10; [4,0] = 2x7 = 14, +2 -> 3x7 = 21 > 20; [2].
    assert plan_batches(lengths, 20) == [[1, 3], [4, 0], [2]]
    # A sample longer than the budget goes alone.
    assert plan_batches([50, 4], 20) == [[0], [1]]


def test_oom_halves_budget_and_every_sample_completes():
    samples = [[1] * n for n in (8, 8, 8, 8, 4, 4)]
    seen: dict[int, int] = {}
    calls = []

    def forward(batch):
        padded = len(batch) * max(len(b) for b in batch)
        calls.append(padded)
        if padded > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. (injected)")
        return [len(b) for b in batch]

    stats = run_batches(samples, 64, forward, lambda i, r: seen.__setitem__(i, r))
    # Budget 64: one batch of all six, 6x8 = 48 padded tokens > 16 -> OOM. Budget 32:
    # [0..3] = 4x8 = 32 -> OOM. Budget 16: [0,1] = 16, [2,3] = 16, [4,5] = 2x4 = 8.
    assert calls == [48, 32, 16, 16, 8]
    assert stats.oom_retries == 2 and stats.final_budget == 16 and stats.batches == 3
    assert seen == {0: 8, 1: 8, 2: 8, 3: 8, 4: 4, 5: 4}


def test_single_sample_oom_fails_clearly():
    def forward(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    with pytest.raises(StageFailedError, match="one sample of 8 tokens"):
        run_batches([[1] * 8], 64, forward, lambda i, r: None)


def test_cpu_allocator_failure_counts_as_oom_but_other_errors_do_not():
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    assert not is_oom(RuntimeError("shape mismatch"))
    with pytest.raises(ValueError):
        run_batches([[1]], 8, lambda b: (_ for _ in ()).throw(ValueError("x")), print)
