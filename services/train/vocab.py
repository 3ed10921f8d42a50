"""The vocab stage: loss-masked token counts → the draft vocabulary (d2t / t2d) + coverage.

Responsibility: `run_vocab(store, recipe, shard)` (the conductor's stage function) reads every
`tokenize/shard-N/`, counts the target ids under `loss_mask == 1`, selects the draft vocab and
writes `vocab/{token_freq.npy, token_freq.pt, d2t.npy, t2d.npy, coverage.json}`
(`shared/artifacts.py`). `teacher_argmax_coverage` adds, once hidden states exist, the share of
the teacher's argmax tokens that the draft vocab can express.

Invariants: the selection, the d2t/t2d construction and the checks are
`shared.conventions` (§3 of eagle3-conventions.md): top `draft_vocab_size` by count, ties by
lower id, padded with the lowest unused ids, ascending; d2t holds offsets. Nothing here
re-implements them. Only loss-masked tokens are counted: the draft predicts assistant tokens.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from shared.conventions import (
    build_d2t_t2d,
    check_d2t_t2d,
    coverage,
    select_draft_vocab,
    shift_mask_left,
)
from shared.errors import ArtifactError
from shared.recipe import Recipe
from shared.store import Manifest, RunStore, atomic_path, atomic_write_bytes, atomic_write_json
from shared.target import target_config

log = logging.getLogger("eyrie.vocab")

STAGE = "vocab"
#: How many of the most frequent left-out tokens the coverage report lists.
TOP_LEFT_OUT = 20
_SHARD_DIR = re.compile(r"^shard-\d{5}$")


def tokenized_shards(store: RunStore) -> list[Path]:
    """Every finished `tokenize/shard-N/` folder, in shard order.

    Raises:
        ArtifactError: no tokenized shard, or the run's plan names a shard that is missing.
    """
    root = store.root / "tokenize"
    found = sorted(p for p in root.glob("shard-*") if p.is_dir() and _SHARD_DIR.match(p.name))
    plan = store.root / "plan.json"
    if plan.is_file():
        import json

        expected = int(json.loads(plan.read_text())["num_shards"])
        names = {p.name for p in found}
        missing = [i for i in range(expected) if f"shard-{i:05d}" not in names]
        if missing:
            raise ArtifactError(
                f"{root}: tokenized shards {missing} missing of {expected} in plan.json; run the "
                "tokenize stage for every shard before vocab"
            )
    if not found:
        raise ArtifactError(f"{root}: no tokenized shards; run the tokenize stage first")
    return found


def count_shard(path: Path, target_vocab: int) -> np.ndarray:
    """int64 `[target_vocab]` counts of the ids under `loss_mask == 1` in one shard.

    Raises:
        ArtifactError: a row's ids and mask differ in length, or an id is outside the target
            vocab; the message names the shard, the row and the field.
    """
    from datasets import load_from_disk

    ds = load_from_disk(str(path)).with_format("numpy", columns=["input_ids", "loss_mask"])
    picked: list[np.ndarray] = []
    for row, item in enumerate(ds):
        ids, mask = np.asarray(item["input_ids"]), np.asarray(item["loss_mask"])
        if ids.shape != mask.shape:
            raise ArtifactError(
                f"{path} row {row}: loss_mask has {mask.shape[0]} entries but input_ids has "
                f"{ids.shape[0]}; re-run the tokenize stage"
            )
        sel = ids[mask.astype(bool)].astype(np.int64)
        if sel.size and (sel.min() < 0 or sel.max() >= target_vocab):
            bad = int(sel.max()) if sel.max() >= target_vocab else int(sel.min())
            raise ArtifactError(
                f"{path} row {row} field input_ids: id {bad} is outside the target vocab "
                f"[0, {target_vocab}); the shard was tokenized with another tokenizer"
            )
        picked.append(sel)
    # One bincount per shard: a per-row bincount would allocate a full vocab array per row.
    all_ids = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
    return np.bincount(all_ids, minlength=target_vocab).astype(np.int64)


def count_tokens(store: RunStore, target_vocab: int) -> np.ndarray:
    """Loss-masked token counts over every tokenized shard, int64 `[target_vocab]`."""
    freq = np.zeros(target_vocab, dtype=np.int64)
    for path in tokenized_shards(store):
        freq += count_shard(path, target_vocab)
    return freq


def load_tokenizer(recipe: Recipe) -> Any:
    """The target's tokenizer (`target.tokenizer`, else `target.path`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        recipe.target.tokenizer or recipe.target.path,
        trust_remote_code=recipe.target.trust_remote_code,
        revision=recipe.target.revision,
    )


