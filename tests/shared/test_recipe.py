"""Recipe schema: errors name their YAML path, every field is documented, recipes validate."""

import math
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from shared.errors import ConfigError
from shared.recipe import Recipe, check_run_id, resolve_recipe, sanitize_id

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
MINIMAL = {"name": "t", "target": {"path": "/m"}, "datasets": [{"path": "/d.jsonl"}]}


def _write(tmp_path, data) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    r = resolve_recipe(path)
    assert r.run_id().startswith(sanitize_id(r.name))


def test_three_recipes_shipped():
    assert {p.name for p in RECIPES} >= {
        "smollm2-135m-cpu.yaml",
        "llama-3.1-8b.yaml",
        "kimi-k2.5.yaml",
    }


def test_kimi_recipe_settings():
    r = resolve_recipe(ROOT / "recipes" / "kimi-k2.5.yaml")
    t = r.target
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (61, 7168, 163840)
    assert t.trust_remote_code is True
    assert r.draft.draft_vocab_size == 32000 and r.layers == [2, 30, 58]
    # lr: the known run's 3e-5 at ~500 tokens per step, square-root scaled to the recipe's
    known_lr = 3e-5 * math.sqrt(r.train.tokens_per_step / 500)
    assert abs(r.train.lr - known_lr) / known_lr < 0.02
    assert (r.train.scheduler, r.train.epochs) == ("cosine", 10)
    assert (r.train.ttt_steps, r.train.noise_std) == (3, 0.05)
    assert r.serve.tensor_parallel_size == 8
    # thinking explicit, and what the server parses it with
    assert t.chat_template_kwargs == {"thinking": True}
    assert (r.serve.reasoning_parser, r.serve.tool_call_parser) == ("kimi_k2", "kimi_k2")
    assert r.regen.max_tokens > 4096 and r.serve.max_model_len >= (
        r.prep.max_len_tokens // 2 + r.regen.max_tokens
    )
    # the mix: ten datasets by weight over chat, instruction, code, math and tool-use presets
    presets = {d.preset: d.weight for d in r.datasets}
    assert len(presets) == 10 and abs(sum(presets.values()) - 1) < 1e-9
    assert {"gsm8k", "math", "codealpaca", "opencodeinstruct", "glaive-toolcall"} <= set(presets)
    assert r.prep.max_samples == 83288 and all(d.max_samples is None for d in r.datasets)
    assert r.run_id().startswith("kimi-k2_5-")  # the dot is not allowed in rq job ids


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"bogus": 1}, "bogus: unknown key"),
        ({"train": {"lr": -1}}, "train.lr: must be greater than 0 (got -1)"),
        ({"train": {"lr": "fast"}}, "train.lr: must be a valid number"),
        ({"train": {"epochs": 0}}, "train.epochs: must be greater than 0 (got 0)"),
        ({"train": {"typo_lr": 1}}, "train.typo_lr: unknown key"),
        ({"target": {"path": "/m", "dtype": "int3"}}, "target.dtype: must be 'auto', 'bfloat16'"),
        ({"layers": [2, 15]}, "layers: must list exactly 3 aux layer ids, not 2 (got [2, 15])"),
        ({"layers": [2, 2, 5]}, "layers: aux layer ids must be distinct"),
        ({"bench": {"concurrency": [1, 0]}}, "bench.concurrency: must be a non-empty list"),
        (
            {"datasets": [{"preset": "a", "path": "/b"}]},
            "datasets[0]: give exactly one of 'preset' or 'path'",
        ),
        (
            {"datasets": [{"path": "/b", "max_samples": -3}]},
            "datasets[0].max_samples: must be greater than 0 (got -3)",
        ),
        ({"draft": {"norm_before_fc": True, "fc_norm": True}}, "mutually exclusive"),
    ],
)
def test_recipe_errors_name_their_path(tmp_path, patch, expected):
    data = {**MINIMAL, **patch}
    with pytest.raises(ConfigError) as e:
        resolve_recipe(_write(tmp_path, data))
    assert expected in str(e.value)
    assert str(tmp_path / "r.yaml") in str(e.value)


def test_missing_required_section(tmp_path):
    with pytest.raises(ConfigError, match="target: Field required"):
        resolve_recipe(_write(tmp_path, {"name": "x", "datasets": [{"path": "/d"}]}))


