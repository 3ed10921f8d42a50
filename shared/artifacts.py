"""The run store: every path of a run, and a typed reader and writer per artifact.

A run lives at `$EYRIE_DATA/runs/<run_id>/`. Stages never build a path: they ask the
`RunStore` (`store.prep.conversations(3)`, `store.vocab.read_maps()`), and a test checks
that no service does otherwise. JSON artifacts are `shared.records` models; tensors and
Arrow datasets are described below with their shapes and dtypes. Every write goes through
`shared.store.atomic_path` (temp + fsync + rename, shared file modes).

Layout (N = shard number, `shard-NNNNN`, 5 digits; each stage folder also holds
`manifest-NNNNN.json` per finished shard, `shared.store.Manifest`):

    recipe.yaml, recipe.json   the resolved recipe (json = canonical, what the run id hashes)
    commands.log               every command that touched the run
    timings.json               wall seconds per stage (the conductor)
    logs/                      worker and Redis logs of `eyrie demo`
    plan/      plan.json (Plan), selection.npy int64 [selected, 2] (dataset, source row) in
               shard order, index-DDD.npy int64 [rows, 2] byte range [start, end) of every
               row of local dataset DDD
    prep/      shard-N.jsonl (Conversation per line), shard-N.quarantine.jsonl
               (QuarantinedRow), shard-N.report.json (PrepReport)
    dedup/     shard-N.jsonl: the conversations of prep shard N that dedup kept, in order;
               report.json (DedupReport)
    split/     split.json (Split); heldout.jsonl: each validation conversation cut before
               its first assistant turn (Conversation), the `heldout` benchmark prompts
    regen/     shard-N.jsonl (RegenRecord, sorted by `row` = line in dedup/shard-N.jsonl),
               shard-N.errors.jsonl (RegenFailure), shard-N.partial.jsonl and
               shard-N.partial-errors.jsonl (append-only resume points, removed when done)
    serve/     <mode>.log: the log of each vLLM server started for the run
    tokenize/  shard-N/ HF `save_to_disk` (TokenizedShard: input_ids list[int32],
               loss_mask list[int8] (1 = assistant-generated), seq_len int32, id str,
               conversation_id str, source str); shard-N.report.json (counts per reason)
    vocab/     token_freq.npy int64 [target_vocab] (counts over loss-masked tokens of the
               training split), d2t.npy int64 [draft_vocab] (offsets: target = draft +
               d2t[draft]), t2d.npy bool [target_vocab], coverage.json (Coverage),
               token_freq.pt ({target id: count}, speculators' format)
    extract/   shard-N/ in speculators' offline layout, readable by speculators' own
               `ArrowDataset(datapath=shard-N)`: the HF save_to_disk files at the shard
               root (state.json, dataset_info.json, data-*.arrow: input_ids, loss_mask,
               seq_len; the rows of tokenize/shard-N, same order; saved in torch format),
               hidden_states/hs_<row>.safetensors (hidden_states bf16 [seq_len, 3+1, H]:
               the aux ids in order, then the final PRE-norm state; token_ids int64
               [seq_len]), meta.json (ExtractMeta); vllm-hidden-states/ (scratch of the
               vllm backend's server)
    train/     checkpoints/epoch-EEEE/ and checkpoints/step-latest/ (services.train.
               checkpoints), metrics.jsonl, metrics.png, best.json (BestCheckpoint)
    export/    vllm/ (llama-style draft, shared.draft), speculators/, sglang/ (aux ids
               written i-1), lint.json ({folder: {ok, problems}}), export.json
               (ExportSummary)
    bench/     shard-N.json: shard 0 the baseline server's sweep, shard 1 the eagle3
               server's (services.bench.sweep); turn1-answers.json; .measure.lock
    report/    report.json, report.md, speedup.png, acceptance.png (services.bench.report)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from shared.errors import ArtifactError
from shared.recipe import Recipe, recipe_to_yaml, resolve_recipe
from shared.records import (
    BestCheckpoint,
    Conversation,
    Coverage,
    DedupReport,
    ExportSummary,
    ExtractMeta,
    Plan,
    PrepReport,
    QuarantinedRow,
    RegenFailure,
    RegenRecord,
    Split,
)
from shared.store import (
    Manifest,
    append_text,
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    data_root,
    make_dirs,
    read_json_file,
    sha256_tree,
)

if TYPE_CHECKING:
    import datasets

M = TypeVar("M", bound=BaseModel)


def shard_name(shard: int) -> str:
    """`shard-NNNNN`: the name every per-shard artifact starts with."""
    return f"shard-{int(shard):05d}"


# -- generic record I/O ----------------------------------------------------------------------


def write_jsonl(path: Path, records: Iterable[BaseModel]) -> Path:
    """Write records as JSON lines (unset optional keys left out), atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.model_dump_json(exclude_none=True) + "\n")
    return path


