"""The one tokenizer loader: which folder a recipe's tokenizer comes from, and its refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from shared.errors import ConfigError
from shared.recipe import resolve_recipe
from shared.tokenizer import TokenizerSpec, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _recipe(path, **target):
    return resolve_recipe(
        {"name": "t", "target": {"path": str(path), **target}, "datasets": [{"path": "/d"}]}
    )


def test_target_tokenizer_overrides_the_model_folder(smollm2_path, tokenizer_dirs):
    # Vocabulary sizes from the tokenizer files themselves: SmolLM2 49,152; Llama-3.1 128,256.
    smol = load_tokenizer(_recipe(smollm2_path))
    llama = load_tokenizer(_recipe(smollm2_path, tokenizer=str(tokenizer_dirs["llama3_1"])))
    assert len(smol) == 49152 and len(llama) == 128256
    assert load_tokenizer(TokenizerSpec(str(smollm2_path))) is smol  # cached per process


def test_tokenizer_without_chat_template_is_refused(tmp_path, tokenizer_dirs):
    src = tokenizer_dirs["llama3_1"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"target\.tokenizer: .* has no chat_template"):
        load_tokenizer(TokenizerSpec(str(tmp_path)))


def test_unloadable_tokenizer_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"target\.tokenizer: cannot load a tokenizer"):
        load_tokenizer(TokenizerSpec(str(tmp_path)))
