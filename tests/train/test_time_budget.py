"""`train.time_budget_s`: the run is cut to the steps that fit and its lr schedule ends there.

The pace is made known: each step reports a set `step_s` and the loop's clock outside steps
stands still, so the expected end step and lr follow from the budget by hand, whatever this
machine's speed.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.train.conftest import train_recipe


def test_budget_steps_known_values():
    from services.train.schedule import budget_steps

    # 90 s left at 3 s a step: 30 more steps after the 4 done.
    assert budget_steps(done=4, spent_s=10, pace_s=3, budget_s=100, total=50) == 34
    assert budget_steps(done=4, spent_s=10, pace_s=3, budget_s=100, total=20) == 20  # all epochs
    assert budget_steps(done=4, spent_s=10, pace_s=3, budget_s=11.5, total=50) == 4  # 1.5 s left
    assert budget_steps(done=4, spent_s=120, pace_s=3, budget_s=100, total=50) == 4  # overspent
    with pytest.raises(ValueError, match="pace_s"):
        budget_steps(done=4, spent_s=0, pace_s=0, budget_s=100, total=50)


def _cosine(step: int, total: int, warmup: int) -> float:
    """transformers' get_cosine_schedule_with_warmup, written out (the expected lr shape)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * min((step - warmup) / (total - warmup), 1.0)))


class _Killed(Exception):
    """Stands for a SIGKILL during the last validation."""


def record_planned_ends(monkeypatch) -> list[int | None]:
    """A list that receives `state.planned_steps` after each step's time is counted."""
    from services.train.trainer import Trainer

    planned: list[int | None] = []
    real_count = Trainer._count_time

    def count_and_record(self, seconds):
        real_count(self, seconds)
        planned.append(self.state.planned_steps)

    monkeypatch.setattr(Trainer, "_count_time", count_and_record)
    return planned


