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

from shared.draft import random_llama_draft
from shared.errors import ContractMismatchError
from shared.recipe import resolve_recipe
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
