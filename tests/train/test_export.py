"""Export of the trained draft: three folders that load, and a lint that catches each
EAGLE-3 invariant (shared/conventions.py §1, §3; the layout in shared/draft.py) broken on
purpose, one test each."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import train_recipe

pytestmark = pytest.mark.slow

AUX = [2, 15, 27]


def _target(smollm2_path) -> dict:
    return json.loads((Path(smollm2_path) / "config.json").read_text())


def _lint(folder: Path, smollm2_path) -> list[str]:
    from shared.draft import lint_draft_dir

    return lint_draft_dir(
        folder, _target(smollm2_path), expect_verifier=str(smollm2_path), expect_aux_ids=AUX
    )


def test_export_writes_three_linted_folders(exported_run, smollm2_path):
    out = exported_run.export.dir
    lint = json.loads(exported_run.export.lint_path.read_text())
    assert lint == {n: {"ok": True, "problems": []} for n in ("sglang", "speculators", "vllm")}
    vllm = json.loads((out / "vllm" / "config.json").read_text())
    sglang = json.loads((out / "sglang" / "config.json").read_text())
    spec = json.loads((out / "speculators" / "config.json").read_text())
    assert vllm["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert sglang["eyrie"]["aux_id_convention"].startswith("output_of_layer_i")
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(smollm2_path)
    for cfg in (vllm, sglang, spec):
        assert cfg["target_hidden_size"] == 576
        assert cfg["norm_before_residual"] is False  # explicit: speculators defaults it true
        assert all(f in cfg for f in ("norm_before_fc", "fc_norm", "norm_output"))
    assert exported_run.is_done("export")
    # export.json names the best validated epoch's checkpoint and the three folders.
    best = json.loads(exported_run.train.best_path.read_text())["best"]
    summary = json.loads(exported_run.export.summary_path.read_text())
    assert summary["checkpoint"] == f"epoch-{best['epoch']:04d}"
    assert sorted(summary["written"]) == ["sglang", "speculators", "vllm"]
    assert summary["skipped"] == {}
    # ...and every epoch's offline tau it was chosen by: the chosen one has the highest.
    validations = json.loads(exported_run.train.best_path.read_text())["validations"]
    epochs = summary["selection"]["epochs"]
    assert [(e["epoch"], e["tau"]) for e in epochs] == [(v["epoch"], v["tau"]) for v in validations]
    top = max(epochs, key=lambda e: (e["tau"], -e["val_loss"]))
    assert summary["checkpoint"] == f"epoch-{top['epoch']:04d}"


def test_exported_weights_are_the_checkpoint_and_the_target_rows(exported_run, smollm2_path):
    from safetensors.torch import load_file

    w = load_file(str(exported_run.export.vllm_draft / "model.safetensors"))
    best = json.loads(exported_run.train.best_path.read_text())["best"]
    ckpt_dir = exported_run.train.checkpoints_dir / f"epoch-{best['epoch']:04d}"
    ckpt = load_file(str(ckpt_dir / "draft.safetensors"))
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"):
        exported = w[name.replace("layers.0.", "midlayer.")].float()
        assert (exported - ckpt[name]).abs().max() <= 1e-2 * ckpt[name].abs().max()
    d2t, t2d = np.load(exported_run.vocab.d2t_path), np.load(exported_run.vocab.t2d_path)
    assert np.array_equal(w["d2t"].numpy(), d2t) and np.array_equal(w["t2d"].numpy(), t2d)
    # lm_head = the target's (tied) embedding rows of the draft vocab, frozen.
    embed = load_file(str(Path(smollm2_path) / "model.safetensors"))["model.embed_tokens.weight"]
    assert (w["lm_head.weight"].float() - embed[np.nonzero(t2d)[0]].float()).abs().max() < 1e-2


def test_sglang_export_refused_for_ids_not_starting_at_2(exported_run, smollm2_path, tmp_path):
    from shared.artifacts import RunStore
    from tests.conftest import run_stage
    from tests.train.data import link_inputs

    recipe = train_recipe(smollm2_path).model_copy(update={"layers": [3, 15, 27]})
    store = RunStore.create(recipe, root=tmp_path / "data")
    link_inputs(store, exported_run, ("train", "vocab"))
    (manifest,) = run_stage(store, "export")
    assert "sglang" in manifest.extra["skipped"]
    assert "PR #25454" in manifest.extra["skipped"]["sglang"]
    assert sorted(p.name for p in store.export.dir.iterdir() if p.is_dir()) == [
        "speculators",
        "vllm",
    ]


def _edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        change(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))

    return apply


def _edit_weights(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        w = load_file(str(folder / "model.safetensors"))
        change(w)
        save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))

    return apply


def _set_ids(ids):
    def change(cfg):
        key = "eagle_aux_hidden_state_layer_ids"
        (cfg["eagle_config"] if "eagle_config" in cfg else cfg)[key] = ids

    return change


def _arange_d2t(w):
    import torch

    w["d2t"] = torch.arange(len(w["d2t"]))  # target ids instead of offsets


def _extra_t2d(w):
    t2d = w["t2d"].clone()
    t2d[int((~t2d).nonzero()[0])] = True
    w["t2d"] = t2d


def _del(key):
    return lambda c: c.pop(key)


BROKEN = {
    # name: (folder, mutation, the key the lint must name)
    "d2t_missing": ("vllm", _edit_weights(lambda w: w.pop("d2t")), "d2t"),
    "d2t_not_offsets": ("vllm", _edit_weights(_arange_d2t), "d2t/t2d"),
    "t2d_sum_wrong": ("vllm", _edit_weights(_extra_t2d), "d2t/t2d"),
    "lm_head_rows_wrong": (
        "vllm",
        _edit_weights(lambda w: w.update({"lm_head.weight": w["lm_head.weight"][:-1]})),
        "lm_head.weight",
    ),
    "fc_width_wrong": (
        "vllm",
        _edit_weights(lambda w: w.update({"fc.weight": w["fc.weight"].repeat(1, 2)[:, : 4 * 576]})),
        "fc.weight",
    ),
    "q_proj_not_2h": (
        "vllm",
        _edit_weights(
            lambda w: w.update(
                {"midlayer.self_attn.q_proj.weight": w["midlayer.self_attn.q_proj.weight"][:, :576]}
            )
        ),
        "midlayer.self_attn.q_proj.weight",
    ),
    "target_hidden_size_missing": (
        "vllm",
        _edit_config(_del("target_hidden_size")),
        "target_hidden_size",
    ),
    "norm_flag_missing": ("vllm", _edit_config(_del("norm_before_residual")), "norm flags"),
    "four_aux_ids": (
        "vllm",
        _edit_config(_set_ids([2, 15, 27, 30])),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "aux_id_out_of_range": (
        "vllm",
        _edit_config(_set_ids([2, 15, 30])),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "vllm_ids_written_as_sglang": (
        "vllm",
        _edit_config(_set_ids([1, 14, 26])),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "sglang_ids_not_shifted": (
        "sglang",
        _edit_config(_set_ids([2, 15, 27])),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "wrong_architecture": (
        "vllm",
        _edit_config(lambda c: c.update(architectures=["LlamaForCausalLM"])),
        "architectures",
    ),
    "vocab_size_is_draft_vocab": (
        "vllm",
        _edit_config(lambda c: c.update(vocab_size=2048)),
        "vocab_size",
    ),
    "use_aux_hidden_state_false": (
        "vllm",
        _edit_config(lambda c: c["eagle_config"].update(use_aux_hidden_state=False)),
        "eagle_config.use_aux_hidden_state",
    ),
    "two_layers": (
        "vllm",
        _edit_config(lambda c: c.update(num_hidden_layers=2)),
        "num_hidden_layers",
    ),
    "speculators_norm_flag_missing": (
        "speculators",
        _edit_config(_del("norm_before_residual")),
        "norm flags",
    ),
    "speculators_other_verifier": (
        "speculators",
        _edit_config(
            lambda c: c["speculators_config"]["verifier"].update(name_or_path="/elsewhere")
        ),
        "verifier",
    ),
    "speculators_d2t_missing": ("speculators", _edit_weights(lambda w: w.pop("d2t")), "d2t"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_lint_catches(case, exported_run, smollm2_path, tmp_path):
    folder_name, mutate, key = BROKEN[case]
    folder = tmp_path / folder_name
    shutil.copytree(exported_run.export.folder(folder_name), folder)
    assert _lint(folder, smollm2_path) == []  # the pristine copy is clean
    mutate(folder)
    problems = _lint(folder, smollm2_path)
    assert any(p.startswith(key) for p in problems), problems


def test_speculators_folder_reloads_in_speculators(exported_run):
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    folder = exported_run.export.folder("speculators")
    model = Eagle3DraftModel.from_pretrained(str(folder))
    assert model.config.eagle_aux_hidden_state_layer_ids == AUX
    assert model.config.norm_before_residual is False
    vllm = load_file(str(exported_run.export.vllm_draft / "model.safetensors"))
    assert torch.equal(model.fc.weight.to(torch.bfloat16), vllm["fc.weight"])
    assert torch.equal(model.d2t, vllm["d2t"])


def test_vllm_reads_every_export_with_the_checkpoints_settings(exported_run, smollm2_path):
    """Export round trip: each folder, read by vLLM's own config loader (`get_config`; the
    llama-style ones wrapped in `EAGLEConfig` as vLLM's SpeculativeConfig does, the
    speculators one converted by vLLM's speculators parser), has the forward-pass settings
    of the draft rebuilt from the exported checkpoint."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    from services.train import checkpoints as ckpt
    from services.train.draft_model import build_draft, load_trainable_state

    recipe = exported_run.recipe()
    weights, _, _ = ckpt.load(ckpt.best_or_last(exported_run.train))
    d2t, t2d = exported_run.vocab.read_maps()
    model = build_draft(recipe, d2t, t2d)
    load_trainable_state(model, weights)
    layer = model.config.transformer_layer_config
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "rope_parameters",
    )
    want = {k: getattr(layer, k) for k in keys}
    assert want["rms_norm_eps"] == _target(smollm2_path)["rms_norm_eps"]
    assert want["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    ids = {"vllm": AUX, "sglang": [a - 1 for a in AUX], "speculators": AUX}
    for name in ("vllm", "sglang", "speculators"):
        cfg = get_config(str(exported_run.export.folder(name)), trust_remote_code=False)
        if name != "speculators":
            cfg = EAGLEConfig(cfg, method="eagle3", model_type="eagle").model
        got = {k: getattr(cfg, k) for k in keys}
        assert got == want, name
        assert cfg.draft_vocab_size == model.config.draft_vocab_size, name
        assert cfg.target_hidden_size == 576, name
        aux = getattr(cfg, "eagle_aux_hidden_state_layer_ids", None)
        aux = aux or (cfg.eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")
        assert aux == ids[name], name
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            assert bool(getattr(cfg, flag)) == bool(getattr(model.config, flag)), (name, flag)
