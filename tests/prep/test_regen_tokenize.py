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
    first_turn = {"prompt_token_ids": [1], "completion_token_ids": [2], "finish_reason": "stop"}

    def rec(i, prompt, completion, finish):
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
