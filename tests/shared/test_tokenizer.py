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


@pytest.mark.parametrize("name", ["deepseek_v3", "llama3_1", "qwen3"])
def test_ids_equal_the_tokenizer_file(tokenizer_dirs, name):
    """The loaded tokenizer's ids are those of `tokenizers.Tokenizer.from_file` on the
    model's own tokenizer.json, and decode back to the text (DeepSeek-V3 failed both: its
    declared LlamaTokenizerFast got a Metaspace pre-tokenizer, 'a b' -> [425] -> 'ab')."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_dirs[name] / "tokenizer.json"))
    tok = load_tokenizer(TokenizerSpec(str(tokenizer_dirs[name])))
    for text in ("a b", "  two  spaces", "café 12345", "中文测试，你好世界", "x\n\ty"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    if name == "deepseek_v3":
        # Byte-level BPE ids from the file: 'a' 67, ' b' 291.
        assert tok("a b", add_special_tokens=False)["input_ids"] == [67, 291]


def test_round_trip_problem_names_the_metaspace_cause(tokenizer_dirs):
    """What transformers' own class does to DeepSeek-V3's file, named by the check."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from shared.tokenizer import round_trip_problem

    d = tokenizer_dirs["deepseek_v3"]
    auto = AutoTokenizer.from_pretrained(str(d))
    problem = round_trip_problem(auto, Tokenizer.from_file(str(d / "tokenizer.json")))
    assert problem is not None
    assert "'a b' as [425], the tokenizer.json as [67, 291]" in problem
    assert "pre-tokenizer Metaspace vs Sequence, decoder Sequence vs ByteLevel" in problem


def test_tokenizer_that_cannot_round_trip_is_refused(tmp_path, tokenizer_dirs):
    """A tokenizer.json with a lowercasing normalizer: the file and the loaded tokenizer
    agree, but 'a b'-style probes with capitals do not decode back: refused, naming why."""
    src = tokenizer_dirs["llama3_1"]
    data = json.loads((src / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(src / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with pytest.raises(ConfigError, match=r"not the model's: .* decodes its ids of .* to"):
        load_tokenizer(TokenizerSpec(str(tmp_path)))


@pytest.mark.slow
def test_ids_equal_the_serving_engines(tmp_path, tokenizer_dirs):
    """vLLM's own tokenizer loader (which special-cases `model_type: deepseek_v3`) and Eyrie's
    give the same ids on every probe for a DeepSeek-V3 model folder."""
    from vllm.tokenizers import get_tokenizer

    from shared.tokenizer import PROBES

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dirs["deepseek_v3"] / name, tmp_path / name)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
    )
    engine = get_tokenizer(str(tmp_path))
    ours = load_tokenizer(TokenizerSpec(str(tmp_path)))
    for text in PROBES:
        assert ours(text, add_special_tokens=False)["input_ids"] == engine.encode(
            text, add_special_tokens=False
        )
