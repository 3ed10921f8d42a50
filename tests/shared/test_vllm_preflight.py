"""The eagle3 preflight (`shared.vllm`) refuses each bad draft, one test per rule (issue 4,
item 2).

Each test starts from a valid random draft for the real SmolLM2 (written by
`shared.draft.random_llama_draft`), breaks exactly one thing, and checks the refusal names it.
That no server starts when the preflight refuses is tests/conductor/test_servers.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.draft import random_llama_draft
from shared.errors import ContractMismatchError
from shared.recipe import Recipe, resolve_recipe
from shared.vllm import preflight_eagle3, preflight_problems, speculative_config

AUX = [2, 15, 27]


@pytest.fixture
def recipe(smollm2_path):
    return resolve_recipe(
        {
            "name": "preflight",
            "target": {"path": str(smollm2_path)},
            "datasets": [{"path": "x.jsonl"}],
            "layers": AUX,
            "serve": {"port": 18000, "eagle3_port": 18001},  # no server starts here
        }
    )


@pytest.fixture
def draft(tmp_path, smollm2_path) -> Path:
    out = tmp_path / "draft"
    random_llama_draft(smollm2_path, out, AUX, 64, seed=0)
    return out


def _edit_config(draft: Path, edit) -> None:
    cfg = json.loads((draft / "config.json").read_text())
    edit(cfg)
    (draft / "config.json").write_text(json.dumps(cfg))


def _edit_weights(draft: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    w = load_file(str(draft / "model.safetensors"))
    edit(w)
    save_file(w, str(draft / "model.safetensors"))


def _refused(recipe, draft: Path, match: str, method: str = "eagle3") -> None:
    spec = {**speculative_config(recipe, "eagle3", draft), "method": method}
    with pytest.raises(ContractMismatchError, match=match):
        preflight_eagle3(recipe, draft, spec)


def test_valid_draft_passes(recipe, draft):
    assert preflight_problems(recipe, draft, speculative_config(recipe, "eagle3", draft)) == []


def test_method_eagle_is_refused(recipe, draft):
    _refused(recipe, draft, r"method: expected 'eagle3', got 'eagle'", method="eagle")


def test_four_aux_ids_refused(recipe, draft):
    _edit_config(
        draft, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 15, 27, 30])
    )
    _refused(recipe, draft, r"need exactly 3 ids")


def test_fc_width_not_three_hidden_refused(recipe, draft):
    import torch

    _edit_weights(draft, lambda w: w.update({"fc.weight": torch.zeros(576, 2 * 576)}))
    _refused(recipe, draft, r"fc\.weight: expected \[576, 3·576=1728\], got \(576, 1152\)")


def test_vocab_size_not_target_refused(recipe, draft):
    _edit_config(draft, lambda c: c.update(vocab_size=32000))
    _refused(recipe, draft, r"vocab_size: 32000 != target vocab 49152")


def test_draft_vocab_size_not_d2t_length_refused(recipe, draft):
    _edit_config(draft, lambda c: c.update(draft_vocab_size=128))
    _refused(recipe, draft, r"lm_head\.weight: expected 128 rows")


def test_lm_head_rows_not_d2t_length_refused(recipe, draft):
    import torch

    _edit_weights(draft, lambda w: w.update({"lm_head.weight": torch.zeros(32, 576)}))
    _refused(
        recipe, draft, r"lm_head\.weight: expected 64 rows \(draft_vocab_size\), got \(32, 576\)"
    )


def test_missing_d2t_refused(recipe, draft):
    _edit_weights(draft, lambda w: w.pop("d2t"))
    _refused(recipe, draft, r"d2t: missing from model\.safetensors")


def test_implicit_norm_flag_refused(recipe, draft):
    _edit_config(draft, lambda c: c.pop("norm_before_residual"))
    _refused(recipe, draft, r"norm flags not written explicitly: \['norm_before_residual'\]")


def test_other_verifier_refused(recipe, draft):
    _edit_config(draft, lambda c: c["eyrie"].update(verifier="/models/Llama-3.1-8B-Instruct"))
    _refused(recipe, draft, r"verifier: draft was trained for '/models/Llama-3.1-8B-Instruct'")


# -- the final argument list (issue 15, fault 9) --------------------------------------------


def _with_extra(recipe, extra: list[str]):
    return recipe.model_copy(
        update={"serve": recipe.serve.model_copy(update={"extra_args": extra})}
    )


EAGLE = json.dumps({"method": "eagle", "model": "DRAFT", "num_speculative_tokens": 3})


def _launch_refused(recipe, mode, draft, match):
    from shared.vllm import preflight_launch

    with pytest.raises(ContractMismatchError, match=match) as e:
        preflight_launch(recipe, mode, draft)
    return str(e.value)


def test_valid_launches_pass(recipe, draft):
    from shared.vllm import launch_problems, vllm_args

    for mode, d in (("baseline", None), ("eagle3", draft), ("extract", None)):
        assert launch_problems(recipe, mode, vllm_args(recipe, mode, d), d) == [], mode


def test_vllm_itself_takes_the_last_speculative_config(recipe, draft):
    """The fact the check rests on, from vLLM's own parser: a second flag wins."""
    from shared.vllm import final_speculative_config, vllm_args

    extra = ["--speculative-config", EAGLE.replace("DRAFT", str(draft))]
    args = vllm_args(_with_extra(recipe, extra), "eagle3", draft)
    final, parser = final_speculative_config(args)
    assert parser == "vllm"
    assert final == {"method": "eagle", "model": str(draft), "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    "extra",
    [
        ["--speculative-config", EAGLE],
        ["-sc", EAGLE],  # vLLM's alias
        ["--speculative_config=" + EAGLE],  # underscores and '='
        ["--speculative-config.method", "eagle"],  # one key, merged by vLLM's parser
    ],
    ids=["flag", "alias", "underscore", "per-key"],
)
def test_second_speculative_config_in_extra_args_refused(recipe, draft, extra):
    extra = [a.replace("DRAFT", str(draft)) for a in extra]
    msg = _launch_refused(_with_extra(recipe, extra), "eagle3", draft, "given 2 times")
    assert "vLLM would run with" in msg and '"method": "eagle"' in msg
    assert "method: expected 'eagle3', got 'eagle'" in msg  # the draft preflight saw it too


