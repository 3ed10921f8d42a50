"""Offline acceptance: a greedy chain of k draft tokens checked against the teacher's argmax.

Responsibility: `simulated_tau`, the validation metric of every epoch and the bench's
"offline τ": how many of k drafted tokens a greedy (temperature 0) target would accept, on
held-out samples, without a server.

Method. At every anchor position p (a trainable position of a sample), the draft runs k
steps as it does when served (speculators' TTT forward: step j sees its own hidden state from
step j-1). Step j's draft token (mapped to a target id with d2t) is accepted when
- it equals the teacher's argmax over the FULL target vocab at p+j (a draft vocab that lacks
  the target's choice can never match it), and
- for j >= 1, the token the forward fed at step j (the sample's own token) is the teacher's
  argmax at p+j-1: only then is the teacher's next argmax, computed on the sample's prefix,
  the one a greedy target would compute after accepting the previous draft token;
- p+j is still a trainable position of the same sample.
The accepted length of an anchor is the leading run of accepted steps (shared/conventions.py
§7), and τ = 1 + mean accepted length. On data the target generated greedily this is exact;
on other data the second condition makes it a lower bound.

Invariants: runs under `torch.no_grad` in eval mode and restores the model's mode; the
teacher logits are `lm_head(final_norm(h_pre))` (shared/conventions.py §2) with the target's full
lm_head, which `teacher_head` loads once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.train.draft_model import length_multiple
from services.train.packing import collate
from services.train.samples import AlignedSample
from shared.errors import ArtifactError

if TYPE_CHECKING:
    import torch


def teacher_head(model: Any) -> torch.Tensor:
    """The target's full lm_head weight `[target_vocab, H]` (fp32, CPU).

    Read from the verifier named in the draft's speculators config; a target with tied
    embeddings (no `lm_head.weight`) uses its embedding matrix, which the draft already holds.
    """
    from speculators.utils.loading import load_model_layers

    path = model.config.speculators_config.verifier.name_or_path
    if _tied(path):
        return model.embed_tokens.weight.detach().float().cpu()
    try:
        found = load_model_layers(["lm_head.weight"], path)
    except ValueError as e:
        raise ArtifactError(f"{path}: no lm_head.weight and embeddings are not tied ({e})") from e
    return found["lm_head.weight"].detach().float().cpu()


def _tied(path: str) -> bool:
    """Whether the target's config.json ties lm_head to the embeddings (HF default: True)."""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("tie_word_embeddings", True))


def simulated_tau(
    model: Any,
    samples: Iterable[AlignedSample],
    k: int,
    lm_head: torch.Tensor | None = None,
    autocast_dtype: str | None = None,
    pad_to: int | None = None,
) -> dict[str, Any]:
    """Simulated mean acceptance length of a greedy chain of `k` draft tokens.

    Args:
        model: a speculators `Eagle3DraftModel` (unwrapped), on its training device.
        samples: held-out samples, run (and may be loaded) one at a time.
        k: draft tokens per step (vLLM's `num_speculative_tokens`).
        lm_head: the target's full lm_head `[target_vocab, H]`; default `teacher_head(model)`.
        autocast_dtype: 'bf16' to run under bf16 autocast, None for fp32.
        pad_to: each sample's length multiple (`collate`'s `multiple`); default the draft's
            attention block (`length_multiple`). The trainer passes its batch length, so
            held-out samples reuse the training step's compiled shape.

    Returns:
        `{"tau": float, "k": int, "anchors": int, "accepted": int,
          "accept_rate_per_pos": [k floats: share of anchors with >= j+1 accepted],
          "draft_acceptance_rate": accepted / (anchors * k),
          "teacher_in_draft_vocab": share of anchors whose teacher argmax is in the draft
          vocab}`; tau is 1.0 with anchors 0 when no sample has a trainable position.
    """
    import torch

    device = next(model.parameters()).device
    multiple = pad_to or length_multiple(model)
    head = (lm_head if lm_head is not None else teacher_head(model)).to(device)
    counts = torch.zeros(k, dtype=torch.long)
    anchors = in_vocab = 0
    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_dtype == "bf16"),
        ):
            for sample in samples:
                _, chain, teacher_ok = _chain(model, head, sample, k, device, multiple)
                counts += chain.sum(dim=0).cpu()
                anchors += chain.shape[0]
                in_vocab += int(teacher_ok)
    finally:
        model.train(was_training)
    accepted = int(counts.sum())
    return {
        "tau": 1.0 + accepted / anchors if anchors else 1.0,
        "k": k,
        "anchors": anchors,
        "accepted": accepted,
        "accept_rate_per_pos": [c / anchors if anchors else 0.0 for c in counts.tolist()],
        "draft_acceptance_rate": accepted / (anchors * k) if anchors else 0.0,
        "teacher_in_draft_vocab": in_vocab / anchors if anchors else 0.0,
    }