def read_jsonl(path: Path, model: type[M]) -> list[M]:
    """Every line of a JSONL artifact as `model`.

    Raises:
        ArtifactError: the file is missing (its stage has not finished) or a line does not
            fit `model`; the message names the file and the line.
    """
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the stage that writes it has not finished")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(model.model_validate_json(line))
                except ValidationError as e:
                    raise ArtifactError(f"{path} line {lineno}: not a {model.__name__}: {e}") from e
    return out


def write_model(path: Path, record: BaseModel) -> Path:
    """Write one record as indented JSON, atomically."""
    return atomic_write_bytes(path, (record.model_dump_json(indent=2) + "\n").encode())


def read_model(path: Path, model: type[M]) -> M:
    """One JSON artifact as `model`.

    Raises:
        ArtifactError: missing, or not a `model`; the message names the file.
    """
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the stage that writes it has not finished")
    try:
        return model.model_validate_json(path.read_bytes())
    except ValidationError as e:
        raise ArtifactError(f"{path}: not a {model.__name__}: {e}") from e


def write_npy(path: Path, arr: np.ndarray) -> Path:
    """Write a numpy array (no pickle), atomically."""
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return atomic_write_bytes(path, buf.getvalue())


def read_npy(path: Path) -> np.ndarray:
    """A numpy array written by `write_npy`. Raises ArtifactError when missing."""
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the stage that writes it has not finished")
    return np.load(path, allow_pickle=False)


# -- per-stage artifacts ---------------------------------------------------------------------


class _Stage:
    """Base of a stage's artifacts: its folder under the run."""

    name = ""

    def __init__(self, store: RunStore):
        self.store = store

    @property
    def dir(self) -> Path:
        """The stage's folder (not created: writers create what they write into)."""
        return self.store.root / self.name

    def _shard(self, shard: int, suffix: str) -> Path:
        return self.dir / f"{shard_name(shard)}{suffix}"


class PlanArtifacts(_Stage):
    """`plan/`: the plan, the selected rows, the row index of each local dataset."""

    name = "plan"

    @property
    def plan_path(self) -> Path:
        return self.dir / "plan.json"

    @property
    def selection_path(self) -> Path:
        return self.dir / "selection.npy"

    def index_path(self, dataset: int) -> Path:
        """`plan/index-DDD.npy`: byte range of every row of local dataset DDD."""
        return self.dir / f"index-{dataset:03d}.npy"

    def read(self) -> Plan:
        """The plan. Raises ArtifactError when the plan stage has not run."""
        return read_model(self.plan_path, Plan)

    def num_shards(self) -> int:
        """Prep shards of the run (the shard count of every per-shard stage)."""
        return self.read().num_shards

    def shard_rows(self, shard: int) -> np.ndarray:
        """int64 `[rows, 2]`: (dataset index, source row) of each row of prep shard `shard`."""
        plan = self.read()
        sel = read_npy(self.selection_path)
        return sel[shard * plan.shard_rows : (shard + 1) * plan.shard_rows]

    def row_index(self, dataset: int) -> np.ndarray:
        """int64 `[rows, 2]`: byte range [start, end) of each row of a local dataset."""
        return read_npy(self.index_path(dataset))


