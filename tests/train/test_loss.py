"""The chunked TTT loss equals speculators' unchunked one, and so do its gradients.

Reference: speculators 0.9.0's own `Eagle3DraftModel.forward` with the teacher states (full
`[T, Vd]` logits per TTT step, its alignment, masking, decay and normalization), on the same
draft (built from the real SmolLM2 target) and the same packed batch of two documents, all in
fp64. speculators' eager KL forces fp32, so the reference passes it a KL term written here
in fp64 (`F.kl_div` of the fp64 log-softmax and softmax over the whole vocab).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests.train.conftest import train_recipe

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.timeout(300)

TTT, DECAY = 3, 0.8
#: speculators' step normalizer is `mask.sum() + 1e-5` in fp32 (rel. error ~6e-8); ours is
#: exact. Everything else is fp64 on both sides.
RTOL = 2e-7


@pytest.fixture(scope="module")
def draft_and_batch(smollm2_path):
    import torch

    from services.train.draft_model import build_draft
    from services.train.runtime import unwrap

    recipe = train_recipe(smollm2_path, ttt_steps=TTT)
    vd, v = recipe.draft.draft_vocab_size, 49152
    t2d = np.zeros(v, dtype=bool)
    rng = np.random.default_rng(0)
    chosen = np.sort(rng.choice(v, vd, replace=False))
    t2d[chosen] = True
    d2t = (chosen - np.arange(vd)).astype(np.int64)
    torch.manual_seed(0)
    model = unwrap(build_draft(recipe, d2t, t2d)).double()
    g = torch.Generator().manual_seed(1)
    n, h = 70, 576
    batch = {
        "hidden_states": torch.randn(1, n, 3 * h, generator=g, dtype=torch.float64),
        "input_ids": torch.randint(0, v, (1, n), generator=g),
        "verifier_last_hidden_states": torch.randn(1, n, h, generator=g, dtype=torch.float64) * 3,
        "loss_mask": torch.rand(1, n, generator=g) > 0.3,
        "position_ids": torch.cat([torch.arange(1, 41), torch.arange(1, 31)]).unsqueeze(0),
        "document_ids": torch.cat(
            [torch.zeros(40, dtype=torch.long), torch.ones(30, dtype=torch.long)]
        ).unsqueeze(0),
    }
    return model, batch


def _kl64(logits, targets):
    import torch.nn.functional as F

    logq = F.log_softmax(logits.double(), dim=-1)
    p = F.softmax(targets.double(), dim=-1)
    return F.kl_div(logq, p, reduction="none", log_target=False).sum(dim=-1)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _chat_mask(n: int) -> torch.Tensor:
    """Chat-shaped loss mask of the fixture's two documents (40 + 30 positions): a prompt
    span (mask off), then an answer span (on), so `ttt_rows` leaves whole spans out."""
    import torch

    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, 12:33] = True  # document 0: prompt 0-11, answer 12-32, prompt of a 2nd turn
    mask[0, 55:68] = True  # document 1 (40-69): prompt 40-54, answer 55-67
    return mask


@pytest.mark.parametrize("mask_kind", ["scattered", "chat", "prompt only"])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_chunked_loss_and_gradients_equal_speculators_fp64(draft_and_batch, fused, mask_kind):
    """Eager and compiled (`loss_kernels`) element-wise kernels alike; a scattered loss mask
    (the forward computes nearly every row) and a chat-shaped one (it skips prompt spans)."""
    import torch

    from services.train.loss import loss_kernels, teacher_positions, ttt_loss
    from services.train.ttt import ttt_rows

    model, batch = draft_and_batch
    if mask_kind == "prompt only":  # a micro-batch of prompts: steps >= 1 run on no row
        batch = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    if mask_kind == "chat":
        batch = {**batch, "loss_mask": _chat_mask(batch["loss_mask"].shape[1])}
        rows = ttt_rows(batch["loss_mask"][0], TTT)
        # By hand: t in 10..32 and 53..67 (an answer within 2 positions), of 69 and 68.
        want = [*range(10, 33), *range(53, 68)]
        assert rows[1].tolist() == want and rows[2].tolist() == want
    if fused:  # built here, not fallen back to eager (CI's machine has a C++ compiler)
        assert loss_kernels(True) is not loss_kernels(False)
    ref_model = copy.deepcopy(model)
    _, ref_loss, ref_metrics = ref_model(
        **batch,
        ttt_steps=TTT,
        ttt_step_loss_decay=DECAY,
        loss_config={"kl_div": (_kl64, 1.0)},
    )
    ref_loss.backward()
    ref_grads = _grads(ref_model)
    assert ref_grads  # trainable weights got gradients

    need = len(teacher_positions(batch["loss_mask"][0], TTT))
    # The scattered mask needs more teacher positions than chunks 7 and 64 hold.
    assert need < 1000 and (need > 64 or mask_kind != "scattered")
    # 7 and 64 split every step's positions and recompute the teacher per chunk; 1000 does
    # not, and computes the teacher once for all steps (`Teacher`'s cache).
    for chunk in (7, 64, 1000):
        model.zero_grad(set_to_none=True)
        loss, metrics = ttt_loss(model, batch, TTT, DECAY, chunk_tokens=chunk, fused=fused)
        loss.backward()
        assert loss.dtype == torch.float64
        # speculators adds the steps' fp64 losses into an fp32 total in place; each step's
        # own loss (and every gradient) stays fp64.
        assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
        for j in range(TTT):
            ref_j = ref_metrics[f"loss_{j}_sum"]
            assert ref_j.dtype == torch.float64
            assert float(metrics[f"loss_{j}_sum"]) == pytest.approx(float(ref_j), rel=RTOL)
        for key, ref in ref_metrics.items():
            assert float(metrics[key]) == pytest.approx(float(ref), rel=1e-6), key
        grads = _grads(model)
        assert set(grads) == set(ref_grads)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=RTOL, atol=1e-12, msg=name)


def test_micro_batches_with_the_step_denominators_sum_to_the_whole_step(draft_and_batch):
    """Split by document (what the OOM back-off does): losses and gradients add up."""
    import torch

    from services.train.loss import step_denominators, ttt_loss

    model, batch = draft_and_batch
    model.zero_grad(set_to_none=True)
    whole, _ = ttt_loss(model, batch, TTT, DECAY, chunk_tokens=32)
    whole.backward()
    want = _grads(model)
    denoms = step_denominators(batch["loss_mask"], TTT)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for doc in (0, 1):
        keep = batch["document_ids"][0] == doc
        part = {k: v[:, keep] for k, v in batch.items()}
        part["document_ids"] = torch.zeros_like(part["document_ids"])
        loss, _ = ttt_loss(model, part, TTT, DECAY, chunk_tokens=32, denominators=denoms)
        loss.backward()
        total += float(loss)
    # Not exact by construction: positions whose step-j target lies in the next document
    # are scored in the whole step but not in the split one (speculators' alignment crosses
    # document boundaries), so compare with a tolerance that this boundary effect meets.
    assert total == pytest.approx(float(whole), rel=0.05)
    for name, ref in want.items():
        got = _grads(model)[name]
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
        assert float(cos) > 0.95, name


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("scale", [0.01, 1.0, 40.0])
def test_fp32_kl_matches_fp64_kl_div_from_flat_to_peaked_logits(scale, fused):
    """The closed form (log-sum-exp read off each row's top entry) against `F.kl_div` in fp64.

    `scale` spans near-uniform rows (KL ~1e-6: cancellation would show), ordinary ones, and
    rows whose top logit leads by hundreds (softmax underflows to 0 elsewhere: kl_div's
    0 * log 0 convention). The teacher is a perturbed copy of the draft, so KL is small and
    positive, the regime late in training.
    """
    import torch

    from services.train.loss import Teacher, chunked_kl

    g = torch.Generator().manual_seed(2)
    n, hid, vd = 96, 64, 512
    h = torch.randn(n, hid, generator=g) * scale
    w = torch.randn(vd, hid, generator=g)
    th = h + 0.05 * scale * torch.randn(n, hid, generator=g)
    weight = torch.rand(n, generator=g)
    pos = torch.arange(n)
    teacher = Teacher(th, w, h.dtype, fused=fused)
    loss, pred, teach = chunked_kl(h, w, teacher, pos, weight, chunk_tokens=40)
    want = (_kl64(h.double() @ w.double().T, th.double() @ w.double().T) * weight.double()).sum()
    # fp32's own rounding: at scale 0.01 (KL ~4e-6 a row) this form is 0.3 % off eager and
    # 0.2 % fused, as kl_div in fp32 is; a wrong or missing log-sum-exp term is off by orders.
    assert float(loss) == pytest.approx(float(want), rel=1e-2, abs=1e-8)
    assert float(loss) >= 0
    assert torch.equal(pred, (h @ w.T).argmax(-1))
    assert torch.equal(teach, (th @ w.T).argmax(-1))


def test_teacher_positions_cover_every_step_shift():
    """Position i is needed when some j < ttt has mask[i - j]: worked by hand."""
    import torch

    from services.train.loss import teacher_positions

    mask = torch.tensor([0, 1, 0, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert teacher_positions(mask, 1).tolist() == [1, 5, 6]
    assert teacher_positions(mask, 2).tolist() == [1, 2, 5, 6, 7]
    assert teacher_positions(mask, 3).tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert teacher_positions(torch.zeros(4, dtype=torch.bool), 3).tolist() == []


@pytest.mark.parametrize("cached", [False, True], ids=["per chunk", "cached"])
def test_loss_rows_padded_to_a_multiple_change_nothing(cached):
    """`Teacher(multiple=...)` rounds the logits matmuls' rows up with weightless repeats
    (`padded_rows`): loss, gradients and both argmaxes equal the unpadded ones in fp64, for
    chunks that are and are not whole multiples, the teacher cached or per chunk."""
    import torch

    from services.train.loss import Teacher, chunked_kl, padded_rows

    assert padded_rows(5, 4).tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
    assert padded_rows(8, 4).tolist() == list(range(8))
    assert padded_rows(0, 4).tolist() == []
    g = torch.Generator().manual_seed(3)
    n, hd, vd = 45, 16, 50
    h = torch.randn(n, hd, generator=g, dtype=torch.float64)
    w = torch.randn(vd, hd, generator=g, dtype=torch.float64, requires_grad=True)
    th = torch.randn(n + 2, hd, generator=g, dtype=torch.float64) * 2
    tw = torch.randn(vd, hd, generator=g, dtype=torch.float64)
    pos = torch.arange(n) + 2
    weight = torch.rand(n, generator=g, dtype=torch.float64)
    out = []
    for multiple in (1, 8):
        teacher = Teacher(th, tw, torch.float64, pos if cached else None, multiple=multiple)
        hh = h.clone().requires_grad_(True)
        w.grad = None
        for chunk in (16, 13):
            loss, pred, teach = chunked_kl(hh, w, teacher, pos, weight, chunk_tokens=chunk)
            loss.backward()
            out.append((multiple, chunk, loss.detach(), pred, teach, hh.grad.clone()))
            hh.grad = None
        out[-1] += (w.grad.clone(),)
    by = {(m, c): rest for m, c, *rest in out}
    for chunk in (16, 13):
        for want, got in zip(by[1, chunk], by[8, chunk], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_padding_ends_the_chain_as_the_micro_batch_end_does(draft_and_batch, monkeypatch):
    """With a draft that always agrees with the teacher, every chain stays alive to the
    micro-batch's end: padded, the chain at a position whose step-j target is padding ends
    there, so the accuracy metrics (`cond_acc_j` totals) equal the unpadded batch's."""
    import torch

    from services.train import loss as loss_mod

    def agreeing(h, w, teacher, pos, weight, chunk_tokens, matmul_dtype=None):
        teach = teacher.at(pos)[2]
        return (h.sum() * 0).double(), teach.clone(), teach

    monkeypatch.setattr(loss_mod, "chunked_kl", agreeing)
    model, batch = draft_and_batch
    batch = {**batch, "loss_mask": torch.ones_like(batch["loss_mask"])}
    n, pad = batch["input_ids"].shape[1], 26
    padded = {k: torch.cat([v, v.new_zeros((1, pad, *v.shape[2:]))], 1) for k, v in batch.items()}
    padded["document_ids"][0, n:] = -1
    got = [loss_mod.ttt_loss(model, b, TTT, DECAY, chunk_tokens=64)[1] for b in (batch, padded)]
    # By hand: every position is trainable, so step j counts the n - j positions with a
    # target, all correct.
    for j in range(TTT):
        assert float(got[0][f"cond_acc_{j}_total"]) == n - j
    for key, want in got[0].items():
        assert float(got[1][key]) == float(want), key


@pytest.mark.parametrize("mask_kind", ["scattered", "chat"])
def test_padded_micro_batch_gives_the_unpadded_loss_and_gradients(draft_and_batch, mask_kind):
    """A micro-batch padded to `CPU_ROW_MULTIPLE` as `collate` pads it (zeros, document -1,
    loss mask off: what `Trainer.pad_to` asks for on CPU) gives the unpadded batch's loss,
    metrics and gradients in fp64, its TTT rows padded too (`ttt_rows`' multiple)."""
    import torch

    from services.train.loss import ttt_loss
    from services.train.runtime import CPU_ROW_MULTIPLE, row_multiple
    from services.train.ttt import ttt_rows

    model, batch = draft_and_batch
    if mask_kind == "chat":
        batch = {**batch, "loss_mask": _chat_mask(batch["loss_mask"].shape[1])}
    n = batch["input_ids"].shape[1]
    pad = -n % CPU_ROW_MULTIPLE
    assert row_multiple("cpu") == CPU_ROW_MULTIPLE and pad > 0
    padded = {k: torch.cat([v, v.new_zeros((1, pad, *v.shape[2:]))], 1) for k, v in batch.items()}
    padded["document_ids"][0, n:] = -1
    rows = ttt_rows(padded["loss_mask"][0], TTT, CPU_ROW_MULTIPLE)
    # Rounded up to 64, or every row below n - j where that is fewer (scattered: 127, 126).
    total = n + pad
    assert [len(r) for r in rows] == [total, *([64] * 2 if mask_kind == "chat" else [127, 126])]
    results = []
    for b in (batch, padded):
        model.zero_grad(set_to_none=True)
        loss, metrics = ttt_loss(model, b, TTT, DECAY, chunk_tokens=64)
        loss.backward()
        results.append((float(loss.detach()), {k: float(v) for k, v in metrics.items()}))
        results[-1] += (_grads(model),)
    (want, want_m, want_g), (got, got_m, got_g) = results
    assert got == pytest.approx(want, rel=1e-12)
    assert got_m.keys() == want_m.keys()
    for key, value in want_m.items():
        assert got_m[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert got_g.keys() == want_g.keys()
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-10, atol=1e-14, msg=name)


def test_ttt_rows_keep_every_position_a_later_step_may_score():
    """Worked by hand: step j keeps t < n - j with mask[t] or mask[t + j'], j <= j' < ttt."""
    import torch

    from services.train.ttt import ttt_rows

    mask = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    rows = [r.tolist() for r in ttt_rows(mask, 3)]
    assert rows == [list(range(9)), [0, 1, 2, 3, 5, 6, 7], [0, 1, 2, 3, 5]]
    assert [r.tolist() for r in ttt_rows(mask, 2)] == [list(range(9)), [1, 2, 3, 6, 7]]
    assert [r.tolist() for r in ttt_rows(mask, 1)] == [list(range(9))]
    assert ttt_rows(torch.zeros(3, dtype=torch.bool), 3)[2].tolist() == []
    # Padded to a multiple with the first unneeded rows of the previous step below n - j:
    # step 1 takes 4 (7 -> 8 rows); step 2 takes 4 of {4, 6} (5 -> 6 rows), or both when 8
    # rows would be needed (7 rows: none below 7 is left).
    assert [r.tolist() for r in ttt_rows(mask, 3, 3)][1:] == [[*range(8)], [*range(6)]]
    assert [r.tolist() for r in ttt_rows(mask, 3, 4)][1:] == [[*range(8)], [*range(7)]]
    assert [r.tolist() for r in ttt_rows(mask, 3, 1)] == rows


def test_row_forward_equals_speculators_forward_at_the_rows(draft_and_batch):
    """`ttt_states` on the dense path (rows skipped) against speculators' own forward with
    the lm_head's input recorded (the path a DDP wrapper takes), TTT 3, chat-shaped mask."""
    import torch

    from services.train.ttt import ttt_states

    model, batch = draft_and_batch
    mask = _chat_mask(batch["loss_mask"].shape[1])
    inputs = {
        k: v for k, v in batch.items() if k not in ("loss_mask", "verifier_last_hidden_states")
    }

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    with torch.no_grad():
        rows, states = ttt_states(model, inputs, mask, TTT)
        all_rows, ref = ttt_states(Wrapper(model), inputs, mask, TTT)
    n = mask.shape[1]
    assert [len(r) for r in all_rows] == [n - j for j in range(TTT)]
    assert len(rows[1]) < n - 1
    for j in range(TTT):
        assert states[j].shape == (len(rows[j]), 576)
        torch.testing.assert_close(states[j], ref[j][rows[j]], rtol=1e-12, atol=1e-12)


def test_cached_teacher_reads_what_it_computes_and_refuses_other_positions():
    """Gathered rows equal a fresh computation, and the entropy term is -H(p) in fp64."""
    import torch

    from services.train.loss import Teacher

    g = torch.Generator().manual_seed(3)
    th, tw = (
        torch.randn(12, 16, generator=g, dtype=torch.float64),
        torch.randn(40, 16, generator=g, dtype=torch.float64),
    )
    cached = torch.tensor([2, 3, 7, 11])
    teacher = Teacher(th, tw, torch.float64, cached)
    for got, want in zip(
        teacher.at(torch.tensor([7, 2, 7])),
        Teacher(th, tw, torch.float64).at(torch.tensor([7, 2, 7])),
        strict=True,
    ):
        # fp64 up to the matmul's blocking, which depends on the number of rows.
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    p, neg_entropy, arg = teacher.at(torch.tensor([11]))
    logp = torch.log_softmax(th[11] @ tw.T, dim=-1)
    assert float(neg_entropy[0]) == pytest.approx(float((logp.exp() * logp).sum()), rel=1e-12)
    assert int(arg[0]) == int(logp.argmax())
    with pytest.raises(IndexError):
        teacher.at(torch.tensor([4]))


FALLBACK = """
import json, logging, torch
import torch._inductor.config as cfg
cfg.cpp.cxx = ("/nonexistent/g++",)  # a machine without a C++ compiler
logging.basicConfig(level=logging.WARNING)
from services.train.loss import loss_kernels
k = loss_kernels(True)
t = torch.tensor([[0.0, 1.0, 3.0], [2.0, 2.0, -1.0]])
p, neg_entropy, arg = k.teacher(t, torch.float32)
print("RESULT", json.dumps([p.sum(-1).tolist(), neg_entropy.tolist(), arg.tolist()]))
"""


REBUILD = """
import json, logging, torch
import torch._inductor.config as cfg
logging.basicConfig(level=logging.WARNING)
from services.train.loss import loss_kernels
k = loss_kernels(True)
t = torch.tensor([[0.0, 1.0, 3.0], [2.0, 2.0, -1.0]])
k.teacher(t, torch.float32)  # built and run compiled
cfg.cpp.cxx = ("/nonexistent/g++",)  # the next build fails, as on a torn cached kernel
p, neg_entropy, arg = k.teacher(t.double(), torch.float64)  # another dtype: a rebuild
print("RESULT", json.dumps([p.sum(-1).tolist(), neg_entropy.tolist(), arg.tolist()]))
"""


def _neg_h(row):
    z = sum(math.exp(v) for v in row)
    return sum(math.exp(v) / z * (v - math.log(z)) for v in row)


def _fallback_result(script: str, tmp_path: Path, rel: float) -> None:
    """Run `script` (its kernels' build fails) in a fresh process with an empty inductor
    cache: it must log the fallback and print the eager teacher terms, worked by hand."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}  # no cached build
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "fused loss kernel _teacher_terms not built, running eager" in out.stderr
    assert "InvalidCxxCompiler" in out.stderr
    sums, neg_entropy, arg = json.loads(out.stdout.split("RESULT")[1])
    assert sums == pytest.approx([1.0, 1.0], rel=rel)
    assert neg_entropy == pytest.approx([_neg_h([0, 1, 3]), _neg_h([2, 2, -1])], rel=rel)
    assert arg == [2, 0]


def test_fused_kernels_fall_back_to_eager_when_a_later_rebuild_fails(tmp_path):
    """A kernel built at its first call, whose rebuild fails at a later call (another dtype
    or grad mode, e.g. the first validation; in a deployment, a cached kernel torn by a killed
    trainer), logs one line and gives the eager result (fp64 here): the stage goes on."""
    _fallback_result(REBUILD, tmp_path, rel=1e-12)


def test_fused_kernel_keeps_its_build_on_out_of_memory():
    """Out of memory in a compiled call is raised as is, not taken for a failed build: the
    next call (the OOM back-off's smaller micro-batch) runs the compiled kernel again."""
    import torch

    from services.train.loss import _Compiled

    calls = []

    def compiled(x):
        calls.append(x)
        if x > 1:
            raise torch.OutOfMemoryError("out of memory")
        return "compiled"

    k = _Compiled(lambda x: "eager")
    k.fn = compiled
    with pytest.raises(torch.OutOfMemoryError):
        k(2)
    assert k(1) == "compiled" and calls == [2, 1]


def test_fused_kernels_fall_back_to_eager_without_a_compiler(tmp_path):
    """A failed build logs one line and gives the eager result (fp32)."""
    _fallback_result(FALLBACK, tmp_path, rel=1e-6)
