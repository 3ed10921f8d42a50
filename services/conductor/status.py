"""`eyrie status`: a per-stage progress table built from manifests and rq `job.meta`."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from shared.artifacts import RunStore, list_runs
from shared.errors import ArtifactError, ConfigError, ServiceUnavailableError
from shared.queue import connect, get_queue, job_id
from shared.recipe import check_run_id
from shared.stage import pipeline


def _job_state(conn, queue: str, jid: str) -> tuple[str, dict]:
    if conn is None:
        return "?", {}
    job = get_queue(queue, conn).fetch_job(jid)
    if job is None:
        return "-", {}
    return str(job.get_status(refresh=True).value), dict(job.meta.get("progress") or {})


def stage_rows(store: RunStore, conn) -> list[dict]:
    """One dict per stage: name, shards done/total, job states, live progress, counts."""
    recipe = store.recipe()
    rows = []
    for stage in pipeline(recipe):
        try:
            shards = stage.shard_numbers(store)
        except ArtifactError:
            shards = []
        done = [s for s in shards if store.is_done(stage.name, s)]
        states: dict[str, int] = {}
        live = []
        for s in shards:
            if s in done:
                continue
            st, prog = _job_state(conn, stage.queue, job_id(store.run_id, stage.name, s))
            states[st] = states.get(st, 0) + 1
            if prog:
                live.append(
                    f"[{s}] {prog.get('done')}/{prog.get('total')} {prog.get('unit')}"
                    + (f" eta {prog['eta_s']:.0f}s" if prog.get("eta_s") else "")
                )
        counts: dict[str, int] = {}
        for m in store.manifests(stage.name):
            for k, v in m.counts.items():
                counts[k] = counts.get(k, 0) + v
        rows.append(
            {
                "stage": stage.name,
                "done": len(done),
                "total": len(shards),
                "states": states,
                "live": live,
                "counts": counts,
            }
        )
    return rows


def print_status(run: str | None) -> int:
    """Print the status table of `run`, or the list of runs. Returns the exit code."""
    console = Console()
    if run is None:
        for run_id in list_runs():
            console.print(run_id)
        return 0
    store = RunStore(check_run_id(run))
    if not store.exists():
        raise ConfigError(f"run {run!r}: no such run under {store.root.parent}")
    try:
        conn = connect()
    except ServiceUnavailableError as e:
        console.print(f"[yellow]{e}[/]: showing manifests only")
        conn = None
    table = Table(title=f"run {run}")
    for col in ("stage", "shards done", "jobs", "progress", "counts"):
        table.add_column(col)
    for r in stage_rows(store, conn):
        table.add_row(
            r["stage"],
            f"{r['done']}/{r['total']}",
            " ".join(f"{k}:{v}" for k, v in r["states"].items()),
            "\n".join(r["live"][:4]),
            json.dumps(dict(list(r["counts"].items())[:6]))[:80],
        )
    console.print(table)
    return 0