class PrepArtifacts(_Stage):
    """`prep/`: canonical conversations, quarantined rows and a report per shard."""

    name = "prep"

    def conversations_path(self, shard: int) -> Path:
        return self._shard(shard, ".jsonl")

    def quarantine_path(self, shard: int) -> Path:
        return self._shard(shard, ".quarantine.jsonl")

    def report_path(self, shard: int) -> Path:
        return self._shard(shard, ".report.json")

    def conversations(self, shard: int) -> list[Conversation]:
        return read_jsonl(self.conversations_path(shard), Conversation)

    def write(
        self,
        shard: int,
        kept: Sequence[Conversation],
        quarantined: Sequence[QuarantinedRow],
        report: PrepReport,
    ) -> list[Path]:
        """Write the shard's three files; returns their paths."""
        return [
            write_jsonl(self.conversations_path(shard), kept),
            write_jsonl(self.quarantine_path(shard), quarantined),
            write_model(self.report_path(shard), report),
        ]


class DedupArtifacts(_Stage):
    """`dedup/`: the conversations kept from each prep shard, and the counts."""

    name = "dedup"

    def conversations_path(self, shard: int) -> Path:
        return self._shard(shard, ".jsonl")

    @property
    def report_path(self) -> Path:
        return self.dir / "report.json"

    def conversations(self, shard: int) -> list[Conversation]:
        """The kept conversations of prep shard `shard`, in prep order."""
        return read_jsonl(self.conversations_path(shard), Conversation)

    def write(self, kept: dict[int, list[Conversation]], report: DedupReport) -> list[Path]:
        files = [write_jsonl(self.conversations_path(s), rows) for s, rows in sorted(kept.items())]
        return files + [write_model(self.report_path, report)]


class SplitArtifacts(_Stage):
    """`split/`: the validation conversations and their benchmark prompts."""

    name = "split"

    @property
    def split_path(self) -> Path:
        return self.dir / "split.json"

    @property
    def heldout_path(self) -> Path:
        return self.dir / "heldout.jsonl"

    def read(self) -> Split:
        return read_model(self.split_path, Split)

    def val_ids(self) -> set[str]:
        """Conversation ids held out from training."""
        return set(self.read().val_ids)

    def heldout_prompts(self) -> list[Conversation]:
        return read_jsonl(self.heldout_path, Conversation)

    def write(self, split: Split, prompts: Sequence[Conversation]) -> list[Path]:
        return [write_model(self.split_path, split), write_jsonl(self.heldout_path, prompts)]


class RegenArtifacts(_Stage):
    """`regen/`: regenerated conversations, failures, and the resume points."""

    name = "regen"

    def records_path(self, shard: int) -> Path:
        return self._shard(shard, ".jsonl")

    def errors_path(self, shard: int) -> Path:
        return self._shard(shard, ".errors.jsonl")

    def partial_path(self, shard: int) -> Path:
        return self._shard(shard, ".partial.jsonl")

    def partial_errors_path(self, shard: int) -> Path:
        return self._shard(shard, ".partial-errors.jsonl")

    def records(self, shard: int) -> list[RegenRecord]:
        return read_jsonl(self.records_path(shard), RegenRecord)

    def write(
        self, shard: int, ok: Sequence[RegenRecord], bad: Sequence[RegenFailure]
    ) -> list[Path]:
        """Write the shard's outputs sorted by row (and draw); returns their paths."""
        return [
            write_jsonl(self.records_path(shard), sorted(ok, key=attrgetter("row", "sample"))),
            write_jsonl(self.errors_path(shard), sorted(bad, key=attrgetter("row"))),
        ]

    def read_resume(self, shard: int) -> tuple[list[RegenRecord], list[RegenFailure]]:
        """What an unfinished shard already has (its resume files).

        After a kill between writing the outputs and the manifest, the outputs themselves.
        A torn last line (hard kill mid-write) is cut off.
        """
        if not self.partial_path(shard).is_file() and self.records_path(shard).is_file():
            return self.records(shard), read_jsonl(self.errors_path(shard), RegenFailure)
        return (
            [RegenRecord.model_validate_json(x) for x in _durable_lines(self.partial_path(shard))],
            [
                RegenFailure.model_validate_json(x)
                for x in _durable_lines(self.partial_errors_path(shard))
            ],
        )

    def remove_partial(self, shard: int) -> None:
        for p in (self.partial_path(shard), self.partial_errors_path(shard)):
            p.unlink(missing_ok=True)


