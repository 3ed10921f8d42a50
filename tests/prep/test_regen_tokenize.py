"""Tokenize from regen output: training uses the server's ids, never a re-tokenization.

The "server" prompt ids here come from HF's own `apply_chat_template(tokenize=True)`, and the
expected masks from literal template pieces tokenized one by one.
"""

from __future__ import annotations

import json
import os

from shared.artifacts import RunStore
from shared.recipe import resolve_recipe
from shared.records import RegenRecord
from tests.conftest import run_stage

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOL_SYS = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n"
)
MSGS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "Sure, 42."},
]


def _pieces(tok, pieces):
    ids, mask = [], []
    for text, trainable in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trainable] * len(piece)
    return ids, mask


def test_regen_rows_use_server_ids(tmp_path, data_dir, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"messages": MSGS}) + "\n")
    recipe = resolve_recipe(
        {
            "name": "regen-tok",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": str(src)}],
            "regen": {"enabled": True},
        }
    )
    store = RunStore.create(recipe)
    run_stage(store, "plan")

    server_prompt = list(
        tok.apply_chat_template(
            MSGS[:3], tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    answer = tok("Sure, 42.", add_special_tokens=False)["input_ids"]
    p0 = list(
        tok.apply_chat_template(
            MSGS[:1], tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    hello = tok("Hello there", add_special_tokens=False)["input_ids"] + [2]

    def rec(i, prompt, completion, finish):
        # the first turn as the server produced it: its ids are in the second prompt
        pre = prompt[: len(prompt) - len(server_prompt)]
        first_turn = {
            "prompt_token_ids": pre + p0,
            "completion_token_ids": hello,
            "finish_reason": "stop",
        }
        return RegenRecord.model_validate(
            {
                "row": i,
                "id": f"src:{i}",
                "source": "src",
                "messages": MSGS,
                "tools": None,
                "turns": [
                    first_turn,
                    {
                        "prompt_token_ids": prompt,
                        "completion_token_ids": completion,
                        "finish_reason": finish,
                    },
                ],
                "sampling": {"temperature": 0.7},
                "chat_template_kwargs": {},
                "server": {"model": "smollm2", "url": "http://127.0.0.1:1/v1"},
            }
        )

    rows = [
        rec(0, server_prompt, answer + [2], "stop"),  # server returned <|im_end|>
        rec(1, server_prompt, answer, "stop"),  # stop without the eot id: appended
        rec(2, server_prompt, answer, "length"),  # cut by max_tokens: nothing appended
        rec(3, [7] + server_prompt, answer + [2], "stop"),
    ]  # local render differs
    store.regen.write(0, rows, [])

    run_stage(store, "tokenize")
    ds = store.tokenize.dataset(0)
    exp_prompt_ids, exp_prompt_mask = _pieces(
        tok,
        [
            (SMOL_SYS + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello there<|im_end|>", 1),
            ("\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n", 0),
        ],
    )
    assert exp_prompt_ids == server_prompt
    n = len(answer)
    assert ds[0]["input_ids"] == server_prompt + answer + [2]
    assert ds[0]["loss_mask"] == exp_prompt_mask + [1] * (n + 1)
    assert ds[1]["input_ids"] == server_prompt + answer + [2]
    assert ds[2]["input_ids"] == server_prompt + answer
    assert ds[2]["loss_mask"] == exp_prompt_mask + [1] * n
    assert ds[3]["input_ids"] == [7] + server_prompt + answer + [2]
    assert ds[3]["loss_mask"] == [0] * (len(server_prompt) + 1) + [1] * (n + 1)
    assert ds["conversation_id"] == ds["id"] == [f"src:{i}" for i in range(4)]
    rep = json.loads(store.tokenize.report_path(0).read_text())
    assert rep["eot_appended"] == 1 and rep["prompt_render_mismatch"] == 1
    assert rep["input"] == "regen"


FIXTURES = __import__("pathlib").Path(__file__).parents[1] / "fixtures"


def _rec(msgs, turns, rid="src:0"):
    return RegenRecord.model_validate(
        {
            "row": 0,
            "id": rid,
            "source": "src",
            "messages": msgs,
            "turns": turns,
            "sampling": {"temperature": 0.7},
            "chat_template_kwargs": {},
            "server": {"model": "m", "url": "http://127.0.0.1:1/v1"},
        }
    )


def _server_prompt(raw, tok, msgs):
    """The prompt ids a server renders: the template text, tokenized by the raw file."""
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return raw.encode(text, add_special_tokens=False).ids


def test_stop_ids_from_generation_config_and_tokenizer(tokenizer_dirs):
    from shared.tokenizer import load_tokenizer, stop_ids

    for fixture, tok_name, want in (
        ("llama-3.1", "llama3_1", {128001, 128008, 128009}),
        ("qwen3", "qwen3", {151645, 151643}),
    ):
        recipe = resolve_recipe(
            {
                "name": "stops",
                "target": {
                    "path": str(FIXTURES / fixture),
                    "tokenizer": str(tokenizer_dirs[tok_name]),
                },
                "datasets": [{"path": "/d"}],
            }
        )
        assert stop_ids(recipe, load_tokenizer(recipe)) == want


def test_completion_ending_in_eom_is_kept_and_nothing_appended(tokenizer_dirs):
    """Llama-3.1 stops on <|eom_id|> 128008 after a tool call: that id is trained, and no
    <|eot_id|> 128009 is appended after it (both were trained before)."""
    from collections import Counter

    from tokenizers import Tokenizer

    from services.prep.tokenize import from_regen
    from shared.tokenizer import TokenizerSpec, load_tokenizer

    tok = load_tokenizer(TokenizerSpec(str(tokenizer_dirs["llama3_1"])))
    raw = Tokenizer.from_file(str(tokenizer_dirs["llama3_1"] / "tokenizer.json"))
    msgs = [
        {"role": "user", "content": "What's the weather in Oslo?"},
        {"role": "assistant", "content": "Checking."},
    ]
    prompt = _server_prompt(raw, tok, msgs[:1])
    body = raw.encode("Checking.", add_special_tokens=False).ids
    turn = {"prompt_token_ids": prompt, "completion_token_ids": body + [128008]}
    counts: Counter = Counter()
    stops = frozenset({128001, 128008, 128009})
    (s,) = from_regen(tok, _rec(msgs, [{**turn, "finish_reason": "stop"}]), {}, 4096, counts, stops)
    assert s.input_ids == prompt + body + [128008]
    assert s.loss_mask == [0] * len(prompt) + [1] * (len(body) + 1)
    assert counts == {"stopped_on:128008": 1}


def test_every_regenerated_turn_passes_the_server_round_trip_or_trains_alone(tokenizer_dirs):
    """Turn 0 stopped on <|eom_id|>; the server's turn-1 prompt re-renders it closed by
    <|eot_id|>, so the ids the target sampled are not in the last sample's prompt: turn 0
    becomes its own sample of exactly the server's ids, and the prompt is masked 0."""
    from collections import Counter

    from tokenizers import Tokenizer

    from services.prep.tokenize import from_regen, server_round_trip
    from shared.records import RegenTurn
    from shared.tokenizer import TokenizerSpec, load_tokenizer

    tok = load_tokenizer(TokenizerSpec(str(tokenizer_dirs["llama3_1"])))
    raw = Tokenizer.from_file(str(tokenizer_dirs["llama3_1"] / "tokenizer.json"))
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    p0, p1 = _server_prompt(raw, tok, msgs[:1]), _server_prompt(raw, tok, msgs[:3])
    hello = raw.encode("Hello there", add_special_tokens=False).ids
    a2 = raw.encode("A2", add_special_tokens=False).ids
    stops = frozenset({128001, 128008, 128009})

    def turns(stop0):
        return [
            {
                "prompt_token_ids": p0,
                "completion_token_ids": hello + [stop0],
                "finish_reason": "stop",
            },
            {
                "prompt_token_ids": p1,
                "completion_token_ids": a2 + [128009],
                "finish_reason": "stop",
            },
        ]

    # <|eot_id|>: the round trip holds, one sample, turn 0 trained inside the prompt.
    ok = _rec(msgs, turns(128009))
    assert server_round_trip([RegenTurn.model_validate(t) for t in turns(128009)]) == []
    counts: Counter = Counter()
    (s,) = from_regen(tok, ok, {}, 4096, counts, stops)
    assert p1[len(p0) : len(p0) + len(hello) + 1] == hello + [128009]
    assert [i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m] == (
        hello + [128009] + a2 + [128009]
    )
    # <|eom_id|>: turn 0 fails the round trip and trains alone.
    counts = Counter()
    last, first = from_regen(tok, _rec(msgs, turns(128008)), {}, 4096, counts, stops)
    assert first.id == "src:0#0" and first.conversation_id == "src:0"
    assert first.input_ids == p0 + hello + [128008]
    assert first.loss_mask == [0] * len(p0) + [1] * (len(hello) + 1)
    assert last.input_ids == p1 + a2 + [128009]
    assert last.loss_mask == [0] * len(p1) + [1] * (len(a2) + 1)
    assert counts["server_round_trip_failed"] == 1 and counts["turn_samples"] == 1
