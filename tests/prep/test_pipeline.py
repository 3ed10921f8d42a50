"""Plan → prep → dedup → tokenize in-process on real files and the real SmolLM2 tokenizer.

Expected ids come from HF's own `apply_chat_template(tokenize=True)` and expected mask sums
from tokenizing each assistant content + `<|im_end|>` alone: paths independent of
`services.prep.template`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.prep import jobs
from services.prep.plan import make_plan, read_plan, weighted_quotas
from shared.errors import StageFailedError
from shared.recipe import resolve_recipe
from shared.store import RunStore

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SAMPLES = Path(__file__).parents[1] / "fixtures" / "samples"


def make_recipe(smollm2_path, datasets, **prep):
    return resolve_recipe(
        {
            "name": "prep-test",
            "target": {"path": str(smollm2_path)},
            "datasets": datasets,
            "prep": {"shard_rows": 4, "max_len_tokens": 512, **prep},
            "regen": {"enabled": False},
        }
    )


def run_all(store, recipe):
    n = make_plan(store, recipe)
    for s in range(n):
        jobs.run_prep(store, recipe, s)
    jobs.run_dedup(store, recipe, 0)
    for s in range(n):
        jobs.run_tokenize(store, recipe, s)
    return n


def conv(q, a):
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def test_weighted_quotas_by_hand():
    # 10 rows split 1:3 → 2.5 / 7.5 → floors 2, 7; the tie on .5 goes to the lower index.
    assert weighted_quotas(10, [1, 3], [100, 100]) == [3, 7]
    assert weighted_quotas(10, [1, 1], [2, 100]) == [2, 5]


def test_truncated_json_keeps_complete_records_and_reports_byte_offset(
    tmp_path, data_dir, smollm2_path
):
    rows = [conv(f"question é {i}", f"answer {i}") for i in range(6)]
    text = json.dumps(rows, ensure_ascii=False)
    cut = text.rindex('{"conversations"', 0, text.index("question é 5"))
    broken = tmp_path / "broken.json"
    broken.write_text(text[: cut + 30], encoding="utf-8")
    recipe = make_recipe(smollm2_path, [{"path": str(broken)}])
    store = RunStore.create(recipe)
    make_plan(store, recipe)
    ds = read_plan(store)["datasets"][0]
    assert ds["rows"] == 5 and ds["load"]["truncated"] is True
    assert ds["load"]["error_byte_offset"] == len(text[:cut].encode("utf-8"))


def test_pipeline_counts_masks_dedup_and_mixed_formats(tmp_path, data_dir, smollm2_path):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    from services.bench.prompts import mtbench_first_turns

    mt = mtbench_first_turns()[0]
    rows = [conv(f"What is {i} + {i}?", f"It is {2 * i}.") for i in range(8)]
    rows += [
        conv("what IS 3 +   3?", "dup"),
        conv("  " + mt.upper() + " ", "contaminated"),
        {"instruction": "other format", "input": "", "output": "x"},
        {
            "conversations": [
                {"from": "gpt", "value": "lead"},
                {"from": "human", "value": "Q?"},
                {"from": "gpt", "value": "A."},
            ]
        },
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    recipe = make_recipe(smollm2_path, [{"path": str(path)}], min_kept_fraction=0.1)
    store = RunStore.create(recipe)
    n = run_all(store, recipe)
    plan = read_plan(store)
    assert n == 3 and plan["datasets"][0]["adapter"] == "sharegpt"
    assert plan["datasets"][0]["load"]["bad_lines"] == [
        {"line": 13, "error": "Expecting property name enclosed in double quotes"}
    ]
    reports = [
        json.loads(store.shard_path("prep", s, ".report.json").read_text()) for s in range(n)
    ]
    assert sum(r["rows_in"] for r in reports) == 12
    assert sum(r["skipped"].get("format_mismatch", 0) for r in reports) == 1
    assert sum(r["realigned"].get("leading_non_user_turns_dropped", 0) for r in reports) == 1
    assert json.loads((store.root / "dedup/report.json").read_text()) == {
        "duplicates": 1,
        "contaminated": 1,
        "kept": 9,
    }

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    total = 0
    for s in range(n):
        ds = load_from_disk(str(store.shard_path("tokenize", s, "")))
        assert ds.column_names == ["input_ids", "loss_mask", "seq_len", "id", "source"]
        for r in ds:
            src = rows[int(r["id"].split(":")[1])]
            turns = src["conversations"][-2:]
            msgs = [
                {"role": "user", "content": turns[0]["value"]},
                {"role": "assistant", "content": turns[1]["value"]},
            ]
            expect = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
            assert r["input_ids"] == list(expect)
            n_asst = len(
                tok(turns[1]["value"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            )
            assert sum(r["loss_mask"]) == n_asst and r["seq_len"] == len(expect)
            assert r["source"] == "mixed"
            total += 1
    assert total == 9
    stats = jobs.run_stats(store)
    assert stats["samples"] == 9 and stats["per_source"]["mixed"]["samples"] == 9


def test_truncation_counted_and_untrainable_dropped(tmp_path, data_dir, smollm2_path):
    long_q = "word " * 600
    rows = [conv(long_q, "answer"), conv("short?", "fine " * 600)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(smollm2_path, [{"path": str(path)}], dedup=False)
    store = RunStore.create(recipe)
    run_all(store, recipe)
    rep = json.loads(store.shard_path("tokenize", 0, ".report.json").read_text())
    assert rep["truncated"] == 2
    assert rep["dropped:no_trainable_token"] == 1 and rep["kept"] == 1


def test_prep_fails_below_kept_fraction(tmp_path, data_dir, smollm2_path):
    rows = [{"conversations": []}] * 3 + [conv("q", "a")]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(smollm2_path, [{"path": str(path)}], min_kept_fraction=0.5)
    store = RunStore.create(recipe)
    make_plan(store, recipe)
    with pytest.raises(StageFailedError, match=r"kept 1/4 rows.*empty_conversation"):
        jobs.run_prep(store, recipe, 0)
    q = store.shard_path("prep", 0, ".quarantine.jsonl").read_text().splitlines()
    assert len(q) == 3 and json.loads(q[0])["reason"] == "empty_conversation"
    assert not store.is_done("prep", 0)


def test_sharegpt_wheel_preset_plan_is_deterministic(data_dir, smollm2_path, tmp_path):
    recipe = make_recipe(smollm2_path, [{"preset": "sharegpt-v3-wheel", "max_samples": 10}])
    a = RunStore.create(recipe)
    make_plan(a, recipe)
    b = RunStore.create(recipe, root=tmp_path / "other")
    make_plan(b, recipe)
    plan = (a.root / "plan.json").read_text()
    assert plan == (b.root / "plan.json").read_text()
    info = json.loads(plan)["datasets"][0]
    assert info["rows"] == 17671 and info["selected"] == 10  # real-inputs.md: 17,671


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_parquet_and_arrow_load_through_datasets(tmp_path, suffix):
    import datasets

    from services.prep.loaders import read_path

    rows = json.loads((SAMPLES / "alpaca_en_demo.json").read_text())[:7]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"alpaca{suffix}"
    if suffix == ".parquet":
        ds.to_parquet(str(path))
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    got, report = read_path(str(path))
    assert got == rows and report["rows"] == 7


def test_prep_stats_command(tmp_path, data_dir, smollm2_path, capsys):
    from services.conductor.cli import main

    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps(conv("Hi", "Hello there")) + "\n")
    recipe = make_recipe(smollm2_path, [{"path": str(path)}])
    store = RunStore.create(recipe)
    run_all(store, recipe)
    assert main(["prep-stats", store.run_id]) == 0
    out = capsys.readouterr().out
    # SmolLM2 ChatML with its default system prompt: "Hello there<|im_end|>" is 3 tokens.
    assert out.startswith("1 samples, ") and "3 assistant tokens" in out
