"""`train.time_budget_s`: the run is cut to the steps that fit and its lr schedule ends there.

The pace is made known: each step reports 1.0 s (`step_s`), so the expected end step and lr
follow from the budget by hand, whatever this machine's speed.
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


@pytest.mark.slow
def test_a_budgeted_run_ends_where_the_budget_ends_and_resumes_to_the_same_end(
    make_run, smollm2_path, monkeypatch
):
    from services.train.samples import index_samples
    from services.train.trainer import Trainer

    # Step times: a slow first step (left out of the pace), then 1, 1, 2 (median 1), then 1 s.
    times = iter([10.0, 1.0, 1.0, 2.0] + [1.0] * 100)
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
    assert first.total_steps > 2 * 12  # the budget, not the epochs, ends this run
    with pytest.raises(_Killed):
        first.run()
    # 4 steps timed (14 s), then 8.5 s left at 1 s a step: 8 more, 12 in all, mid-epoch 1.
    assert first.state.planned_steps == 12 and first.state.step == 12
    assert first.state.step_seconds == pytest.approx(22.0)
    assert totals == [12]  # the progress bar's total follows the budget's end step
    lrs_first = [json.loads(x)["lr"] for x in store.train.metrics_path.read_text().splitlines()]

    # Killed during the last validation: the rolling checkpoint is step 8's (none is written
    # at the end step), so the resumed run trains steps 9-12 again, then validates.
    resumed = Trainer(recipe, store, index_samples(store))
    resumed.run()
    assert resumed.state.planned_steps == 12 and resumed.state.step == 12
    records = [json.loads(x) for x in store.train.metrics_path.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert [r["lr"] for r in steps] == pytest.approx(lrs_first, rel=1e-12)
    # From step 5 on, the lr follows a 12-step cosine with ceil(0.1 * 12) = 2 warm-up steps,
    # ending near 0.
    for r in steps[4:]:
        assert r["lr"] == pytest.approx(1e-3 * _cosine(r["step"] - 1, 12, 2), rel=1e-9)
    assert steps[-1]["lr"] < 0.03 * 1e-3
    # The partial epoch is validated and checkpointed like a whole one.
    (epoch,) = [r for r in records if r["kind"] == "epoch"]
    assert epoch["epoch"] == 1 and epoch["step"] == 12 and epoch["tau"] > 1.0
    assert epoch["partial"] is True
    assert totals == [12, 4]  # resumed at step 8: steps 9-12 left
    saved = json.loads((store.train.epoch_dir(1) / "state.json").read_text())
    assert saved["step"] == 12 and saved["planned_steps"] == 12
    assert saved["step_seconds"] == pytest.approx(22.0)

    # Resumed once more, the run is over: no step is added.
    again = Trainer(recipe, store, index_samples(store))
    again.run()
    assert again.state.step == 12
    assert len(store.train.metrics_path.read_text().splitlines()) == len(records)
