"""Real extracted hidden states for trainer tests (and scripts/bench_train.py).

Real ShareGPT V3 conversations, rendered with SmolLM2's real ChatML template and masked by
the prep stage's own rule (`services.prep.template.assistant_mask`), run through the real
SmolLM2 by the extract stage's HF backend (`services.extract.hf_backend.extract_batch`), and
written in the extract/vocab layouts of `shared/artifacts.py`. The draft vocab comes from the
real loss-masked token counts (`shared.conventions.select_draft_vocab`).

This is test data, not the extract stage (services/extract owns that): it writes only what
the trainer reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shared.conventions import build_d2t_t2d, select_draft_vocab
from shared.store import atomic_path

AUX_IDS = [2, 15, 27]


def sharegpt_rows(tok: Any, n: int, max_len: int) -> list[dict[str, Any]]:
    """`n` tokenized ShareGPT conversations (first user turn + answer), <= max_len tokens."""
    from services.prep.formats import RowRejected, adapt_sharegpt
    from services.prep.sharegpt_pkg import iter_sharegpt
    from services.prep.template import assistant_mask

    rows = []
    for rec in iter_sharegpt():
        try:
            msgs = adapt_sharegpt(rec).messages[:2]
            if [m["role"] for m in msgs] != ["user", "assistant"]:
                continue
            ids, mask = assistant_mask(tok, msgs, {})
        except RowRejected:
            continue
        ids, mask = ids[:max_len], mask[:max_len]
        if sum(mask[2:]) < 8:
            continue
        rows.append({"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)})
        if len(rows) == n:
            return rows
    raise RuntimeError(f"ShareGPT ran out after {len(rows)} usable rows")


def write_extract_shard(shard_dir: Path, rows: list[dict[str, Any]], states: list[Any]) -> None:
    """Write `extract/shard-N/` (data/, hidden_states/hs_<row>.safetensors, meta.json)."""
    import torch
    from datasets import Dataset, Features, Sequence, Value
    from safetensors.torch import save_file

    feats = Features(
        {
            "input_ids": Sequence(Value("int32")),
            "loss_mask": Sequence(Value("int8")),
            "seq_len": Value("int32"),
        }
    )
    with atomic_path(shard_dir) as tmp:
        Dataset.from_dict({k: [r[k] for r in rows] for k in feats}, features=feats).save_to_disk(
            str(tmp / "data")
        )
        (tmp / "hidden_states").mkdir()
        for i, (r, hs) in enumerate(zip(rows, states, strict=True)):
            save_file(
                {
                    "hidden_states": hs.contiguous(),
                    "token_ids": torch.tensor(r["input_ids"], dtype=torch.long),
                },
                str(tmp / "hidden_states" / f"hs_{i}.safetensors"),
            )
        (tmp / "meta.json").write_text(
            json.dumps(
                {
                    "aux_layer_ids": AUX_IDS,
                    "final_state": "pre_norm",
                    "hidden_size": 576,
                    "dtype": "bfloat16",
                }
            )
        )


def write_vocab(
    vocab_dir: Path, rows: list[dict[str, Any]], draft_vocab: int, target_vocab: int
) -> None:
    """`vocab/{token_freq,d2t,t2d}.npy` from the rows' loss-masked tokens."""
    freq = np.zeros(target_vocab, dtype=np.int64)
    for r in rows:
        ids = np.asarray(r["input_ids"])[np.asarray(r["loss_mask"], dtype=bool)]
        np.add.at(freq, ids, 1)
    d2t, t2d = build_d2t_t2d(select_draft_vocab(freq, draft_vocab), target_vocab)
    vocab_dir.mkdir(parents=True, exist_ok=True)
    np.save(vocab_dir / "token_freq.npy", freq)
    np.save(vocab_dir / "d2t.npy", d2t)
    np.save(vocab_dir / "t2d.npy", t2d)


def make_extract_data(
    root: Path,
    smollm2_path: Path,
    n: int = 32,
    max_len: int = 96,
    draft_vocab: int = 2048,
    shards: int = 2,
) -> Path:
    """Tokenize, extract and write `n` samples in `shards` shards plus the vocab under root."""
    from services.extract.hf_backend import LoadSpec, extract_batch, load_target
    from services.prep.template import load_tokenizer

    tok = load_tokenizer(str(smollm2_path))
    rows = sharegpt_rows(tok, n, max_len)
    model = load_target(LoadSpec(str(smollm2_path), "bfloat16", "cpu"))
    per = (n + shards - 1) // shards
    for s in range(shards):
        part = rows[s * per : (s + 1) * per]
        states = []
        for i in range(0, len(part), 8):
            states += extract_batch(model, [r["input_ids"] for r in part[i : i + 8]], AUX_IDS)
        write_extract_shard(root / "extract" / f"shard-{s:05d}", part, states)
    write_vocab(root / "vocab", rows, draft_vocab, 49152)
    return root