def _durable_lines(path: Path) -> list[bytes]:
    if not path.is_file():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "rb+") as f:
            f.truncate(end)
    return [line for line in data[:end].splitlines() if line.strip()]


@dataclass
class TokenizedSample:
    """One training row: a conversation rendered, tokenized and masked.

    Attributes:
        id: the sample id (the conversation id, or `<conversation id>#<turn>` when one
            conversation gives several samples).
        conversation_id: the conversation it comes from (what the split holds out).
        source: the dataset name.
        input_ids: token ids, `list[int]` of length n.
        loss_mask: 0/1 per token, length n; 1 = the assistant generated it.
    """

    id: str
    conversation_id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


TOKENIZED_COLUMNS = ("input_ids", "loss_mask", "seq_len", "id", "conversation_id", "source")
#: The columns speculators' offline data format reads.
SPECULATORS_COLUMNS = ("input_ids", "loss_mask", "seq_len")


class TokenizeArtifacts(_Stage):
    """`tokenize/`: one HF dataset of `TokenizedSample` rows and a report per shard."""

    name = "tokenize"

    def dataset_path(self, shard: int) -> Path:
        return self._shard(shard, "")

    def report_path(self, shard: int) -> Path:
        return self._shard(shard, ".report.json")

    def write(
        self, shard: int, samples: Sequence[TokenizedSample], report: dict[str, Any]
    ) -> list[Path]:
        """Write the shard's dataset and report.

        The dataset fingerprint hashes its content, so equal samples give byte-identical
        folders whichever worker wrote them.
        """
        import hashlib

        import datasets
        import pyarrow as pa

        table = pa.table(
            {
                "input_ids": pa.array([s.input_ids for s in samples], pa.list_(pa.int32())),
                "loss_mask": pa.array([s.loss_mask for s in samples], pa.list_(pa.int8())),
                "seq_len": pa.array([len(s.input_ids) for s in samples], pa.int32()),
                "id": pa.array([s.id for s in samples], pa.string()),
                "conversation_id": pa.array([s.conversation_id for s in samples], pa.string()),
                "source": pa.array([s.source for s in samples], pa.string()),
            }
        )
        h = hashlib.sha256()
        for s in samples:
            h.update(f"{s.id}\0{s.source}\0{s.input_ids}\0{s.loss_mask}\n".encode())
        ds = datasets.Dataset(table, fingerprint=h.hexdigest()[:16])
        path = self.dataset_path(shard)
        with atomic_path(path) as tmp:
            # An empty dataset is saved with no arrow file unless a shard count is given,
            # and `load_from_disk` then fails (IndexError): a shard whose every row was
            # dropped must still load, as zero rows.
            ds.save_to_disk(str(tmp), num_shards=1 if len(samples) == 0 else None)
        return [path, atomic_write_json(self.report_path(shard), report)]

    def dataset(self, shard: int) -> datasets.Dataset:
        """The shard's dataset (python-object format).

        Raises:
            ArtifactError: missing, or a column is missing; the message names both.
        """
        from datasets import load_from_disk

        path = self.dataset_path(shard)
        if not path.is_dir():
            raise ArtifactError(f"{path}: tokenized shard {shard} not found; run tokenize")
        ds = load_from_disk(str(path))
        missing = [c for c in TOKENIZED_COLUMNS if c not in ds.column_names]
        if missing:
            raise ArtifactError(f"{path}: columns {missing} missing (got {ds.column_names})")
        return ds.with_format(None)

    def reports(self) -> list[dict[str, Any]]:
        """Every shard's report, in shard order."""
        n = self.store.plan.num_shards()
        return [json.loads(self.report_path(s).read_text()) for s in range(n)]


