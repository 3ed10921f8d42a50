"""Run store: atomic writes survive SIGKILL, manifests, disk preflight."""

import json
import os
import signal
import subprocess
import sys

import pytest

from shared.errors import ArtifactError, ConfigError
from shared.recipe import resolve_recipe
from shared.store import (
    RunStore,
    atomic_path,
    atomic_write_json,
    check_free_space,
    sha256_file,
    sweep_temps,
)

MINIMAL = {"name": "t", "target": {"path": "/m"}, "datasets": [{"path": "/d.jsonl"}]}

SLOW_WRITER = """
import sys, time
from shared.store import atomic_path
with atomic_path(sys.argv[1]) as tmp, open(tmp, "w") as f:
    for i in range(10_000):
        f.write("x" * 1000 + "\\n")
        f.flush()
        if i == 50:
            print("writing", flush=True)
        time.sleep(0.001)
"""


def test_sigkilled_writer_leaves_no_partial_file(tmp_path):
    final = tmp_path / "out" / "big.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(final)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not final.exists()
    leftovers = [p for p in (tmp_path / "out").iterdir()]
    assert leftovers and all(p.name.startswith(".tmp-") for p in leftovers)
    assert sweep_temps(tmp_path / "out") == len(leftovers)
    assert list((tmp_path / "out").iterdir()) == []


def test_atomic_folder_replace(tmp_path):
    final = tmp_path / "d"
    for content in ("one", "two"):
        with atomic_path(final) as tmp:
            tmp.mkdir()
            (tmp / "f.txt").write_text(content)
    assert (final / "f.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_failed_writer_leaves_nothing(tmp_path):
    final = tmp_path / "x.json"
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        tmp.write_text("partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_manifest_roundtrip(data_dir, tmp_path):
    recipe = resolve_recipe(MINIMAL)
    store = RunStore.create(recipe, command="eyrie test")
    assert store.root == data_dir / "runs" / recipe.run_id()
    assert not store.is_done("prep", 3)
    out = store.shard_path("prep", 3, ".jsonl")
    atomic_write_json(out, {"a": 1})
    m = store.write_manifest("prep", 3, {"rows_in": 5, "kept": 4}, files=[out])
    assert store.is_done("prep", 3)
    on_disk = json.loads(store.manifest_path("prep", 3).read_text())
    assert on_disk["counts"] == {"rows_in": 5, "kept": 4}
    assert on_disk["files"] == {"shard-00003.jsonl": sha256_file(out)}
    assert on_disk["recipe_hash"] == recipe.recipe_hash() == m.recipe_hash
    assert on_disk["eyrie_version"]
    assert store.recipe().run_id() == recipe.run_id()
    assert "eyrie test" in (store.root / "commands.log").read_text()
    with pytest.raises(ArtifactError, match="has not finished"):
        store.read_manifest("prep", 4)


def test_disk_preflight_refuses_with_both_numbers(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    check_free_space(tmp_path, 1024)
    with pytest.raises(ConfigError) as e:
        check_free_space(tmp_path, free * 10, what="hidden states")
    msg = str(e.value)
    assert "hidden states" in msg and str(free * 10) in msg and "bytes) are free" in msg
