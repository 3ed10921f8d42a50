"""Client-side aggregation of streamed requests (hand-computed values)."""

from __future__ import annotations

import pytest

from services.bench.client import RequestResult, RequestSpec, summarize


def test_summarize_counts_only_successful_tokens_and_reports_errors():
    results = [
        RequestResult(output_tokens=11, ttft_s=0.1, latency_s=1.1, chunk_gaps_s=[0.1] * 10),
        RequestResult(output_tokens=5, ttft_s=0.3, latency_s=0.7, chunk_gaps_s=[0.2, 0.2]),
        RequestResult(error="HTTP 500"),
        RequestResult(error="HTTP 500"),
    ]
    lv = summarize(results, concurrency=2, temperature=0.0, wall_s=2.0)
    assert (lv.requests, lv.failed, lv.errors) == (4, 2, {"HTTP 500": 2})
    assert lv.output_tokens == 16
    assert lv.output_tok_s == 8.0
    assert lv.ttft_s_mean == pytest.approx(0.2)
    assert lv.ttft_s_p50 == pytest.approx(0.2)
    assert lv.itl_s_mean == pytest.approx(1.4 / 12)
    # tpot: (1.1-0.1)/10 = 0.1 and (0.7-0.3)/4 = 0.1
    assert lv.tpot_s_mean == pytest.approx(0.1)


def test_all_failed_window_has_no_latencies():
    lv = summarize([RequestResult(error="ConnectError")], 1, 0.7, 0.5)
    assert lv.output_tok_s == 0.0 and lv.ttft_s_mean is None and lv.tpot_s_mean is None


def test_both_servers_get_the_same_request_body():
    spec = RequestSpec(
        model="m",
        max_tokens=32,
        temperature=0.7,
        seed=5,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msgs = [{"role": "user", "content": "hi"}]
    body = spec.body(msgs, 3)
    assert body == {
        "model": "m",
        "messages": msgs,
        "max_tokens": 32,
        "temperature": 0.7,
        "seed": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
