"""Torn compiled kernels in inductor's cache (`services.train.kernel_cache`).

A trainer killed while g++ writes a kernel library leaves a partial file that every later
process took for a built kernel (`scripts/test-deploy`'s restarted trainer: "file too
short"). The ELF checks run on real libraries cut at many lengths and on headers whose sizes
are worked by hand; the end-to-end test tears a real cache and checks the next process builds
its kernels again instead of running eager.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from services.train import kernel_cache
from services.train.kernel_cache import elf_complete, is_torn, purge_torn_kernels

ROOT = Path(__file__).resolve().parents[2]


def _real_library() -> Path:
    import torch

    return Path(torch.__file__).parent / "lib" / "libc10.so"


def test_whole_libraries_are_complete_and_every_cut_of_them_is_not():
    for path in (_real_library(), Path(sys.executable).resolve()):
        data = path.read_bytes()
        assert elf_complete(data[:64], len(data)), path
        cuts = sorted(
            {0, 3, 5, 40, 63, 64, len(data) // 2, len(data) - 1, *range(0, len(data), 4099)}
        )
        assert [c for c in cuts if elf_complete(data[:64], c)] == []


def _header(elf_class: int, order: str, phoff: int, phnum: int, shoff: int, shnum: int) -> bytes:
    """An ELF header with program headers of 56/32 bytes and section headers of 64/40."""
    head = bytearray(64 if elf_class == 2 else 52)
    head[:6] = b"\x7fELF" + bytes([elf_class, 1 if order == "<" else 2])
    if elf_class == 2:
        struct.pack_into(order + "QQ", head, 0x20, phoff, shoff)
        struct.pack_into(order + "HHHH", head, 0x36, 56, phnum, 64, shnum)
    else:
        struct.pack_into(order + "II", head, 0x1C, phoff, shoff)
        struct.pack_into(order + "HHHH", head, 0x2A, 32, phnum, 40, shnum)
    return bytes(head)


@pytest.mark.parametrize(
    ("elf_class", "order", "need"),
    [
        (2, "<", 5000 + 30 * 64),  # section headers end last: 6,920
        (2, ">", 5000 + 30 * 64),
        (1, "<", 3000 + 12 * 40),  # 3,480
        (1, ">", 3000 + 12 * 40),
    ],
)
def test_the_header_tables_decide_the_length_a_file_needs(elf_class, order, need):
    shnum = 30 if elf_class == 2 else 12
    head = _header(
        elf_class,
        order,
        phoff=64,
        phnum=9,
        shoff=need - shnum * (64 if elf_class == 2 else 40),
        shnum=shnum,
    )
    assert elf_complete(head, need)
    assert not elf_complete(head, need - 1)
    # Program headers past the section headers: they decide (64 + 200 * 56 = 11,264).
    late = _header(elf_class, order, phoff=64, phnum=200, shoff=100, shnum=1)
    ph = 32 if elf_class == 1 else 56
    assert elf_complete(late, 64 + 200 * ph) and not elf_complete(late, 64 + 200 * ph - 1)


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"\x7fEL",
        b"MZ\x90\x00" + bytes(60),
        b"\x7fELF\x03\x01" + bytes(58),
        b"\x7fELF\x02\x03" + bytes(58),
    ],
)
def test_what_is_not_elf_is_not_complete(head):
    assert not elf_complete(head, 1 << 20)


def _torn_copy(src: Path, dst: Path, keep: int) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes()[:keep])
    return dst


def test_purge_removes_torn_builds_only_and_waits_for_a_build_in_progress(
    tmp_path, monkeypatch, caplog
):
    from filelock import FileLock

    lib = _real_library()
    size = lib.stat().st_size
    whole = _torn_copy(lib, tmp_path / "ab" / "cabwhole.so", size)
    torn_main = _torn_copy(lib, tmp_path / "cd" / "ccdtorn.main.so", size // 2)
    empty_obj = _torn_copy(lib, tmp_path / "ef" / "ceftorn.o", 0)
    building = _torn_copy(lib, tmp_path / "gh" / "cghbuilding.so", 4096)
    source = _torn_copy(lib, tmp_path / "ij" / "cijsource.py", 10)  # not a build output
    (tmp_path / "locks").mkdir()
    monkeypatch.setattr(kernel_cache, "LOCK_TIMEOUT_S", 0.2)
    with FileLock(tmp_path / "locks" / "cghbuilding.lock"), caplog.at_level(logging.WARNING):
        removed = purge_torn_kernels(tmp_path)
    assert removed == [torn_main, empty_obj]
    assert not torn_main.exists() and not empty_obj.exists()
    assert whole.read_bytes() == lib.read_bytes() and not is_torn(whole)
    assert building.stat().st_size == 4096 and source.exists()
    assert "cghbuilding.so is still being built by another process" in caplog.text
    assert purge_torn_kernels(tmp_path) == [building]  # its lock released: torn after all


BUILD = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING)
from services.train.loss import loss_kernels
k = loss_kernels(True)
t = torch.tensor([[0.0, 1.0, 3.0], [2.0, 2.0, -1.0]])
p, neg_entropy, arg = k.teacher(t, torch.float32)
print("RESULT", json.dumps([k.teacher.fn is not k.teacher.eager, p.tolist(), neg_entropy.tolist()]))
"""


def _softmax(row):
    import math

    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


@pytest.mark.slow
def test_a_torn_kernel_cache_is_built_again_not_run_eager(tmp_path):
    """A fresh process on a cache whose built files were all cut in half (as a trainer killed
    while g++ writes leaves them) removes them, builds its kernels again, and runs them
    compiled: the results are the softmax and negative entropy worked by hand."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def run() -> tuple[list, str]:
        out = subprocess.run(
            [sys.executable, "-c", BUILD], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.split("RESULT")[1]), out.stderr

    (compiled, _, _), _ = run()
    assert compiled
    built = [p for p in tmp_path.rglob("*") if p.suffix in (".so", ".o")]
    assert built
    for p in built:
        os.truncate(p, p.stat().st_size // 2)
    (compiled, p, neg_entropy), log = run()
    assert f"removed {len(built)} torn compiled kernel file(s)" in log
    assert "not built" not in log and compiled
    want = [_softmax([0, 1, 3]), _softmax([2, 2, -1])]
    assert p == [pytest.approx(w, rel=1e-6) for w in want]
    import math

    assert neg_entropy == pytest.approx([sum(q * math.log(q) for q in w) for w in want], rel=1e-6)
    assert not any(is_torn(p) for p in built if p.exists())
