"""The regen check of the local tokenizer against the server's `/tokenize`, over a fake HTTP
transport (`httpx.MockTransport`) that answers as vLLM's tokenize endpoint does.

The ids the fake server returns are computed independently of the code under test: the
SmolLM2 chat template's output is written out by hand (from its chat_template.jinja) and
encoded with the raw `tokenizers` library on the model's tokenizer.json. Checked:
- equal ids pass; the first `CHECK_ROWS` conversations with a prompt are compared, with the
  request fields of vLLM's TokenizeChatRequest / TokenizeCompletionRequest;
- prompt ids that differ at one position, text ids that differ, and a server answer that is
  a prefix of the local one refuse with one line naming row, position, both ids and tokens;
- 503 is the server being down (not a mismatch); 4xx rows are listed, not compared, and a
  server rejecting every prompt refuses.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from services.regen.client import ChatClient
from services.regen.tokcheck import CHECK_ROWS, check_tokenizer
from shared.errors import ConfigError, ServiceUnavailableError
from shared.records import Conversation, Message

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = ["What is 2+2?", "Name a café in Paris.", "Translate 你好 to English", "Last one"]
ANSWERS = ["It is 4.", "Café de Flore.", "Hello", "ok"]


def _rendered(question: str) -> str:
    """SmolLM2's chat template on [user question] with the generation prompt, by hand."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def raw(smollm2_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from shared.tokenizer import TokenizerSpec, load_tokenizer

    return load_tokenizer(TokenizerSpec(str(smollm2_path)))


def _rows(n: int = 4) -> list[Conversation]:
    return [
        Conversation(
            id=f"data:{i}",
            source="data",
            messages=[
                Message(role="user", content=QUESTIONS[i]),
                Message(role="assistant", content=ANSWERS[i]),
            ],
        )
        for i in range(n)
    ]


def _client() -> ChatClient:
    return ChatClient("http://server:8000", "m", {}, {}, 10.0, 0)


class FakeVllm:
    """Answers `/tokenize` from the raw tokenizer, after `edit(kind, ids)` (the mismatch)."""

    def __init__(self, raw, edit=lambda kind, ids: ids, status=200):
        self.raw, self.edit, self.status = raw, edit, status
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tokenize"
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "nope"}})
        if "messages" in body:
            (m,) = body["messages"]
            kind, text = "prompt", _rendered(m["content"])
        else:
            kind, text = "text", body["prompt"]
        ids = self.edit(kind, self.raw.encode(text, add_special_tokens=False).ids)
        strs = [self.raw.id_to_token(i) for i in ids]
        return httpx.Response(
            200, json={"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": strs}
        )


def _check(tok, fake, rows=None):
    rows = _rows() if rows is None else rows
    return check_tokenizer(tok, rows, _client(), "/models/smol", httpx.MockTransport(fake))


def test_equal_ids_pass_on_the_first_rows_with_vllms_request_fields(tok, raw):
    fake = FakeVllm(raw)
    check = _check(tok, fake)
    assert check.rows == ["data:0", "data:1", "data:2"] and CHECK_ROWS == 3
    want_prompt = sum(
        len(raw.encode(_rendered(q), add_special_tokens=False).ids) for q in QUESTIONS[:3]
    )
    want_text = sum(len(raw.encode(a, add_special_tokens=False).ids) for a in ANSWERS[:3])
    assert (check.prompt_tokens, check.text_tokens) == (want_prompt, want_text)
    assert check.record()["server"] == "http://server:8000/tokenize"
    assert fake.bodies[0] == {
        "model": "m",
        "return_token_strs": True,
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "add_generation_prompt": True,
        "chat_template_kwargs": {},
    }
    assert fake.bodies[1] == {
        "model": "m",
        "return_token_strs": True,
        "prompt": ANSWERS[0],
        "add_special_tokens": False,
    }
    assert len(fake.bodies) == 6


def test_prompt_ids_differing_at_one_position_refuse_naming_it(tok, raw):
    want = raw.encode(_rendered(QUESTIONS[0]), add_special_tokens=False).ids
    # The question's first token, right after the system turn and "<|im_start|>user\n".
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    k = len(raw.encode(head, add_special_tokens=False).ids)
    assert raw.id_to_token(want[k]) == "What"
    other = raw.token_to_id("Who")

    def edit(kind, ids):
        return [other if i == k else x for i, x in enumerate(ids)] if kind == "prompt" else ids

    with pytest.raises(ConfigError) as e:
        _check(tok, FakeVllm(raw, edit))
    msg = str(e.value)
    assert "\n" not in msg
    assert "'/models/smol'" in msg and "row data:0, prompt" in msg
    assert f"first difference at token {k} " in msg
    assert f"local {want[k]} 'What' vs server {other} 'Who'" in msg
    assert "target.tokenizer" in msg and "target.revision" in msg and "chat_template" in msg