def accepted_lengths(
    model: Any, sample: AlignedSample, k: int, lm_head: torch.Tensor | None = None
) -> torch.Tensor:
    """Per position of `sample`, the draft tokens a greedy target accepts at that anchor.

    The same chain as `simulated_tau` (no autocast: in the model's dtype), kept per
    position, for replaying a served answer step by step (`shared.conventions.replay_steps`).

    Args:
        model: a speculators `Eagle3DraftModel` (unwrapped).
        sample: one aligned sample; its anchors are its loss-mask positions.
        k: draft tokens per step.
        lm_head: the target's full lm_head; default `teacher_head(model)`.

    Returns:
        int64 `[n]` (n = the sample's positions), 0..k at anchors, 0 elsewhere.
    """
    import torch

    device = next(model.parameters()).device
    head = (lm_head if lm_head is not None else teacher_head(model)).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            anchors, chain, _ = _chain(model, head, sample, k, device, length_multiple(model))
    finally:
        model.train(was_training)
    out = torch.zeros(len(sample.input_ids), dtype=torch.long)
    out[anchors.cpu()] = chain.sum(dim=1).cpu()
    return out


def _chain(
    model: Any,
    head: torch.Tensor,
    sample: AlignedSample,
    k: int,
    device: torch.device,
    multiple: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per anchor, which of the k steps lie in its accepted prefix.

    The sample is padded to a length multiple of `multiple` (masked, so no anchor).

    Returns:
        (int64 `[anchors]` anchor positions, bool `[anchors, k]`, number of anchors whose
        teacher argmax is in the draft vocab).
    """
    import torch

    # Stored states are bf16; the draft's weights are fp32 (autocast, when on, casts down).
    dtype = next(model.parameters()).dtype
    batch = {
        key: v.to(device, dtype) if v.is_floating_point() else v.to(device)
        for key, v in collate([sample], len(sample.input_ids), multiple).items()
    }
    ids = batch["input_ids"][0]  # shape: [n], x_{t+1}
    n = ids.shape[0]
    drafts = model(
        hidden_states=batch["hidden_states"],
        input_ids=batch["input_ids"],
        document_ids=batch["document_ids"],
        position_ids=batch["position_ids"],
        ttt_steps=k,
    )  # k tensors [1, n] of draft ids
    final = model.verifier_norm(batch["verifier_last_hidden_states"][0].to(head.dtype))
    teacher = (final @ head.T).argmax(dim=-1)  # shape: [n], target ids
    mask = batch["loss_mask"][0]
    anchors = torch.nonzero(mask).squeeze(1)  # shape: [a]
    steps = []
    alive = torch.ones_like(anchors, dtype=torch.bool)
    for j in range(k):
        pos = anchors + j
        inside = pos < n
        pos_c = pos.clamp(max=n - 1)
        draft_ids = drafts[j][0][anchors]
        pred = draft_ids + model.d2t[draft_ids] if model.d2t is not None else draft_ids
        ok = inside & mask[pos_c] & (pred == teacher[pos_c])
        if j > 0:
            ok &= ids[pos_c] == teacher[(pos_c - 1).clamp(min=0)]
        alive = alive & ok
        steps.append(alive.clone())
    t2d = model.t2d
    in_vocab = int(t2d[teacher[anchors]].sum()) if t2d is not None else len(anchors)
    return anchors, torch.stack(steps, dim=1), in_vocab
