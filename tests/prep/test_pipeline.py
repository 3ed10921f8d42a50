"""plan → prep → dedup → split → tokenize → vocab in-process on real files and SmolLM2's tokenizer.

Expected ids come from HF's own `apply_chat_template(tokenize=True)` and expected mask sums
from tokenizing each assistant content + `<|im_end|>` alone: paths independent of
`services.prep.template`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from services.prep.plan import weighted_quotas
from services.prep.tokenize import run_stats
from shared.artifacts import RunStore
from shared.errors import InputError, StageFailedError
from shared.mtbench import mtbench_first_turns
from shared.recipe import resolve_recipe
from tests.conftest import run_stage

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SAMPLES = Path(__file__).parents[1] / "fixtures" / "samples"
COLUMNS = ["input_ids", "loss_mask", "seq_len", "id", "conversation_id", "source"]


def make_recipe(smollm2_path, datasets, train=None, **prep):
    return resolve_recipe(
        {
            "name": "prep-test",
            "target": {"path": str(smollm2_path)},
            "datasets": datasets,
            "prep": {"shard_rows": 4, "max_len_tokens": 512, **prep},
            "regen": {"enabled": False},
            "train": train or {},
        }
    )


def run_all(store, until="tokenize"):
    for name in ("plan", "prep", "dedup", "split", "tokenize", "vocab"):
        run_stage(store, name)
        if name == until:
            break
    return store.plan.num_shards()


def conv(q, a):
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def test_weighted_quotas_by_hand():
    # 10 rows split 1:3 → 2.5 / 7.5 → floors 2, 7; the tie on .5 goes to the lower index.
    assert weighted_quotas(10, [1, 3], [100, 100]) == [3, 7]
    assert weighted_quotas(10, [1, 1], [2, 100]) == [2, 5]


def _broken_json(tmp_path):
    rows = [conv(f"question é {i}", f"answer {i}") for i in range(6)]
    text = json.dumps(rows, ensure_ascii=False)
    cut = text.rindex('{"conversations"', 0, text.index("question é 5"))
    broken = tmp_path / "broken.json"
    broken.write_text(text[: cut + 30], encoding="utf-8")
    return broken, rows, len(text[:cut].encode("utf-8"))


def test_truncated_json_is_refused_naming_the_byte_offset(tmp_path, data_dir, smollm2_path):
    broken, _, offset = _broken_json(tmp_path)
    store = RunStore.create(make_recipe(smollm2_path, [{"path": str(broken)}]))
    with pytest.raises(InputError) as e:
        run_stage(store, "plan")
    msg = str(e.value)
    assert f"{broken}: truncated at byte {offset}" in msg
    assert "5 complete rows" in msg and "datasets[0].allow_truncated: true" in msg
    assert not store.is_done("plan")


def test_truncated_json_allowed_keeps_complete_records(tmp_path, data_dir, smollm2_path):
    broken, rows, offset = _broken_json(tmp_path)
    recipe = make_recipe(smollm2_path, [{"path": str(broken), "allow_truncated": True}])
    store = RunStore.create(recipe)
    run_stage(store, "plan")
    ds = store.plan.read().datasets[0]
    assert ds.rows == 5 and ds.source.reader == "json_array" and ds.load.truncated is True
    assert ds.load.error_byte_offset == offset
    run_stage(store, "prep")
    got = sorted(
        (c for s in range(store.plan.num_shards()) for c in store.prep.conversations(s)),
        key=lambda c: c.id,
    )
    assert [c.id for c in got] == [f"broken:{i}" for i in range(5)]
    for c in got:
        src = rows[int(c.id.split(":")[1])]["conversations"]
        assert [(m.role, m.content) for m in c.messages] == [
            ("user", src[0]["value"]),
            ("assistant", src[1]["value"]),
        ]


def test_pipeline_counts_masks_dedup_and_mixed_formats(tmp_path, data_dir, smollm2_path):
    from transformers import AutoTokenizer

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
    lines = [(json.dumps(r) + "\n").encode() for r in rows] + [b"{not json\n"]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(lines))
    recipe = make_recipe(smollm2_path, [{"path": str(path)}], min_kept_fraction=0.1)
    store = RunStore.create(recipe)
    n = run_all(store)
    plan = store.plan.read()
    # 13 rows (the bad line is a row of the plan now), 4 per shard
    assert n == 4 and plan.selected == 13 and plan.datasets[0].source.adapter == "sharegpt"
    assert plan.datasets[0].load.bad_lines == []  # the plan parses no JSON any more
    reports = [json.loads(store.prep.report_path(s).read_text()) for s in range(n)]
    assert sum(r["rows_in"] for r in reports) == 13
    assert sum(r["kept"] for r in reports) == 11
    assert sum(r["skipped"].get("format_mismatch", 0) for r in reports) == 1
    assert sum(r["skipped"].get("bad_json", 0) for r in reports) == 1
    assert sum(r["realigned"].get("leading_non_user_turns_dropped", 0) for r in reports) == 1
    quarantined = [
        json.loads(line)
        for s in range(n)
        for line in store.prep.quarantine_path(s).read_text().splitlines()
    ]
    bad = [q for q in quarantined if q["reason"] == "bad_json"]
    # json.loads("{not json") fails at character 1 of the 13th line
    assert bad == [
        {
            "file": str(path),
            "row": 12,
            "field": "<row>",
            "reason": "bad_json",
            "detail": f"byte {len(b''.join(lines[:12])) + 1}: "
            "Expecting property name enclosed in double quotes",
            "raw": "",
        }
    ]
    assert sorted(q["reason"] for q in quarantined) == ["bad_json", "format_mismatch"]
    assert json.loads(store.dedup.report_path.read_text()) == {
        "duplicates": 1,
        "contaminated": 1,
        "kept": 9,
    }

    # dedup writes the kept conversations of each prep shard, in prep order
    prep_ids = [c.id for s in range(n) for c in store.prep.conversations(s)]
    later_dup = max(("mixed:3", "mixed:8"), key=prep_ids.index)
    for s in range(n):
        expect = [c for c in store.prep.conversations(s) if c.id not in ("mixed:9", later_dup)]
        assert store.dedup.conversations(s) == expect
    kept_ids = [c.id for s in range(n) for c in store.dedup.conversations(s)]
    assert sorted(kept_ids) == sorted(set(prep_ids) - {"mixed:9", later_dup})

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    total = 0
    for s in range(n):
        ds = store.tokenize.dataset(s)
        assert ds.column_names == COLUMNS
        for r in ds:
            assert r["conversation_id"] == r["id"]
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
    stats = run_stats(store)
    assert stats["samples"] == 9 and stats["per_source"]["mixed"]["samples"] == 9


def test_invalid_utf8_line_is_quarantined(tmp_path, data_dir, smollm2_path):
    good = [(json.dumps(conv(f"q{i}", f"a{i}")) + "\n").encode() for i in range(3)]
    bad = b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n'  # latin-1 é
    path = tmp_path / "latin.jsonl"
    path.write_bytes(good[0] + bad + good[1] + good[2])
    store = RunStore.create(make_recipe(smollm2_path, [{"path": str(path)}], shard_rows=10))
    run_stage(store, "plan")
    run_stage(store, "prep")
    report = json.loads(store.prep.report_path(0).read_text())
    assert report["rows_in"] == 4 and report["kept"] == 3
    assert report["skipped"] == {"invalid_utf8": 1}
    (q,) = [json.loads(x) for x in store.prep.quarantine_path(0).read_text().splitlines()]
    offset = len(good[0]) + bad.index(b"\xe9")
    assert (q["row"], q["reason"]) == (1, "invalid_utf8")
    assert q["detail"].startswith(f"byte {offset}: ")


def test_split_holds_out_deterministically(tmp_path, data_dir, smollm2_path):
    rows = [conv(f"Question number {i}?", f"Answer number {i}.") for i in range(20)]
    rows.append(conv("Question number 3?", "a duplicate, dropped by dedup"))
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    train = {"seed": 7, "val_fraction": 0.1}
    store = RunStore.create(make_recipe(smollm2_path, [{"path": str(path)}], train))
    n = run_all(store, until="split")
    split = store.split.read()
    ids = [c.id for s in range(n) for c in store.dedup.conversations(s)]
    assert len(ids) == split.conversations == 20
    # the documented rule: a seeded permutation of the ids in dedup order, its last
    # round(20 * 0.1) = 2 held out
    perm = np.random.default_rng(7).permutation(20)
    assert split.val_ids == [ids[i] for i in perm[-2:]]
    assert (split.seed, split.val_fraction) == (7, 0.1)
    # the held-out prompts: each conversation cut before its first assistant turn
    prompts = store.split.heldout_prompts()
    assert [p.id for p in prompts] == split.val_ids
    for p in prompts:
        q = rows[int(p.id.split(":")[1])]["conversations"][0]["value"]
        assert [(m.role, m.content) for m in p.messages] == [("user", q)]

    # the same recipe elsewhere, and other shard sizes, hold out the same conversations
    again = RunStore.create(store.recipe(), root=tmp_path / "again")
    run_all(again, until="split")
    assert again.split.split_path.read_bytes() == store.split.split_path.read_bytes()
    resharded = RunStore.create(
        make_recipe(smollm2_path, [{"path": str(path)}], train, shard_rows=7)
    )
    assert resharded.run_id != store.run_id
    run_all(resharded, until="split")
    assert resharded.split.val_ids() == set(split.val_ids)

    tiny = RunStore.create(
        make_recipe(smollm2_path, [{"path": str(path)}], {"seed": 7, "val_fraction": 0.01})
    )
    run_all(tiny, until="split")
    assert len(tiny.split.read().val_ids) == 1  # round(0.2) = 0, but at least one
    none = RunStore.create(
        make_recipe(smollm2_path, [{"path": str(path)}], {"seed": 7, "val_fraction": 0.0})
    )
    run_all(none, until="split")
    assert none.split.read().val_ids == [] and none.split.heldout_prompts() == []


def test_vocab_counts_only_the_training_split(tmp_path, data_dir, smollm2_path):
    from transformers import AutoTokenizer

    words = ["apple", "banana", "cherry", "damson", "elderberry", "fig", "grape", "hazelnut"]
    rows = [conv(f"Name fruit {i}.", f"The fruit is {w}.") for i, w in enumerate(words)]
    path = write_jsonl(tmp_path / "fruit.jsonl", rows)
    recipe = resolve_recipe(
        {
            "name": "vocab-test",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": str(path)}],
            "prep": {"shard_rows": 3, "max_len_tokens": 512},
            "regen": {"enabled": False},
            "draft": {"draft_vocab_size": 64},
            "train": {"val_fraction": 0.25},
        }
    )
    store = RunStore.create(recipe)
    run_all(store, until="vocab")
    val = store.split.val_ids()
    assert len(val) == 2

    # Expected counts from the tokenizer alone: each answer's loss-masked tokens are its
    # content plus <|im_end|> (SmolLM2's end of turn), tokenized on their own.
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    vocab = 49152

    def counts(ids_wanted):
        ids = [
            t
            for i, w in enumerate(words)
            if f"fruit:{i}" in ids_wanted
            for t in tok(f"The fruit is {w}.<|im_end|>", add_special_tokens=False)["input_ids"]
        ]
        return np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)

    train_ids = {f"fruit:{i}" for i in range(8)} - val
    expected = counts(train_ids)
    freq = np.load(store.vocab.freq_path)
    assert freq.dtype == np.int64 and freq.shape == (vocab,)
    assert np.array_equal(freq, expected)
    assert not np.array_equal(freq, counts(train_ids | val))  # the held-out ones had tokens
    cov = store.vocab.coverage()
    assert cov.assistant_tokens == int(expected.sum()) and cov.coverage == 1.0
    assert cov.distinct_seen == int((expected > 0).sum()) and cov.draft_vocab == 64

    # the draft vocab: top 64 by count, ties by lower id (so unused ids fill it, lowest
    # first), ascending; d2t holds offsets (target = draft + d2t[draft])
    chosen = sorted(sorted(range(vocab), key=lambda i: (-expected[i], i))[:64])
    d2t, t2d = store.vocab.read_maps()
    assert np.flatnonzero(t2d).tolist() == chosen
    assert (np.arange(64) + d2t).tolist() == chosen


def test_truncation_counted_and_untrainable_dropped(tmp_path, data_dir, smollm2_path):
    long_q = "word " * 600
    rows = [conv(long_q, "answer"), conv("short?", "fine " * 600)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    recipe = make_recipe(smollm2_path, [{"path": str(path)}], dedup=False)
    store = RunStore.create(recipe)
    run_all(store)
    rep = json.loads(store.tokenize.report_path(0).read_text())
    assert rep["truncated"] == 2
    assert rep["dropped:no_trainable_token"] == 1 and rep["kept"] == 1
    assert len(store.tokenize.dataset(0)["input_ids"][0]) == 512


def test_shard_emptied_by_truncation_loads_and_vocab_counts_the_rest(
    tmp_path, data_dir, smollm2_path
):
    """Issue 15 fault 8: two rows, one shard each; row 2's 1,500-token prompt fills all 512
    tokens, so its shard keeps no row, and the vocab stage still runs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    long_q = "word " * 1500
    assert len(tok(long_q, add_special_tokens=False)["input_ids"]) >= 1500
    rows = [conv("Name a fruit.", "The fruit is a fig."), conv(long_q, "fine")]
    path = write_jsonl(tmp_path / "two.jsonl", rows)
    recipe = make_recipe(
        smollm2_path,
        [{"path": str(path)}],
        train={"val_fraction": 0.0},
        shard_rows=1,
        dedup=False,
    )
    store = RunStore.create(recipe)
    assert run_all(store, until="vocab") == 2
    rep = json.loads(store.tokenize.report_path(1).read_text())
    assert rep["dropped:no_trainable_token"] == 1 and rep["kept"] == 0
    empty = store.tokenize.dataset(1)
    assert len(empty) == 0 and empty.column_names == COLUMNS
    # The counts are row 1's answer and end of turn, tokenized on their own.
    ids = tok("The fruit is a fig.<|im_end|>", add_special_tokens=False)["input_ids"]
    want = np.bincount(np.asarray(ids, dtype=np.int64), minlength=49152)
    assert np.array_equal(np.load(store.vocab.freq_path), want)


