"""Pipeline stages: how one is declared, found, ordered and run.

A stage turns its inputs into its outputs for one shard. It is declared beside its code:

    @stage("tokenize", queue="prep", timeout_s=HOUR_S, shards=PER_PLAN_SHARD,
           after=("regen", "dedup"))
    def tokenize(ctx: StageContext) -> ShardResult:
        ...  # read inputs and write outputs through ctx.store (shared.artifacts)
        return ShardResult(counts, files)

The declaration is all the conductor knows of a stage: its queue, job timeout, shard count,
the stages it reads from, its GPU phase and the vLLM servers its shards need. Stage modules
are listed as `eyrie.stages` entry points (pyproject.toml), so neither the conductor nor the
job entry point imports a service by name.

`execute` gives every stage the same bookkeeping: a shard whose manifest exists is a
no-op; the temp files of a hard-killed earlier run of the shard are swept; the manifest is
written last, from the files the body returns. `run_stage_job` is the one function rq
workers run (`shared.queue.JOB_FUNC`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from shared.artifacts import RunStore, shard_name
from shared.errors import ArtifactError, ConfigError, ContractMismatchError, InputError
from shared.progress import Progress
from shared.recipe import Recipe
from shared.store import Manifest, sweep_temps

log = logging.getLogger("eyrie.stage")

HOUR_S = 3600
#: `shards=PER_PLAN_SHARD`: one job per prep shard of the run's plan.
PER_PLAN_SHARD = "plan"
#: Entry-point group naming the modules that declare stages.
ENTRY_POINT_GROUP = "eyrie.stages"

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass
class ShardResult:
    """What a stage body returns: the manifest's content.

    Attributes:
        counts: named integer counts (rows in/out, tokens, skips per reason...).
        files: the outputs written (files or folders, inside the stage's folder); their
            sha256 goes into the manifest.
        extra: JSON-serializable stage metadata for the manifest.
    """

    counts: dict[str, int]
    files: Sequence[Path] = ()
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageContext:
    """What a stage body gets: the run, its recipe, the shard, where the servers answer.

    Attributes:
        store: the run's artifacts.
        recipe: the run's resolved recipe.
        stage: the running stage's declaration.
        shard: the shard number.
        urls: server mode → base URL, for servers started elsewhere than the recipe says
            (`eyrie bench --baseline-url`); empty = `shared.vllm.base_url`.
    """

    store: RunStore
    recipe: Recipe
    stage: Stage
    shard: int
    urls: dict[str, str] = field(default_factory=dict)

    def server_url(self, mode: str) -> str:
        """Base URL of `mode`'s server for this run."""
        from shared.vllm import base_url

        return self.urls.get(mode) or base_url(self.recipe, mode)

    def progress(self, total: int, unit: str) -> Progress:
        """A progress bar (and `job.meta` progress) labelled `<stage>[<shard>]`."""
        return Progress(total, unit, f"{self.stage.name}[{self.shard}]")


def _always(recipe: Recipe) -> bool:
    return True


def _no_server(recipe: Recipe, shard: int) -> str | None:
    return None


def _same_recipe(recipe: Recipe, shard: int) -> Recipe:
    return recipe


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's declaration.

    Attributes:
        name: stage name, also its folder under the run.
        queue: the rq queue its jobs go to (`shared.queue.QUEUES`).
        timeout_s: rq job timeout (rq's default of 180 s would kill long jobs).
        body: `fn(ctx) -> ShardResult` for one shard.
        shards: a fixed shard count, PER_PLAN_SHARD, or `fn(recipe) -> count`.
        after: stages whose outputs it reads (disabled ones are ignored).
        gpu_phase: the GPU lease phase its jobs need (None = CPU only).
        enabled: whether a recipe runs this stage.
        server: the vLLM server mode a shard needs while it runs (None = none).
        side_by_side: whether the servers of different shards may run at once.
        server_recipe: the recipe a shard's servers start with (default the run's; the bench
            serves other k this way). Shards whose server recipes differ never share servers.
        release: frees accelerator memory when the phase's queue has drained.
        warm: imports what the body needs, run once by a forking worker before it forks
            its work-horses (so each job does not pay for them).
        sized_timeout: `fn(recipe, store) -> seconds`, the job timeout sized from the run's
            work (replaces `timeout_s` when given); see `job_timeout`.
    """

    name: str
    queue: str
    timeout_s: int
    body: Callable[[StageContext], ShardResult]
    shards: int | str | Callable[[Recipe], int] = 1
    after: tuple[str, ...] = ()
    gpu_phase: str | None = None
    enabled: Callable[[Recipe], bool] = _always
    server: Callable[[Recipe, int], str | None] = _no_server
    side_by_side: Callable[[Recipe], bool] = _always
    release: Callable[[], None] | None = None
    warm: Callable[[], None] | None = None
    sized_timeout: Callable[[Recipe, RunStore], int] | None = None
    server_recipe: Callable[[Recipe, int], Recipe] = _same_recipe

    def job_timeout(self, recipe: Recipe, store: RunStore) -> int:
        """The rq job timeout in seconds: `sized_timeout`'s when declared, else `timeout_s`."""
        return self.sized_timeout(recipe, store) if self.sized_timeout else self.timeout_s

    def shard_numbers(self, store: RunStore) -> list[int]:
        """The shard numbers of this stage in the run (per-plan stages read the plan)."""
        if self.shards == PER_PLAN_SHARD:
            return list(range(store.plan.num_shards()))
        if callable(self.shards):
            return list(range(self.shards(store.recipe())))
        return list(range(int(self.shards)))

    def servers(self, recipe: Recipe, shards: Sequence[int]) -> list[str]:
        """The server modes `shards` need, in shard order, without repeats."""
        modes = (self.server(recipe, s) for s in sorted(set(shards)))
        return list(dict.fromkeys(m for m in modes if m))

    def shard_groups(self, recipe: Recipe, shards: Sequence[int]) -> list[list[int]]:
        """Shards that run together, in shard order.

        Consecutive shards with the same server recipe form a group (all at once); when
        servers may not run side by side, consecutive shards with the same server do.
        """
        apart = bool(self.servers(recipe, shards)) and not self.side_by_side(recipe)
        groups: list[list[int]] = []
        last = None
        for s in shards:
            key = (
                self.server_recipe(recipe, s).canonical_json(),
                self.server(recipe, s) if apart else None,
            )
            if key != last:
                groups.append([])
                last = key
            groups[-1].append(s)
        return groups


#: Every declared stage, by name (filled by importing the stage modules).
STAGES: dict[str, Stage] = {}


def stage(
    name: str,
    *,
    queue: str,
    timeout_s: int,
    shards: int | str | Callable[[Recipe], int] = 1,
    after: tuple[str, ...] = (),
    gpu_phase: str | None = None,
    enabled: Callable[[Recipe], bool] = _always,
    server: Callable[[Recipe, int], str | None] = _no_server,
    side_by_side: Callable[[Recipe], bool] = _always,
    release: Callable[[], None] | None = None,
    warm: Callable[[], None] | None = None,
    sized_timeout: Callable[[Recipe, RunStore], int] | None = None,
    server_recipe: Callable[[Recipe, int], Recipe] = _same_recipe,
) -> Callable[[Callable[[StageContext], ShardResult]], Callable[[StageContext], ShardResult]]:
    """Declare the decorated function as stage `name` (see `Stage` for the fields).

    Raises:
        ConfigError: the name is invalid or already declared.
    """

    def register(body: Callable[[StageContext], ShardResult]) -> Callable:
        if not _NAME.match(name):
            raise ConfigError(f"stage name {name!r}: lowercase letters, digits and '_' only")
        if name in STAGES and STAGES[name].body is not body:
            raise ConfigError(f"stage {name!r} is declared twice")
        STAGES[name] = Stage(
            name, queue, timeout_s, body, shards, after, gpu_phase, enabled, server,
            side_by_side, release, warm, sized_timeout, server_recipe,
        )  # fmt: skip
        return body

    return register


_loaded = False


def load_stages() -> dict[str, Stage]:
    """Import every module of the `eyrie.stages` entry points (once); the declared stages.

    Raises:
        ConfigError: no stage module is registered (Eyrie is not installed: `pip install -e .`).
    """
    global _loaded
    if not _loaded:
        eps = entry_points(group=ENTRY_POINT_GROUP)
        if not eps:
            raise ConfigError(
                f"no {ENTRY_POINT_GROUP!r} entry points: Eyrie is not installed "
                "(`pip install -e .`, which scripts/setup runs)"
            )
        for ep in eps:
            ep.load()
        _loaded = True
    return STAGES


def warm_queues(queues: Sequence[str]) -> None:
    """Run the `warm` hooks of every stage on `queues` (a forking worker, before forking)."""
    for st in load_stages().values():
        if st.queue in queues and st.warm is not None:
            st.warm()


def get_stage(name: str) -> Stage:
    """The named stage. Raises ConfigError listing the known names."""
    stages = load_stages()
    try:
        return stages[name]
    except KeyError:
        raise ConfigError(f"unknown stage {name!r}; known: {', '.join(stages)}") from None


def pipeline(recipe: Recipe) -> list[Stage]:
    """The stages the recipe runs, in an order that respects `after`.

    Among stages that are ready at once, CPU stages go before GPU ones (a cheap stage that
    fails should fail before hours of GPU work), then by name.

    Raises:
        ConfigError: a stage depends on an unknown stage, or the dependencies form a loop.
    """
    stages = {n: s for n, s in load_stages().items() if s.enabled(recipe)}
    known = load_stages()
    for s in stages.values():
        unknown = [a for a in s.after if a not in known]
        if unknown:
            raise ConfigError(f"stage {s.name!r} runs after unknown stages {unknown}")
    deps = {n: {a for a in s.after if a in stages} for n, s in stages.items()}
    order: list[Stage] = []
    while deps:
        ready = sorted(
            (n for n, d in deps.items() if not d),
            key=lambda n: (stages[n].gpu_phase is not None, n),
        )
        if not ready:
            raise ConfigError(f"stage dependencies form a loop among {sorted(deps)}")
        order.append(stages[ready[0]])
        del deps[ready[0]]
        for d in deps.values():
            d.discard(ready[0])
    return order


def execute(
    st: Stage,
    store: RunStore,
    shard: int,
    force: bool = False,
    urls: dict[str, str] | None = None,
) -> Manifest:
    """Run one shard of a stage in this process, with the stage bookkeeping.

    A shard whose manifest exists is not run again (unless `force`); leftovers of an
    interrupted run of the same shard are swept first; the manifest is written last.

    Raises:
        ConfigError: the shard number is out of range for this run.
        Whatever the body raises: the shard then has no manifest and a rerun resumes it.
    """
    shards = st.shard_numbers(store)
    if shard not in shards:
        raise ConfigError(f"stage {st.name}: shard {shard} out of range (0..{len(shards) - 1})")
    if store.is_done(st.name, shard) and not force:
        return store.read_manifest(st.name, shard)
    folder = store.stage_dir(st.name)
    # One shard per job: sweep only this shard's temps, never another worker's.
    prefix = shard_name(shard) if len(shards) > 1 else ""
    sweep_temps(folder, prefix)
    if prefix:  # and inside the shard's own folder (extract/shard-N/hidden_states/.tmp-*)
        sweep_temps(folder / prefix)
    ctx = StageContext(store, store.recipe(), st, shard, dict(urls or {}))
    result = st.body(ctx)
    return store.write_manifest(st.name, shard, result.counts, result.files, result.extra)


#: Errors a retry cannot fix: the job fails at once (`run_stage_job`).
PERMANENT_ERRORS = (ConfigError, InputError, ContractMismatchError)


def run_stage_job(run_id: str, stage: str, shard: int) -> dict[str, int]:
    """The rq job of every stage shard: `{run_id, stage, shard}` in, manifest counts out.

    A permanent error (`PERMANENT_ERRORS`: a bad recipe, setting, input or contract) fails
    the job at once: its rq retries are cancelled, since a rerun would fail the same way and
    only delay the message.

    Raises:
        ConfigError: the payload does not name a run, a known stage or a shard of it.
    """
    from rq import get_current_job

    from shared.queue import validate_payload

    job = get_current_job()
    try:
        run_id, stage, shard = validate_payload(run_id, stage, shard)
        st = get_stage(stage)
        store = RunStore(run_id)
        if not store.exists():
            raise ConfigError(
                f"job payload: run {run_id!r} does not exist under {store.root.parent}"
            )
        if store.is_done(stage, shard):
            log.info("%s[%d] of %s already done: skipping", stage, shard, run_id)
            return {"skipped": 1}
        manifest = execute(st, store, shard)
    except PERMANENT_ERRORS:
        if job is not None and job.retries_left:
            # rq's worker reads this very object (rq.job's current-job context) when it
            # decides whether to retry.
            job.retries_left = 0
        raise
    if st.release is not None and job is not None:
        from redis.exceptions import RedisError

        from shared.queue import queue_drained

        try:
            drained = queue_drained(st.queue, job.connection)
        except RedisError as e:  # the shard is done; keep the memory until the next job
            log.warning("%s[%d]: queue %s not checked (%s)", stage, shard, st.queue, e)
            drained = False
        if drained:
            st.release()
    return dict(manifest.counts)


def require_done(store: RunStore, stage_name: str) -> None:
    """Raise ArtifactError unless every shard of `stage_name` has finished."""
    st = get_stage(stage_name)
    missing = [s for s in st.shard_numbers(store) if not store.is_done(stage_name, s)]
    if missing:
        raise ArtifactError(
            f"{store.stage_dir(stage_name)}: shards {missing[:10]} of stage {stage_name!r} "
            "have not finished"
        )
