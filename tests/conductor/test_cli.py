"""The `eyrie` CLI: light import boundary, exit codes, recipe check, one stage in-process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm", "speculators", "datasets")


def _eyrie(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.conductor.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys\n"
        "from services.conductor.cli import build_parser\n"
        "build_parser().format_help()\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == ""


def test_help_lists_commands():
    out = _eyrie("--help")
    assert out.returncode == 0
    for cmd in ("recipe", "run", "status", "worker", "stage", "reconcile"):
        assert cmd in out.stdout
    # the commands the services add through the `eyrie.commands` entry points
    for cmd in ("serve", "bench", "compare", "tau", "prep-stats", "demo"):
        assert cmd in out.stdout


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_recipe_check_passes(recipe):
    out = _eyrie("recipe", "check", str(recipe))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# run id: ")
    assert "train:" in out.stdout and "draft_vocab_size:" in out.stdout


def test_malformed_recipe_exits_2_with_yaml_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {path: /m}\ndatasets: [{path: /d}]\ntrain: {lr: -1}\n")
    out = _eyrie("recipe", "check", str(bad))
    assert out.returncode == 2
    assert "train.lr: must be greater than 0 (got -1)" in out.stderr


def test_missing_recipe_file_exits_2(tmp_path):
    out = _eyrie("recipe", "check", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2 and "nope.yaml: recipe file not found" in out.stderr


def test_unreachable_redis_message(tmp_path):
    env = {"EYRIE_REDIS_URL": "redis://:hunter2@127.0.0.1:1/0", "PATH": "/usr/bin:/bin"}
    out = _eyrie("reconcile", env=env)
    assert out.returncode == 1
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in out.stderr
    assert "hunter2" not in out.stderr


def test_stage_command_plans_first_and_runs_one_shard(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(6)
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: cli-stage\ntarget: {{path: /m}}\ndatasets: [{{path: {data}}}]\n"
        "prep: {shard_rows: 4}\n"
    )
    env = {**os.environ, "EYRIE_DATA": str(tmp_path / "data")}
    out = _eyrie("stage", "prep", str(recipe), "--shard", "1", env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["stage"], result["shard"]) == ("prep", 1)
    assert result["counts"] == {"rows_in": 2, "kept": 2, "skipped": 0}  # the last 2 of 6 rows
    again = _eyrie("stage", "prep", str(recipe), "--shard", "1", env=env)
    assert again.returncode == 0 and "prep[1] already done" in again.stdout
    bad = _eyrie("stage", "prep", str(recipe), "--shard", "2", env=env)
    assert bad.returncode == 2 and "shard 2 out of range (0..1)" in bad.stderr
    early = _eyrie("stage", "split", str(recipe), env=env)  # dedup has not run
    assert early.returncode == 1 and "missing; the stage that writes it" in early.stderr


def test_prep_stats_refuses_a_malformed_run_id(tmp_path):
    out = _eyrie("prep-stats", "--", "-rf", env={**os.environ, "EYRIE_DATA": str(tmp_path)})
    assert out.returncode == 2 and "run id '-rf'" in out.stderr
    out = _eyrie("prep-stats", "nope-1", env={**os.environ, "EYRIE_DATA": str(tmp_path)})
    assert out.returncode == 2 and "run 'nope-1': no such run" in out.stderr
