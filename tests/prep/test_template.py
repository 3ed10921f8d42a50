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
    <|im_end|> in an assistant turn: SpecForge marks it 1, Eyrie 0 (convention §4); and an
    earlier turn whose reasoning the template drops once a later turn exists: SpecForge
    trains it as header -> answer, which the target never generated; Eyrie masks it here (and
    trains it from its own prefix, `test_rewritten_turn_trained_from_its_prefix`)."""
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
    dropped = [
        m["content"] + "<|im_end|>"
        for k, m in enumerate(conv)
        if m.get("reasoning_content") and any(x["role"] == "user" for x in conv[k + 1 :])
    ]
    rewritten = [i for i in range(len(ids)) if gold["loss_mask"][i] and not mask[i]]
    rewritten = [i for i in rewritten if i not in skip]
    assert toks["qwen3"].decode([ids[i] for i in rewritten]) == "".join(dropped)
    skip |= set(rewritten)
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


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}])
def test_rewritten_turn_trained_from_its_prefix(toks, raw_files, kwargs):
    """Qwen3 drops turn 1's reasoning once turn 2 exists. The whole conversation masks
    turn 1; the prefix ending with turn 1 trains it with the reasoning the target wrote."""
    from services.prep.template import prefix_turn, render_turns, tokenize_rendered

    tok = toks["qwen3"]
    conv = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Add three and three."},
    ]
    whole = render_turns(tok, conv, kwargs)
    assert whole.rewritten == [1] and [t.message for t in whole.turns] == [3]
    ((ids, mask, problem),) = tokenize_rendered(tok, [prefix_turn(tok, conv, 1, kwargs)])
    exp_ids, exp_mask = _pieces(
        raw_files["qwen3"],
        [
            ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\nAdd two and two.\n</think>\n\n4<|im_end|>", 1),
            ("\n", 0),
        ],
    )
    assert (ids, mask, problem) == (exp_ids, exp_mask, None)


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


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER_ROW = {
    "messages": [
        {"role": "user", "content": "What's the weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 3}'},
        {"role": "assistant", "content": "It is 3 °C in Oslo."},
    ],
    "tools": WEATHER_TOOLS,
}


@pytest.mark.parametrize("name", ["smollm2", "llama3_1", "deepseek_v3"])
def test_tool_call_a_template_cannot_render_is_rejected(toks, name):
    """SmolLM2's and the shipped Llama-3.1 template print no tool calls (the call turn was
    trained as a lone end-of-turn); DeepSeek-V3's prints them only for null content and
    concatenates the arguments as text, so it raises on the decoded arguments vLLM passes."""
    from services.prep.formats import normalize

    a = normalize(adapt_openai(WEATHER_ROW), 10**6)
    assert a.messages[1]["content"] is None  # kept as the source had it
    with pytest.raises(RowRejected) as e:
        assistant_mask(toks[name], a.messages, {}, a.tools)
    assert e.value.reason == "template_cannot_render_tool_calls"
    assert e.value.field == "messages[1].tool_calls"


def test_tool_call_rendered_by_qwen3_is_trained(toks, raw_files):
    """Qwen3 raises on null content ('</think>' in None), renders the call with "": the
    call turn is trained as <tool_call> JSON, counted as normalized."""
    from services.prep.formats import normalize
    from services.prep.template import render_turns

    a = normalize(adapt_openai(WEATHER_ROW), 10**6)
    r = render_turns(toks["qwen3"], a.messages, {}, a.tools)
    assert r.normalized == "tool_call_content_null_as_empty"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert [r.text[x:y] for x, y in r.spans] == [
        call + "<|im_end|>",
        "It is 3 °C in Oslo.<|im_end|>",
    ]
    ids, mask = assistant_mask(toks["qwen3"], a.messages, {}, a.tools)
    trained = raw_files["qwen3"].decode([i for i, m in zip(ids, mask, strict=True) if m], False)
    assert trained == call + "<|im_end|>It is 3 °C in Oslo.<|im_end|>"


def test_null_content_kept_where_the_template_tells_it_from_empty(toks):
    """A template (DeepSeek-V3's rule, with tojson arguments) that renders calls only when
    content is null: the source's null is kept and the call is trained. The same row with ""
    (what normalizing null gave before) renders without the call; it is rendered with null
    instead, and counted, never trained as an empty turn."""
    from services.prep.formats import normalize
    from services.prep.template import render_turns

    tok = toks["smollm2"]
    original = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and m['content'] is none %}"
        "{% for c in m['tool_calls'] %}{{ 'CALL ' + c['function']['name'] + ' ' "
        "+ c['function']['arguments'] | tojson }}{% endfor %}"
        "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    try:
        a = normalize(adapt_openai(WEATHER_ROW), 10**6)
        r = render_turns(tok, a.messages, {"probe": 2}, a.tools)
        assert r.normalized == ""
        assert r.text[slice(*r.spans[0])] == 'CALL get_weather {"city": "Oslo"}<|im_end|>'
        a.messages[1]["content"] = ""
        r2 = render_turns(tok, a.messages, {"probe": 2}, a.tools)
        assert r2.normalized == "tool_call_content_empty_as_null" and r2.text == r.text
    finally:
        tok.chat_template = original


REASONING_CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime above 10."},
    {"role": "assistant", "content": "11 is prime.", "reasoning_content": "Check 11: no divisor."},
]


@pytest.mark.parametrize("name", ["smollm2", "llama3_1", "qwen3", "deepseek_v3"])
def test_template_round_trip_on_every_tokenizer(toks, name):
    """Each turn's trained tokens decode to show its content (and its reasoning where the
    template writes it: Qwen3 only); a span moved past the content is caught."""
    from dataclasses import replace

    from services.prep.template import render_turns, tokenize_rendered

    tok = toks[name]
    for conv in (CONV, REASONING_CONV):
        r = render_turns(tok, conv, {})
        ((ids, _, problem),) = tokenize_rendered(tok, [r])
        assert problem is None
        kinds = {k for t in r.turns for k, _ in t.expect}
        assert kinds == (
            {"content", "reasoning"} if conv is REASONING_CONV and name == "qwen3" else {"content"}
        )
        # A mask that starts after the answer's first characters fails the round trip.
        last = r.turns[-1]
        a, b = last.span
        content = conv[-1]["content"]
        shifted = replace(last, span=(r.text.index(content, a) + 3, b))
        broken = replace(r, turns=[*r.turns[:-1], shifted])
        ((_, _, problem),) = tokenize_rendered(tok, [broken])
        assert problem == "round_trip_content_missing"


@pytest.mark.parametrize("policy", ["prefix", "mask"])
def test_rewritten_turn_policy_in_tokenize(toks, policy):
    """prep.rewritten_turns: 'prefix' adds the sample `<id>#0` for Qwen3's rewritten first
    turn, 'mask' only masks it; either way it is counted."""
    from collections import Counter

    from services.prep.tokenize import from_conversations
    from shared.records import Conversation

    conv = Conversation.model_validate(
        {
            "id": "q:0",
            "source": "q",
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6", "reasoning_content": "Add three."},
            ],
        }
    )
    counts: Counter = Counter()
    out = from_conversations(toks["qwen3"], [conv], {}, 4096, counts, policy)
    tok = toks["qwen3"]
    trained = [
        tok.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]) for s in out
    ]
    if policy == "prefix":
        assert [s.id for s in out] == ["q:0", "q:0#0"]
        assert [s.conversation_id for s in out] == ["q:0", "q:0"]
        assert trained == [
            "<think>\nAdd three.\n</think>\n\n6<|im_end|>",
            "<think>\nAdd two and two.\n</think>\n\n4<|im_end|>",
        ]
        assert counts == {"rewritten_turn_prefix_sample": 1}
    else:
        assert [s.id for s in out] == ["q:0"]
        assert trained == ["<think>\nAdd three.\n</think>\n\n6<|im_end|>"]
        assert counts == {"rewritten_turn_masked": 1}


def test_qwen3_multi_step_tool_use_trains_every_reasoning_once(toks):
    """LLaMA-Factory's reason_tool_use demo (50 rows of reasoning + tool-call steps) on
    Qwen3: 16 rows were dropped as `template_prefix_mismatch` (a later user turn makes the
    template drop the reasoning of earlier steps). Now no row is dropped, and every assistant
    step's reasoning is trained in exactly one sample, with its own tool calls."""
    from collections import Counter

    from services.prep.formats import normalize
    from services.prep.tokenize import from_conversations
    from shared.records import Conversation

    path = GOLDEN.parent / "reason_tool_use_demo_50.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    convs = []
    for i, r in enumerate(rows):
        a = normalize(adapt_openai(r), 200_000)
        convs.append(
            Conversation.model_validate(
                {"id": f"r:{i}", "source": "r", "messages": a.messages, "tools": a.tools}
            )
        )
    tok = toks["qwen3"]
    counts: Counter = Counter()
    out = from_conversations(tok, convs, {}, 16384, counts)
    assert not [k for k in counts if k.startswith("dropped:")]
    trained: dict[str, list[str]] = {}
    for s in out:
        text = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
        trained.setdefault(s.conversation_id, []).append(text)
    steps = 0
    for c in convs:
        for m in c.messages:
            if m.role == "assistant" and m.reasoning_content:
                steps += 1
                hits = [t for t in trained[c.id] if m.reasoning_content.strip() in t]
                assert len(hits) == 1, (c.id, m.reasoning_content[:60])
                for call in m.tool_calls or ():
                    assert call.function.name in hits[0]
    assert steps == 112  # reasoning parts in the file (tests/fixtures/samples/SOURCES.md)
    assert counts["rewritten_turn_prefix_sample"] == len(out) - len(convs) > 0
