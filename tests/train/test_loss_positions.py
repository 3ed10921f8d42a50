"""`train.loss_positions`: which positions the training loss scores (validation unchanged)."""

from __future__ import annotations

import pytest
import torch

from services.train.packing import all_positions_mask, collate, loss_positions
from services.train.samples import AlignedSample
from tests.train.conftest import train_recipe


def _sample(mask: list[int], h: int = 4) -> AlignedSample:
    n = len(mask)
    return AlignedSample(
        input_ids=torch.arange(n, dtype=torch.long),
        aux=torch.zeros(n, 3 * h),
        final=torch.zeros(n, h),
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        position_ids=torch.arange(1, n + 1),
    )


def test_all_positions_drop_the_last_and_the_first_ttt_minus_one():
    assert all_positions_mask(8, 3).tolist() == [0, 0, 1, 1, 1, 1, 1, 0]
    assert all_positions_mask(4, 1).tolist() == [1, 1, 1, 0]
    assert all_positions_mask(2, 3).tolist() == [0, 0]
    assert all_positions_mask(0, 3).tolist() == []


def test_packed_row_mask_of_each_choice():
    # Two conversations: a prompt of 4 and 2 positions, then the answer (the last position
    # predicts nothing, so shift_mask_left left it False).
    a, b = _sample([0, 0, 0, 0, 1, 1, 0]), _sample([0, 0, 1, 1, 1, 0])
    kept = collate(loss_positions([a, b], "assistant", 3), 64)["loss_mask"][0]
    assert kept.tolist() == [0, 0, 0, 0, 1, 1, 0] + [0, 0, 1, 1, 1, 0]
    every = loss_positions([a, b], "all", 3)
    packed = collate(every, 64)
    assert packed["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 0] + [0, 0, 1, 1, 1, 0]
    # Only the mask changes, and the inputs are untouched.
    assert packed["input_ids"][0].tolist() == list(range(7)) + list(range(6))
    assert a.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 0]
    # Truncated to 5 positions, the kept last position has a next token: it is trained.
    truncated = collate(every, 5)["loss_mask"][0]
    assert truncated.tolist() == [0, 0, 1, 1, 1] + [0, 0, 1, 1, 1]


@pytest.mark.slow
def test_training_scores_every_position_and_validation_only_the_answers(make_run, smollm2_path):
    from services.train.samples import SampleReader, index_samples
    from services.train.trainer import Trainer

    runs = {}
    for positions in ("assistant", "all"):
        recipe = train_recipe(smollm2_path, loss_positions=positions)
        store = make_run(recipe)
        runs[positions] = (Trainer(recipe, store, index_samples(store)), store)
    trainer, store = runs["all"]
    read = SampleReader(store)
    refs = [trainer.train_refs[i] for i in trainer.plans[0][0]]
    samples = [read(r) for r in refs]
    tps, ttt = trainer.cfg.tokens_per_step, trainer.cfg.ttt_steps
    # Counted from the sample lengths alone: TTT step 0 scores every position but the first
    # ttt-1 and, when the sample is not truncated, the last.
    want = sum(min(r.positions, tps) - (ttt - 1) - (r.positions <= tps) for r in refs)
    answers = sum(int(s.loss_mask[:tps].sum()) for s in samples)
    assert want > answers > 0
    raw, _ = trainer.step_loss(samples, train=True)
    assert raw["full_acc_0_total"] == want
    # Validation scores the assistant positions, exactly as the default recipe does (same
    # seed, so the same initial draft).
    val_all, _ = trainer.step_loss(samples, train=False)
    val_default, _ = runs["assistant"][0].step_loss(samples, train=False)
    assert val_all["full_acc_0_total"] == answers
    assert val_all == pytest.approx(val_default, rel=1e-6)
