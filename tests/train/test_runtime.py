"""`train.precision: auto` picks bf16 only where the CPU has bf16 matmul kernels."""

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