class VocabArtifacts(_Stage):
    """`vocab/`: token counts, the draft vocabulary maps and the coverage report."""

    name = "vocab"

    @property
    def freq_path(self) -> Path:
        return self.dir / "token_freq.npy"

    @property
    def d2t_path(self) -> Path:
        return self.dir / "d2t.npy"

    @property
    def t2d_path(self) -> Path:
        return self.dir / "t2d.npy"

    @property
    def coverage_path(self) -> Path:
        return self.dir / "coverage.json"

    @property
    def speculators_freq_path(self) -> Path:
        return self.dir / "token_freq.pt"

    def write(
        self, freq: np.ndarray, d2t: np.ndarray, t2d: np.ndarray, coverage: Coverage
    ) -> list[Path]:
        """Write every vocab file (speculators' `token_freq.pt` too); returns the paths."""
        import torch

        files = [
            write_npy(self.freq_path, freq),
            write_npy(self.d2t_path, d2t),
            write_npy(self.t2d_path, t2d),
        ]
        with atomic_path(self.speculators_freq_path) as tmp:
            torch.save({int(i): int(freq[i]) for i in np.nonzero(freq)[0]}, tmp)
        return files + [self.speculators_freq_path, write_model(self.coverage_path, coverage)]

    def read_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """`(d2t int64 [draft_vocab], t2d bool [target_vocab])`.

        Raises:
            ArtifactError: the vocab stage has not run.
        """
        return read_npy(self.d2t_path).astype(np.int64), read_npy(self.t2d_path).astype(bool)

    def coverage(self) -> Coverage:
        return read_model(self.coverage_path, Coverage)


