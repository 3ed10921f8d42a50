"""`eyrie up`, the compose conductor's command: recipe from the environment, no-op on a
finished run, the target made or refused before anything is queued."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.conductor.up import ensure_target, finished_report, recipe_from_env
from shared.artifacts import RunStore
from shared.errors import ConfigError
from shared.recipe import resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
DEMO = "recipes/smollm2-135m-cpu.yaml"


def _up(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.conductor.cli", "up", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_recipe_is_a_config_error():
    r = _up({"EYRIE_RECIPE": ""})
    assert r.returncode == 2 and "EYRIE_RECIPE is empty" in r.stderr


def test_recipe_and_overrides_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("EYRIE_RECIPE", DEMO)
    monkeypatch.setenv("EYRIE_RECIPE_OVERRIDES", "serve.backend=docker serve.host=vllm")
    r = recipe_from_env(None, ["datasets.0.max_samples=48"])
    assert (r.serve.backend, r.serve.host) == ("docker", "vllm")
    assert r.datasets[0].max_samples == 48
    assert r.name == "smollm2-135m-cpu"


def test_finished_run_is_a_no_op_that_prints_the_report(data_dir, tmp_path):
    """A second `docker compose up` after completion: no Redis, no target, only the path."""
    recipe = resolve_recipe(ROOT / DEMO, ["target.path=/nonexistent/SmolLM2"])
    store = RunStore.create(recipe)
    assert finished_report(store) is None
    store.report.dir.mkdir(parents=True)
    store.report.json_path.write_text("{}")
    store.report.markdown_path.write_text("# report\n")
    env = {
        "EYRIE_DATA": str(data_dir),
        "EYRIE_RECIPE": DEMO,
        "EYRIE_RECIPE_OVERRIDES": "target.path=/nonexistent/SmolLM2",
        "EYRIE_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing listens: never contacted
    }
    r = _up(env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        f"run {store.run_id} is finished; report: {store.report.markdown_path}"
    )


def test_unfinished_run_without_redis_fails_before_the_target_is_made(data_dir):
    env = {
        "EYRIE_DATA": str(data_dir),
        "EYRIE_RECIPE": DEMO,
        "EYRIE_RECIPE_OVERRIDES": "target.path=/nonexistent/SmolLM2",
        "EYRIE_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    r = _up(env)
    assert r.returncode == 1 and "cannot reach Redis at redis://127.0.0.1:1/0" in r.stderr


def test_local_target_present_missing_or_made(tmp_path, smollm2_path):
    recipe = resolve_recipe(ROOT / DEMO)
    assert ensure_target(recipe) == smollm2_path  # the converted demo target exists
    missing = resolve_recipe(ROOT / DEMO, [f"target.path={tmp_path}/Other-Model"])
    with pytest.raises(ConfigError, match=r"Other-Model does not exist and this image cannot"):
        ensure_target(missing)