def coverage_report(
    freq: np.ndarray, t2d: np.ndarray, tokenizer: Any | None, top: int = TOP_LEFT_OUT
) -> dict[str, Any]:
    """The coverage report: the share covered, sizes, and the most frequent left-out tokens.

    Args:
        freq: int64 `[target_vocab]` loss-masked counts.
        t2d: bool `[target_vocab]` draft-vocab mask.
        tokenizer: decodes left-out ids to text; None leaves `text` out.
        top: how many left-out tokens to list.

    Returns:
        `{"coverage", "target_vocab", "draft_vocab", "assistant_tokens", "distinct_seen",
        "left_out_tokens", "left_out_distinct", "top_left_out": [{"id", "text", "count",
        "share"}]}`; shares are fractions of assistant-token occurrences.
    """
    total = int(freq.sum())
    left = np.where(~t2d & (freq > 0))[0]
    order = left[np.lexsort((left, -freq[left]))][:top]
    return {
        "coverage": coverage(freq, t2d),
        "target_vocab": int(freq.shape[0]),
        "draft_vocab": int(t2d.sum()),
        "assistant_tokens": total,
        "distinct_seen": int((freq > 0).sum()),
        "left_out_tokens": int(freq[left].sum()),
        "left_out_distinct": int(left.size),
        "top_left_out": [
            {
                "id": int(i),
                **({"text": tokenizer.decode([int(i)])} if tokenizer is not None else {}),
                "count": int(freq[i]),
                "share": float(freq[i] / total) if total else 0.0,
            }
            for i in order
        ],
    }


def run_vocab(store: RunStore, recipe: Recipe, shard: int) -> Manifest:
    """Stage function: build the draft vocab from every tokenized shard (shard is always 0).

    Raises:
        ArtifactError: a tokenized shard is missing or malformed.
        ConfigError: draft.draft_vocab_size exceeds the target vocab.
        ContractMismatchError: d2t/t2d break an invariant (a bug, never user input).
    """
    import torch

    target_vocab = int(target_config(recipe)["vocab_size"])
    draft_vocab = recipe.draft.draft_vocab_size
    freq = count_tokens(store, target_vocab)
    d2t, t2d = build_d2t_t2d(select_draft_vocab(freq, draft_vocab).tolist(), target_vocab)
    check_d2t_t2d(d2t, t2d, draft_vocab)
    report = coverage_report(freq, t2d, load_tokenizer(recipe))
    log.info(
        "draft vocab %d of %d covers %.4f of %d assistant tokens",
        draft_vocab,
        target_vocab,
        report["coverage"],
        report["assistant_tokens"],
    )

    out = store.stage_dir(STAGE)
    files = [
        _save_npy(out / "token_freq.npy", freq),
        _save_npy(out / "d2t.npy", d2t),
        _save_npy(out / "t2d.npy", t2d),
    ]
    # speculators' offline format: {target id: count} for ids seen (train/vocab_mapping.py).
    with atomic_path(out / "token_freq.pt") as tmp:
        torch.save({int(i): int(freq[i]) for i in np.nonzero(freq)[0]}, tmp)
    files += [out / "token_freq.pt", atomic_write_json(out / "coverage.json", report)]
    counts = {
        "assistant_tokens": report["assistant_tokens"],
        "distinct_seen": report["distinct_seen"],
        "target_vocab": target_vocab,
        "draft_vocab": draft_vocab,
        "covered_tokens": report["assistant_tokens"] - report["left_out_tokens"],
    }
    return store.write_manifest(
        STAGE, shard, counts, files=files, extra={"coverage": report["coverage"]}
    )


def _save_npy(path: Path, arr: np.ndarray) -> Path:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return atomic_write_bytes(path, buf.getvalue())


def teacher_argmax_coverage(store: RunStore, recipe: Recipe, model: Any | None = None) -> dict:
    """Share of the teacher's argmax tokens inside the draft vocab, over extracted states.

    For every written `extract/shard-N/hidden_states/hs_<row>.safetensors`, the teacher
    logits are `lm_head(final_norm(h_pre))` (`services.extract.hf_backend.teacher_logits`);
    positions counted are the trained ones, `shift_mask_left(loss_mask)` (position t
    predicts token t+1). Writes `vocab/teacher_coverage.json`.

    Args:
        model: the loaded target; None loads it per `recipe` (cached per process).

    Returns:
        `{"teacher_argmax_coverage", "positions", "in_draft_vocab"}`.

    Raises:
        ArtifactError: the vocab stage or every extract shard is missing.
    """
    from safetensors.torch import load_file

    from services.extract import hf_backend

    t2d_path = store.root / STAGE / "t2d.npy"
    if not t2d_path.is_file():
        raise ArtifactError(f"{t2d_path}: run the vocab stage first")
    t2d = np.load(t2d_path)
    model = model or hf_backend.load_target(hf_backend.LoadSpec.from_recipe(recipe))
    inside = positions = 0
    for data in sorted((store.root / "extract").glob("shard-*/data")):
        from datasets import load_from_disk

        masks = load_from_disk(str(data)).with_format(None)["loss_mask"]
        for row, mask in enumerate(masks):
            f = data.parent / "hidden_states" / f"hs_{row}.safetensors"
            if not f.is_file():
                continue  # quarantined rows have no states
            h = load_file(f)["hidden_states"][:, -1]
            top = hf_backend.teacher_logits(model, h).argmax(-1).cpu().numpy()
            sel = np.asarray(shift_mask_left(mask), dtype=bool)
            positions += int(sel.sum())
            inside += int(t2d[top[sel]].sum())
    if positions == 0:
        raise ArtifactError(f"{store.root / 'extract'}: no extracted hidden states to score")
    result = {
        "teacher_argmax_coverage": inside / positions,
        "positions": positions,
        "in_draft_vocab": inside,
    }
    atomic_write_json(store.root / STAGE / "teacher_coverage.json", result)
    return result