class ExtractArtifacts(_Stage):
    """`extract/`: per shard the rows, one hidden-state file per row, and meta.json."""

    name = "extract"
    HS_DIR = "hidden_states"

    def shard_dir(self, shard: int) -> Path:
        return self._shard(shard, "")

    #: The file `save_to_disk` writes last; its presence at the shard root marks the rows
    #: as written (they are moved there with it last).
    DATA_STATE = "state.json"

    def data_path(self, shard: int) -> Path:
        """The shard's rows dataset: the shard folder itself.

        That is where speculators' `ArrowDataset` reads it (`load_from_disk(datapath)`, with
        `datapath/hidden_states/` beside it).
        """
        return self.shard_dir(shard)

    def hs_dir(self, shard: int) -> Path:
        return self.shard_dir(shard) / self.HS_DIR

    def hs_path(self, shard: int, row: int) -> Path:
        """`hidden_states/hs_<row>.safetensors` (speculators' offline name)."""
        return self.hs_dir(shard) / f"hs_{row}.safetensors"

    def meta_path(self, shard: int) -> Path:
        return self.shard_dir(shard) / "meta.json"

    @property
    def vllm_scratch(self) -> Path:
        """Where the vllm backend's extract-mode server writes its files."""
        return self.dir / "vllm-hidden-states"

    def shards(self) -> list[int]:
        """The shards with finished output (a manifest), ascending."""
        return [m.shard for m in self.store.manifests(self.name)]

    def meta(self, shard: int) -> ExtractMeta:
        return read_model(self.meta_path(shard), ExtractMeta)

    def write_meta(self, shard: int, meta: ExtractMeta) -> Path:
        return write_model(self.meta_path(shard), meta)

    def data(self, shard: int) -> datasets.Dataset:
        """The shard's rows (input_ids, loss_mask, seq_len), python-object format."""
        from datasets import load_from_disk

        path = self.data_path(shard)
        if not (path / self.DATA_STATE).is_file():
            raise ArtifactError(
                f"{path}: no rows dataset at the shard root (extract shard {shard} did not "
                "finish, or was written with the old data/ subfolder: rerun extract --force)"
            )
        return load_from_disk(str(path)).with_format(None)

    def data_files(self, shard: int) -> list[Path]:
        """The rows dataset's own files at the shard root.

        What a manifest hashes; the hidden-state files beside them are not part of it.
        """
        root = self.data_path(shard)
        arrow = sorted(root.glob("data-*.arrow"))
        return [*arrow, root / "dataset_info.json", root / self.DATA_STATE]

    def write_data(self, shard: int, rows: datasets.Dataset) -> list[Path]:
        """Write the shard's rows once at the shard root; later calls keep them.

        Only speculators' columns, saved in torch format (speculators' preprocessing calls
        `set_format(type="torch")` before saving, and its `ArrowDataset` compares the rows'
        `input_ids` with tensors). Each file is moved into place atomically, `state.json`
        last, so the rows count as written only when all of them are.

        Returns:
            `data_files(shard)`.
        """
        import shutil
        import tempfile

        path = make_dirs(self.data_path(shard))
        if (path / self.DATA_STATE).is_file():
            return self.data_files(shard)
        holder = Path(tempfile.mkdtemp(prefix=".tmp-data-", dir=path))
        try:
            ds = rows.select_columns(list(SPECULATORS_COLUMNS)).with_format("torch")
            # An empty dataset needs an explicit shard count to be loadable (see tokenize).
            ds.save_to_disk(str(holder / "ds"), num_shards=1 if len(ds) == 0 else None)
            files = sorted((holder / "ds").iterdir(), key=lambda f: f.name == self.DATA_STATE)
            for f in files:
                with atomic_path(path / f.name) as tmp:
                    shutil.move(str(f), str(tmp))
        finally:
            shutil.rmtree(holder, ignore_errors=True)
        return self.data_files(shard)


class TrainArtifacts(_Stage):
    """`train/`: checkpoints, metrics and the best epoch."""

    name = "train"

    #: Files of one checkpoint folder (services.train.checkpoints writes and reads them).
    CHECKPOINT_WEIGHTS = "draft.safetensors"
    CHECKPOINT_STATE = "training_state.pt"
    CHECKPOINT_STATE_JSON = "state.json"
    STEP_LATEST = "step-latest"

    @property
    def checkpoints_dir(self) -> Path:
        return self.dir / "checkpoints"

    def epoch_dir(self, epoch: int) -> Path:
        """`checkpoints/epoch-EEEE` for the 1-based finished epoch."""
        return self.checkpoints_dir / f"epoch-{epoch:04d}"

    @property
    def step_dir(self) -> Path:
        """`checkpoints/step-latest`: the rolling mid-epoch checkpoint."""
        return self.checkpoints_dir / self.STEP_LATEST

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def plot_path(self) -> Path:
        return self.dir / "metrics.png"

    @property
    def best_path(self) -> Path:
        return self.dir / "best.json"

    def write_best(self, best: BestCheckpoint) -> Path:
        return write_model(self.best_path, best)


