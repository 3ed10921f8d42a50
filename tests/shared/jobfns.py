"""Job functions for the queue tests, importable by real rq workers (JSON payloads only)."""

import json
import os
import sys
import time
from pathlib import Path

from shared.store import atomic_path, atomic_write_json


def slow_write(out_dir: str, rows: int, delay_s: float) -> int:
    """Idempotent stage-like job: write `rows` lines atomically, then a manifest.

    Each run appends its pid to `runs.log`, so a test can count executions.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.log", "a") as f:
        f.write(f"{os.getpid()}\n")
    if (out / "manifest.json").exists():
        return 0
    with atomic_path(out / "data.txt") as tmp, open(tmp, "w") as f:
        for i in range(rows):
            f.write(f"row {i}\n")
            f.flush()
            time.sleep(delay_s)
    atomic_write_json(out / "manifest.json", {"rows": rows})
    return rows


def echo(value):
    return json.dumps(value)


def mark_callback(job, connection, *args) -> None:
    """An rq callback (`on_success`/`on_failure`/`on_stopped`): touches `job.meta["marker"]`."""
    Path(job.meta["marker"]).write_text(f"callback ran for {job.id}\n")


def main(argv: list[str]) -> int:
    """`python -m tests.shared.jobfns QUEUE NAME MONITOR_S BURST`: a real rq worker that also
    runs this module's functions (an `eyrie worker` refuses everything but the stage job)."""
    from shared.queue import JOB_FUNC, connect, make_worker

    queue, name, monitor_s, burst = argv
    funcs = frozenset({JOB_FUNC, "tests.shared.jobfns.slow_write", "tests.shared.jobfns.echo"})
    w = make_worker([queue], connect(), name=name, job_monitoring_interval=int(monitor_s),
                    job_funcs=funcs)  # fmt: skip
    try:
        w.work(burst=burst == "1", with_scheduler=True, logging_level="INFO")
    except Exception as e:  # as `eyrie worker` does: one line, exit 1
        print(f"eyrie: {w.gave_up or e}", file=sys.stderr)
        return 1
    if w.gave_up:
        print(f"eyrie: {w.gave_up}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
