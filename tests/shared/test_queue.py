"""rq plumbing on a real Redis with real workers: ids, JSON payloads, reconciler."""

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest
from rq.job import JobStatus

from shared.errors import ConfigError, ServiceUnavailableError
from shared.queue import JobSpec, connect, enqueue, get_queue, job_id, mask_url, reconcile
from shared.recipe import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_job_ids_deterministic_and_valid():
    run = resolve_recipe(
        {"name": "kimi-k2.5", "target": {"path": "/m"}, "datasets": [{"path": "/d"}]}
    ).run_id()
    assert job_id(run, "prep", 3) == job_id(run, "prep", 3) == f"{run}-prep-3"
    assert all(ch.isalnum() or ch in "_-" for ch in job_id(run, "prep", 3))
    with pytest.raises(ConfigError, match="only letters"):
        job_id("kimi-k2.5", "prep", 0)


def test_unreachable_redis_masks_password():
    with pytest.raises(ServiceUnavailableError) as e:
        connect("redis://:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in str(e.value) and "***" in str(e.value)
    assert mask_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"


def test_enqueue_uses_json_and_explicit_timeout(redis_url):
    conn = connect(redis_url)
    job = enqueue(JobSpec("prep", "run-1", "prep", 2, timeout_s=1234), conn)
    assert job.id == "run-1-prep-2" and job.timeout == 1234
    assert job.kwargs == {"run_id": "run-1", "stage": "prep", "shard": 2}
    raw = zlib.decompress(conn.hget(job.key, "data"))  # rq stores zlib(serializer output)
    assert json.loads(raw)[0] == "shared.stage.run_stage_job"  # JSON, not pickle
    again = enqueue(JobSpec("prep", "run-1", "prep", 2, timeout_s=1234), conn)
    assert again.id == job.id and len(get_queue("prep", conn)) == 1


def test_non_json_payload_refused_at_enqueue(redis_url):
    conn = connect(redis_url)
    with pytest.raises(ConfigError, match="not plain JSON"):
        enqueue(JobSpec("prep", "run-1", "prep", float("nan"), timeout_s=10), conn)  # type: ignore[arg-type]
    q = get_queue("prep", conn)
    with pytest.raises(TypeError):
        q.enqueue("tests.shared.jobfns.echo", object())  # the JSON serializer refuses it
    assert len(q) == 0


def _start_worker(
    redis_url: str, name: str, burst: bool, queue: str = "prep", monitor_interval_s: int = 2
) -> subprocess.Popen:
    # A real worker process, allowed to run tests.shared.jobfns as well as the stage job.
    env = {**os.environ, "EYRIE_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    args = [queue, name, str(monitor_interval_s), "1" if burst else "0"]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.shared.jobfns", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )


def _kill_tree(proc: subprocess.Popen) -> None:
    # Not reaped on purpose: a killed worker stays a zombie until its parent waits for it,
    # and the reconciler must still see it as dead.
    parent = psutil.Process(proc.pid)
    for p in parent.children(recursive=True) + [parent]:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(parent.children(recursive=True), timeout=10)


@pytest.mark.slow
def test_real_worker_runs_a_job(redis_url, tmp_path):
    conn = connect(redis_url)
    q = get_queue("prep", conn)
    job = q.enqueue(
        "tests.shared.jobfns.slow_write",
        str(tmp_path / "o"),
        3,
        0.0,
        job_id="t-write-0",
        job_timeout=60,
    )
    w = _start_worker(redis_url, "w-once", burst=True)
    assert w.wait(timeout=120) == 0
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert (tmp_path / "o" / "data.txt").read_text().count("\n") == 3


@pytest.mark.slow
@pytest.mark.parametrize("retry_after_s", [None, 5], ids=["no-retries", "retry-in-5s"])
def test_sigkilled_worker_job_is_reenqueued_and_written_once(redis_url, tmp_path, retry_after_s):
    """Without retries rq fails the abandoned job and the reconciler requeues it; with one
    (stage jobs have them), rq schedules it and the reconciler reports it once, when due."""
    from rq import Retry

    conn = connect(redis_url)
    q = get_queue("prep", conn)
    out = tmp_path / "o"
    retry = None if retry_after_s is None else Retry(max=1, interval=[retry_after_s])
    job = q.enqueue(
        "tests.shared.jobfns.slow_write",
        str(out),
        400,
        0.02,
        job_id="t-write-1",
        job_timeout=300,
        retry=retry,
    )
    w1 = _start_worker(redis_url, "w-victim", burst=False)
    deadline = time.monotonic() + 120
    while not (out / "runs.log").exists():
        assert time.monotonic() < deadline, "worker never started the job"
        time.sleep(0.2)
    time.sleep(1.0)
    _kill_tree(w1)  # the worker and its work-horse
    assert job.get_status(refresh=True) == JobStatus.STARTED  # rq still thinks it runs
    assert not (out / "data.txt").exists()

    t0 = time.monotonic()
    requeued: list[str] = []
    scheduled_seen = False
    while not requeued:
        # Only the worker's heartbeat tells it died (beats every 2 s here): no pid lookup.
        requeued = reconcile(conn, ("prep",), stale_after_s=8)
        scheduled_seen |= job.get_status(refresh=True) == JobStatus.SCHEDULED
        assert time.monotonic() - t0 < 30, "reconciler did not re-enqueue within 30 s"
        time.sleep(0.5)
    assert requeued == ["t-write-1"]
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    assert scheduled_seen == (retry_after_s is not None)
    assert reconcile(conn, ("prep",), stale_after_s=8) == []  # reported once

    w1.wait()
    w2 = _start_worker(redis_url, "w-rescue", burst=True)
    assert w2.wait(timeout=180) == 0
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    lines = (out / "data.txt").read_text().splitlines()
    assert lines == [f"row {i}" for i in range(400)]
    assert (out / "runs.log").read_text().count("\n") == 2  # killed run + rescue run
    assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")] != []  # orphan temp
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".tmp-")) == [
        "data.txt",
        "manifest.json",
        "runs.log",
    ]


