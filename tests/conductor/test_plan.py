"""`eyrie plan` / `eyrie pull` / the run gate, and the shipped Kimi-K2.5 recipe at plan level.

The Kimi recipe names a hub id; here its snapshot is a real Hugging Face cache layout
(`models--moonshotai--Kimi-K2.5/refs/main` + `snapshots/<sha>/config.json`) holding the
fixture `config.json`, so config resolution goes through huggingface_hub's own cache lookup
with no network. The known run's figures the estimates are held to (within 2×): weights
547 GB, loading at tensor-parallel 8 in 22.5 min, extraction 2,912 tokens/s at 56 KiB per
token, a 2.5B-parameter draft trained in 17.7 GB at one ~500-token sample per step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from services.conductor.cli import main
from services.conductor.plan import make_plan, mix_samples
from shared import sizing
from shared.errors import ArtifactError
from shared.model import local_snapshot, model_path, pull, weights_problems
from shared.recipe import resolve_recipe
from shared.target import normalize_config, target_config
from shared.vllm import speculative_config, vllm_args

ROOT = Path(__file__).resolve().parents[2]
KIMI_RECIPE = ROOT / "recipes" / "kimi-k2.5.yaml"
KIMI_CONFIG = ROOT / "tests" / "fixtures" / "kimi-k2.5" / "config.json"
#: The snapshot sha: the Kimi recipe's pinned revision, so the cache resolves it.
SHA = yaml.safe_load(KIMI_RECIPE.read_text())["target"]["revision"]

KNOWN_WEIGHTS_BYTES = 547e9
KNOWN_LOAD_S = 22.5 * 60
KNOWN_EXTRACT_TOK_S = 2912
KNOWN_DRAFT_PARAMS = 2.5e9
KNOWN_TRAIN_BYTES = 17.7e9


def within_2x(got: float, known: float) -> bool:
    return known / 2 <= got <= known * 2


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache that huggingface_hub uses for this test."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def cached_snapshot(cache: Path, repo: str, files: dict[str, Path | bytes]) -> Path:
    """Put `files` into `cache` as huggingface_hub lays out a downloaded snapshot."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / SHA
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(SHA)
    for name, src in files.items():
        if isinstance(src, bytes):
            (snap / name).write_bytes(src)
        else:
            shutil.copyfile(src, snap / name)
    return snap


def save_sharded(folder: Path, tensors: dict[str, np.ndarray], shards: int) -> dict[str, str]:
    """Save `tensors` as `shards` safetensors files plus the index, as save_pretrained does."""
    from safetensors.numpy import save_file

    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def small_model(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rng = np.random.default_rng(0)
    tensors = {f"w{i}": rng.standard_normal((64, 32)).astype(np.float32) for i in range(6)}
    return save_sharded(folder, tensors, 3)


# -- the shipped Kimi recipe -------------------------------------------------------------------


def test_kimi_recipe_resolves_from_the_cached_config(hf_cache):
    snap = cached_snapshot(hf_cache, "moonshotai/Kimi-K2.5", {"config.json": KIMI_CONFIG})
    recipe = resolve_recipe(KIMI_RECIPE)
    assert local_snapshot(recipe) == snap and model_path(recipe) == str(snap)
    cfg = target_config(recipe)  # the text config inside the multimodal wrapper
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (61, 7168)
    assert cfg["vocab_size"] == 163_840 and recipe.draft.draft_vocab_size == 32_000
    spec = speculative_config(recipe, "extract")
    assert spec is not None
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        30,
        58,
        61,
    ]
    args = vllm_args(recipe, "extract")
    assert args[args.index("--model") + 1] == str(snap)
    assert args[args.index("--tensor-parallel-size") + 1] == "8"


