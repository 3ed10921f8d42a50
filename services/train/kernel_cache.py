"""Torn compiled kernels in inductor's on-disk cache: found by their ELF headers and removed.

Responsibility: `purge_torn_kernels`, which `services.train.loss.loss_kernels` calls once per
process, before its first build.

Why. torch 2.13's inductor writes the sources and Python wrappers of its CPU kernels
atomically (a temp file, then a rename), but `g++` writes each library (`<key>.so`,
`<key>.main.so`) and object (`.o`) straight to its cache path, under a file lock, and later
processes take any file that exists for a built kernel (`CppCodeCache.load_async`). A trainer
killed while `g++` runs (a restarted container: `scripts/test-deploy` kills the trainer at its
first checkpoint) leaves a partial file, and every later process that needs it fails:
`ImportError: ...main.so: file too short` on loading a kernel, or, when the torn file is the
small library inductor builds to test the CPU's vector ISA (`VecISA.check_build`), a CPU taken
for one without AVX-512, whose flags then fail to compile the cached vectorized kernels
("'at::vec' has not been declared"). Inductor keeps that ISA decision in memory, so the purge
runs before the process's first build: a retry after a failure fails the same way. Removing
the partial file lets the next build make it again.

A complete ELF file holds its program and section header tables; the linker writes the
section headers at the file's end, so a file cut anywhere is shorter than they say (the
check behind the dynamic loader's "file too short"). A file that looks torn is checked again
and removed under the lock inductor builds it under (`<cache>/locks/<key>.lock`), so a build
in progress in another process is never mistaken for a torn one.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

log = logging.getLogger("eyrie.train")

#: The suffixes of what g++ writes into inductor's cache (libraries and objects).
BUILT_SUFFIXES = (".so", ".o")
#: Seconds to wait for a kernel's build lock (inductor's own `LOCK_TIMEOUT` is 600).
LOCK_TIMEOUT_S = 600.0

_ELF_MAGIC = b"\x7fELF"
#: (e_phoff, e_shoff) format and offset, and (e_phentsize, e_phnum, e_shentsize, e_shnum)
#: offset, per ELF class (1: 32-bit, 2: 64-bit), from the System V ABI's ELF header layout.
_HEADER = {1: ("II", 0x1C, 0x2A, 52), 2: ("QQ", 0x20, 0x36, 64)}


def elf_complete(data: bytes, size: int) -> bool:
    """Whether an ELF file of `size` bytes starting with `data` holds all its header tables.

    Args:
        data: the file's first 64 bytes (or all of it, if shorter).
        size: the file's length in bytes.

    Returns:
        False for anything that is not a whole ELF file: a wrong magic, an unknown class or
        byte order, or a length short of `e_phoff + e_phnum * e_phentsize` or of
        `e_shoff + e_shnum * e_shentsize`.
    """
    if len(data) < 6 or data[:4] != _ELF_MAGIC or data[4] not in _HEADER or data[5] not in (1, 2):
        return False
    offsets, at_off, at_sizes, header_len = _HEADER[data[4]]
    if size < header_len or len(data) < header_len:
        return False
    order = "<" if data[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + offsets, data, at_off)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, at_sizes)
    return size >= max(phoff + phnum * phentsize, shoff + shnum * shentsize, header_len)


def is_torn(path: Path) -> bool:
    """Whether the built file `path` is not a complete ELF file (see `elf_complete`).

    A file removed meanwhile (another process purging or rebuilding) is not torn.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return False
    return not elf_complete(head, size)


def purge_torn_kernels(cache_dir: Path | None = None) -> list[Path]:
    """Remove the torn libraries and objects from inductor's cache; return their paths.

    Args:
        cache_dir: inductor's cache folder; default the one this process uses
            (`$TORCHINDUCTOR_CACHE_DIR`, else `/tmp/torchinductor_<user>`).

    Only a file that looks torn takes its build lock, to be checked again under it; one whose
    lock another process holds for longer than `LOCK_TIMEOUT_S` is left alone (with a
    warning): that build is still running, not torn.
    """
    from filelock import FileLock, Timeout

    if cache_dir is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

        cache_dir = Path(inductor_cache_dir())
    removed = []
    for path in sorted(p for p in cache_dir.rglob("*") if p.suffix in BUILT_SUFFIXES):
        if not is_torn(path):
            continue
        key = path.name.split(".", 1)[0]
        try:
            with FileLock(cache_dir / "locks" / f"{key}.lock", timeout=LOCK_TIMEOUT_S):
                if is_torn(path):
                    path.unlink()
                    removed.append(path)
        except Timeout:
            log.warning("train: %s is still being built by another process; left alone", path)
    return removed
