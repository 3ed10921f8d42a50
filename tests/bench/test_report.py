"""Report, flags, plots, the report stage and `eyrie compare` on hand-built shard results."""

from __future__ import annotations

import json
import struct

import pytest

from services.bench.report import build_report, to_markdown
from services.conductor.cli import main
from shared.artifacts import RunStore
from shared.draft import random_llama_draft
from shared.recipe import resolve_recipe
from tests.conftest import run_stage

AUX = [2, 15, 27]


def _window(t: float, c: int, tok_s: float, counters: dict | None = None) -> dict:
    client = {
        "output_tok_s": tok_s,
        "ttft_s_mean": 0.05,
        "itl_s_mean": 0.01,
        "tpot_s_mean": 0.011,
        "failed": 0,
    }
    base = {
        "drafts": None,
        "draft_tokens": None,
        "accepted": None,
        "accepted_per_position": None,
        "tau": None,
        "acceptance_rate": None,
        "per_position_rate": None,
    }
    return {
        "temperature": t,
        "concurrency": c,
        "client": client,
        "counters": {**base, **(counters or {})},
    }


def _ctr(drafts: float, accepted: float, per_pos: list[float], k: int = 3) -> dict:
    return {
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted": accepted,
        "accepted_per_position": per_pos,
        "tau": 1 + accepted / drafts,
        "acceptance_rate": accepted / (drafts * k),
        "per_position_rate": [a / drafts for a in per_pos],
    }


META = {
    "run_id": "r1",
    "target": "smol",
    "k": 3,
    "prompt_set": "mtbench",
    "num_prompts": 4,
    "max_tokens": 32,
}


def _shards(eagle_tok: tuple[float, float], ctrs: tuple[dict, dict]):
    base = {"windows": [_window(0.0, 1, 90.0), _window(0.0, 8, 400.0)]}
    eag = {
        "windows": [_window(0.0, 1, eagle_tok[0], ctrs[0]), _window(0.0, 8, eagle_tok[1], ctrs[1])]
    }
    return base, eag


def test_slower_draft_with_decent_tau_is_flagged_slower():
    # The real case: tau 2.1 yet 82.3 tok/s against 90: speedup 0.914 at c=1.
    base, eag = _shards((82.3, 480.0), (_ctr(10, 11, [6, 3, 2]), _ctr(10, 11, [6, 3, 2])))
    rep = build_report(base, eag, META, [])
    rows = {r["concurrency"]: r for r in rep["rows"]}
    assert rows[1]["speedup"] == pytest.approx(82.3 / 90.0)
    assert rows[8]["speedup"] == pytest.approx(1.2)
    # Pooled over both windows: 1 + 22/20.
    assert rep["tau"]["0.0"] == pytest.approx(2.1)
    assert rep["per_position_rate"]["0.0"] == pytest.approx([0.6, 0.3, 0.2])
    kinds = [f["kind"] for f in rep["flags"]]
    assert kinds == ["slower"]
    assert "T=0.0 c=1: 0.91x" in rep["flags"][0]["message"]
    md = to_markdown(rep)
    assert "| 0 | 1 | 90.0 | 82.3 | 0.91x | 2.100 |" in md
    assert "FLAG (slower)" in md


def test_tau_near_one_is_flagged_with_causes():
    base, eag = _shards((60.0, 300.0), (_ctr(40, 0, [0, 0, 0]), _ctr(80, 2, [2, 0, 0])))
    rep = build_report(base, eag, META, ["layer ids: config has [1, 2, 3]"])
    low = [f for f in rep["flags"] if f["kind"] == "low_tau"][0]
    assert "tau 1.017" in low["message"]  # 1 + 2/120
    causes = " ".join(low["likely_causes"])
    for word in ("mode", "layer ids", "d2t", "norm flags"):
        assert word in causes
    assert low["confirmed"] == ["layer ids: config has [1, 2, 3]"]
    assert {f["kind"] for f in rep["flags"]} == {"low_tau", "slower"}


def test_good_run_has_no_flags():
    base, eag = _shards((180.0, 600.0), (_ctr(10, 20, [9, 7, 4]), _ctr(10, 18, [8, 6, 4])))
    rep = build_report(base, eag, META, [])
    assert rep["flags"] == []
    assert "No flags" in to_markdown(rep)


def test_mismatched_windows_are_refused():
    from shared.errors import ArtifactError

    base, eag = _shards((1.0, 1.0), (_ctr(1, 1, [1, 0, 0]), _ctr(1, 1, [1, 0, 0])))
    eag["windows"][1]["concurrency"] = 16
    with pytest.raises(ArtifactError, match="differ"):
        build_report(base, eag, META, [])


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _run_with_bench_shards(tmp_path, smollm2_path, base, eag, draft_aux=AUX) -> RunStore:
    """A run whose bench shards hold `base`/`eag` and whose export holds a random draft."""
    recipe = resolve_recipe(
        {
            "name": "report",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": "x.jsonl"}],
            "layers": AUX,
            "bench": {"num_speculative_tokens": 3, "num_prompts": 4, "max_tokens": 32},
        }
    )
    store = RunStore.create(recipe, root=tmp_path / "data")
    store.bench.write_shard(0, base)
    store.bench.write_shard(1, eag)
    random_llama_draft(smollm2_path, store.export.vllm_draft, draft_aux, 64)
    return store


