"""Redis outages: a real redis-server stopped mid-run and started again on its data folder.

The conductor's wait loop, the reconciler, the workers and the GPU lease ride out an outage
shorter than `$EYRIE_REDIS_OUTAGE_S`; a longer one ends `eyrie run` with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import yaml

from services.conductor.processes import (
    free_port,
    start_redis_server,
    start_worker,
    stop_process,
)
from shared.artifacts import RunStore
from shared.errors import ServiceUnavailableError
from shared.lease import LEASE_KEY, current_holder, gpu_lease
from shared.queue import RedisOutage, connect
from shared.recipe import resolve_recipe
from shared.stage import pipeline
from tests.conftest import run_stage

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "fixtures" / "samples" / "sharegpt_fastchat_dummy.json"
STAGES = ["plan", "prep", "dedup", "split", "tokenize"]


def _recipe_file(tmp_path: Path, smollm2_path: Path) -> Path:
    f = tmp_path / "outage.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "outage-test",
                "target": {"path": str(smollm2_path)},
                "datasets": [{"path": str(SAMPLES), "format": "sharegpt", "max_samples": 40}],
                "prep": {"shard_rows": 5, "max_len_tokens": 512},
                "regen": {"enabled": False},
            }
        )
    )
    return f


def _outputs(store: RunStore) -> dict[tuple[str, int], tuple[dict, dict]]:
    """(stage, shard) → (counts, file sha256s) of every manifest up to tokenize."""
    from shared.stage import get_stage

    out = {}
    for name in STAGES:
        for s in get_stage(name).shard_numbers(store):
            m = store.read_manifest(name, s)
            out[(name, s)] = (m.counts, m.files)
    return out


def _eyrie_run(recipe: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.conductor.cli", "run", str(recipe)]
    cmd += ["--stop-after", "tokenize", "--poll-s", "0.2"]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _dead(workers: list[subprocess.Popen], tmp_path: Path, when: str) -> str:
    """The failure message: which worker died, its exit code and the end of its log."""
    parts = [f"a worker died {when} the outage"]
    for i, w in enumerate(workers):
        if w.poll() is not None:
            tail = (tmp_path / f"worker-{i}.log").read_text().splitlines()[-40:]
            parts.append(f"worker-{i} exit {w.returncode}:\n" + "\n".join(tail))
    return "\n".join(parts)


def _wait_for(cond, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_run_rides_out_a_redis_outage_with_identical_outputs(
    data_dir, smollm2_path, tmp_path, monkeypatch
):
    recipe_file = _recipe_file(tmp_path, smollm2_path)
    recipe = resolve_recipe(recipe_file)
    store = RunStore(recipe.run_id(), data_dir)

    # The reference: the same stages run in this process, no Redis, no outage.
    ref = RunStore.create(recipe, root=tmp_path / "ref")
    for st in pipeline(recipe):
        run_stage(ref, st.name)
        if st.name == "tokenize":
            break

    port, redis_dir = free_port(), tmp_path / "redis"
    redis_log = open(tmp_path / "redis.log", "w")  # noqa: SIM115 (closed by the stack)
    redis, url = start_redis_server(port, redis_dir, log=redis_log)
    env = {
        **os.environ,
        "EYRIE_REDIS_URL": url,
        "EYRIE_DATA": str(data_dir),
        "HF_HUB_OFFLINE": "1",
        "EYRIE_REDIS_OUTAGE_S": "120",
    }
    with ExitStack() as stack:
        stack.callback(redis_log.close)
        stack.callback(lambda: stop_process(redis))
        workers = []
        for i in range(2):
            log = open(tmp_path / f"worker-{i}.log", "w")  # noqa: SIM115
            stack.callback(log.close)
            w = start_worker(["prep"], f"outage-{i}", env, log=log, monitor_interval_s=2)
            stack.callback(stop_process, w)
            workers.append(w)
        run = _eyrie_run(recipe_file, env)
        stack.callback(lambda: run.poll() is None and run.kill())

        # Stop Redis as soon as prep has started: shards are queued, some are running.
        _wait_for(lambda: store.is_done("plan") and store.is_done("prep", 0), "prep shard 0")
        stop_process(redis)
        down_at = time.monotonic()
        time.sleep(10)
        assert run.poll() is None, "eyrie run died during a 10 s Redis outage"
        assert all(w.poll() is None for w in workers), _dead(workers, tmp_path, "during")
        redis, _ = start_redis_server(port, redis_dir, log=redis_log)
        outage_s = time.monotonic() - down_at

        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, out[-2000:] + err[-3000:]
        assert all(w.poll() is None for w in workers), _dead(workers, tmp_path, "after")
    assert outage_s >= 10
    assert "Traceback" not in err
    assert "unreachable" in err and "Redis is back" in err  # the conductor rode it out
    assert _outputs(store) == _outputs(ref)
    assert store.plan.num_shards() == 8


@pytest.mark.slow
def test_run_gives_up_with_one_line_past_the_outage_budget(data_dir, smollm2_path, tmp_path):
    recipe_file = _recipe_file(tmp_path, smollm2_path)
    store = RunStore(resolve_recipe(recipe_file).run_id(), data_dir)
    redis, url = start_redis_server(free_port(), tmp_path / "redis")
    env = {
        **os.environ,
        "EYRIE_REDIS_URL": url,
        "EYRIE_DATA": str(data_dir),
        "HF_HUB_OFFLINE": "1",
        "EYRIE_REDIS_OUTAGE_S": "4",
    }
    try:
        run = _eyrie_run(recipe_file, env)  # no workers: the run waits on plan
        _wait_for(lambda: store.root.exists(), "the run folder", 120)
        time.sleep(1)
    finally:
        stop_process(redis)
    t0 = time.monotonic()
    out, err = run.communicate(timeout=120)
    waited = time.monotonic() - t0
    assert run.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("eyrie:")]
    assert len(lines) == 1 and "unreachable" in lines[0] and "EYRIE_REDIS_OUTAGE_S=4" in lines[0]
    assert "Traceback" not in err
    assert 4 <= waited < 60


def test_outage_helper_retries_then_gives_up(tmp_path):
    port = free_port()
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    from redis import Redis

    conn = Redis.from_url(url, socket_connect_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as e:
        RedisOutage("a test", budget_s=2, url=url).call(conn.ping)
    assert 2 <= time.monotonic() - t0 < 10
    assert "s3cret" not in str(e.value) and "unreachable for 2s during a test" in str(e.value)


@pytest.mark.slow
def test_outage_helper_resumes_when_redis_comes_back(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    from redis import Redis

    conn = Redis.from_url(url, socket_connect_timeout=1)
    started: list = []

    def start_later() -> None:
        time.sleep(3)
        started.append(start_redis_server(port, tmp_path / "r")[0])

    t = threading.Thread(target=start_later)
    t.start()
    outage = RedisOutage("a test", budget_s=60, url=url)
    try:
        assert outage.call(conn.ping) is True
        assert outage.since is None
    finally:
        t.join()
        for p in started:
            stop_process(p)


@pytest.mark.slow
def test_gpu_lease_survives_an_outage_longer_than_its_ttl(tmp_path):
    port, folder = free_port(), tmp_path / "r"
    redis, url = start_redis_server(port, folder)
    conn = connect(url)
    try:
        with gpu_lease(conn, "extract", "run-x", ttl_s=3, outage_s=60) as lease:
            token = current_holder(conn)["token"]
            stop_process(redis)
            time.sleep(6)  # twice the TTL: the key is expired when Redis comes back
            redis, _ = start_redis_server(port, folder)
            _wait_for(lambda: current_holder(conn) is not None, "the lease taken again", 30)
            lease.check()
            assert current_holder(conn)["token"] == token
        assert conn.get(LEASE_KEY) is None  # released at the end
    finally:
        stop_process(redis)


@pytest.mark.slow
def test_gpu_lease_is_lost_past_the_outage_budget(tmp_path):
    redis, url = start_redis_server(free_port(), tmp_path / "r")
    conn = connect(url)
    try:
        with gpu_lease(conn, "train", "run-y", ttl_s=3, outage_s=2) as lease:
            stop_process(redis)
            _wait_for(lambda: lease.lost is not None, "the lease marked lost", 30)
            with pytest.raises(ServiceUnavailableError, match="unreachable for more than 2s"):
                lease.check()
    finally:
        stop_process(redis)


def _test_worker(url: str, queue: str, name: str, log, outage_s: str = "120"):
    """A real worker process (tests.shared.jobfns: Eyrie's worker class, test jobs allowed)."""
    env = {**os.environ, "EYRIE_REDIS_URL": url, "EYRIE_REDIS_OUTAGE_S": outage_s}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.shared.jobfns", queue, name, "1", "0"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["prep", "train"])  # forking and non-forking workers
def test_a_running_shard_survives_an_outage_and_runs_once(tmp_path, queue):
    from rq.job import JobStatus

    from shared.queue import get_queue

    port, folder = free_port(), tmp_path / "r"
    redis, url = start_redis_server(port, folder)
    out = tmp_path / "o"
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (closed below)
    w = _test_worker(url, queue, f"busy-{queue}", log)
    try:
        conn = connect(url)
        job = get_queue(queue, conn).enqueue(
            "tests.shared.jobfns.slow_write", str(out), 100, 0.1, job_id="busy-0", job_timeout=300
        )
        _wait_for(lambda: (out / "runs.log").exists(), "the job to start", 120)
        time.sleep(1)
        stop_process(redis)  # mid-job: about 9 s of writing left
        time.sleep(6)
        assert w.poll() is None, "the worker died during the outage"
        redis, _ = start_redis_server(port, folder)
        _wait_for(lambda: job.get_status(refresh=True) == JobStatus.FINISHED, "the job", 120)
        assert w.poll() is None
    finally:
        stop_process(w)
        stop_process(redis)
        log.close()
    assert (out / "data.txt").read_text().splitlines() == [f"row {i}" for i in range(100)]
    assert (out / "runs.log").read_text().count("\n") == 1, "the shard ran twice"


@pytest.mark.slow
def test_a_worker_gives_up_with_one_line_past_the_outage_budget(tmp_path):
    from shared.queue import get_queue

    redis, url = start_redis_server(free_port(), tmp_path / "r")
    out = tmp_path / "o"
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (closed below)
    w = _test_worker(url, "train", "doomed", log, outage_s="3")
    try:
        get_queue("train", connect(url)).enqueue(
            "tests.shared.jobfns.slow_write", str(out), 300, 0.1, job_id="long-0", job_timeout=300
        )
        _wait_for(lambda: (out / "runs.log").exists(), "the job to start", 120)
        stop_process(redis)
        assert w.wait(timeout=120) == 1
    finally:
        stop_process(w)
        stop_process(redis)
        log.close()
    text = (tmp_path / "worker.log").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("eyrie:")]
    assert len(lines) == 1 and "unreachable" in lines[0] and "EYRIE_REDIS_OUTAGE_S=3" in lines[0]
    assert "Traceback" not in text
