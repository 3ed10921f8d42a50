"""`eyrie up`: what the compose `conductor` service runs, so `docker compose up` does the job.

With the recipe named by `$EYRIE_RECIPE` (and `$EYRIE_RECIPE_OVERRIDES`, space-separated
dotted overrides), both from `.env`:
1. a finished run (its report written) is left alone: the report's path is printed and the
   command exits 0, so a second `docker compose up` is a no-op;
2. otherwise the target is made available on the shared volumes (`ensure_target`): a hub id
   is downloaded into `$HF_HOME` (the `hf-cache` volume every service and vLLM read), a
   local folder that a converter in this image makes (`LOCAL_TARGET_MAKERS`) is made;
3. then the run is driven to its report as `eyrie run` does; an interrupted run resumes
   from its manifests (finished shards are never redone).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

from shared.artifacts import RunStore
from shared.cli import add_override_arg
from shared.errors import ConfigError
from shared.recipe import Recipe

log = logging.getLogger("eyrie.up")

#: Local targets an image can make itself, by folder name → converter script (run as
#: `python SCRIPT --out FOLDER`). The CPU image ships the demo's (images/cpu.Dockerfile);
#: a checkout has it under scripts/.
LOCAL_TARGET_MAKERS = {
    "SmolLM2-135M-Instruct": [
        Path("/opt/eyrie/convert_smollm2.py"),
        Path(__file__).resolve().parents[2] / "scripts" / "convert_smollm2.py",
    ],
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `up` subcommand."""
    p = sub.add_parser(
        "up",
        help="run $EYRIE_RECIPE to its report (the compose conductor; no-op when finished)",
    )
    p.add_argument("recipe", nargs="?", help="recipe YAML (default: $EYRIE_RECIPE)")
    add_override_arg(p, "serve.backend=docker")
    p.add_argument("--poll-s", type=float, default=2.0, help="manifest poll interval")
    p.set_defaults(func=cmd_up)


def recipe_from_env(recipe: str | None, overrides: list[str]) -> Recipe:
    """The recipe `eyrie up` runs: the argument or `$EYRIE_RECIPE`.

    Overrides: `$EYRIE_RECIPE_OVERRIDES` first, then the `-o` ones.

    Raises:
        ConfigError: no recipe named, or the recipe is invalid.
    """
    from shared.recipe import resolve_recipe

    path = recipe or os.environ.get("EYRIE_RECIPE", "")
    if not path:
        raise ConfigError(
            "EYRIE_RECIPE is empty: name the recipe to run in .env, e.g. "
            "EYRIE_RECIPE=recipes/llama-3.1-8b.yaml"
        )
    env_overrides = shlex.split(os.environ.get("EYRIE_RECIPE_OVERRIDES", ""))
    return resolve_recipe(path, env_overrides + list(overrides))


def ensure_target(recipe: Recipe) -> Path | str:
    """Make the recipe's target available where every service reads it; returns where.

    A local folder that exists is used as is; a missing one is made by its converter when
    this image has one (`LOCAL_TARGET_MAKERS`), else refused. A hub id is downloaded with
    huggingface_hub into `$HF_HOME` by `shared.model.pull` (resumable, then checked), with
    `HF_TOKEN` for gated models.

    Raises:
        ConfigError: a missing local folder nobody here can make.
        ArtifactError: a hub download that failed or left an incomplete copy (named).
    """
    from shared.model import is_hub_id, pull

    t = recipe.target
    path = Path(t.path)
    if not is_hub_id(t.path):
        if path.is_dir():
            return path
        makers = [m for m in LOCAL_TARGET_MAKERS.get(path.name, []) if m.is_file()]
        if not makers:
            raise ConfigError(
                f"target.path: model folder {path} does not exist and this image cannot make "
                "it: put the model there (on the volume) or name a hub id"
            )
        log.info("making the target %s with %s", path, makers[0])
        subprocess.run([sys.executable, str(makers[0]), "--out", str(path)], check=True)
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return t.path  # the operator says the cache is complete
    log.info("downloading %s (revision %s) into the HF cache", t.path, t.revision or "main")
    log.info("target %s is in %s", t.path, pull(recipe))
    return t.path


def finished_report(store: RunStore) -> Path | None:
    """The report of a finished run, or None. The report is the run's last artifact."""
    md = store.report.markdown_path
    return md if store.exists() and md.is_file() and store.report.json_path.is_file() else None


def cmd_up(args: argparse.Namespace) -> int:
    """Run the recipe to its report, or print the report of the finished run."""
    from services.conductor.driver import DriveOptions, drive
    from shared.queue import connect

    recipe = recipe_from_env(args.recipe, args.override)
    store = RunStore(recipe.run_id())
    done = finished_report(store)
    if done is not None:
        print(f"run {store.run_id} is finished; report: {done}", flush=True)
        return 0
    conn = connect()  # before a long download: a stack without Redis fails at once
    ensure_target(recipe)
    store = RunStore.create(recipe, command=" ".join(sys.argv))
    print(f"run {store.run_id} at {store.root}", flush=True)
    drive(store, conn, DriveOptions(poll_s=args.poll_s))
    report = finished_report(store)
    print(f"run {store.run_id}: done; report: {report or store.report.dir}", flush=True)
    return 0