def test_kimi_plan_matches_the_known_run_within_2x(hf_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path / "data"))
    cached_snapshot(hf_cache, "moonshotai/Kimi-K2.5", {"config.json": KIMI_CONFIG})
    recipe = resolve_recipe(KIMI_RECIPE)
    plan = make_plan(recipe, "recipes/kimi-k2.5.yaml")
    raw = normalize_config(json.loads(KIMI_CONFIG.read_text()), str(KIMI_CONFIG))

    assert plan.hs_bytes_per_token == 4 * 7168 * 2 == 57_344  # 56 KiB
    assert plan.weight_source == "config estimate"
    assert within_2x(plan.weight_bytes, KNOWN_WEIGHTS_BYTES), plan.weight_bytes
    assert within_2x(plan.load_s, KNOWN_LOAD_S), plan.load_s
    extract = next(s for s in plan.stages if s.name == "extract")
    assert extract.disk_bytes == plan.tokens * 57_344
    assert within_2x(plan.tokens / (extract.seconds - plan.load_s), KNOWN_EXTRACT_TOK_S)
    assert within_2x(plan.draft_params["total"], KNOWN_DRAFT_PARAMS), plan.draft_params
    # The draft's trainable part counted by hand: fc 3H→H, q/k/v over 2H (64 heads of
    # 7168/64), o, the MLP at the target's intermediate size, 3 norms + the final norm.
    h, i = raw["hidden_size"], raw["intermediate_size"]
    by_hand = 3 * h * h + 3 * (h * 2 * h) + h * h + 3 * h * i + 4 * h
    assert plan.draft_params["trainable"] == by_hand
    assert plan.draft_params["lm_head"] == 32_000 * h and plan.draft_params["embed"] == 163_840 * h
    known_batch = sizing.train_memory_bytes(recipe, raw, 500)
    assert within_2x(known_batch, KNOWN_TRAIN_BYTES), known_batch
    # The sample count is the mix's cap: the known run's 83,288 prompts.
    assert plan.samples == mix_samples(recipe) == 83_288
    assert plan.tokens == 83_288 * recipe.rates.mean_sample_tokens
    # Config-only snapshot: refused with the command that fixes it.
    assert any("eyrie pull recipes/kimi-k2.5.yaml" in p for p in plan.problems)


def test_kimi_training_fits_an_h200_and_131072_tokens_per_step_is_refused(hf_cache, tmp_path):
    cached_snapshot(hf_cache, "moonshotai/Kimi-K2.5", {"config.json": KIMI_CONFIG})
    recipe = resolve_recipe(KIMI_RECIPE, ["rates.gpu_memory_gib=141"])
    gpu = [p for p in make_plan(recipe).problems if p.startswith("gpu:")]
    assert gpu == []
    big = resolve_recipe(KIMI_RECIPE, ["rates.gpu_memory_gib=141", "train.tokens_per_step=131072"])
    gpu = [p for p in make_plan(big).problems if p.startswith("gpu:")]
    assert len(gpu) == 1 and "train.tokens_per_step=131072" in gpu[0]
    # ~3.6 MB per token (fp32 logits over 163,840 + 32,000 ids, 3 TTT steps): > 400 GiB
    assert sizing.train_memory_bytes(big, target_config(big), 131072) > 400 * 2**30


def test_eyrie_plan_prints_the_table_and_exits_2_when_the_copy_is_missing(hf_cache, capsys):
    assert main(["plan", str(KIMI_RECIPE)]) == 2
    err = capsys.readouterr().err
    assert "cannot plan the run" in err and f"eyrie pull {KIMI_RECIPE}" in err
    cached_snapshot(hf_cache, "moonshotai/Kimi-K2.5", {"config.json": KIMI_CONFIG})
    assert main(["plan", str(KIMI_RECIPE)]) == 2
    out = capsys.readouterr().out
    for stage in ("model", "prep", "regen", "extract", "train", "export", "bench"):
        assert f"\n{stage} " in out
    assert "57,344 B/token (56 KiB)" in out and f"eyrie pull {KIMI_RECIPE}" in out


# -- weights: completeness, pull, the run gate -------------------------------------------------


