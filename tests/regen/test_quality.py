"""Which regenerated answers are trained on: loops and length cuts are quarantined, counted.

`tests/fixtures/samples/smollm2_greedy_answers.jsonl` holds real answers of SmolLM2-135M-
Instruct (greedy, 256 new tokens) to ShareGPT V3 first prompts, each labelled by reading it
(`loop`: the answer falls into repeating the same lines until the cut). The detector must
agree with every label. The stage test sends those answers through a real HTTP server and
the real regen stage and checks where each row ends up and what the manifest counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.regen.quality import (
    DEGENERATE,
    LENGTH_CUT,
    MIN_JUDGED_TOKENS,
    AnswerPolicy,
    repeated_tail_share,
)
from tests.regen.test_client import _stage_store, serve, vllm_body  # noqa: F401 (fixture)

ANSWERS = Path(__file__).parents[1] / "fixtures" / "samples" / "smollm2_greedy_answers.jsonl"


def _answers() -> list[dict]:
    return [json.loads(line) for line in ANSWERS.read_text().splitlines()]


def test_share_of_a_tail_that_loops_is_counted_by_hand():
    # 32 distinct tokens, then "1 2 3 4" eight times (64 tokens). With n = 4 the 4-gram at
    # position 36 is the first repeat (of position 32), and every later one repeats too:
    # positions 36..63 are covered, 28 of the 32 tail positions 32..63.
    ids = list(range(100, 132)) + [1, 2, 3, 4] * 8
    assert repeated_tail_share(ids, 4) == pytest.approx(28 / 32)
    # The same loop seen with n = 8: the first repeated 8-gram starts at 36 as well
    # (1 2 3 4 1 2 3 4 first occurs at 32), so the share is the same.
    assert repeated_tail_share(ids, 8) == pytest.approx(28 / 32)
    assert repeated_tail_share(list(range(200)), 4) == 0.0


def test_a_repeat_that_ends_before_the_tail_is_not_counted():
    # A repeat in the first half only: positions 10..13 repeat 0..3, the tail is fresh.
    ids = [1, 2, 3, 4] + list(range(100, 106)) + [1, 2, 3, 4] + list(range(200, 226))
    assert len(ids) == 40
    assert repeated_tail_share(ids, 4) == 0.0
    # Moved into the tail (positions 30..33), exactly those 4 of 20 tail positions count.
    ids = [1, 2, 3, 4] + list(range(100, 126)) + [1, 2, 3, 4] + list(range(200, 206))
    assert repeated_tail_share(ids, 4) == pytest.approx(4 / 20)


def test_short_answers_are_not_judged():
    assert repeated_tail_share([5] * (MIN_JUDGED_TOKENS - 1), 2) == 0.0
    assert repeated_tail_share([5] * MIN_JUDGED_TOKENS, 2) == 1.0
    with pytest.raises(ValueError, match="n must be >= 1"):
        repeated_tail_share([1, 2, 3], 0)


def test_detector_agrees_with_every_hand_label_on_real_answers():
    policy = AnswerPolicy(stop_ids=frozenset({0, 1, 2}))
    answers = _answers()
    labels = {a["label"] for a in answers}
    assert labels == {"loop", "ok"}, "the fixture must hold both kinds"
    for a in answers:
        v = policy.verdict(a["completion_token_ids"], a["finish_reason"], a["text"])
        got = "loop" if v is not None and v.reason == DEGENERATE else "ok"
        assert got == a["label"], (a["id"], a["text"][-200:])


def test_length_cut_policy():
    (cut,) = [a for a in _answers() if a["label"] == "ok" and a["finish_reason"] == "length"][:1]
    ids = cut["completion_token_ids"]
    assert AnswerPolicy(length_cut="keep").verdict(ids, "length") is None
    v = AnswerPolicy(length_cut="drop").verdict(ids, "length")
    assert v is not None and v.reason == LENGTH_CUT and f"after {len(ids)} tokens" in v.detail
    assert AnswerPolicy(length_cut="drop", max_repeat_share=None).verdict(ids, "stop") is None


def test_stage_quarantines_loops_resamples_and_counts(serve, smollm2_path, tmp_path):  # noqa: F811
    from tests.conftest import run_stage

    answers = _answers()
    loop = next(a for a in answers if a["label"] == "loop")
    ok = next(a for a in answers if a["label"] == "ok" and a["finish_reason"] == "stop")
    draws: dict[str, int] = {}

    def script(n, body):
        prompt = body["messages"][-1]["content"]
        draws[prompt] = draws.get(prompt, 0) + 1
        # "always loops" loops on every draw; "loops once" loops on the first draw only.
        a = loop if prompt == "always loops" or draws[prompt] == 1 and "once" in prompt else ok
        reply = vllm_body(a["text"], ids=a["completion_token_ids"])
        reply["choices"][0]["finish_reason"] = a["finish_reason"]
        return 200, {}, reply

    srv = serve(script)
    store = _stage_store(smollm2_path, tmp_path, ["always loops", "loops once", "fine"])
    rows = [c.messages[0].content for c in store.dedup.conversations(0)]
    (m,) = run_stage(store, "regen", urls={"baseline": srv.url})
    # Default policy: 2 extra draws at temperature 0.7.
    assert draws == {"always loops": 3, "loops once": 2, "fine": 1}
    assert (m.counts["input"], m.counts["success"], m.counts["skipped"]) == (3, 2, 1)
    assert m.counts[f"skipped:{DEGENERATE}"] == 1
    assert m.counts["resampled"] == 1
    (bad,) = [json.loads(x) for x in store.regen.errors_path(0).read_text().splitlines()]
    assert bad["row"] == rows.index("always loops") and bad["reason"] == DEGENERATE
    assert "repeat earlier 8-grams" in bad["detail"]
    kept = {rows[r.row]: r for r in store.regen.records(0)}
    assert set(kept) == {"loops once", "fine"}
    assert kept["loops once"].resampled == 1 and kept["fine"].resampled == 0
    assert kept["loops once"].turns[0].completion_token_ids == ok["completion_token_ids"]


def test_several_draws_per_prompt_are_kept_as_samples_of_one_conversation(
    serve,  # noqa: F811
    smollm2_path,
    tmp_path,
):
    from tests.conftest import run_stage
    from tests.regen.realdata import store_with_dedup

    answers = _answers()
    loop = next(a for a in answers if a["label"] == "loop")
    oks = [a for a in answers if a["label"] == "ok" and a["finish_reason"] == "stop"]
    draws: dict[str, int] = {}

    def script(n, body):
        prompt = body["messages"][-1]["content"]
        draws[prompt] = draws.get(prompt, 0) + 1
        d = draws[prompt]
        looping = prompt == "always loops" or (prompt == "loops twice" and d <= 2)
        a = loop if looping else oks[d % len(oks)]
        reply = vllm_body(a["text"], ids=a["completion_token_ids"])
        reply["choices"][0]["finish_reason"] = a["finish_reason"]
        return 200, {}, reply

    srv = serve(script)
    prompts = ["fine", "loops twice", "always loops"]
    rows = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}]}
        for p in prompts
    ]
    recipe = {
        "name": "regen-samples",
        "target": {"path": str(smollm2_path)},
        "datasets": [{"path": "replaced.jsonl"}],
        "regen": {
            "max_retries": 1,
            "request_timeout_s": 10,
            "max_turns": 1,
            "samples_per_prompt": 3,
            "resample_attempts": 0,
        },
        "serve": {"served_model_name": "m"},
    }
    store, _ = store_with_dedup(recipe, tmp_path / "data", [{**r, "tools": None} for r in rows])
    order = [c.messages[0].content for c in store.dedup.conversations(0)]
    (m,) = run_stage(store, "regen", urls={"baseline": srv.url})
    assert draws == {"fine": 3, "loops twice": 3, "always loops": 3}
    # Rows: 2 with a kept draw, 1 quarantined; draws kept: 3 + 1.
    assert (m.counts["input"], m.counts["success"], m.counts["skipped"]) == (3, 2, 1)
    assert m.counts["samples"] == 4
    assert m.counts[f"draw_quarantined:{DEGENERATE}"] == 2
    assert m.counts[f"skipped:{DEGENERATE}"] == 1
    kept = [(order[r.row], r.sample, r.failed_draws) for r in store.regen.records(0)]
    assert sorted(kept) == sorted(
        [
            ("fine", 0, []),
            ("fine", 1, []),
            ("fine", 2, []),
            ("loops twice", 2, [DEGENERATE, DEGENERATE]),
        ]
    )
    # Tokenized: one sample per kept draw, all of a conversation under its id.
    run_stage(store, "tokenize")
    ds = store.tokenize.dataset(0)
    by_conv: dict[str, list[str]] = {}
    for sid, cid in zip(ds["id"], ds["conversation_id"], strict=True):
        by_conv.setdefault(cid, []).append(sid)
    ids = {c.messages[0].content: c.id for c in store.dedup.conversations(0)}
    fine, twice = ids["fine"], ids["loops twice"]
    assert sorted(by_conv) == sorted([fine, twice])
    assert sorted(by_conv[fine]) == sorted([fine, f"{fine}#s1", f"{fine}#s2"])
    assert by_conv[twice] == [f"{twice}#s2"]
