"""Export checks behind the report's "confirmed" causes, on real draft folders."""

from __future__ import annotations

import json

import numpy as np

from services.bench.diagnosis import check_export
from shared.draft import random_llama_draft

AUX = [2, 15, 27]
FLAGS = {
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
}


def _draft(smollm2_path, out):
    random_llama_draft(smollm2_path, out, AUX, 64, seed=0, selected_ids=list(range(0, 128, 2)))
    return out


def test_matching_draft_has_no_problems(smollm2_path, tmp_path):
    assert check_export(_draft(smollm2_path, tmp_path / "d"), AUX, FLAGS) == []


def test_wrong_layer_ids_and_norm_flag_are_found(smollm2_path, tmp_path):
    d = _draft(smollm2_path, tmp_path / "d")
    got = check_export(d, [1, 14, 26], {**FLAGS, "norm_before_residual": True})
    assert any("layer ids" in p and "[2, 15, 27]" in p and "[1, 14, 26]" in p for p in got)
    assert any("norm_before_residual=False" in p for p in got)


def test_d2t_written_as_ids_is_found(smollm2_path, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d = _draft(smollm2_path, tmp_path / "d")
    w = load_file(str(d / "model.safetensors"))
    # the classic mistake: target ids instead of offsets (ids 0,2,4.. vs offsets 0,1,2..)
    assert np.array_equal(w["d2t"].numpy(), np.arange(64))
    w["d2t"] = torch.arange(0, 128, 2, dtype=torch.int64)
    save_file(w, str(d / "model.safetensors"))
    got = check_export(d, AUX, FLAGS)
    assert len(got) == 1 and got[0].startswith("d2t:")


def test_missing_d2t_with_a_smaller_draft_vocab_is_found(smollm2_path, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _draft(smollm2_path, tmp_path / "d")
    w = load_file(str(d / "model.safetensors"))
    del w["d2t"]
    save_file(w, str(d / "model.safetensors"))
    assert json.loads((d / "config.json").read_text())["draft_vocab_size"] == 64
    got = check_export(d, AUX, FLAGS)
    assert got == [
        f"d2t: {d / 'model.safetensors'} has no d2t, so vLLM maps draft id i to target id i"
    ]


def test_export_checks_list_what_passed_and_what_failed(smollm2_path, tmp_path):
    from services.bench.diagnosis import CHECKS, export_checks

    d = _draft(smollm2_path, tmp_path / "d")
    ok = export_checks(d, AUX, FLAGS, "eagle3", str(smollm2_path))
    assert [c["check"] for c in ok] == list(CHECKS)
    assert all(c["passed"] for c in ok)
    bad = {c["check"]: c for c in export_checks(d, AUX, FLAGS, "eagle", "/other/target")}
    assert not bad["mode"]["passed"] and "'eagle'" in bad["mode"]["detail"]
    assert not bad["verifier"]["passed"] and "/other/target" in bad["verifier"]["detail"]
    assert bad["d2t"]["passed"] and bad["layer ids"]["passed"]
    assert export_checks(tmp_path / "none", AUX, FLAGS) == []
