"""Packed batches under flex attention (the CUDA kernel) are padded to whole 128-position
blocks: speculators' Eagle3 draft builds one BlockMask per batch and extends it by blocks for
each TTT step, and torch refuses a mask longer than the batch. Found by scripts/gpu-check on
an H200 (a 3,793-position batch against a 3,840-position mask); reproduced here on CPU, where
flex attention runs forward (unfused) but has no backward."""

from __future__ import annotations

import pytest
import torch

from services.train.packing import collate
from services.train.samples import AlignedSample


def _sample(n: int, start: int, h: int = 4) -> AlignedSample:
    return AlignedSample(
        input_ids=torch.arange(start, start + n, dtype=torch.long),
        aux=torch.ones(n, 3 * h, dtype=torch.bfloat16),
        final=torch.ones(n, h, dtype=torch.bfloat16),
        loss_mask=torch.ones(n, dtype=torch.bool),
        position_ids=torch.arange(1, n + 1),
    )


def test_flex_block_size_is_torchs():
    from torch.nn.attention import flex_attention

    from services.train.draft_model import FLEX_BLOCK_SIZE

    assert flex_attention._DEFAULT_SPARSE_BLOCK_SIZE == FLEX_BLOCK_SIZE == 128


@pytest.mark.parametrize(
    ("lengths", "multiple", "padded"),
    [
        ([5, 3], 1, 8),  # sdpa: no padding
        ([5, 3], 128, 128),
        ([100, 28], 128, 128),  # already whole blocks: no padding document
        ([100, 29], 128, 256),
        ([300], 128, 384),
        ([7], 4, 8),
    ],
)
def test_collate_pads_to_the_multiple_with_one_masked_document(lengths, multiple, padded):
    samples = [_sample(n, 1000 * i) for i, n in enumerate(lengths)]
    batch = collate(samples, 10_000, multiple)
    real, pad = sum(lengths), padded - sum(lengths)
    assert {k: v.shape[1] for k, v in batch.items()} == dict.fromkeys(batch, padded)
    assert batch["hidden_states"].shape == (1, padded, 12)
    assert batch["hidden_states"].dtype == torch.bfloat16
    docs = batch["document_ids"][0].tolist()
    want = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * pad
    assert docs == want
    assert batch["loss_mask"][0].tolist() == [True] * real + [False] * pad
    assert batch["input_ids"][0, :real].tolist() == [
        1000 * i + j for i, n in enumerate(lengths) for j in range(n)
    ]
    for key in ("hidden_states", "verifier_last_hidden_states", "input_ids", "position_ids"):
        assert not batch[key][0, real:].any(), key  # padding is zeros
    for key in ("hidden_states", "verifier_last_hidden_states"):
        assert batch[key][0, :real].all(), key  # the samples' states (ones) are all kept
    assert batch["position_ids"][0, :real].tolist() == [p for n in lengths for p in range(1, n + 1)]


def test_truncation_applies_before_padding():
    batch = collate([_sample(300, 0), _sample(10, 5000)], 200, 128)
    assert batch["document_ids"][0].tolist() == [0] * 200 + [1] * 10 + [-1] * 46


@pytest.mark.slow
def test_padded_flex_batch_matches_the_unpadded_sdpa_batch(extract_data):
    """The same weights, sdpa on the packed samples and flex on the padded batch: the same
    draft tokens at every real position for each TTT step, the same TTT loss and the same
    simulated τ."""
    from services.train.acceptance import simulated_tau
    from services.train.draft_model import build_draft, length_multiple
    from services.train.loss import ttt_loss
    from services.train.samples import SampleReader, index_samples

    recipe = extract_data.recipe()
    d2t, t2d = extract_data.vocab.read_maps()
    torch.manual_seed(0)
    sdpa = build_draft(recipe, d2t, t2d, device="cpu")
    flex = build_draft(recipe, d2t, t2d, device="cuda")  # the CUDA kernel choice, run on CPU
    flex.load_state_dict(sdpa.state_dict())
    assert (length_multiple(sdpa), length_multiple(flex)) == (1, 128)
    read = SampleReader(extract_data)
    samples = [read(r) for r in index_samples(extract_data).train[:3]]
    plain = collate(samples, 10_000, length_multiple(sdpa))
    padded = collate(samples, 10_000, length_multiple(flex))
    n = plain["input_ids"].shape[1]
    assert n % 128 != 0 and padded["input_ids"].shape[1] == n + (-n % 128)

    def inputs(b):
        keys = ("hidden_states", "input_ids", "document_ids", "position_ids")
        return {k: b[k].float() if b[k].is_floating_point() else b[k] for k in keys}

    def as_float(b):
        return {k: v.float() if v.is_floating_point() else v for k, v in b.items()}

    with torch.no_grad():
        want = sdpa(**inputs(plain), ttt_steps=3)
        got = flex(**inputs(padded), ttt_steps=3)
        for step, (w, g) in enumerate(zip(want, got, strict=True)):
            agree = (w[0] == g[0, :n]).float().mean().item()
            assert agree >= 0.99, (step, agree)  # fp32 kernels differ only on near-ties
        loss_want, _ = ttt_loss(sdpa, as_float(plain), 3, 1.0, 4096)
        loss_got, _ = ttt_loss(flex, as_float(padded), 3, 1.0, 4096)
    torch.testing.assert_close(loss_got, loss_want, rtol=1e-4, atol=1e-5)
    # Simulated τ pads each held-out sample the same way: to whole blocks by default, to the
    # trainer's fixed batch length when given one.
    want_tau = simulated_tau(sdpa, samples, 3)
    assert want_tau["anchors"] > 50
    # On CPU the trainer pads to 64 (`runtime.CPU_ROW_MULTIPLE`): sdpa gives the same τ.
    assert simulated_tau(sdpa, samples, 3, pad_to=64) == want_tau
    for pad_to in (None, 512):
        got_tau = simulated_tau(flex, samples, 3, pad_to=pad_to)
        assert got_tau["anchors"] == want_tau["anchors"]
        assert abs(got_tau["accepted"] - want_tau["accepted"]) <= 2, (pad_to, got_tau, want_tau)
