"""Export a trained draft: vLLM llama-style, speculators and SGLang folders, then lint them.

Layout written (`shared/artifacts.py`, export/):
    vllm/         llama-style (`shared.draft.write_llama_draft`): the
                  trained weights renamed `layers.0.*` → `midlayer.*`, d2t/t2d inside
                  model.safetensors, target_hidden_size and every norm flag explicit
    speculators/  speculators' `save_pretrained` (bf16) of the same weights;
                  `speculators_config.verifier` names the target; config.json then gets
                  `target_hidden_size` and every norm flag written explicitly
                  (`norm_before_residual` defaults to true in this format's readers)
    sglang/       llama-style weights with aux ids written as i-1 (SGLang reads an id as the
                  output of layer i; `shared.conventions.sglang_layer_ids`, which refuses ids
                  whose first id is not 2); `config.json["eyrie"]` records the convention
                  written and the original Eyrie ids
    lint.json     `{folder: {"ok", "problems"}}` from `shared.draft.lint_draft_dir`, plus,
                  where vLLM is installed, how vLLM's own config loader reads each folder
                  (`shared.vllm.engine_read_problems`, the export round trip)

Invariants: every folder's config is built from the rebuilt draft's own config object
(`draft_spec`), never re-derived from the target, and the lint compares each folder's
forward-pass settings, as transformers reads them, with it key by key
(`shared.draft.forward_view`); the export is rebuilt from the chosen checkpoint (best by
validation, else the last epoch) plus the frozen weights reloaded from the target, so it
never depends on the training process; every folder is written atomically and linted; any
lint problem fails the stage after lint.json is written.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.train import checkpoints as ckpt
from shared.artifacts import RunStore
from shared.conventions import SGLANG_ID_CONVENTION, resolve_aux_layer_ids, sglang_layer_ids
from shared.draft import NORM_FLAGS, DraftSpec, lint_draft_dir, write_llama_draft
from shared.errors import ContractMismatchError
from shared.recipe import Recipe
from shared.records import ExportSummary
from shared.store import atomic_path
from shared.target import target_config
from shared.vllm import engine_read_problems

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eyrie.export")

#: Weights that are never exported: teacher-side copies and vocab maps written separately.
_NOT_EXPORTED = ("verifier_lm_head.", "verifier_norm.", "embed_tokens.", "rotary_emb.")


@dataclass
class ExportReport:
    """What an export wrote.

    Attributes:
        checkpoint: the checkpoint folder exported.
        written: folder names under export/ that were written and linted.
        skipped: folder name → reason it was not written.
        lint: folder name → problems (empty = ok).
    """

    checkpoint: Path
    written: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    lint: dict[str, list[str]] = field(default_factory=dict)


def llama_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's weights under vLLM llama-style names (`layers.0.` → `midlayer.`).

    Excludes the target embeddings (vLLM shares the target's when hidden sizes match), the
    teacher-side verifier lm_head/norm, d2t/t2d (the writer adds them) and rotary buffers.
    """
    out = {}
    for name, tensor in model.state_dict().items():
        if name in ("d2t", "t2d") or name.startswith(_NOT_EXPORTED):
            continue
        out[name.replace("layers.0.", "midlayer.", 1)] = tensor
    return out


def draft_spec(
    model: Any, tcfg: dict[str, Any], aux_ids: list[int], verifier: str, meta: dict[str, Any]
) -> DraftSpec:
    """The llama-style spec of a built draft, read from the model's own config object.

    Every forward-pass setting (layer shape, hidden_act, rms_norm_eps, RoPE, max positions)
    and every norm flag comes from `model.config` (speculators' `Eagle3SpeculatorConfig`
    and its `transformer_layer_config`), i.e. what the draft trained with; only the target's
    hidden size and layer count come from the target config `tcfg`.
    """
    c = model.config
    return DraftSpec.from_layer_config(
        c.transformer_layer_config.to_dict(),
        target_hidden_size=int(tcfg["hidden_size"]),
        target_num_layers=int(tcfg["num_hidden_layers"]),
        aux_layer_ids=aux_ids,
        draft_vocab_size=int(c.draft_vocab_size),
        verifier=verifier,
        **{flag: bool(getattr(c, flag)) for flag in NORM_FLAGS},
        meta=meta,
    )