class ExportArtifacts(_Stage):
    """`export/`: the served draft folders, their lint and what was written."""

    name = "export"
    FOLDERS = ("vllm", "speculators", "sglang")

    def folder(self, name: str) -> Path:
        """`export/<name>/` for name in FOLDERS."""
        if name not in self.FOLDERS:
            raise ArtifactError(f"unknown export folder {name!r}; known: {self.FOLDERS}")
        return self.dir / name

    @property
    def vllm_draft(self) -> Path:
        """The draft an eagle3 server loads: the llama-style folder."""
        return self.folder("vllm")

    @property
    def lint_path(self) -> Path:
        return self.dir / "lint.json"

    @property
    def summary_path(self) -> Path:
        return self.dir / "export.json"

    def write_lint(self, results: dict[str, list[str]]) -> Path:
        """`{folder: {"ok": bool, "problems": [...]}}`."""
        return atomic_write_json(
            self.lint_path, {k: {"ok": not v, "problems": v} for k, v in results.items()}
        )

    def write_summary(self, summary: ExportSummary) -> Path:
        return write_model(self.summary_path, summary)


class BenchArtifacts(_Stage):
    """`bench/`: one server's sweep per shard, turn-1 answers, the measurement lock."""

    name = "bench"

    def shard_path(self, shard: int) -> Path:
        return self._shard(shard, ".json")

    @property
    def turn1_path(self) -> Path:
        return self.dir / "turn1-answers.json"

    @property
    def lock_path(self) -> Path:
        return self.dir / ".measure.lock"

    def write_shard(self, shard: int, result: dict[str, Any]) -> Path:
        return atomic_write_json(self.shard_path(shard), result)

    def read_shard(self, shard: int) -> dict[str, Any]:
        path = self.shard_path(shard)
        if not path.is_file():
            raise ArtifactError(f"{path}: bench shard {shard} has not run")
        result: dict[str, Any] = json.loads(path.read_text())
        return result


class ReportArtifacts(_Stage):
    """`report/`: the benchmark report as JSON, Markdown and plots."""

    name = "report"

    @property
    def json_path(self) -> Path:
        return self.dir / "report.json"

    @property
    def markdown_path(self) -> Path:
        return self.dir / "report.md"

    @property
    def speedup_plot(self) -> Path:
        return self.dir / "speedup.png"

    @property
    def acceptance_plot(self) -> Path:
        return self.dir / "acceptance.png"

    def read(self) -> dict[str, Any]:
        if not self.json_path.is_file():
            raise ArtifactError(f"{self.json_path}: the run has no report yet")
        report: dict[str, Any] = json.loads(self.json_path.read_text())
        return report


class ServeArtifacts(_Stage):
    """`serve/`: the logs of the vLLM servers started for the run."""

    name = "serve"

    def log_path(self, mode: str) -> Path:
        return self.dir / f"{mode}.log"


# -- the run ---------------------------------------------------------------------------------


