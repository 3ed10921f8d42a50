"""The extract stage end to end on real SmolLM2 and real ShareGPT rows: layout, checks,
resume, injected OOM, NaN quarantine, disk preflight."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.extract.hf_backend import HFExtractor
from shared.errors import ConfigError
from tests.extract.conftest import make_recipe, run_extract
from tests.extract.data import write_tokenized_shard

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def extractor(smollm2_path, smollm2_model):
    return HFExtractor(make_recipe(smollm2_path))


def _shard(store_for, recipe, rows):
    store = store_for(recipe)
    write_tokenized_shard(store, 0, rows)
    return store, store.extract


def _meta(art, shard=0):
    return json.loads(art.meta_path(shard).read_text())


def test_layout_checks_and_resume(smollm2_path, smollm2_model, extractor, store_for, sharegpt_rows):
    from datasets import load_from_disk

    rows = sharegpt_rows[:6]
    recipe = make_recipe(smollm2_path, tokens_per_batch=400)
    store, art = _shard(store_for, recipe, rows)
    m = run_extract(store, 0, extractor)
    assert m.counts["rows"] == 6 and m.counts["written"] == 6 and m.counts["quarantined"] == 0
    assert m.counts["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert store.is_done("extract", 0)

    meta = _meta(art)
    assert meta["aux_layer_ids"] == [2, 15, 27]
    assert meta["aux_id_convention"].startswith("input_of_layer_k")
    assert meta["final_state"] == "pre_norm" and meta["pre_norm"] is True
    assert meta["hidden_size"] == 576 and meta["target_revision"]

    # The rows dataset sits at the shard root, beside hidden_states/, in torch format.
    assert art.data_path(0) == art.shard_dir(0) == art.hs_dir(0).parent
    data = load_from_disk(str(art.data_path(0)))
    assert data.format["type"] == "torch"
    assert data.with_format(None)["input_ids"] == [r["input_ids"] for r in rows]
    assert set(data.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert art.data(0)["loss_mask"] == [r["loss_mask"] for r in rows]
    assert set(json.loads(store.manifest_path("extract", 0).read_text())["files"]) == {
        "shard-00000/data-00000-of-00001.arrow",
        "shard-00000/dataset_info.json",
        "shard-00000/state.json",
        "shard-00000/meta.json",
    }

    for row, r in enumerate(rows):
        f = load_file(art.hs_path(0, row))
        assert set(f) == {"hidden_states", "token_ids"}
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(r["input_ids"]), 4, 576)
        assert f["token_ids"].tolist() == r["input_ids"]
        # bytes on disk: the 4 x H x 2 formula per token plus token ids and a small header.
        size = art.hs_path(0, row).stat().st_size
        assert 0 < size - len(r["input_ids"]) * (4 * 576 * 2 + 8) < 512

    # The stored aux state k is HF's output_hidden_states[k] (up to batching's bf16 noise).
    ids = rows[0]["input_ids"]
    with torch.inference_mode():
        hf = smollm2_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    got = load_file(art.hs_path(0, 0))["hidden_states"].float()
    for slot, k in enumerate([2, 15, 27]):
        cos = torch.nn.functional.cosine_similarity(got[:, slot], hf[k][0].float(), dim=-1)
        assert float(cos.min()) > 0.999

    # Rerun: every sample is already written, nothing is redone.
    mtimes = [art.hs_path(0, r).stat().st_mtime_ns for r in range(6)]
    run_extract(store, 0, extractor)
    meta2 = _meta(art)
    assert meta2["this_run"]["written"] == 0 and meta2["written_rows"] == 6
    assert [art.hs_path(0, r).stat().st_mtime_ns for r in range(6)] == mtimes


class OOMAbove:
    """The real extractor, except a batch above `limit` padded tokens raises CUDA's OOM error
    (the GPU condition this CPU machine cannot produce)."""

    def __init__(self, inner, limit):
        self.inner, self.limit, self.padded = inner, limit, []
        self.aux_ids, self.hidden_size = inner.aux_ids, inner.hidden_size

    def extract(self, batch):
        padded = len(batch) * max(len(b) for b in batch)
        self.padded.append(padded)
        if padded > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        return self.inner.extract(batch)

    def metadata(self):
        return self.inner.metadata()


def test_injected_oom_halves_budget_and_shard_completes(
    smollm2_path, extractor, store_for, sharegpt_rows
):
    rows = [
        dict(r, input_ids=r["input_ids"][:64], loss_mask=r["loss_mask"][:64], seq_len=64)
        for r in sharegpt_rows[:8]
    ]
    recipe = make_recipe(smollm2_path, tokens_per_batch=1024)
    store, art = _shard(store_for, recipe, rows)
    oom = OOMAbove(extractor, limit=256)
    m = run_extract(store, 0, oom)
    # 8 x 64 = 512 tokens: budget 1024 -> OOM at 512, budget 512 -> OOM at 512,
    # budget 256 -> two batches of 4 x 64.
    assert oom.padded == [512, 512, 256, 256]
    run = _meta(art)["this_run"]
    assert run["oom_retries"] == 2 and run["final_budget_tokens"] == 256
    assert m.counts["written"] == 8 and m.counts["oom_retries"] == 2
    assert all(art.hs_path(0, r).is_file() for r in range(8))


class NaNInRow:
    """The real extractor, with one NaN planted in the sample whose first tokens match."""

    def __init__(self, inner, poisoned_ids):
        self.inner, self.poisoned = inner, list(poisoned_ids)
        self.aux_ids, self.hidden_size = inner.aux_ids, inner.hidden_size

    def extract(self, batch):
        out = self.inner.extract(batch)
        for ids, s in zip(batch, out, strict=True):
            if list(ids) == self.poisoned:
                s.states[3, 1, 7] = float("nan")
        return out

    def metadata(self):
        return self.inner.metadata()


def test_nan_sample_is_quarantined(smollm2_path, extractor, store_for, sharegpt_rows, smollm2_tok):
    from tests.extract.data import tokenized_rows

    # 21 short rows: one bad row is 4.8 %, under the 5 % failure threshold. Tokens 30..54
    # skip the system prompt every row shares, so the poisoned row is the only match.
    rows = [
        dict(r, input_ids=r["input_ids"][30:54], loss_mask=r["loss_mask"][30:54], seq_len=24)
        for r in tokenized_rows(smollm2_tok, 21, 160, skip=30)
    ]
    assert len({tuple(r["input_ids"]) for r in rows}) == 21
    recipe = make_recipe(smollm2_path, tokens_per_batch=2048)
    store, art = _shard(store_for, recipe, rows)
    m = run_extract(store, 0, NaNInRow(extractor, rows[5]["input_ids"]))
    assert m.counts["quarantined"] == 1 and m.counts["written"] == 20
    q = _meta(art)["quarantined"]
    assert [x["row"] for x in q] == [5] and q[0]["id"] == rows[5]["id"]
    assert "non-finite" in q[0]["reason"]
    assert not art.hs_path(0, 5).exists() and art.hs_path(0, 6).is_file()


def test_disk_preflight_refuses_with_both_numbers(
    smollm2_path, store_for, sharegpt_rows, monkeypatch
):
    import shutil
    from collections import namedtuple

    rows = sharegpt_rows[:3]
    recipe = make_recipe(smollm2_path)
    store, _ = _shard(store_for, recipe, rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    needed = tokens * 4 * 576 * 2
    # A nearly full volume cannot be made here; report 1,000 free bytes instead.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ConfigError) as err:
        run_extract(store, 0)  # no extractor: the model is never loaded
    assert f"({needed} bytes)" in str(err.value) and "(1000 bytes)" in str(err.value)


def test_speculators_reads_the_shard_as_it_is(smollm2_path, extractor, store_for, sharegpt_rows):
    """Peer round trip: speculators 0.9.0's own `ArrowDataset` (datapath = the shard folder,
    hidden states from `hidden_states/` beside it, as `speculators train --data-path` reads
    them) and its `CollateFn` load every extracted row with the right values and shapes."""
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import SampleUnavailable

    rows = sharegpt_rows[:4]
    store, art = _shard(store_for, make_recipe(smollm2_path), rows)
    run_extract(store, 0, extractor)
    ds = ArrowDataset(max_len=1024, datapath=str(art.shard_dir(0)), on_missing="raise")
    assert len(ds) == 4 and ds.approx_lengths == [len(r["input_ids"]) for r in rows]
    for i, r in enumerate(rows):
        item = ds[i]
        assert not isinstance(item, SampleUnavailable), item
        n = len(r["input_ids"])
        stored = load_file(art.hs_path(0, i))["hidden_states"]
        assert item["input_ids"].tolist() == r["input_ids"]
        assert item["loss_mask"].tolist() == r["loss_mask"]
        assert item["hidden_states"].shape == (n, 3 * 576)
        assert torch.equal(item["hidden_states"], stored[:, :3].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], stored[:, 3])
    # speculators packs a batch into one max_len row; document_ids says whose token is where.
    lengths = [len(r["input_ids"]) for r in rows]
    max_len = sum(lengths) + 8
    batch = CollateFn(max_len=max_len, hidden_size=576)([ds[i] for i in range(4)])
    assert batch["error_records"] == 0
    assert batch["hidden_states"].shape == (1, max_len, 3 * 576)
    flat = [t for r in rows for t in r["input_ids"]]
    assert batch["input_ids"][0, : len(flat)].tolist() == flat
    docs = batch["document_ids"][0]
    assert [int((docs == i).sum()) for i in range(4)] == lengths and int((docs == -1).sum()) == 8


def test_writer_moves_a_backend_file_into_place_or_removes_it(tmp_path):
    """A file the backend wrote next to the final one (vLLM extract mode) is checked, then
    renamed (same inode: not written again); a quarantined one is removed."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.extract.vllm_backend import staging_path
    from services.extract.writer import StateWriter

    def final(row: int):
        return tmp_path / f"hs_{row}.safetensors"

    ids = [5, 6, 7]
    good = torch.randn(3, 4, 8).to(torch.bfloat16)
    bad = good.clone()
    bad[1, 2, 3] = float("nan")
    files = {}
    for row, states in ((0, good), (1, bad)):
        files[row] = staging_path(final(row))
        save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, files[row])
    inode = files[0].stat().st_ino
    w = StateWriter(final, 4, torch.bfloat16)
    w.submit(0, "a", good, ids, ids, files[0])
    w.submit(1, "b", bad, ids, ids, files[1])
    result = w.close()
    assert result.written == 1 and [q.row for q in result.quarantined] == [1]
    assert final(0).stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hs_0.safetensors"]
    assert torch.equal(load_file(final(0))["hidden_states"], good)
