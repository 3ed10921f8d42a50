"""The hf backend on the real SmolLM2-135M (30 layers, H 576), bf16 on CPU."""

from __future__ import annotations

import pytest
import torch

from services.extract.hf_backend import HFExtractor, extract_batch, teacher_logits
from tests.extract.conftest import make_recipe

pytestmark = pytest.mark.slow

AUX = [2, 15, 27]


def test_default_aux_ids_for_30_layers(smollm2_path, smollm2_model):
    ex = HFExtractor(make_recipe(smollm2_path))
    assert ex.aux_ids == [2, 15, 27]
    meta = ex.metadata()
    assert meta["aux_layer_ids"] == [2, 15, 27]
    assert meta["final_state"] == "pre_norm" and meta["pre_norm"] is True
    assert meta["hidden_size"] == 576 and meta["num_hidden_layers"] == 30
    assert meta["target_revision"]


def test_aux_states_equal_hf_output_hidden_states_exactly(smollm2_model, sharegpt_rows):
    ids = sharegpt_rows[0]["input_ids"]
    (states,) = extract_batch(smollm2_model, [ids], AUX)
    assert states.shape == (len(ids), 4, 576) and states.dtype == torch.bfloat16
    with torch.inference_mode():
        hf = smollm2_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for slot, k in enumerate(AUX):
        assert torch.equal(states[:, slot], hf[k][0]), f"aux id {k}"
    # HF's last entry is post-norm; the stored 4th state is the norm's input (pre-norm).
    assert not torch.equal(states[:, 3], hf[30][0])
    post = smollm2_model.model.norm(states[:, 3])
    assert torch.equal(post, hf[30][0])


def test_teacher_argmax_matches_model_on_real_text(smollm2_model, sharegpt_rows):
    agree = total = 0
    for row in sharegpt_rows[:4]:
        ids = row["input_ids"]
        (states,) = extract_batch(smollm2_model, [ids], AUX)
        teacher = teacher_logits(smollm2_model, states[:, 3]).argmax(-1)
        with torch.inference_mode():
            own = smollm2_model(torch.tensor([ids])).logits[0].argmax(-1)
        agree += int((teacher == own).sum())
        total += len(ids)
    assert total >= 500
    assert agree / total >= 0.99, f"{agree}/{total}"


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token, per-slot relative L2 error `[seq, 4]`."""
    x, ref = x.float(), ref.float()
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_mixed_length_batch_matches_one_at_a_time(smollm2_path, smollm2_model, sharegpt_rows):
    from transformers import AutoModelForCausalLM

    # "Within bf16 tolerance" is measured, not assumed: the error bf16 itself makes against
    # an fp32 forward of the same sample bounds the batch-vs-single difference. (Loaded
    # directly, not through the backend's one-model cache, which would evict the bf16 one.)
    fp32 = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    lengths = [17, 45, 73, 101, 129, 160]
    batch = [r["input_ids"][:n] for r, n in zip(sharegpt_rows, lengths, strict=False)]
    assert len({len(b) for b in batch}) == len(batch)
    together = extract_batch(smollm2_model, batch, AUX)
    for ids, got in zip(batch, together, strict=True):
        (alone,) = extract_batch(smollm2_model, [ids], AUX)
        (ref,) = extract_batch(fp32, [ids], AUX)
        assert got.shape == alone.shape == (len(ids), 4, 576)
        batch_err, bf16_err = _rel_err(got, alone), _rel_err(alone, ref)
        assert float(batch_err.max()) <= float(bf16_err.max()), len(ids)
        assert float(batch_err.mean()) <= float(bf16_err.mean()), len(ids)
    # The longest sample has no padding. It is bit-identical to running it alone only where
    # the bf16 matmul kernel does not block by batch size (AMX does), so the measured bf16
    # bound above is its check too.


def test_aux_id_out_of_range_is_refused(smollm2_model):
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="out of range 1..29"):
        extract_batch(smollm2_model, [[1, 2, 3]], [2, 15, 30])