def write_speculators(out_dir: Path, model: Any, target_hidden: int) -> Path:
    """Write speculators' `save_pretrained` folder (bf16 copy); make every flag explicit."""
    import torch

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.config.target_hidden_size = target_hidden
    with atomic_path(out_dir) as tmp:
        bf16.save_pretrained(str(tmp))
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["target_hidden_size"] = target_hidden
        for flag in NORM_FLAGS:
            cfg[flag] = bool(getattr(model.config, flag))
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


#: The checkpoint rule `services.train.trainer` applies at each epoch's end.
SELECTION_RULE = "highest offline tau (simulated on the held-out split), then lowest val_loss"


def selection(validations: list[dict[str, Any]]) -> dict[str, Any]:
    """The export's record of how its checkpoint was chosen (`ExportSummary.selection`)."""
    if not validations:
        return {}
    epochs = [
        {"epoch": v["epoch"], "tau": v.get("tau"), "val_loss": v.get("val_loss")}
        for v in validations
    ]
    return {"by": SELECTION_RULE, "epochs": epochs}


def export_all(store: RunStore, recipe: Recipe) -> ExportReport:
    """Rebuild the chosen checkpoint's draft and write the three folders and lint.json.

    Raises:
        ArtifactError: no finished training checkpoint.
        ContractMismatchError: a folder fails the lint (after lint.json is written).
    """
    from services.train.draft_model import build_draft, load_trainable_state

    folder = ckpt.best_or_last(store.train)
    weights, state, _ = ckpt.load(folder)
    d2t, t2d = store.vocab.read_maps()
    model = build_draft(recipe, d2t, t2d, device="cpu")
    load_trainable_state(model, weights)
    tcfg = target_config(recipe)
    aux_ids = resolve_aux_layer_ids(recipe.layers, int(tcfg["num_hidden_layers"]))
    art = store.export
    report = ExportReport(folder)
    meta = {
        "recipe_hash": recipe.recipe_hash(),
        "checkpoint": folder.name,
        "train_step": state.step,
        "best": state.best,
    }
    spec = draft_spec(model, tcfg, aux_ids, recipe.target.path, meta)
    layer_weights = llama_weights(model)
    write_llama_draft(art.folder("vllm"), spec, layer_weights, d2t, t2d)
    report.written.append("vllm")
    write_speculators(art.folder("speculators"), model, int(tcfg["hidden_size"]))
    report.written.append("speculators")
    try:
        sg_ids = sglang_layer_ids(aux_ids)
    except ContractMismatchError as e:
        report.skipped["sglang"] = str(e)
    else:
        sg_meta = {
            **meta,
            "aux_id_convention": SGLANG_ID_CONVENTION,
            "eyrie_aux_layer_ids": aux_ids,
        }
        write_llama_draft(
            art.folder("sglang"),
            replace(spec, aux_layer_ids=sg_ids, meta=sg_meta),
            layer_weights,
            d2t,
            t2d,
        )
        report.written.append("sglang")
    for name in report.written:
        report.lint[name] = lint_draft_dir(
            art.folder(name),
            tcfg,
            expect_verifier=recipe.target.path,
            expect_aux_ids=aux_ids,
            expect_forward=spec.forward_config(),
        )
        engine = engine_read_problems(art.folder(name), spec.forward_config())
        if engine is None:
            log.info("%s: vLLM not installed here; the engine round trip did not run", name)
        report.lint[name] += engine or []
    art.write_lint(report.lint)
    art.write_summary(
        ExportSummary(
            checkpoint=folder.name,
            written=report.written,
            skipped=report.skipped,
            selection=selection(state.validations),
        )
    )
    bad = {k: v for k, v in report.lint.items() if v}
    if bad:
        raise ContractMismatchError(f"{art.dir}: exported drafts fail the lint: {bad}")
    return report
