"""The `eyrie` CLI: light import boundary, exit codes, recipe check."""

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