def test_report_stage_writes_json_md_and_pngs(tmp_path, smollm2_path):
    base, eag = _shards((82.3, 480.0), (_ctr(10, 11, [6, 3, 2]), _ctr(10, 11, [6, 3, 2])))
    store = _run_with_bench_shards(tmp_path, smollm2_path, base, eag)
    (m,) = run_stage(store, "report")
    assert sorted(p.name for p in store.report.dir.iterdir() if p.suffix != ".json") == [
        "acceptance.png",
        "report.md",
        "speedup.png",
    ]
    assert _png_size(store.report.speedup_plot) == (600, 400)
    assert _png_size(store.report.acceptance_plot) == (600, 400)
    rep = store.report.read()
    assert (rep["run_id"], rep["target"], rep["k"]) == (store.run_id, str(smollm2_path), 3)
    assert rep["tau"]["0.0"] == pytest.approx(2.1)  # 1 + 22/20
    assert [f["kind"] for f in rep["flags"]] == ["slower"]  # the draft matches: nothing confirmed
    assert store.report.markdown_path.read_text() == to_markdown(rep)
    assert m.counts == {"rows": 2, "flags": 1}
    assert m.extra["tau"]["0.0"] == pytest.approx(2.1)


def test_report_stage_confirms_a_wrong_export_behind_a_low_tau(tmp_path, smollm2_path):
    base, eag = _shards((60.0, 300.0), (_ctr(40, 0, [0, 0, 0]), _ctr(80, 2, [2, 0, 0])))
    store = _run_with_bench_shards(tmp_path, smollm2_path, base, eag, draft_aux=[1, 14, 26])
    run_stage(store, "report")
    low = next(f for f in store.report.read()["flags"] if f["kind"] == "low_tau")
    assert any("[2, 15, 27]" in p and "[1, 14, 26]" in p for p in low["confirmed"])


def test_report_stage_without_a_bench_shard_fails(tmp_path, smollm2_path):
    from shared.errors import ArtifactError

    base, eag = _shards((1.0, 1.0), (_ctr(1, 1, [1, 0, 0]), _ctr(1, 1, [1, 0, 0])))
    store = _run_with_bench_shards(tmp_path, smollm2_path, base, eag)
    store.bench.shard_path(1).unlink()
    with pytest.raises(ArtifactError, match="bench shard 1 has not run"):
        run_stage(store, "report")
    assert not store.is_done("report")


def _two_reports():
    a_base, a_eag = _shards((82.3, 480.0), (_ctr(10, 11, [6, 3, 2]), _ctr(10, 11, [6, 3, 2])))
    b_base, b_eag = _shards((180.0, 600.0), (_ctr(10, 20, [9, 7, 4]), _ctr(10, 18, [8, 6, 4])))
    return build_report(a_base, a_eag, META, []), build_report(
        b_base, b_eag, {**META, "run_id": "r2"}, []
    )


def _check_compare(out: str) -> None:
    assert "A = r1 vs B = r2" in out
    assert "| 0 | 1 | 0.91 | 2.00 | 2.100 | 3.000 |" in out  # b at c=1: 180/90, 1 + 20/10
    assert "A FLAG (slower)" in out


def test_cli_compare_prints_both_runs(tmp_path, capsys):
    a, b = _two_reports()
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    _check_compare(capsys.readouterr().out)


def test_cli_compare_by_run_id_and_by_run_folder(tmp_path, data_dir, capsys):
    import shutil

    from shared.store import atomic_write_json

    a, b = _two_reports()
    for run_id, rep in (("run-a", a), ("run-b", b)):
        atomic_write_json(RunStore(run_id).report.json_path, rep)
    assert main(["compare", "run-a", "run-b"]) == 0
    _check_compare(capsys.readouterr().out)
    assert main(["compare", str(RunStore("run-a").root), str(RunStore("run-b").root)]) == 0
    _check_compare(capsys.readouterr().out)
    # A run folder copied out of the data root is still a run folder.
    copied = tmp_path / "elsewhere" / "run-a-copy"
    shutil.copytree(RunStore("run-a").root, copied)
    assert main(["compare", str(copied), "run-b"]) == 0
    _check_compare(capsys.readouterr().out)


def test_cli_compare_unknown_run_exits_1(tmp_path, data_dir, capsys):
    assert main(["compare", "nope-1", "nope-2"]) == 1
    err = capsys.readouterr().err
    assert "nope-1: no report" in err and str(RunStore("nope-1").report.json_path) in err


def test_cli_bench_needs_a_recipe(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench"])
    assert e.value.code == 2
    assert "required: recipe" in capsys.readouterr().err
