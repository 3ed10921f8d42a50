"""scripts/make_kimi_target.py: the scaled config keeps the real Kimi-K2.5 layout, and the
kimi-format tokenizer puts Kimi's special tokens at Kimi's ids over DeepSeek-V3's BPE.

The full build and its vLLM serving are rehearsed by hand (see the script's docstring); these
checks need no model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    path = ROOT / "scripts" / "make_kimi_target.py"
    spec = importlib.util.spec_from_file_location("make_kimi_target", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KIMI_IDS = {
    "vocab_size": 163840,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "media_placeholder_token_id": 163605,
}
DROPPED = {"quantization_config", "auto_map"}
MLA = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def test_tiny_config_keeps_the_real_layout():
    m = _script()
    real = json.loads((m.FIXTURE / "config.json").read_text())
    cfg, changes = m.tiny_config(real, KIMI_IDS, 6, 256)
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k25" and cfg["text_config"]["model_type"] == "kimi_k2"
    for part in ("", "text_config", "vision_config"):
        src = real[part] if part else real
        dst = cfg[part] if part else cfg
        assert set(src) - set(dst) <= DROPPED, part
    t = cfg["text_config"]
    assert (t["num_hidden_layers"], t["hidden_size"], t["vocab_size"]) == (6, 256, 163840)
    assert (t["n_routed_experts"], t["n_shared_experts"], t["first_k_dense_replace"]) == (8, 1, 1)
    assert all(t[k] == real["text_config"][k] for k in MLA)  # vLLM's MLA needs the real dims
    assert t["topk_method"] == "noaux_tc" and t["rope_scaling"]["type"] == "yarn"
    v = cfg["vision_config"]
    assert v["hidden_size"] == v["vt_hidden_size"] == cfg["projection_hidden_size"] == 64
    assert any(c.startswith("quantization_config: dropped") for c in changes)
    assert not any("kv_lora_rank" in c for c in changes)


def test_kimi_format_tokenizer(tokenizer_dirs):
    from tokenizers import Tokenizer

    m = _script()
    dsv3_path = tokenizer_dirs["deepseek_v3"] / "tokenizer.json"
    dsv3 = json.loads(dsv3_path.read_text())
    tok = Tokenizer.from_str(json.dumps(m.kimi_format_tokenizer_json(dsv3)))
    assert tok.get_vocab_size() == 163840
    for i, (content, _) in m.KIMI_SPECIALS.items():
        assert tok.token_to_id(content) == i
    text = "You are helpful. What is the capital of France?"
    plain = tok.encode(text, add_special_tokens=False).ids
    assert plain == Tokenizer.from_file(str(dsv3_path)).encode(text, add_special_tokens=False).ids
    assert tok.decode(plain) == text


def test_kimi_format_chat_template(tokenizer_dirs):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    m = _script()
    dsv3 = json.loads((tokenizer_dirs["deepseek_v3"] / "tokenizer.json").read_text())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(m.kimi_format_tokenizer_json(dsv3))),
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
    )
    tok.chat_template = (m.FIXTURE / "chat_template.jinja").read_text()
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello.<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert tok.apply_chat_template(msgs[:3], tokenize=False, thinking=False).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello.<|im_end|>"
    )
    last = tok.apply_chat_template(msgs[1:3], tokenize=False)
    assert last.endswith("<think></think>Hello.<|im_end|>")  # reasoning dropped: history turn
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 163594 and ids[-1] == 163606 and ids.count(m.IM_END) == 4
