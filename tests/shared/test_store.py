"""Run store: atomic writes survive SIGKILL, manifests, disk preflight, typed artifacts."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.artifacts import RunStore
from shared.errors import ArtifactError, ConfigError
from shared.recipe import resolve_recipe
from shared.store import (
    atomic_path,
    atomic_write_json,
    check_free_space,
    sha256_file,
    sweep_temps,
)

ROOT = Path(__file__).resolve().parents[2]
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
    out = store.prep.conversations_path(3)
    assert out == data_dir / "runs" / recipe.run_id() / "prep" / "shard-00003.jsonl"
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


def test_sweep_with_prefix_leaves_other_shards_temps(tmp_path):
    for name in (".tmp-shard-00001.jsonl-a", ".tmp-shard-00002.jsonl-b", "shard-00001.jsonl"):
        (tmp_path / name).write_text("x")
    (tmp_path / ".tmp-shard-00001-c").mkdir()
    assert sweep_temps(tmp_path, "shard-00001") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-shard-00002.jsonl-b",
        "shard-00001.jsonl",
    ]
    assert sweep_temps(tmp_path / "absent") == 0


def test_atomic_writes_get_shared_modes(tmp_path):
    """A library that creates its file 0600 (safetensors does) still yields a readable file."""
    old = os.umask(0o022)
    try:
        final = tmp_path / "w.bin"
        with atomic_path(final) as tmp:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))
        folder = tmp_path / "d"
        with atomic_path(folder) as tmp:
            tmp.mkdir(mode=0o700)
            os.close(os.open(tmp / "f", os.O_WRONLY | os.O_CREAT, 0o600))
    finally:
        os.umask(old)
    assert final.stat().st_mode & 0o777 == 0o644
    assert folder.stat().st_mode & 0o777 == 0o755
    assert (folder / "f").stat().st_mode & 0o777 == 0o644


def _modes(folder):
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in folder.rglob("*")}


def test_safetensors_and_save_pretrained_outputs_get_shared_modes(tmp_path):
    """The real writers of checkpoints, exports and hidden states: each leaves a 0600 file
    on its own; written through `atomic_path` every file is 0644 and every folder 0755."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    old = os.umask(0o022)
    try:
        raw = tmp_path / "raw.safetensors"
        save_file({"x": torch.zeros(2)}, str(raw))
        cfg = LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
        )
        model = LlamaForCausalLM(cfg)
        model.save_pretrained(tmp_path / "raw-model")
        hs = tmp_path / "hs" / "shard-0.safetensors"
        with atomic_path(hs) as tmp:
            save_file({"hidden_states": torch.zeros(3, 4)}, str(tmp))
        folder = tmp_path / "export"
        with atomic_path(folder) as tmp:
            model.save_pretrained(tmp)
    finally:
        os.umask(old)
    # What the libraries do by themselves: what made artifacts unreadable across uids.
    assert raw.stat().st_mode & 0o777 == 0o600
    assert _modes(tmp_path / "raw-model")["model.safetensors"] == 0o600
    assert hs.stat().st_mode & 0o777 == 0o644
    modes = _modes(folder)
    assert {"config.json", "model.safetensors"} <= set(modes)
    assert set(modes.values()) == {0o644}
    assert folder.stat().st_mode & 0o777 == 0o755


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root (chown) and setpriv (a reader without root's DAC override)",
)
def test_unreadable_file_is_reported_as_permission_denied(tmp_path):
    """A file written 0600 by one uid, read by another: check_readable says permission
    denied, with owner, mode and the reader's uid, where a library may say "not found"."""
    import torch
    from safetensors.torch import save_file

    f = str(tmp_path / "shard-0.safetensors")
    save_file({"x": torch.zeros(2)}, f)  # 0600
    os.chown(f, 10001, 10001)  # written by the workers' uid; read here by root
    code = (
        "import sys\n"
        "from shared.errors import ConfigError\n"
        "from shared.store import check_readable\n"
        "try:\n"
        "    from safetensors.torch import load_file; load_file(sys.argv[1])\n"
        "except Exception as e:\n"
        "    print('LIB:', e)\n"
        "try:\n"
        "    check_readable(sys.argv[1], 'train hidden states')\n"
        "except ConfigError as e:\n"
        "    print('EYRIE:', e)\n"
    )
    # Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH reads like any other uid.
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    out = subprocess.run(
        [*drop, sys.executable, "-c", code, f],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout
    lib = next(line for line in out.splitlines() if line.startswith("LIB:"))
    eyrie = next(line for line in out.splitlines() if line.startswith("EYRIE:"))
    assert "No such file" in lib or "Permission denied" in lib
    assert f"train hidden states: permission denied reading {f}" in eyrie
    assert "owner 10001:10001, mode 0600" in eyrie and "runs as uid 0" in eyrie


def test_writer_that_writes_nothing_is_an_error(tmp_path):
    with (
        pytest.raises(ArtifactError, match="the writer created nothing"),
        atomic_path(tmp_path / "x"),
    ):
        pass
    assert list(tmp_path.iterdir()) == []


def _conv(i: int):
    from shared.records import Conversation

    return Conversation.model_validate(
        {
            "id": f"d:{i}",
            "source": "d",
            "messages": [
                {"role": "user", "content": f"q é {i}"},
                {"role": "assistant", "content": f"a {i}"},
            ],
        }
    )


def test_jsonl_artifacts_roundtrip_and_name_the_bad_line(data_dir):
    from shared.records import DedupReport, PrepReport

    store = RunStore.create(resolve_recipe(MINIMAL))
    with pytest.raises(ArtifactError, match=r"shard-00000\.jsonl: missing; the stage"):
        store.prep.conversations(0)
    with pytest.raises(ArtifactError, match=r"plan\.json: missing"):
        store.plan.read()
    convs = [_conv(0), _conv(1)]
    report = PrepReport(rows_in=3, kept=2, skipped={"bad_json": 1}, realigned={})
    files = store.prep.write(0, convs, [], report)
    assert [f.name for f in files] == [
        "shard-00000.jsonl",
        "shard-00000.quarantine.jsonl",
        "shard-00000.report.json",
    ]
    assert store.prep.conversations(0) == convs
    lines = store.prep.conversations_path(0).read_text(encoding="utf-8").splitlines()
    # unset optional keys are left out; non-ASCII is written as is
    assert json.loads(lines[0]) == {
        "id": "d:0",
        "source": "d",
        "messages": [{"role": "user", "content": "q é 0"}, {"role": "assistant", "content": "a 0"}],
    }
    # a writer and a reader that drift apart fail on the first odd record, naming it
    path = store.dedup.conversations_path(0)
    path.parent.mkdir(parents=True)
    path.write_text(lines[0] + "\n" + lines[1][:-1] + ', "score": 1}\n', encoding="utf-8")
    with pytest.raises(ArtifactError, match=r"shard-00000\.jsonl line 2: not a Conversation"):
        store.dedup.conversations(0)
    store.dedup.write({0: convs[:1], 1: []}, DedupReport(duplicates=1, contaminated=0, kept=1))
    assert store.dedup.conversations(0) == convs[:1] and store.dedup.conversations(1) == []


def test_plan_shard_rows_slice_the_selection(data_dir):
    import numpy as np

    from shared.artifacts import write_model, write_npy
    from shared.records import Plan

    store = RunStore.create(resolve_recipe(MINIMAL))
    sel = np.array([[0, 5], [1, 2], [0, 1], [1, 0], [0, 9]], dtype=np.int64)
    write_npy(store.plan.selection_path, sel)
    write_model(
        store.plan.plan_path,
        Plan(recipe_hash="h", num_shards=3, shard_rows=2, selected=5, datasets=[]),
    )
    assert store.plan.num_shards() == 3
    assert store.plan.shard_rows(0).tolist() == [[0, 5], [1, 2]]
    assert store.plan.shard_rows(2).tolist() == [[0, 9]]


def test_regen_resume_cuts_a_torn_last_line(data_dir):
    from shared.records import RegenRecord

    store = RunStore.create(resolve_recipe(MINIMAL))

    def rec(row):
        return RegenRecord(
            row=row,
            id=f"d:{row}",
            source="d",
            messages=_conv(row).messages,
            turns=[{"prompt_token_ids": [1], "completion_token_ids": [2], "finish_reason": "stop"}],
            sampling={"temperature": 0.0},
            chat_template_kwargs={},
            server={"model": "m"},
        )

    whole = [rec(3).model_dump_json() + "\n", rec(1).model_dump_json() + "\n"]
    path = store.regen.partial_path(0)
    path.parent.mkdir(parents=True)
    path.write_text(whole[0] + whole[1] + rec(2).model_dump_json()[:40])  # killed mid-line
    ok, bad = store.regen.read_resume(0)
    assert [r.row for r in ok] == [3, 1] and bad == []
    assert path.read_text() == whole[0] + whole[1]  # the torn tail is gone for good
    store.regen.write(0, ok, [])
    assert [r.row for r in store.regen.records(0)] == [1, 3]  # sorted by row