def test_text_ids_differing_refuse(tok, raw):
    def edit(kind, ids):
        return ids if kind == "prompt" else [ids[0], 0, *ids[1:]]

    want = raw.encode(ANSWERS[0], add_special_tokens=False).ids
    with pytest.raises(ConfigError) as e:
        _check(tok, FakeVllm(raw, edit))
    msg = str(e.value)
    assert "row data:0, plain text: first difference at token 1 " in msg
    assert f"local {want[1]} {raw.id_to_token(want[1])!r} vs server 0 '<|endoftext|>'" in msg


def test_a_server_prefix_differs_at_its_end(tok, raw):
    want = raw.encode(_rendered(QUESTIONS[0]), add_special_tokens=False).ids

    def edit(kind, ids):
        return ids[:-1] if kind == "prompt" else ids

    with pytest.raises(ConfigError) as e:
        _check(tok, FakeVllm(raw, edit))
    n = len(want)
    assert f"first difference at token {n - 1} " in str(e.value)
    assert f"vs server <end> ({n} vs {n - 1} tokens)" in str(e.value)


def test_rows_without_a_user_turn_are_passed_over(tok, raw):
    rows = _rows()
    rows[0] = Conversation(
        id="data:x", source="data", messages=[Message(role="assistant", content="hi")]
    )
    fake = FakeVllm(raw)
    assert _check(tok, fake, rows).rows == ["data:1", "data:2", "data:3"]


def test_503_is_the_server_down_not_a_mismatch(tok, raw):
    with pytest.raises(ServiceUnavailableError, match="503"):
        _check(tok, FakeVllm(raw, status=503))


def test_404_names_the_model(tok, raw):
    with pytest.raises(ServiceUnavailableError, match="404 for model 'm'"):
        _check(tok, FakeVllm(raw, status=404))


def test_a_server_rejecting_every_prompt_refuses(tok, raw):
    fake = FakeVllm(raw, status=400)
    with pytest.raises(ConfigError, match="rejected the prompts .*data:0: 400"):
        _check(tok, fake)
    assert len(fake.bodies) == CHECK_ROWS


def test_a_rejected_row_is_listed_and_the_next_compared(tok, raw):
    fake = FakeVllm(raw)

    def handler(request: httpx.Request) -> httpx.Response:
        if QUESTIONS[1] in request.content.decode():
            return httpx.Response(400, json={"error": {"message": "bad row"}})
        return fake(request)

    rows = _rows()
    check = check_tokenizer(tok, rows, _client(), "/models/smol", httpx.MockTransport(handler))
    assert check.rows == ["data:0", "data:2", "data:3"]
    assert len(check.rejected) == 1 and check.rejected[0].startswith("data:1: 400 ")


def test_prep_stats_sums_the_shards_checks(tmp_path, monkeypatch, capsys):
    import argparse

    from services.prep.cli import cmd_prep_stats
    from services.prep.tokenize import regen_tokenizer_checks
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    monkeypatch.setenv("EYRIE_DATA", str(tmp_path))
    recipe = resolve_recipe(
        {"name": "t", "target": {"path": "/m"}, "datasets": [{"path": "/d.jsonl"}]}
    )
    store = RunStore.create(recipe)
    assert regen_tokenizer_checks(store) is None
    checks = [
        {"server": "u", "rows": ["a:0", "a:1", "a:2"], "prompt_tokens": 100, "text_tokens": 30,
         "rejected": []},
        {"server": "u", "rows": ["a:7"], "prompt_tokens": 11, "text_tokens": 5,
         "rejected": ["a:5: 400 x", "a:6: 400 y"]},
    ]  # fmt: skip
    for shard, check in enumerate(checks):
        store.write_manifest("regen", shard, {"input": 1}, extra={"tokenizer_check": check})
    store.write_manifest("regen", 2, {"input": 1})  # a shard finished before the check existed
    assert regen_tokenizer_checks(store) == {
        "shards": 3,
        "unchecked": 1,
        "rows": 4,
        "prompt_tokens": 111,
        "text_tokens": 35,
        "rejected": 2,
    }
    assert cmd_prep_stats(argparse.Namespace(run=store.run_id, json=False)) == 0
    assert (
        "regen tokenizer check (local vs the server's /tokenize): 4 conversations equal "
        "(111 prompt + 35 text tokens) in 2 of 3 shards; 2 prompts rejected by the server"
    ) in capsys.readouterr().out
