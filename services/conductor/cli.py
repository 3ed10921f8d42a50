"""The `eyrie` command line.

The conductor owns the commands that drive runs, workers and servers; each service adds
its own through the `eyrie.commands` entry points (pyproject.toml), so this module imports
no other service. `eyrie --help` must not import torch, transformers or vLLM: heavy imports
live inside the command functions (a test checks the import boundary). Only this module
turns an `EyrieError` into an exit code: 2 for configuration and input errors, 1 for
the rest; an `OSError` naming a file or a `UnicodeError` becomes one line and exit 2, a
closed stdout (`| head -1`) exit 141.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from importlib.metadata import entry_points

from services.conductor import demo, serve_cli, up
from shared.cli import (
    EXIT_BROKEN_PIPE,
    add_recipe_args,
    describe_input_error,
    input_error_exit_code,
    positive_seconds,
)
from shared.errors import ConfigError, EyrieError, InputError

#: Entry-point group of the services' `register(subparsers)` functions.
COMMANDS_GROUP = "eyrie.commands"


def _load(args: argparse.Namespace, check_inputs: bool = False):
    from shared.preflight import check_recipe_inputs
    from shared.recipe import resolve_recipe

    recipe = resolve_recipe(args.recipe, args.override)
    args.loaded_recipe = recipe  # lets main() name the recipe field of a failing file
    if check_inputs:
        for note in check_recipe_inputs(recipe):
            print(f"eyrie: note: {note}", file=sys.stderr)
    return recipe


def cmd_recipe_check(args: argparse.Namespace) -> int:
    from shared.recipe import recipe_to_yaml

    recipe = _load(args, check_inputs=True)
    print(f"# run id: {recipe.run_id()}")
    print(recipe_to_yaml(recipe), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from services.conductor.driver import DriveOptions, drive
    from services.conductor.plan import refuse_unless_fits
    from shared.artifacts import RunStore
    from shared.queue import connect

    recipe = _load(args, check_inputs=True)
    if args.stop_after is not None:
        from shared.stage import pipeline

        names = [s.name for s in pipeline(recipe)]
        if args.stop_after not in names:
            # an unknown name would never match, and the whole run would go on to the end
            raise ConfigError(
                f"--stop-after {args.stop_after!r}: not a stage of this run "
                f"(its stages: {', '.join(names)})"
            )
    refuse_unless_fits(recipe, args.recipe)
    conn = connect()
    store = RunStore.create(recipe, command=" ".join(sys.argv))
    print(f"run {store.run_id} at {store.root}", flush=True)
    drive(store, conn, DriveOptions(stop_after=args.stop_after, poll_s=args.poll_s))
    print(f"run {store.run_id}: done", flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from services.conductor.status import print_status

    return print_status(args.run)


def cmd_worker(args: argparse.Namespace) -> int:
    from shared.errors import ServiceUnavailableError
    from shared.queue import (
        NON_FORKING_QUEUES,
        REDIS_DOWN,
        connect,
        make_worker,
        record_local_worker,
    )
    from shared.stage import warm_queues

    conn = connect()
    if not NON_FORKING_QUEUES & set(args.queues):
        # A forking worker imports once what its jobs need; every fork inherits it.
        warm_queues(args.queues)
    w = make_worker(
        args.queues,
        conn,
        name=args.name,
        job_monitoring_interval=args.monitor_interval_s,
        worker_ttl=args.worker_ttl_s,
    )
    # The container's healthcheck (images/worker-health.py) looks this worker up by name.
    recorded = record_local_worker(w.name)
    try:
        w.work(
            burst=args.burst,
            with_scheduler=not args.no_scheduler,
            logging_level=os.environ.get("EYRIE_LOG_LEVEL", "INFO"),
        )
    except REDIS_DOWN as e:  # rq's teardown talks to Redis too
        raise ServiceUnavailableError(w.gave_up or f"worker {w.name}: lost Redis ({e})") from e
    finally:
        recorded.unlink(missing_ok=True)
    if w.gave_up:  # rq's loop logged the error and returned; the exit code must say so
        raise ServiceUnavailableError(w.gave_up)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from shared.artifacts import RunStore
    from shared.stage import PER_PLAN_SHARD, execute, get_stage

    recipe = _load(args)
    store = RunStore.create(recipe, command=" ".join(sys.argv))
    stage = get_stage(args.name)
    if stage.shards == PER_PLAN_SHARD and not store.is_done("plan"):
        execute(get_stage("plan"), store, 0)  # cheap, and what the shard numbers come from
    if store.is_done(stage.name, args.shard) and not args.force:
        print(f"{stage.name}[{args.shard}] already done (manifest exists); --force to redo")
        return 0
    t0 = time.monotonic()
    m = execute(stage, store, args.shard, force=args.force)
    print(
        json.dumps(
            {
                "stage": stage.name,
                "shard": args.shard,
                "counts": m.counts,
                "seconds": round(time.monotonic() - t0, 1),
            },
            indent=2,
        )
    )
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    from shared.queue import RedisOutage, connect, reconcile

    conn = connect()
    outage = RedisOutage("eyrie reconcile")
    for jid in outage.call(reconcile, conn, stale_after_s=args.stale_after_s):
        print(f"re-enqueued {jid}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every `eyrie` subcommand."""
    parser = argparse.ArgumentParser(
        prog="eyrie", description="Train, export and benchmark EAGLE-3 drafts for vLLM."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    recipe = sub.add_parser("recipe", help="recipe tools")
    rsub = recipe.add_subparsers(dest="recipe_command", required=True)
    check = rsub.add_parser("check", help="validate a recipe and print the resolved one")
    add_recipe_args(check)
    check.set_defaults(func=cmd_recipe_check)

    run = sub.add_parser("run", help="plan a run and drive it to completion through rq")
    add_recipe_args(run)
    run.add_argument("--stop-after", metavar="STAGE", help="stop after this stage")
    run.add_argument(
        "--poll-s", type=positive_seconds, default=1.0, help="manifest poll interval in seconds"
    )
    run.set_defaults(func=cmd_run)

    st = sub.add_parser("status", help="per-stage progress of a run (or list runs)")
    st.add_argument("run", nargs="?", help="run id (default: list runs)")
    st.set_defaults(func=cmd_status)

    wk = sub.add_parser("worker", help="an rq worker (non-forking for extract/train)")
    wk.add_argument("queues", nargs="+", help="queues: prep regen extract train bench")
    wk.add_argument("--name", help="worker name (default: rq's)")
    wk.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    # Retries of failed and abandoned jobs wait in rq's scheduled registry; without a
    # scheduler among the workers they would never run again. rq elects one at a time.
    wk.add_argument(
        "--no-scheduler",
        action="store_true",
        help="do not take part in rq's scheduler (retries need one somewhere)",
    )
    wk.add_argument(
        "--monitor-interval-s",
        type=int,
        default=30,
        help="rq job_monitoring_interval: heartbeat period in seconds",
    )
    wk.add_argument("--worker-ttl-s", type=int, default=None, help="rq worker_ttl in seconds")
    wk.set_defaults(func=cmd_worker)

    sg = sub.add_parser("stage", help="run one stage shard in-process, without Redis")
    sg.add_argument("name", help="stage name")
    add_recipe_args(sg)
    sg.add_argument("--shard", type=int, default=0, help="shard number")
    sg.add_argument("--force", action="store_true", help="ignore an existing manifest")
    sg.set_defaults(func=cmd_stage)

    rc = sub.add_parser("reconcile", help="re-enqueue jobs abandoned by dead workers")
    rc.add_argument(
        "--stale-after-s",
        type=positive_seconds,
        default=90.0,
        help="worker heartbeat age in seconds that counts as dead",
    )
    rc.set_defaults(func=cmd_reconcile)

    serve_cli.register(sub)
    demo.register(sub)
    up.register(sub)
    for ep in entry_points(group=COMMANDS_GROUP):
        ep.load()(sub)
    return parser


def _terminate(signum: int, frame: object) -> None:
    # Unwind like Ctrl-C, so context managers stop the servers and workers this command
    # started instead of orphaning them.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `eyrie` console script. Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    if args.command != "worker":  # rq workers handle SIGTERM themselves (warm shutdown)
        signal.signal(signal.SIGTERM, _terminate)
    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except (ConfigError, InputError) as e:
        print(f"eyrie: {e}", file=sys.stderr)
        return 2
    except EyrieError as e:
        print(f"eyrie: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`eyrie recipe check r.yaml | head -1`). Point
        # stdout at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("eyrie: output cut short: stdout was closed by its reader", file=sys.stderr)
        return EXIT_BROKEN_PIPE
    except (OSError, UnicodeError) as e:
        if args.verbose:
            raise
        print(
            f"eyrie: {describe_input_error(e, getattr(args, 'loaded_recipe', None))}",
            file=sys.stderr,
        )
        return input_error_exit_code(e)
    except Exception as e:
        from redis.exceptions import ConnectionError, TimeoutError

        if not isinstance(e, ConnectionError | TimeoutError):
            raise
        # Redis went away where no retry covers it: one line, not redis-py's traceback.
        from shared.queue import mask_url, redis_url

        print(f"eyrie: lost Redis at {mask_url(redis_url())}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