def test_prep_fails_below_kept_fraction(tmp_path, data_dir, smollm2_path):
    rows = [{"conversations": []}] * 3 + [conv("q", "a")]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    recipe = make_recipe(smollm2_path, [{"path": str(path)}], min_kept_fraction=0.5)
    store = RunStore.create(recipe)
    run_stage(store, "plan")
    with pytest.raises(StageFailedError, match=r"kept 1/4 rows.*empty_conversation"):
        run_stage(store, "prep")
    q = store.prep.quarantine_path(0).read_text().splitlines()
    assert len(q) == 3 and json.loads(q[0])["reason"] == "empty_conversation"
    assert not store.is_done("prep", 0)


def test_sharegpt_wheel_preset_plan_is_deterministic(data_dir, smollm2_path, tmp_path):
    spec = {"preset": "sharegpt-v3-wheel", "max_samples": 10, "allow_truncated": True}
    recipe = make_recipe(smollm2_path, [spec])
    a = RunStore.create(recipe)
    run_stage(a, "plan")
    b = RunStore.create(recipe, root=tmp_path / "other")
    run_stage(b, "plan")
    for name in ("plan.json", "selection.npy", "index-000.npy"):
        assert (a.plan.dir / name).read_bytes() == (b.plan.dir / name).read_bytes(), name
    assert a.read_manifest("plan").files == b.read_manifest("plan").files
    info = a.plan.read().datasets[0]
    assert info.rows == 17671 and info.selected == 10  # the complete records of the truncated file
    assert info.load.truncated is True and a.plan.read().num_shards == 3


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_parquet_and_arrow_load_through_datasets(tmp_path, suffix):
    import datasets

    from services.prep.sources import index_source, read_rows, resolve_source
    from shared.recipe import DatasetSpec

    rows = json.loads((SAMPLES / "alpaca_en_demo.json").read_text())[:7]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"alpaca{suffix}"
    if suffix == ".parquet":
        ds.to_parquet(str(path))
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    source = resolve_source(DatasetSpec(path=str(path)), 0)
    assert source.reader == "hf"
    ranges, load = index_source(source)
    assert ranges is None and load.rows == 7 and load.file == str(path)
    assert read_rows(source, None, list(range(7))) == rows
    assert read_rows(source, None, [5, 0]) == [rows[5], rows[0]]