def test_speculative_config_in_baseline_refused(recipe, draft):
    spec = json.dumps(speculative_config(recipe, "eagle3", draft))
    bad = _with_extra(recipe, ["--speculative-config", spec])
    _launch_refused(bad, "baseline", None, r"baseline mode: the arguments carry a speculative")


def test_without_vllm_the_scan_catches_the_same(recipe, draft, monkeypatch):
    import shared.vllm as sv

    monkeypatch.setattr(sv, "_vllm_parser", lambda: None)
    assert sv.launch_problems(recipe, "eagle3", sv.vllm_args(recipe, "eagle3", draft), draft) == []
    extra = ["-sc=" + EAGLE.replace("DRAFT", str(draft))]
    args = sv.vllm_args(_with_extra(recipe, extra), "eagle3", draft)
    assert sv.final_speculative_config(args) == (json.loads(extra[0][4:]), "scan")
    problems = sv.launch_problems(recipe, "eagle3", args, draft)
    assert any("given 2 times" in p for p in problems), problems
    base = sv.vllm_args(_with_extra(recipe, ["--speculative_config", "{}"]), "baseline")
    assert sv.launch_problems(recipe, "baseline", base)[0].startswith("baseline mode")
    dotted = sv.vllm_args(
        _with_extra(recipe, ["--speculative-config.method", "eagle"]), "eagle3", draft
    )
    assert (
        "cannot be checked without vLLM" in sv.launch_problems(recipe, "eagle3", dotted, draft)[0]
    )


def test_draft_with_other_rope_than_the_target_refused(recipe, draft):
    """An Eyrie export that lost the target's RoPE (as exports before issue 15 did: only
    rope_theta) is refused before vLLM serves it with other positions."""
    _edit_config(
        draft,
        lambda c: c.update(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_theta=10000.0
        ),
    )
    _refused(recipe, draft, r"rope_parameters: the draft reads as .*'rope_theta': 10000\.0")


# -- the engine's attention pairing -------------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _kimi(tmp_path: Path, dtype: str) -> Recipe:
    """A recipe for Kimi-K2.5's real config (MLA: kv_lora_rank 512 + rope 64)."""
    target = tmp_path / "kimi"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text((FIXTURES / "kimi-k2.5" / "config.json").read_text())
    return resolve_recipe(
        {
            "name": "kimi-dtype",
            "target": {"path": str(target), "dtype": dtype},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 30, 58],
        }
    )


def test_engine_pairing_passes_a_non_mla_target(recipe, draft):
    from shared.vllm import engine_pairing_problems

    assert engine_pairing_problems(recipe, draft) == []


@pytest.mark.skipif(
    __import__("torch").cpu._is_amx_tile_supported(), reason="AMX CPU: AMX_MLA pages 32"
)
def test_engine_pairing_refuses_a_llama_draft_next_to_mla_on_this_cpu(tmp_path, draft):
    """Kimi-K2.5's real config (MLA, kv_lora_rank 512 + rope 64): on a CPU without AMX,
    vLLM's CPU_MLA pages 16-token blocks and CPU_ATTN multiples of 32; the process backend
    refuses, a docker-served recipe (another machine's vLLM) is not judged here."""
    from shared.vllm import engine_pairing_problems, preflight_launch

    kimi = _kimi(tmp_path, "auto")
    (problem,) = engine_pairing_problems(kimi, draft)
    assert "CPU_MLA: [16]" in problem and "CPU_ATTN: [MultipleOf(32)]" in problem
    with pytest.raises(ContractMismatchError, match="no KV block size common"):
        preflight_launch(kimi, "eagle3", draft, local_engine=True)


def test_auto_dtype_of_an_mla_target_is_one_its_cpu_backend_takes(tmp_path, recipe):
    """vLLM 0.32 serves MLA on an AMX CPU with AMX_MLA (bf16 weights only: float32 failed at
    weight loading in the Kimi rehearsal) and elsewhere with CPU_MLA (float16/bf16/float32)."""
    from shared.vllm import dtype_problems, served_dtype, vllm_args

    amx = torch.cpu._is_amx_tile_supported()
    kimi = _kimi(tmp_path, "auto")
    assert served_dtype(kimi) == ("bfloat16" if amx else "float32")
    assert dtype_problems(kimi) == []
    args = vllm_args(kimi, "baseline")
    assert args[args.index("--dtype") + 1] == served_dtype(kimi)
    # A dense target stays float32 on every CPU.
    assert served_dtype(recipe) == "float32" and dtype_problems(recipe) == []


def test_explicit_float32_mla_target_is_refused_where_the_backend_takes_bf16_only(tmp_path):
    from shared.vllm import dtype_problems, preflight_launch

    kimi = _kimi(tmp_path, "float32")
    if not torch.cpu._is_amx_tile_supported():
        assert dtype_problems(kimi) == []  # CPU_MLA takes float32
        return
    (problem,) = dtype_problems(kimi)
    assert problem.startswith("target.dtype float32:") and "AMX_MLA" in problem
    with pytest.raises(ContractMismatchError, match="AMX_MLA, which takes bfloat16 only"):
        preflight_launch(kimi, "baseline", local_engine=True)
