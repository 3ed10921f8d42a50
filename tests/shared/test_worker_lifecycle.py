"""rq's scheduler child dies with its worker: real `eyrie worker` processes, real Redis."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from rq.scheduler import RQScheduler

from services.conductor.processes import start_worker, stop_process
from shared.queue import connect, get_queue


def _scheduler_child(worker: psutil.Process, timeout_s: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kids = worker.children()
        if kids:
            return kids[0]
        time.sleep(0.1)
    raise AssertionError("the worker started no scheduler process")


@pytest.mark.slow
def test_scheduler_child_exits_and_frees_its_lock_when_the_worker_is_killed(redis_url, tmp_path):
    conn = connect(redis_url)
    lock_key = RQScheduler.get_locking_key("prep")
    env = {**os.environ, "EYRIE_REDIS_URL": redis_url}
    log = open(tmp_path / "w1.log", "w")  # noqa: SIM115 (closed below)
    w1 = start_worker(["prep"], "sched-victim", env, log=log, monitor_interval_s=2)
    try:
        worker = psutil.Process(w1.pid)
        sched = _scheduler_child(worker)
        deadline = time.monotonic() + 30
        while conn.get(lock_key) is None:
            assert time.monotonic() < deadline, "the scheduler never took its lock"
            time.sleep(0.1)
        w1.send_signal(signal.SIGKILL)
        w1.wait(timeout=10)
        # the scheduler stops (its status then is gone, or a zombie of the dead worker)
        gone, alive = psutil.wait_procs([sched], timeout=15)
        assert sched in gone or sched.status() == psutil.STATUS_ZOMBIE, "scheduler outlived it"
        assert conn.get(lock_key) is None, "the scheduler lock was not released"
    finally:
        stop_process(w1)
        log.close()
    # a new worker takes over scheduling at once, not after the lock's TTL
    log2 = open(tmp_path / "w2.log", "w")  # noqa: SIM115
    w2 = start_worker(["prep"], "sched-heir", env, log=log2, monitor_interval_s=2)
    try:
        deadline = time.monotonic() + 30
        while conn.get(lock_key) is None:
            assert time.monotonic() < deadline, "no new scheduler took over"
            time.sleep(0.1)
        assert w2.poll() is None and len(get_queue("prep", conn)) == 0
    finally:
        stop_process(w2)
        log2.close()
