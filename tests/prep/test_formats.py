"""Format adapters, role aliases, realignment and counted rejections, on the real sample files.

Expected values are read off the sample files by hand (SOURCES.md gives their record counts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.prep.formats import ADAPTERS, RowRejected, adapt_sharegpt, detect_format, normalize
from services.prep.presets import PRESETS, Preset, get_preset, register
from shared.errors import ConfigError

SAMPLES = Path(__file__).parents[1] / "fixtures" / "samples"


def _norm(adapter, row, max_chars=200_000):
    return normalize(ADAPTERS[adapter](row), max_chars)


def _reason(adapter, row, max_chars=200_000):
    with pytest.raises(RowRejected) as e:
        _norm(adapter, row, max_chars)
    return e.value.reason, e.value.field


def test_alpaca_file_all_rows_adapt():
    rows = json.loads((SAMPLES / "alpaca_en_demo.json").read_text())
    out = [_norm("alpaca", r) for r in rows]
    assert len(out) == 999
    with_input = [r for r in rows if r["input"]]
    assert len(with_input) == 412  # SOURCES.md
    r = with_input[0]
    a = _norm("alpaca", r)
    assert a.messages[0] == {"role": "user", "content": r["instruction"] + "\n\n" + r["input"]}
    assert a.messages[1] == {"role": "assistant", "content": r["output"]}
    empty = next(r for r in rows if not r["input"])
    assert _norm("alpaca", empty).messages[0]["content"] == empty["instruction"]


def test_sharegpt_with_system_field():
    rows = json.loads((SAMPLES / "sharegpt_fastchat_dummy_with_system.json").read_text())
    a = _norm("sharegpt", rows[0])
    assert rows[0]["system"]
    assert a.messages[0] == {"role": "system", "content": rows[0]["system"]}
    assert [m["role"] for m in a.messages[1:3]] == ["user", "assistant"]


def test_glaive_tool_calls_and_observations():
    rows = json.loads((SAMPLES / "glaive_toolcall_en_demo.json").read_text())
    a = _norm("sharegpt_tools", rows[0])
    # rows[0]: human, gpt, human, function_call, observation, gpt, human, gpt (the file)
    assert [m["role"] for m in a.messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    call = a.messages[3]["tool_calls"][0]["function"]
    assert call["name"] == "search_recipes"
    assert json.loads(call["arguments"]) == {"ingredients": ["chicken", "bell peppers", "rice"]}
    assert isinstance(a.tools, list) and a.tools[0]["name"]
    # The tool-use preset reads the full hub set of which this file is LLaMA-Factory's demo.
    adapter = get_preset("glaive-toolcall").adapter
    total_calls = sum(
        len(m.get("tool_calls", [])) for r in rows for m in _norm(adapter, r).messages
    )
    assert total_calls == 211  # SOURCES.md: 211 function_call turns


def test_llamafactory_parts_reasoning_and_tool_calls():
    lines = (SAMPLES / "reason_tool_use_demo_50.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    convs = [_norm("openai", r) for r in rows]
    n_tool = sum(m["role"] == "tool" for c in convs for m in c.messages)
    n_calls = sum(len(m.get("tool_calls", [])) for c in convs for m in c.messages)
    n_reason = sum(
        1 for r in rows for m in r["messages"] for p in m["content"] if p["type"] == "reasoning"
    )
    assert (n_tool, n_calls) == (42, 68)  # SOURCES.md
    assert sum("reasoning_content" in m for c in convs for m in c.messages) == n_reason == 112


def test_openai_toy_file_counts_its_bad_rows():
    rows = [
        json.loads(x) for x in (SAMPLES / "toy_chat_fine_tuning.jsonl").read_text().split("\n") if x
    ]
    assert len(_norm("openai", rows[2]).messages) >= 2  # rec 3: no system message
    assert _reason("openai", rows[3])[0] == "no_user_assistant_pair"  # rec 4: no user
    assert _reason("openai", rows[4], max_chars=10_000)[0] == "turn_too_long"  # banana x2000


def test_openai_text_parts_and_null_content_with_tool_calls():
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "done"},
        ],
        "tools": [],
    }
    a = _norm("openai", row)
    assert a.messages[0]["content"] == "ab"
    assert a.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize(
    "alias,role",
    [
        ("human", "user"),
        ("gpt", "assistant"),
        ("chatgpt", "assistant"),
        ("bing", "assistant"),
        ("bard", "assistant"),
        ("model", "assistant"),
    ],
)
def test_role_aliases(alias, role):
    other = "assistant" if role == "user" else "user"
    first, second = (alias, "gpt") if role == "user" else ("human", alias)
    a = adapt_sharegpt(
        {"conversations": [{"from": first, "value": "x"}, {"from": second, "value": "y"}]}
    )
    assert [m["role"] for m in a.messages] == ([role, other] if role == "user" else [other, role])


@pytest.mark.parametrize(
    "row,reason",
    [
        ({"conversations": []}, "empty_conversation"),
        ({"conversations": [{"from": "system", "value": "s"}]}, "system_only"),
        ({"conversations": [{"from": "human", "value": "q"}]}, "no_user_assistant_pair"),
        (
            {"conversations": [{"from": "narrator", "value": "q"}, {"from": "gpt", "value": "a"}]},
            "unknown_role:narrator",
        ),
        (
            {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]},
            "non_string_content",
        ),
        (
            {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "a"}]},
            "null_content",
        ),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
            "empty_assistant_turn",
        ),
        ({"messages": [{"role": "user", "content": "q"}]}, "format_mismatch"),
        ("just a string", "not_an_object"),
    ],
)
def test_bad_rows_are_rejected_with_a_reason(row, reason):
    assert _reason("sharegpt", row)[0] == reason


def test_unknown_role_is_never_guessed_as_user():
    reason, field = _reason(
        "openai",
        {"messages": [{"role": "Human?", "content": "q"}, {"role": "assistant", "content": "a"}]},
    )
    assert reason.startswith("unknown_role") and field == "messages[0].role"


def test_leading_assistant_turns_are_dropped_and_counted():
    a = _norm(
        "sharegpt",
        {
            "conversations": [
                {"from": "gpt", "value": "continuation"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
                {"from": "human", "value": "dangling"},
            ]
        },
    )
    assert [m["content"] for m in a.messages] == ["q", "a"]
    assert a.realigned == {"leading_non_user_turns_dropped": 1, "trailing_turns_dropped": 1}


def test_100k_character_turn_against_the_limit():
    big = "x" * 100_000
    row = {"conversations": [{"from": "human", "value": big}, {"from": "gpt", "value": "a"}]}
    assert _norm("sharegpt", row, max_chars=200_000).messages[0]["content"] == big
    assert _reason("sharegpt", row, max_chars=50_000) == ("turn_too_long", "messages[0].content")


def test_detect_format():
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"messages": []}) == "openai"
    assert detect_format({"instruction": "i", "input": "", "output": "o"}) == "alpaca"
    assert detect_format([1]) is None


def test_presets_registry():
    assert get_preset("ultrachat").hub_id == "HuggingFaceH4/ultrachat_200k"
    assert get_preset("ultrachat").split == "train_sft"
    assert get_preset("gsm8k").config_name == "main"
    assert {
        "sharegpt",
        "ultrachat",
        "perfectblend",
        "magpie",
        "openhermes",
        "infinity-instruct",
        "codealpaca",
        "gsm8k",
        "math",
        "opencodeinstruct",
        "glaive-toolcall",
        "sharegpt-v3-wheel",
    } == set(PRESETS)
    assert all(p.adapter in ADAPTERS for p in PRESETS.values())
    with pytest.raises(ConfigError, match="registered twice"):
        register(Preset("gsm8k", "x", "train", "gsm8k"))
    with pytest.raises(ConfigError, match="known: codealpaca"):
        get_preset("ultrachat-300k")


def test_qa_presets_adapters():
    assert _norm("gsm8k", {"question": "1+1?", "answer": "2"}).messages[1]["content"] == "2"
    assert _norm("math", {"problem": "p", "solution": "s"}).messages[0]["content"] == "p"
    assert _norm("opencodeinstruct", {"input": "i", "output": "o"}).messages[1]["content"] == "o"


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_read_under_its_aliases(key):
    """vLLM >= 0.10 and OpenRouter name it `reasoning`, Anthropic-style exports `thinking`;
    each becomes reasoning_content (it was dropped silently), an alias is counted, and a key
    no adapter knows is counted per role instead of vanishing unseen."""
    row = {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", key: "Two plus two.", "signature": "x"},
        ]
    }
    a = _norm("openai", row)
    want = {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."}
    assert a.messages[1] == want
    expected = {"unknown_field:assistant.signature": 1}
    if key != "reasoning_content":
        expected[f"reasoning_alias:{key}"] = 1
    assert a.fields == expected


@pytest.mark.parametrize(
    "part,kind",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ],
)
def test_multimodal_row_quarantined_under_its_part_type(part, kind):
    """OpenAI vision/audio rows (parts without text) were quarantined as `null_content`."""
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
            {"role": "assistant", "content": "A cat."},
        ]
    }
    assert _reason("openai", row) == (
        f"unsupported_content_part:{kind}",
        "messages[0].content[1].type",
    )


def test_null_tool_call_content_is_kept_null():
    openai_row = {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "assistant", "content": "done"},
        ]
    }
    b = _norm("openai", openai_row)
    assert b.messages[1]["content"] is None and b.messages[2]["tool_call_id"] == "c1"