@pytest.mark.slow
def test_busy_non_forking_worker_is_not_taken_for_dead(redis_url, tmp_path):
    """A long job on a non-forking worker keeps heart-beating (liveness is the heartbeat)."""
    conn = connect(redis_url)
    q = get_queue("train", conn)
    out = tmp_path / "o"
    job = q.enqueue(
        "tests.shared.jobfns.slow_write", str(out), 60, 0.1, job_id="t-train-0", job_timeout=300
    )
    w = _start_worker(redis_url, "w-busy", burst=True, queue="train", monitor_interval_s=1)
    deadline = time.monotonic() + 120
    while not (out / "runs.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    while w.poll() is None:
        assert reconcile(conn, ("train",), stale_after_s=4) == []
        time.sleep(1)
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert (out / "runs.log").read_text().count("\n") == 1


@pytest.mark.slow
def test_config_error_fails_at_once_without_retries(redis_url, data_dir):
    """A job that cannot succeed (its run does not exist) is not retried by rq."""
    from shared.queue import failed_reason

    conn = connect(redis_url)
    job = enqueue(JobSpec("prep", "no-such-run", "prep", 0, timeout_s=60, retries=2), conn)
    assert job.retries_left == 2
    w = _start_worker(redis_url, "w-config", burst=True)
    assert w.wait(timeout=120) == 0
    assert job.get_status(refresh=True) == JobStatus.FAILED  # not SCHEDULED for a retry
    job.refresh()
    assert not job.retries_left
    q = get_queue("prep", conn)
    assert q.scheduled_job_registry.get_job_ids() == [] and len(q) == 0
    reason = failed_reason(conn, "prep", "no-such-run", "prep", 0)
    assert reason is not None and "run 'no-such-run' does not exist" in reason
    assert reconcile(conn, ("prep",)) == []  # nothing for the conductor to re-enqueue


def _worker_on_host(redis_url: str, name: str, host: str) -> subprocess.Popen:
    """A burst worker in its own UTS and pid namespaces, as on another host or container:
    hostname `host`, and a pid that means nothing in this process table."""
    env = {**os.environ, "EYRIE_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    # The test launcher: an `eyrie worker` refuses every job function but the stage job.
    cmd = f"hostname {host} && exec python -m tests.shared.jobfns prep {name} 1 1"
    return subprocess.Popen(
        ["unshare", "--uts", "--pid", "--fork", "sh", "-c", cmd],
        cwd=ROOT,
        env={**env, "PATH": f"{Path(os.sys.executable).parent}:{env['PATH']}"},
    )


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --uts needs root")
def test_workers_on_two_hosts_share_one_run_without_doing_a_shard_twice(redis_url, tmp_path):
    """Two workers with other hostnames and pid namespaces drain one set of shards while the
    conductor's reconciler runs: no live job is taken for abandoned, no shard runs twice."""
    conn = connect(redis_url)
    q = get_queue("prep", conn)
    shards = 6
    for i in range(shards):
        q.enqueue(
            "tests.shared.jobfns.slow_write",
            str(tmp_path / f"shard-{i}"),
            40,
            0.1,  # 4 s a shard: several heartbeats and reconciler passes each
            job_id=f"t-multi-{i}",
            job_timeout=120,
        )
    workers = [
        _worker_on_host(redis_url, "w-node-a", "node-a"),
        _worker_on_host(redis_url, "w-node-b", "node-b"),
    ]
    hosts: set[str] = set()
    requeued: list[str] = []
    deadline = time.monotonic() + 180
    while any(w.poll() is None for w in workers):
        assert time.monotonic() < deadline, "workers did not drain the queue"
        requeued += reconcile(conn, ("prep",), stale_after_s=5)
        from rq import Worker
        from rq.serializers import JSONSerializer

        hosts |= {w.hostname for w in Worker.all(connection=conn, serializer=JSONSerializer)}
        time.sleep(0.5)
    assert [w.returncode for w in workers] == [0, 0]
    assert requeued == []
    assert {"node-a", "node-b"} <= hosts
    for i in range(shards):
        out = tmp_path / f"shard-{i}"
        assert (out / "runs.log").read_text().count("\n") == 1, f"shard {i} ran twice"
        assert (out / "data.txt").read_text().count("\n") == 40
    runs_by = [q.fetch_job(f"t-multi-{i}").worker_name for i in range(shards)]
    assert set(runs_by) == {"w-node-a", "w-node-b"}, runs_by  # both took part
