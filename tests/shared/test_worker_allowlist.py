"""Workers run only Eyrie's stage job: real Redis, real `eyrie worker` processes.

Anyone who can write to Redis can push a JSON job naming any importable function, or a
stage job carrying callbacks or webhooks. The worker must refuse these before running
anything, record why in the failed registry, and keep serving.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from rq import Callback, Queue
from rq.job import JobStatus
from rq.webhook import Webhook

from services.conductor.processes import start_worker, stop_process
from shared.artifacts import RunStore
from shared.errors import ConfigError
from shared.queue import (
    JOB_FUNC,
    JobSpec,
    connect,
    enqueue,
    failure_text,
    get_queue,
    make_worker,
)
from shared.recipe import resolve_recipe
from shared.stage import run_stage_job

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "fixtures" / "samples" / "sharegpt_fastchat_dummy.json"


def _run(smollm2_path: Path, data_dir: Path) -> RunStore:
    """A real, small run (30 ShareGPT rows, 3 prep shards), created as `eyrie run` would."""
    recipe = resolve_recipe(
        {
            "name": "allowlist",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": str(SAMPLES), "format": "sharegpt", "max_samples": 30}],
            "prep": {"shard_rows": 10},
            "regen": {"enabled": False},
        }
    )
    return RunStore.create(recipe, root=data_dir)


def _wait_status(job, statuses: set[str], timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while (status := job.get_status(refresh=True)) not in statuses:
        assert time.monotonic() < deadline, f"job {job.id} stayed {status}"
        time.sleep(0.2)
    return status


@pytest.mark.slow
def test_os_system_job_runs_nothing_and_worker_keeps_serving(
    redis_url, data_dir, smollm2_path, tmp_path
):
    conn = connect(redis_url)
    store = _run(smollm2_path, data_dir)
    marker = tmp_path / "pwned"
    q = get_queue("prep", conn)
    evil = q.enqueue("os.system", f"touch {marker}", job_id="evil-0")  # JSON, as an attacker can
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (closed below)
    env = {**os.environ, "EYRIE_REDIS_URL": redis_url, "HF_HUB_OFFLINE": "1"}
    w = start_worker(["prep"], "allowlist-w", env, log=log, monitor_interval_s=2)
    try:
        assert _wait_status(evil, {JobStatus.FAILED, JobStatus.FINISHED}) == JobStatus.FAILED
        assert not marker.exists()
        text = failure_text(evil)
        assert "refused" in text and "'os.system'" in text and JOB_FUNC in text
        assert evil.id in q.failed_job_registry.get_job_ids()
        assert w.poll() is None, "the worker quit after refusing a job"
        # the same worker then runs a real stage job
        real = enqueue(JobSpec("prep", store.run_id, "plan", 0, timeout_s=300), conn)
        assert _wait_status(real, {JobStatus.FAILED, JobStatus.FINISHED}) == JobStatus.FINISHED
        assert store.is_done("plan") and store.plan.num_shards() == 3
        assert w.poll() is None
    finally:
        stop_process(w)
        log.close()
    worker_log = (tmp_path / "worker.log").read_text()
    assert "refused" in worker_log and "evil-0" in worker_log
    assert "Traceback" not in worker_log
    assert not marker.exists()


@pytest.mark.slow
def test_pickled_job_is_refused_without_unpickling(redis_url, tmp_path):
    conn = connect(redis_url)
    marker = tmp_path / "pwned"
    # rq's default serializer is pickle: what a plain `rq enqueue` would push.
    evil = Queue("prep", connection=conn).enqueue("os.system", f"touch {marker}", job_id="pk-0")
    w = make_worker(["prep"], conn)
    w.work(burst=True)
    assert not marker.exists()
    job = get_queue("prep", conn).fetch_job(evil.id)
    assert job is not None and job.get_status(refresh=True) == JobStatus.FAILED
    assert "not Eyrie's JSON payload" in failure_text(job)


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["prep", "train"])  # forking and non-forking workers
@pytest.mark.parametrize("hook", ["on_success", "on_failure", "on_stopped", "webhook"])
def test_stage_job_with_callback_or_webhook_is_refused(
    redis_url, data_dir, smollm2_path, tmp_path, queue, hook
):
    conn = connect(redis_url)
    store = _run(smollm2_path, data_dir)
    marker = tmp_path / "callback-ran"
    extra: dict = (
        {"webhooks": [Webhook("http://127.0.0.1:9/hook", "finished")]}
        if hook == "webhook"
        else {hook: Callback("tests.shared.jobfns.mark_callback")}
    )
    job = get_queue(queue, conn).enqueue(
        JOB_FUNC,
        kwargs={"run_id": store.run_id, "stage": "plan", "shard": 0},
        job_id=f"cb-{hook}",
        meta={"marker": str(marker)},
        **extra,
    )
    make_worker([queue], conn).work(burst=True)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    text = failure_text(job)
    assert "refused" in text
    assert (f"{hook}='tests.shared.jobfns.mark_callback'" in text) or (
        hook == "webhook" and "1 webhook(s)" in text
    )
    assert not marker.exists()
    assert not store.is_done("plan"), "a refused job must not run its function either"


def test_a_worker_built_by_make_worker_refuses_by_default(redis_url):
    conn = connect(redis_url)
    for queues in (["prep"], ["extract"]):
        assert make_worker(queues, conn).job_funcs == frozenset({JOB_FUNC})


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"run_id": "-rf", "stage": "plan", "shard": 0}, "run"),
        ({"run_id": "a" * 300, "stage": "plan", "shard": 0}, "run"),
        ({"run_id": "../../etc", "stage": "plan", "shard": 0}, "run"),
        ({"run_id": ["x"], "stage": "plan", "shard": 0}, "run"),
        ({"run_id": "ok-run", "stage": "os.system", "shard": 0}, "stage"),
        ({"run_id": "ok-run", "stage": 3, "shard": 0}, "stage"),
        ({"run_id": "ok-run", "stage": "plan", "shard": "0"}, "shard"),
        ({"run_id": "ok-run", "stage": "plan", "shard": True}, "shard"),
        ({"run_id": "ok-run", "stage": "plan", "shard": -1}, "shard"),
        ({"run_id": "ok-run", "stage": "plan", "shard": 1.5}, "shard"),
    ],
)
def test_bad_payloads_are_refused(payload, field, data_dir):
    with pytest.raises(ConfigError, match=field):
        run_stage_job(**payload)
    assert not data_dir.exists() or not any(data_dir.rglob("*"))


def test_payload_shard_beyond_the_plan_and_unknown_run_are_refused(
    data_dir, smollm2_path, redis_url
):
    store = _run(smollm2_path, data_dir)
    with pytest.raises(ConfigError, match="does not exist"):
        run_stage_job("no-such-run", "plan", 0)
    with pytest.raises(ConfigError, match="shard 1 out of range"):
        run_stage_job(store.run_id, "plan", 1)  # plan has one shard
    assert not store.is_done("plan")


def test_rq_hints_carry_the_json_serializer(redis_url, data_dir, smollm2_path):
    from shared.queue import RQ_CLI_FLAGS, failed_reason

    conn = connect(redis_url)
    store = _run(smollm2_path, data_dir)
    q = get_queue("prep", conn)
    payload = {"run_id": store.run_id, "stage": "plan", "shard": 7}
    job = q.enqueue(JOB_FUNC, kwargs=payload, job_id=f"{store.run_id}-plan-7")
    make_worker(["prep"], conn).work(burst=True)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    reason = failed_reason(conn, "prep", store.run_id, "plan", 7)
    assert reason is not None and "out of range" in reason
    assert f"rq info {RQ_CLI_FLAGS}" in reason
    assert RQ_CLI_FLAGS == "--serializer rq.serializers.JSONSerializer"
