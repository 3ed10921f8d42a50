"""Stage declarations: the pipeline order, `execute`'s bookkeeping, job payload checks."""

from __future__ import annotations

import pytest

from shared.artifacts import RunStore
from shared.errors import ConfigError
from shared.queue import validate_payload
from shared.recipe import resolve_recipe
from shared.stage import STAGES, ShardResult, Stage, execute, get_stage, pipeline, run_stage_job
from shared.store import atomic_write_bytes

MINIMAL = {"name": "t", "target": {"path": "/m"}, "datasets": [{"path": "/d.jsonl"}]}

#: The order the README's Architecture section and the refactor notes give.
DOCUMENTED = [
    "plan", "prep", "dedup", "split", "regen", "tokenize", "vocab",
    "extract", "train", "export", "bench", "report",
]  # fmt: skip


def test_pipeline_order_is_the_documented_one():
    assert [s.name for s in pipeline(resolve_recipe(MINIMAL))] == DOCUMENTED
    no_regen = resolve_recipe({**MINIMAL, "regen": {"enabled": False}})
    assert [s.name for s in pipeline(no_regen)] == [n for n in DOCUMENTED if n != "regen"]


def test_every_stage_respects_its_after():
    order = [s.name for s in pipeline(resolve_recipe(MINIMAL))]
    for i, name in enumerate(order):
        assert set(get_stage(name).after) & set(order) <= set(order[:i]), name


@pytest.mark.parametrize(
    ("name", "queue"),
    [("plan", "prep"), ("prep", "prep"), ("dedup", "prep"), ("split", "prep"),
     ("tokenize", "prep"), ("vocab", "prep"), ("regen", "regen"), ("extract", "extract"),
     ("train", "train"), ("export", "train"), ("bench", "bench"), ("report", "bench")],
)  # fmt: skip
def test_stage_queues_match_the_architecture_table(name, queue):
    assert get_stage(name).queue == queue


def test_unknown_stage_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown stage 'eval'; known: .*bench"):
        get_stage("eval")


def _counting_stage(calls: list[int], shards: int = 3) -> Stage:
    """A stage (not registered) writing one file per shard and recording each body call."""

    def body(ctx):
        calls.append(ctx.shard)
        out = ctx.store.stage_dir("probe") / f"shard-{ctx.shard:05d}.txt"
        atomic_write_bytes(out, f"shard {ctx.shard}\n".encode())
        return ShardResult({"rows": ctx.shard + 10}, [out], {"seen": ctx.shard})

    return Stage("probe", "prep", 60, body, shards=shards)


def test_execute_writes_the_manifest_and_skips_done_shards(data_dir):
    store = RunStore.create(resolve_recipe(MINIMAL))
    calls: list[int] = []
    st = _counting_stage(calls)
    m = execute(st, store, 1)
    assert calls == [1] and store.is_done("probe", 1) and not store.is_done("probe", 0)
    assert m.counts == {"rows": 11} and m.extra == {"seen": 1}
    assert list(m.files) == ["shard-00001.txt"]
    assert execute(st, store, 1).counts == {"rows": 11} and calls == [1]  # done: no rerun
    execute(st, store, 1, force=True)
    assert calls == [1, 1]
    with pytest.raises(ConfigError, match=r"shard 3 out of range \(0\.\.2\)"):
        execute(st, store, 3)
    assert "probe" not in STAGES


def test_execute_sweeps_only_its_own_shards_temps(data_dir):
    store = RunStore.create(resolve_recipe(MINIMAL))
    folder = store.stage_dir("probe")
    folder.mkdir(parents=True)
    mine = folder / ".tmp-shard-00002.txt-abc"
    other = folder / ".tmp-shard-00001.txt-def"  # a live writer of another shard
    mine.write_text("left by a killed run")
    other.write_text("in progress")
    # temps inside a shard's own folder (extract/shard-N/hidden_states/ resumes in place)
    nested = folder / "shard-00002" / "hidden_states" / ".tmp-hs_4.safetensors-x" / "hs_4"
    nested_other = folder / "shard-00001" / "hidden_states" / ".tmp-hs_4.safetensors-y"
    nested.parent.mkdir(parents=True)
    nested_other.mkdir(parents=True)
    nested.write_text("half a file")
    done = folder / "shard-00002" / "hidden_states" / "hs_3.safetensors"
    done.write_text("kept")
    execute(_counting_stage([]), store, 2)
    assert not mine.exists() and other.exists()
    assert not nested.parent.exists() and nested_other.exists() and done.exists()


def test_failing_body_leaves_no_manifest(data_dir):
    store = RunStore.create(resolve_recipe(MINIMAL))

    def body(ctx):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        execute(Stage("probe", "prep", 60, body), store, 0)
    assert not store.is_done("probe", 0)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (("-rf", "prep", 0), "run id '-rf'"),
        (("run/../x", "prep", 0), "run id"),
        (("run-1", "eval", 0), "unknown stage 'eval'"),
        (("run-1", 3, 0), "payload stage"),
        (("run-1", "prep", -1), "payload shard"),
        (("run-1", "prep", True), "payload shard"),
        (("run-1", "prep", "0"), "payload shard"),
    ],
)
def test_job_payload_is_checked_before_use(payload, message):
    with pytest.raises(ConfigError, match=message):
        validate_payload(*payload)


def test_job_for_a_missing_run_is_refused(data_dir):
    with pytest.raises(ConfigError, match="run 'nope-1' does not exist"):
        run_stage_job("nope-1", "prep", 0)
    assert validate_payload("run-1", "prep", 2) == ("run-1", "prep", 2)


def test_execute_sweeps_a_single_shard_stage_at_its_start(data_dir):
    """A hard kill in train (one shard) leaves temps deep in its folder; the next run sweeps."""
    store = RunStore.create(resolve_recipe(MINIMAL))
    folder = store.stage_dir("probe")
    ckpt_temp = folder / "checkpoints" / ".tmp-epoch-00001-abc" / "epoch-00001" / "model.bin"
    ckpt_temp.parent.mkdir(parents=True)
    ckpt_temp.write_bytes(b"half a checkpoint")
    loose = folder / ".tmp-metrics.jsonl-xyz"
    loose.write_text("{}")
    kept = folder / "checkpoints" / "epoch-00000" / "model.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"a finished checkpoint")
    seen: list[bool] = []

    def body(ctx):
        seen.append(ckpt_temp.parent.parent.exists() or loose.exists())
        out = ctx.store.stage_dir("probe") / "out.txt"
        atomic_write_bytes(out, b"ok\n")
        return ShardResult({"rows": 1}, [out])

    execute(Stage("probe", "train", 60, body, shards=1), store, 0)
    assert seen == [False], "the temps were still there when the body started"
    assert kept.read_bytes() == b"a finished checkpoint"
    assert not any(p.name.startswith(".tmp-") for p in folder.rglob("*"))