def test_weights_problems_catch_cut_off_missing_and_unindexed_files(tmp_path):
    folder = tmp_path / "m"
    weight_map = small_model(folder)
    assert weights_problems(folder) == []
    first, second = sorted(set(weight_map.values()))[:2]
    size = os.path.getsize(folder / first)
    with open(folder / first, "r+b") as f:
        f.truncate(size - 100)  # an interrupted download
    (folder / second).unlink()
    problems = weights_problems(folder)
    assert f"{first}: {size - 100} bytes, its header says {size} (incomplete)" in problems
    assert f"model.safetensors.index.json: names {second}, which is missing" in problems
    assert len(problems) == 2


def test_index_naming_a_tensor_its_file_lacks_is_a_problem(tmp_path):
    folder = tmp_path / "m"
    small_model(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = "model-00001-of-00003.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_problems(folder) == [
        "model.safetensors.index.json: extra.weight should be in "
        "model-00001-of-00003.safetensors, which lacks it"
    ]


def test_pull_resolves_the_cached_snapshot_and_checks_it(hf_cache, tmp_path):
    src = tmp_path / "src"
    small_model(src)
    files = {p.name: p for p in src.iterdir()}
    snap = cached_snapshot(hf_cache, "acme/tiny", files)
    recipe = resolve_recipe(
        {"name": "t", "target": {"path": "acme/tiny"}, "datasets": [{"preset": "sharegpt"}]}
    )
    assert pull(recipe, local_files_only=True) == snap
    (snap / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(ArtifactError, match="model-00003-of-00003.safetensors, which is missing"):
        pull(recipe, local_files_only=True)
    other = resolve_recipe(
        {"name": "t", "target": {"path": "acme/absent"}, "datasets": [{"preset": "sharegpt"}]}
    )
    with pytest.raises(ArtifactError, match="pull acme/absent"):
        pull(other, local_files_only=True)


def test_eyrie_pull_command_checks_the_cached_copy(hf_cache, tmp_path, capsys):
    src = tmp_path / "src"
    small_model(src)
    snap = cached_snapshot(hf_cache, "acme/tiny", {p.name: p for p in src.iterdir()})
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {"name": "t", "target": {"path": "acme/tiny"}, "datasets": [{"preset": "sharegpt"}]}
        )
    )
    assert main(["pull", str(recipe_file), "--local-files-only"]) == 0
    assert capsys.readouterr().out.strip() == f"acme/tiny: complete at {snap}"
    (snap / "model-00002-of-00003.safetensors").write_bytes(b"\x08")  # cut to 1 byte
    assert main(["pull", str(recipe_file), "--local-files-only"]) == 1
    err = capsys.readouterr().err
    assert "model-00002-of-00003.safetensors: unreadable safetensors header" in err


def test_run_refuses_a_hub_id_without_a_complete_local_copy(
    hf_cache, smollm2_path, tmp_path, capsys
):
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "hub",
                "target": {"path": "acme/tiny"},
                "datasets": [{"preset": "sharegpt", "max_samples": 10}],
                "serve": {"backend": "docker"},
            }
        )
    )
    # No copy at all: refused at once (neither the hub nor Redis is reached).
    assert main(["run", str(recipe_file)]) == 2
    err = capsys.readouterr().err
    assert "acme/tiny (revision main) has no local copy" in err
    assert f"run `eyrie pull {recipe_file}` first" in err
    # The config alone (an interrupted pull): planned from it, still refused.
    cached_snapshot(hf_cache, "acme/tiny", {"config.json": smollm2_path / "config.json"})
    assert main(["run", str(recipe_file)]) == 2
    err = capsys.readouterr().err
    assert "refusing to start the run" in err and "is incomplete" in err
    assert f"`eyrie pull {recipe_file}` (it resumes)" in err and "no *.safetensors" in err


def test_uncapped_datasets_are_planned_without_data_sizes(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path / "data"))
    recipe = resolve_recipe(
        {"name": "open", "target": {"path": str(smollm2_path)}, "datasets": [{"preset": "math"}]}
    )
    plan = make_plan(recipe)
    assert plan.samples is None and plan.tokens == 0 and plan.problems == []
    assert "prep.max_samples" in plan.notes[0]