def test_prep_stats_command(tmp_path, data_dir, smollm2_path, capsys):
    from services.conductor.cli import main

    path = write_jsonl(tmp_path / "two.jsonl", [conv("Hi", "Hello there")])
    recipe = make_recipe(smollm2_path, [{"path": str(path)}])
    store = RunStore.create(recipe)
    run_all(store)
    assert main(["prep-stats", store.run_id]) == 0
    out = capsys.readouterr().out
    # SmolLM2 ChatML with its default system prompt: "Hello there<|im_end|>" is 3 tokens.
    assert out.startswith("1 samples, ") and "3 assistant tokens" in out


def test_prep_stats_lists_every_reason(tmp_path, data_dir, smollm2_path, capsys):
    """A tool call SmolLM2's template cannot print, an image part, reasoning under
    `thinking`: each is counted under its reason, by stage, in prep-stats."""
    from services.conductor.cli import main
    from tests.prep.test_template import WEATHER_ROW

    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    rows = [
        WEATHER_ROW,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]},
                {"role": "assistant", "content": "A cat."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "thinking": "Two and two."},
            ]
        },
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]},
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    store = RunStore.create(make_recipe(smollm2_path, [{"path": str(path)}]))
    run_all(store)
    assert main(["prep-stats", store.run_id, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["samples"] == 2
    assert stats["reasons"]["prep"] == {
        "fields:reasoning_alias:thinking": 1,
        "skipped:unsupported_content_part:image_url": 1,
    }
    assert stats["reasons"]["tokenize"] == {"dropped:template_cannot_render_tool_calls": 1}
    listed = [r for rep in store.tokenize.reports() for r in rep["dropped_rows"]]
    assert [(r["id"], r["reason"], r["field"]) for r in listed] == [
        ("mixed:0", "template_cannot_render_tool_calls", "messages[1].tool_calls")
    ]
    assert main(["prep-stats", store.run_id]) == 0
    out = capsys.readouterr().out
    assert "    dropped:template_cannot_render_tool_calls: 1\n" in out


def test_prep_report_counts_per_dataset_of_a_weighted_mix(tmp_path, data_dir, smollm2_path):
    chat = write_jsonl(
        tmp_path / "chat.jsonl", [conv(f"Hi {i}?", f"Hello {i}.") for i in range(20)]
    )
    alpaca = [
        {"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)} for i in range(20)
    ]
    alpaca.append({"instruction": "", "input": "", "output": ""})  # rejected: empty prompt
    instr = write_jsonl(tmp_path / "instr.jsonl", alpaca)
    recipe = make_recipe(
        smollm2_path,
        [{"path": str(chat), "weight": 3.0}, {"path": str(instr), "weight": 1.0}],
        max_samples=20,
    )
    store = RunStore.create(recipe)
    n = run_all(store, until="prep")
    plan = store.plan.read()
    # 20 split 3:1 by weight (largest remainder): 15 and 5
    assert [d.selected for d in plan.datasets] == [15, 5]
    names = [d.source.name for d in plan.datasets]
    totals: dict[str, dict[str, int]] = {}
    for s in range(n):
        rep = json.loads(store.prep.report_path(s).read_text())
        for name, c in rep["per_source"].items():
            agg = totals.setdefault(name, {"rows_in": 0, "kept": 0, "skipped": 0})
            for k in agg:
                agg[k] += c[k]
        assert sum(c["kept"] for c in rep["per_source"].values()) == rep["kept"]
    assert totals[names[0]] == {"rows_in": 15, "kept": 15, "skipped": 0}
    assert totals[names[1]]["rows_in"] == 5
    assert totals[names[1]]["kept"] + totals[names[1]]["skipped"] == 5
    kept_ids = [c.id for s in range(n) for c in store.prep.conversations(s)]
    assert sum(i.startswith(names[1] + ":") for i in kept_ids) == totals[names[1]]["kept"]