class RunStore:
    """One run's folder, `<data_root>/runs/<run_id>/`, and its artifacts by stage.

    Args:
        run_id: the sanitized run id (`Recipe.run_id()`).
        root: the data root; default `shared.store.data_root()`.
    """

    def __init__(self, run_id: str, root: Path | None = None):
        self.run_id = run_id
        self.root = (root or data_root()) / "runs" / run_id
        self.plan = PlanArtifacts(self)
        self.prep = PrepArtifacts(self)
        self.dedup = DedupArtifacts(self)
        self.split = SplitArtifacts(self)
        self.regen = RegenArtifacts(self)
        self.tokenize = TokenizeArtifacts(self)
        self.vocab = VocabArtifacts(self)
        self.extract = ExtractArtifacts(self)
        self.train = TrainArtifacts(self)
        self.export = ExportArtifacts(self)
        self.bench = BenchArtifacts(self)
        self.report = ReportArtifacts(self)
        self.serve = ServeArtifacts(self)

    # -- creation and the recipe -------------------------------------------------------------
    @classmethod
    def at(cls, folder: Path) -> RunStore:
        """The run in `folder`, wherever it lies (also a run folder copied out of a data root)."""
        folder = Path(folder)
        store = cls(folder.name, folder.parent.parent)
        store.root = folder
        return store

    @classmethod
    def create(cls, recipe: Recipe, command: str = "", root: Path | None = None) -> RunStore:
        """Create (or reopen) the run folder; write the recipe and log the command."""
        store = cls(recipe.run_id(), root)
        make_dirs(store.root)
        atomic_write_bytes(store.recipe_yaml, recipe_to_yaml(recipe).encode())
        atomic_write_bytes(store.recipe_json, recipe.canonical_json().encode())
        if command:
            append_text(
                store.root / "commands.log", f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {command}\n"
            )
        return store

    @property
    def recipe_json(self) -> Path:
        return self.root / "recipe.json"

    @property
    def recipe_yaml(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def timings_path(self) -> Path:
        return self.root / "timings.json"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def exists(self) -> bool:
        """Whether the run has been created (its resolved recipe is stored)."""
        return self.recipe_json.is_file()

    def recipe(self) -> Recipe:
        """The resolved recipe stored with the run (what every job reads).

        Raises:
            ArtifactError: the run does not exist, or its recipe hashes to another run id.
        """
        if not self.recipe_json.is_file():
            raise ArtifactError(f"{self.recipe_json}: run {self.run_id!r} does not exist")
        recipe = resolve_recipe(read_json_file(self.recipe_json))
        if recipe.run_id() != self.run_id:
            raise ArtifactError(
                f"{self.recipe_json}: recipe hashes to run {recipe.run_id()!r}, not {self.run_id!r}"
            )
        return recipe

    def timings(self) -> dict[str, float]:
        """Wall seconds per finished stage."""
        p = self.timings_path
        return json.loads(p.read_text()) if p.is_file() else {}

    def write_timings(self, timings: dict[str, float]) -> Path:
        return atomic_write_json(self.timings_path, timings)

    # -- manifests -----------------------------------------------------------------------------
    def stage_dir(self, stage: str) -> Path:
        """`<run>/<stage>/`: for the stage machinery (`shared.stage`), not stage bodies."""
        return self.root / stage

    def manifest_path(self, stage: str, shard: int = 0) -> Path:
        return self.stage_dir(stage) / f"manifest-{int(shard):05d}.json"

    def is_done(self, stage: str, shard: int = 0) -> bool:
        return self.manifest_path(stage, shard).is_file()

    def write_manifest(
        self,
        stage: str,
        shard: int,
        counts: dict[str, int],
        files: Sequence[Path] = (),
        extra: dict[str, Any] | None = None,
    ) -> Manifest:
        """Hash `files`, then write the manifest atomically: the shard is now done."""
        sdir = self.stage_dir(stage)
        hashes = {str(Path(f).relative_to(sdir)): sha256_tree(Path(f)) for f in files}
        m = Manifest(
            run_id=self.run_id,
            stage=stage,
            shard=int(shard),
            counts={k: int(v) for k, v in counts.items()},
            files=hashes,
            recipe_hash=self.recipe().recipe_hash(),
            extra=extra or {},
        )
        atomic_write_json(self.manifest_path(stage, shard), m.to_json())
        return m

    def read_manifest(self, stage: str, shard: int = 0) -> Manifest:
        path = self.manifest_path(stage, shard)
        if not path.is_file():
            raise ArtifactError(f"{path}: stage {stage!r} shard {shard} has not finished")
        return Manifest(**read_json_file(path))

    def manifests(self, stage: str) -> list[Manifest]:
        """All manifests of a stage, by shard."""
        d = self.stage_dir(stage)
        return [Manifest(**read_json_file(p)) for p in sorted(d.glob("manifest-*.json"))]


def list_runs(root: Path | None = None) -> list[str]:
    """Run ids under the data root, sorted."""
    runs = (root or data_root()) / "runs"
    return sorted(p.parent.name for p in runs.glob("*/recipe.json")) if runs.is_dir() else []