def test_overrides_applied_then_validated(tmp_path):
    p = _write(tmp_path, MINIMAL)
    r = resolve_recipe(p, ["train.lr=1e-4", "bench.concurrency=[1, 2]"])
    assert r.train.lr == 1e-4 and r.bench.concurrency == [1, 2]
    with pytest.raises(ConfigError, match="train.lr: must be greater than 0"):
        resolve_recipe(p, ["train.lr=-1"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        resolve_recipe(p, ["train.lr"])
    r = resolve_recipe(p, ["datasets.0.max_samples=40"])
    assert r.datasets[0].max_samples == 40
    with pytest.raises(ConfigError, match="not an index of a 1-item list"):
        resolve_recipe(p, ["datasets.3.max_samples=40"])


def test_env_expansion_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("EYRIE_CACHE", "/cache")
    r = resolve_recipe({**MINIMAL, "target": {"path": "${EYRIE_CACHE}/models/m"}})
    assert r.target.path == "/cache/models/m"
    with pytest.raises(ConfigError, match="NOPE_UNSET is not set"):
        resolve_recipe({**MINIMAL, "target": {"path": "${NOPE_UNSET}/m"}})


def test_run_id_is_stable_and_changes_with_content():
    a = resolve_recipe(MINIMAL)
    b = resolve_recipe(MINIMAL)
    c = resolve_recipe(MINIMAL, ["train.lr=2e-4"])
    assert a.run_id() == b.run_id() != c.run_id()


@pytest.mark.parametrize(
    ("text", "out"),
    [("kimi-k2.5", "kimi-k2_5"), ("a b/c", "a_b_c"), ("--rm x", "rm_x"), ("-_-a", "a")],
)
def test_sanitize_id(text, out):
    assert sanitize_id(text) == out


def test_run_ids_cannot_pass_for_options_or_paths():
    r = resolve_recipe({**MINIMAL, "name": "-x"})
    assert r.run_id().startswith("x-") and check_run_id(r.run_id()) == r.run_id()
    for bad in ("-x-12345678", "a/b", "a.b", "", "x" * 74):
        with pytest.raises(ConfigError, match="run id"):
            check_run_id(bad)
    longest = resolve_recipe({**MINIMAL, "name": "n" * 64}).run_id()
    assert len(longest) == 64 + 9 and check_run_id(longest) == longest
    with pytest.raises(ConfigError, match="name: .*at most 64 characters"):
        resolve_recipe({**MINIMAL, "name": "n" * 65})
    with pytest.raises(ConfigError, match="name: .*at least 1 character"):
        resolve_recipe({**MINIMAL, "name": ""})


def test_old_eval_section_is_refused_by_name(tmp_path):
    """The benchmark section is `bench` now; an old recipe's `eval` is an unknown key."""
    with pytest.raises(ConfigError, match="eval: unknown key"):
        resolve_recipe(_write(tmp_path, {**MINIMAL, "eval": {"num_prompts": 8}}))


def _submodel(ann):
    for t in (ann, *typing.get_args(ann)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _walk(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from _walk(sub, f"{prefix}{name}.")


def all_field_paths() -> list[str]:
    """Every dotted recipe field path (used by the README reference test too)."""
    return [path for path, _ in _walk(Recipe)]


def test_every_field_documented_and_strict():
    """Every field has a description; every section forbids unknown keys."""
    missing = [path for path, f in _walk(Recipe) if not (f.description or "").strip()]
    assert missing == []
    subs = [(path, _submodel(f.annotation)) for path, f in _walk(Recipe)]
    assert any(path == "datasets" for path, s in subs if s is not None)
    for path, sub in subs:
        if sub is not None:
            assert sub.model_config.get("extra") == "forbid", path


def _target_recipe(**target) -> dict:
    return {"name": "remote-code", "target": target, "datasets": [{"path": "/d.jsonl"}]}


@pytest.mark.parametrize(
    "target",
    [
        {"path": "moonshotai/Kimi-K2.5", "trust_remote_code": True},
        # a local target whose tokenizer comes from the hub runs the hub's code too
        {"path": "/models/kimi", "tokenizer": "moonshotai/Kimi-K2.5", "trust_remote_code": True},
    ],
)
def test_remote_code_from_the_hub_needs_a_pinned_revision(target):
    with pytest.raises(ConfigError) as e:
        resolve_recipe(_target_recipe(**target))
    msg = str(e.value)
    assert "trust_remote_code" in msg and "revision" in msg and "moonshotai/Kimi-K2.5" in msg
    assert "main branch" in msg  # says why
    pinned = resolve_recipe(_target_recipe(**target, revision="4d01dfe0"))
    assert pinned.target.revision == "4d01dfe0"


def test_remote_code_from_a_local_folder_or_without_remote_code_needs_no_revision(tmp_path):
    assert resolve_recipe(_target_recipe(path=str(tmp_path), trust_remote_code=True))
    assert resolve_recipe(_target_recipe(path="./models/x", trust_remote_code=True))
    assert resolve_recipe(_target_recipe(path="org/model", trust_remote_code=False))


def test_shipped_recipes_with_remote_code_pin_a_revision():
    for path in RECIPES:
        t = resolve_recipe(path).target
        assert not t.trust_remote_code or t.revision, path.name