def test_bench_is_planned_per_k_served_and_round(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path / "data"))
    base = {"name": "b", "target": {"path": str(smollm2_path)}, "datasets": [{"preset": "math"}]}
    bench = {"num_prompts": 8, "max_tokens": 64, "concurrency": [1, 4, 8], "temperatures": [0.0]}

    def planned(**more):
        recipe = resolve_recipe({**base, "bench": {**bench, **more}})
        plan = make_plan(recipe)
        (stage,) = [s for s in plan.stages if s.name == "bench"]
        return stage.seconds, stage.note

    one, note = planned()
    assert note == "2 server starts"
    # k = 3, 1, 2 in 2 rounds: one baseline server for all k and 3 eagle3 servers; each k's
    # two servers sweep 8 x 64 tokens x 3 concurrencies twice (12 sweeps).
    three, note = planned(measure_k=[1, 2, 3], rounds=2)
    assert note == "4 server starts"
    rates = resolve_recipe(base).rates
    load = (one - 2 * 8 * 64 * 3 / rates.regen_tokens_per_s) / 2
    assert three == pytest.approx(4 * load + 12 * 8 * 64 * 3 / rates.regen_tokens_per_s)


def test_run_refuses_a_run_the_disk_cannot_hold(smollm2_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EYRIE_DATA", str(tmp_path / "data"))
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        yaml.safe_dump(
            {
                "name": "huge",
                "target": {"path": str(smollm2_path)},
                "datasets": [{"preset": "sharegpt", "max_samples": 10**9}],
                "prep": {"max_len_tokens": 4096},
                "rates": {"mean_sample_tokens": 4096},
            }
        )
    )
    recipe = resolve_recipe(recipe_file)
    free = shutil.disk_usage(tmp_path).free
    # SmolLM2: 4 states × 576 × 2 bytes per token
    hs = 10**9 * 4096 * 4 * 576 * 2
    assert hs > free
    plan = make_plan(recipe, str(recipe_file))
    assert plan.weight_source == "local files"
    assert main(["run", str(recipe_file)]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "disk:" in line)
    m = re.search(r"needs an estimated ([\d,.]+) GiB on (\S+) but ([\d,.]+) GiB are free", line)
    assert m, line
    need_gib, free_gib = (float(m.group(i).replace(",", "")) for i in (1, 3))
    assert need_gib == pytest.approx(plan.data_needed / 2**30, abs=0.1)
    assert need_gib >= hs / 2**30  # the hidden states alone
    assert free_gib == pytest.approx(free / 2**30, abs=1.0)


# -- sizes and timeouts --------------------------------------------------------------------------


def test_weight_estimate_of_a_dense_model_matches_its_file(smollm2_path):
    cfg = json.loads((smollm2_path / "config.json").read_text())
    got = sizing.estimate_target_weight_bytes(cfg)
    real = os.path.getsize(smollm2_path / "model.safetensors")
    assert abs(got - real) / real < 0.01, (got, real)


def test_startup_timeout_is_sized_from_the_weights_unless_set():
    base = {"name": "t", "target": {"path": "/x"}, "datasets": [{"preset": "sharegpt"}]}
    recipe = resolve_recipe(base)
    # 547 GB at 405 MB/s is 1,350.6 s; ×3 + 300 s of margin
    assert sizing.startup_timeout_s(recipe, 547_000_000_000) == pytest.approx(
        547e9 / 405e6 * 3 + 300
    )
    assert sizing.startup_timeout_s(recipe, None) == 600.0
    fixed = resolve_recipe({**base, "serve": {"startup_timeout_s": 120}})
    assert sizing.startup_timeout_s(fixed, 547_000_000_000) == 120.0


