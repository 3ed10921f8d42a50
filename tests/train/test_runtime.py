"""`train.precision: auto` picks bf16 only where the CPU has bf16 matmul kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import train_recipe

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.is_file(), reason="reads /proc/cpuinfo (Linux)")
def test_bf16_kernel_check_follows_the_cpu_flags():
    """oneDNN has bf16 kernels with AVX-512 BW+VL+DQ, AVX512-BF16 or AMX-BF16 (x86)."""
    from services.train.runtime import cpu_has_bf16_kernels

    flags: set[str] = set()
    for line in CPUINFO.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not flags:
        pytest.skip("no x86 flags line in /proc/cpuinfo")
    want = {"avx512bw", "avx512vl", "avx512dq"} <= flags or bool(
        {"avx512_bf16", "amx_bf16"} & flags
    )
    assert cpu_has_bf16_kernels() is want


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
