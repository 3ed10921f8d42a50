"""Job functions for the queue tests, importable by real rq workers (JSON payloads only)."""

import json
import os
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