def test_request_timeout_is_sized_from_max_tokens_unless_set():
    base = {"name": "t", "target": {"path": "/x"}, "datasets": [{"preset": "sharegpt"}]}
    assert sizing.regen_request_timeout_s(resolve_recipe(base)) == 300.0  # 512 tokens: floor
    long = resolve_recipe({**base, "regen": {"max_tokens": 16384}})
    assert sizing.regen_request_timeout_s(long) == 16384 / 5 + 60
    fixed = resolve_recipe({**base, "regen": {"max_tokens": 16384, "request_timeout_s": 50}})
    assert sizing.regen_request_timeout_s(fixed) == 50.0


def test_train_timeout_grows_with_tokens_and_epochs():
    base = {"name": "t", "target": {"path": "/x"}, "datasets": [{"preset": "sharegpt"}]}
    recipe = resolve_recipe({**base, "train": {"epochs": 10}})
    # 83M tokens × 10 epochs at 10,000 tokens/s, ×3
    assert sizing.train_timeout_s(recipe, 83_000_000) == int(83e6 * 10 / 10_000 * 3)
    assert sizing.train_timeout_s(recipe, 1000) == 3600  # at least an hour


def test_train_estimate_and_timeout_stop_at_the_time_budget():
    base = {"name": "t", "target": {"path": "/x"}, "datasets": [{"preset": "sharegpt"}]}
    budget = resolve_recipe({**base, "train": {"epochs": 10, "time_budget_s": 7200}})
    # 83M tokens x 10 epochs at 10,000 tokens/s would be 83,000 s; the budget cuts it to 7,200
    assert sizing.train_estimate_s(budget, 83_000_000) == 7200
    assert sizing.train_timeout_s(budget, 83_000_000) == 7200 * 3
    # a budget larger than the epochs' work changes nothing
    assert sizing.train_estimate_s(budget, 1_000_000) == 1e6 * 10 / 10_000


def test_train_job_timeout_is_sized_from_the_runs_tokens(data_dir):
    from shared.artifacts import RunStore
    from shared.stage import get_stage

    base = {"name": "t", "target": {"path": "/x"}, "datasets": [{"preset": "sharegpt"}]}
    recipe = resolve_recipe({**base, "train": {"epochs": 10}})
    store = RunStore.create(recipe)
    train = get_stage("train")
    assert train.job_timeout(recipe, store) == 3600  # nothing tokenized yet: the floor
    for shard, tokens in enumerate((40_000_000, 43_000_000)):
        store.write_manifest("tokenize", shard, {"tokens": tokens, "samples": 1})
    # 83M tokens × 10 epochs / 10,000 tokens/s × 3: about 69 h, not a fixed 48 h
    assert train.job_timeout(recipe, store) == int(83e6 * 10 / 10_000 * 3)
    assert get_stage("export").job_timeout(recipe, store) == get_stage("export").timeout_s


@pytest.mark.slow
def test_a_tokenized_run_is_planned_from_its_own_token_counts(smollm2_path, data_dir):
    from shared.artifacts import RunStore
    from tests.conftest import run_stage

    samples = ROOT / "tests" / "fixtures" / "samples" / "sharegpt_fastchat_dummy.json"
    recipe = resolve_recipe(
        {
            "name": "counted",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": str(samples), "format": "sharegpt", "max_samples": 30}],
            "prep": {"shard_rows": 10, "max_len_tokens": 512},
            "regen": {"enabled": False},
        }
    )
    store = RunStore.create(recipe)
    before = make_plan(recipe)
    assert before.tokens == 30 * 512  # estimate: mean_sample_tokens capped at max_len_tokens
    for name in ("plan", "prep", "dedup", "split", "tokenize"):
        run_stage(store, name)
    counted = sum(
        len(ids)
        for s in range(store.plan.num_shards())
        for ids in store.tokenize.dataset(s)["input_ids"]
    )
    after = make_plan(recipe)
    assert after.tokens == counted and 0 < counted < 30 * 512
    extract = next(s for s in after.stages if s.name == "extract")
    assert extract.disk_bytes == counted * 4 * 576 * 2  # SmolLM2: 3 aux + final, H 576, bf16
