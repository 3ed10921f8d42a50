"""Deterministic-acceptance model pairs for the benchmark tests (real-inputs.md).

- `untied_zero_head_target`: a copy of SmolLM2 with its embeddings untied and `lm_head`
  zeroed. Every logit is 0, so greedy decoding always picks token 0.
- the matching draft is `shared.draft.random_llama_draft(...,
  zero_lm_head=True)` with token 0 in its vocab (`d2t[0] == 0`): its logits are all 0 too,
  so it always proposes target token 0 and every draft token is accepted (τ == k + 1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def untied_zero_head_target(smollm2: Path, out: Path) -> Path:
    """Copy SmolLM2 to `out` with `tie_word_embeddings: false` and an all-zero lm_head."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, out / name)
    cfg = json.loads((smollm2 / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = load_file(smollm2 / "model.safetensors")
    # Untie first: zeroing a tied head would zero the embeddings too (real-inputs.md).
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