@pytest.mark.slow
def test_a_budgeted_run_ends_where_the_budget_ends_and_resumes_to_the_same_end(
    make_run, smollm2_path, monkeypatch
):
    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    # Step times: a slow first step, then 1, 1, 2, then 1 s; validation and checkpoints take 0.
    times = iter([10.0, 1.0, 1.0, 2.0] + [1.0] * 100)
    monkeypatch.setattr("services.train.trainer._clock", lambda: 0.0)
    real_step, real_validate = Trainer.train_step, Trainer.validate

    def timed_step(self, refs):
        return {**real_step(self, refs), "step_s": next(times)}

    def validate_killed_once(self):
        monkeypatch.setattr(Trainer, "validate", real_validate)
        raise _Killed

    monkeypatch.setattr(Trainer, "train_step", timed_step)
    monkeypatch.setattr(Trainer, "validate", validate_killed_once)
    from shared.progress import Progress

    totals: list[int] = []

    class Recorded(Progress):
        def close(self) -> None:
            totals.append(self.total)
            super().close()

    monkeypatch.setattr("services.train.trainer.Progress", Recorded)
    recipe = train_recipe(smollm2_path, time_budget_s=22.5, step_checkpoint_every=4)
    store = make_run(recipe)
    first = Trainer(recipe, store, index_samples(store))
    assert first.total_steps > 2 * 11  # the budget, not the epochs, ends this run
    planned = record_planned_ends(monkeypatch)
    with pytest.raises(_Killed):
        first.run()
    # Re-planned after every step from step 4 on: end = step + floor((22.5 - spent) / pace),
    # pace = spent / step. Step 4: 14 s, pace 3.5, 8.5 s left: 4 + 2 = 6. Step 5: 15 s, 3.0,
    # 7.5 s: 7. Step 6: 16 s, 2.67, 6.5 s: 8. Step 7: 17 s, 2.43, 5.5 s: 9. Step 8: 18 s,
    # 2.25, 4.5 s: 10. Step 9: 19 s, 2.11, 3.5 s: 10. Step 10: 20 s, 2.0, 2.5 s: 11.
    # Step 11: 21 s, 1.91, 1.5 s: 11, reached (mid-epoch 1).
    assert planned == [None, None, None, 6, 7, 8, 9, 10, 10, 11, 11]
    assert first.state.planned_steps == 11 and first.state.step == 11
    assert first.state.loop_seconds == pytest.approx(21.0)
    assert totals == [11]  # the progress bar's total follows the budget's end step
    lrs_first = [json.loads(x)["lr"] for x in store.train.metrics_path.read_text().splitlines()]

    # Killed during the last validation: the rolling checkpoint is step 8's (none is written
    # at the end step), so the resumed run trains steps 9-11 again at the same step times,
    # plans the same ends from the saved state, and validates.
    times = iter([1.0] * 100)
    planned.clear()
    resumed = Trainer(recipe, store, index_samples(store))
    resumed.run()
    assert planned == [10, 11, 11]
    assert resumed.state.planned_steps == 11 and resumed.state.step == 11
    records = [json.loads(x) for x in store.train.metrics_path.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 12))
    assert [r["lr"] for r in steps] == pytest.approx(lrs_first, rel=1e-12)
    # Each step's lr follows the cosine of the end planned after the step before it, with
    # ceil(0.1 * end) warm-up steps; the last step's lr is near 0.
    for r, end in zip(steps[4:], [6, 7, 8, 9, 10, 10, 11], strict=True):
        want = 1e-3 * _cosine(r["step"] - 1, end, math.ceil(0.1 * end))
        assert r["lr"] == pytest.approx(want, rel=1e-9)
    assert steps[-1]["lr"] < 0.05 * 1e-3  # 0.5 * (1 + cos(pi * 8 / 9)) = 0.030 of the peak
    # The partial epoch is validated and checkpointed like a whole one.
    (epoch,) = [r for r in records if r["kind"] == "epoch"]
    assert epoch["epoch"] == 1 and epoch["step"] == 11 and epoch["tau"] > 1.0
    assert epoch["partial"] is True
    assert totals == [11, 3]  # resumed at step 8: steps 9-11 left
    saved = json.loads((store.train.epoch_dir(1) / "state.json").read_text())
    assert saved["step"] == 11 and saved["planned_steps"] == 11
    assert saved["loop_seconds"] == pytest.approx(21.0)

    # Resumed once more, the run is over: no step is added.
    again = Trainer(recipe, store, index_samples(store))
    again.run()
    assert again.state.step == 11
    assert len(store.train.metrics_path.read_text().splitlines()) == len(records)


@pytest.mark.slow
def test_the_budget_counts_the_loop_outside_steps(make_run, smollm2_path, monkeypatch):
    import itertools

    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    # Each step reports 1 s; the loop's clock advances 0.5 s per reading, so the logging and
    # checkpoint work after each step, and the last validation, each count 0.5 s.
    real_step = Trainer.train_step
    monkeypatch.setattr(
        Trainer, "train_step", lambda self, refs: {**real_step(self, refs), "step_s": 1.0}
    )
    ticks = itertools.count(0.0, 0.5)
    monkeypatch.setattr("services.train.trainer._clock", lambda: next(ticks))
    planned = record_planned_ends(monkeypatch)
    recipe = train_recipe(smollm2_path, time_budget_s=9.2, step_checkpoint_every=0)
    store = make_run(recipe)
    trainer = Trainer(recipe, store, index_samples(store))
    trainer.run()
    # Spent after step k's own second: k + 0.5 (k - 1). Step 4: 5.5 s, pace 1.375, 3.7 s left:
    # 4 + 2 = 6. Step 5: 7.0 s, 1.4, 2.2 s: 6. Step 6: 8.5 s: 6, reached. Counting steps only
    # (pace 1.0) would have planned 9.
    assert planned == [None, None, None, 6, 6, 6]
    assert trainer.state.step == 6
    # 6 steps + 6 x 0.5 s after them + 0.5 s of the last validation
    assert trainer.state.loop_seconds == pytest.approx(9.5)
