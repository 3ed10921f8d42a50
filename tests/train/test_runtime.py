"""`train.precision: auto` picks bf16 only where the CPU has bf16 matmul kernels; the CPU
trainer's allocator setting and fused-loss default."""

from __future__ import annotations

import pytest

from tests.train.conftest import train_recipe


@pytest.mark.parametrize("fast", [True, False])
def test_auto_precision_on_cpu_follows_the_bf16_kernels(smollm2_path, monkeypatch, fast):
    from services.train import runtime

    monkeypatch.setattr(runtime, "cpu_has_bf16_kernels", lambda: fast)
    auto = runtime.resolve_runtime(train_recipe(smollm2_path, precision="auto"))
    assert auto.autocast_dtype == ("bf16" if fast else None)
    # An explicit choice is kept either way.
    bf16 = runtime.resolve_runtime(train_recipe(smollm2_path, precision="bf16"))
    fp32 = runtime.resolve_runtime(train_recipe(smollm2_path, precision="fp32"))
    assert (bf16.autocast_dtype, fp32.autocast_dtype) == ("bf16", None)


def test_fused_loss_auto_is_on_for_cpu_and_an_explicit_choice_is_kept(smollm2_path):
    from services.train import runtime

    def resolved(value):
        return runtime.resolve_runtime(train_recipe(smollm2_path, fused_loss=value)).fused_loss

    assert resolved("auto") is True  # train.device auto on a machine without CUDA: cpu
    assert (resolved(True), resolved(False)) == (True, False)


KEEP_PROBE = """
import ctypes, ctypes.util, sys
import psutil
from services.train.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 24 << 20  # a loss chunk's size: [768, 8192] fp32
buf = libc.malloc(n)
ctypes.memset(buf, 1, n)  # touch every page
before = psutil.Process().memory_info().rss
libc.free(buf)
print((before - psutil.Process().memory_info().rss) / (1 << 20))
"""


@pytest.mark.parametrize("mode", ["default", "keep"])
def test_keep_freed_memory_keeps_a_freed_loss_chunk_resident(mode):
    """glibc returns a freed 24 MiB block to the kernel by default (RSS drops by its size);
    after `keep_freed_memory` it stays in the heap for the next chunk. Each mode runs in a
    fresh interpreter: the setting holds for a whole process."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", KEEP_PROBE, mode], cwd=root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    dropped_mib = float(out.stdout)
    if mode == "keep":
        assert dropped_mib < 2
    else:
        assert dropped_mib > 20
