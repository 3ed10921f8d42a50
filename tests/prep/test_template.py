"""Loss masks on real tokenizers with real chat templates.

Expected values come from SpecForge's golden files (Qwen3) or are written by hand from the
template text: the expected ids are the concatenation of the tokenizer run on each literal
piece (header, assistant content, end-of-turn), never the output of the code under test.
"""

from __future__ import annotations

import json
import os

import pytest

from services.prep.formats import RowRejected, adapt_openai
from services.prep.template import (
    QUIRKS,
    TemplateQuirk,
    assistant_mask,
    get_quirk,
    register_quirk,
    turn_end,
)
from shared.chat import render_ids
from shared.errors import ConfigError
from shared.tokenizer import TokenizerSpec, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOLDEN = __import__("pathlib").Path(__file__).parents[1] / "fixtures/samples/specforge_golden"
CONV = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "A2"},
]


@pytest.fixture(scope="module")
def toks(smollm2_path, tokenizer_dirs):
    paths = {"smollm2": smollm2_path, **tokenizer_dirs}
    return {k: load_tokenizer(TokenizerSpec(str(v))) for k, v in paths.items()}


@pytest.fixture(scope="module")
def raw_files(smollm2_path, tokenizer_dirs):
    """The models' own tokenizer.json files, through `tokenizers` alone (not the loader)."""
    from tokenizers import Tokenizer

    paths = {"smollm2": smollm2_path, **tokenizer_dirs}
    return {k: Tokenizer.from_file(str(v / "tokenizer.json")) for k, v in paths.items()}


def _pieces(raw, pieces):
    """Expected (ids, mask) from literal (text, trainable) pieces, each tokenized alone by
    the raw tokenizer.json (so a loader that changes the ids cannot agree with itself)."""
    ids, mask = [], []
    for text, trainable in pieces:
        piece = raw.encode(text, add_special_tokens=False).ids
        ids += piece
        mask += [int(trainable)] * len(piece)
    return ids, mask


SMOL_SYS = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n"
)


@pytest.mark.parametrize(
    "name,pieces",
    [
        (
            "smollm2",
            [
                (SMOL_SYS + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
                ("Hello there<|im_end|>", 1),
                ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", 0),
                ("A2<|im_end|>", 1),
                ("\n", 0),  # ChatML newline after <|im_end|>: never sampled, mask 0
            ],
        ),
        (
            "llama3_1",
            [
                (
                    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n",
                    0,
                ),
                ("Hello there<|eot_id|>", 1),
                (
                    "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n",
                    0,
                ),
                ("A2<|eot_id|>", 1),
            ],
        ),
        (
            "deepseek_v3",
            [
                ("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>", 0),
                ("Hello there<｜end▁of▁sentence｜>", 1),
                ("<｜User｜>Q2<｜Assistant｜>", 0),
                ("A2<｜end▁of▁sentence｜>", 1),
            ],
        ),
    ],
)
def test_mask_written_from_template_text(toks, raw_files, name, pieces):
    ids, mask = assistant_mask(toks[name], CONV, {})
    exp_ids, exp_mask = _pieces(raw_files[name], pieces)
    assert ids == exp_ids
    assert mask == exp_mask


def test_no_double_bos(toks):
    tok = toks["llama3_1"]
    ids = render_ids(tok, CONV, {}, add_generation_prompt=False)
    assert ids.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == 1
    assert ids[0] == 128000


@pytest.mark.parametrize(
    "ref",
    [
        "qwen3-instruct_standard_ref.json",
        "qwen3-instruct_tool-use_ref.json",
        "qwen3-thinking_reasoning-multi-turn_ref.json",
    ],
)
def test_qwen3_matches_specforge_golden(toks, ref):
    """Every position matches SpecForge's golden mask except the newline after each
    <|im_end|> in an assistant turn: SpecForge marks it 1, Eyrie 0 (convention §4)."""
    inputs = json.loads((GOLDEN / "inputs.json").read_text())
    meta = inputs["references"][ref]
    template = inputs["templates"][meta["template"]]
    msgs = inputs["message_sets"][meta["messages_set"]][0]
    system = {"role": "system", "content": template["system_prompt"]}
    conv = adapt_openai({"messages": [system, *msgs]}).messages
    kwargs = {"enable_thinking": True} if template.get("enable_thinking") else {}
    ids, mask = assistant_mask(toks["qwen3"], conv, kwargs)
    gold = json.loads((GOLDEN / ref).read_text())
    assert ids == gold["input_ids"]
    im_end, newline = 151645, 198
    skip = {i for i in range(1, len(ids)) if ids[i] == newline and ids[i - 1] == im_end}
    skipped_gold = [gold["loss_mask"][i] for i in sorted(skip)]
    assert 1 in skipped_gold  # the differing positions really are there
    assert all(mask[i] == 0 for i in skip)
    assert [m for i, m in enumerate(mask) if i not in skip] == [
        m for i, m in enumerate(gold["loss_mask"]) if i not in skip
    ]


def test_qwen3_enable_thinking_false_masks_injected_block(toks, raw_files):
    tok = toks["qwen3"]
    ids, mask = assistant_mask(tok, CONV, {"enable_thinking": False})
    exp_ids, exp_mask = _pieces(
        raw_files["qwen3"],
        [
            ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello there<|im_end|>", 1),
            ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\n\n</think>\n\n", 0),  # injected by the template, not sampled
            ("A2<|im_end|>", 1),
            ("\n", 0),
        ],
    )
    assert (ids, mask) == (exp_ids, exp_mask)


def test_turn_end_found_per_template(toks):
    assert turn_end(toks["smollm2"], {}).text == "<|im_end|>"
    assert turn_end(toks["smollm2"], {}).token_id == 2
    assert turn_end(toks["llama3_1"], {}).text == "<|eot_id|>"
    assert turn_end(toks["deepseek_v3"], {}).text == "<｜end▁of▁sentence｜>"


def test_all_zero_or_all_one_mask_is_rejected(toks):
    with pytest.raises(RowRejected) as e:
        assistant_mask(toks["smollm2"], [{"role": "user", "content": "only a user"}], {})
    assert e.value.reason == "no_trainable_token"


def test_quirk_registry():
    assert get_quirk("empty-think-block").injected == ("<think>\n\n</think>\n\n",)
    with pytest.raises(ConfigError, match="registered twice"):
        register_quirk(TemplateQuirk("empty-think-block", "dup", lambda t: False))
    with pytest.raises(ConfigError, match="known: empty-think-block"):
        get_quirk("nope")
    assert len(QUIRKS) == 1


def test_turn_closed_by_another_token_is_rejected_not_swallowed(toks):
    """A template that closes a tool-call turn with a different token (as Llama-3.1 does with
    <|eom_id|>) must not let the mask run on into the next turns."""
    tok = toks["smollm2"]
    original = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{% if m['role'] == 'assistant' and m['content'].startswith('CALL') %}{{ '<|endoftext|>' }}"
        "{% else %}{{ '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    try:
        conv = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "CALL f()"},
            {"role": "user", "content": "r"},
            {"role": "assistant", "content": "done"},
        ]
        with pytest.raises(RowRejected) as e:
            # distinct kwargs: turn_end() caches per (tokenizer, kwargs)
            assistant_mask(tok, conv, {"probe": 1})
        assert e.value.reason == "no_end_of_turn" and e.value.field == "messages[1]"
    finally:
        tok.chat_template = original
