"""Training samples read from the extract stage's shards (speculators' offline layout).

Responsibility: index every extracted sample, split them into train and validation, and
load one sample as the draft's aligned inputs.

Layout read (`shared/artifacts.py`, extract/): `extract/shard-N/data/` (HF save_to_disk with
`input_ids`, `loss_mask`, `seq_len`), `extract/shard-N/hidden_states/hs_<row>.safetensors`
(`hidden_states` bf16 `[seq_len, 3+1, H]`: the 3 aux layers, then the final PRE-norm state;
`token_ids` int64 `[seq_len]`), and `extract/shard-N/meta.json`.

Alignment (speculators `models/eagle3/data.py: shift_batch`, vLLM's eagle proposer): the
draft at position t sees the target's aux states `g_t` and the next token `x_{t+1}`, and is
trained against the teacher logits taken at `t+1`, which predict `x_{t+2}`. So a sample of n
tokens gives n-1 positions: `input_ids = x[1:]`, `aux = g[:-1]`, `final = y[1:]`,
`position_ids = 1..n-1`. The loss mask shifts with the targets as
`shared.conventions.shift_mask_left` says (a position is trained when the token it predicts
is assistant-generated): `mask = shift_mask_left(l)[1:]`. This differs from speculators'
`shift_batch` (which keeps `l[1:]`, training the prediction after the end-of-turn token and
skipping the first answer token), on purpose: EAGLE-3 conventions §4.

Invariants: a row whose hidden-state file is missing (quarantined by extract) is skipped and
counted, never trained; a sample with no trainable position after the shift is skipped and
counted; a file whose shape disagrees with the shard's data raises `ArtifactError` naming
the file (extract already checked its token ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.conventions import NUM_AUX_LAYERS, shift_mask_left
from shared.errors import ArtifactError, ContractMismatchError
from shared.store import RunStore

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SampleRef:
    """One extracted sample: where it lives and how many aligned positions it gives.

    Attributes:
        shard_dir: `extract/shard-N/`.
        row: row index in the shard's `data/` (and the `hs_<row>` file number).
        positions: aligned positions after the shift (seq_len - 1).
    """

    shard_dir: Path
    row: int
    positions: int

    @property
    def hs_file(self) -> Path:
        return self.shard_dir / "hidden_states" / f"hs_{self.row}.safetensors"


@dataclass
class Sample:
    """One sample's aligned draft inputs (all CPU tensors, n = positions).

    Attributes:
        input_ids: int64 `[n]`, tokens x_{t+1}.
        aux: `[n, 3*H]` (stored dtype, bf16), concat of the 3 aux states g_t.
        final: `[n, H]` (stored dtype), the final PRE-norm state at t+1 (teacher input).
        loss_mask: bool `[n]`, True where the predicted token is assistant-generated.
        position_ids: int64 `[n]`, 1..n.
    """

    input_ids: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor

    def truncated(self, n: int) -> Sample:
        """The first `n` positions."""
        return Sample(*(t[:n] for t in self.__dict__.values()))


@dataclass
class SampleIndex:
    """All usable samples of a run and the counts of skipped ones.

    Attributes:
        refs: usable samples, in (shard, row) order.
        aux_layer_ids: the aux ids every shard was extracted with.
        hidden_size: H.
        skipped: reason → count (missing_hidden_states, no_trainable_position).
    """

    refs: list[SampleRef]
    aux_layer_ids: list[int]
    hidden_size: int
    skipped: dict[str, int]


def extract_shards(store: RunStore) -> list[Path]:
    """The extract stage's shard folders, sorted.

    Raises:
        ArtifactError: there are none (run the extract stage first).
    """
    root = store.root / "extract"
    shards = sorted(p for p in root.glob("shard-*") if p.is_dir()) if root.is_dir() else []
    if not shards:
        raise ArtifactError(f"{root}: no extract shards; the extract stage must run first")
    return shards


def index_samples(shard_dirs: list[Path]) -> SampleIndex:
    """Index the usable samples of the given extract shards.

    Raises:
        ArtifactError: a shard lacks `data/` or `meta.json`.
        ContractMismatchError: shards disagree on aux ids or hidden size, or a shard did not
            store the final state pre-norm.
    """
    from datasets import load_from_disk

    refs: list[SampleRef] = []
    skipped = {"missing_hidden_states": 0, "no_trainable_position": 0}
    metas = [_read_meta(d) for d in shard_dirs]
    for shard_dir, meta in zip(shard_dirs, metas, strict=True):
        if meta != metas[0]:
            raise ContractMismatchError(
                f"{shard_dir}/meta.json: aux ids/hidden size {meta} differ from "
                f"{shard_dirs[0]}'s {metas[0]}; re-extract the run with one recipe"
            )
        data = load_from_disk(str(shard_dir / "data")).select_columns(["loss_mask", "seq_len"])
        for row, rec in enumerate(data):
            ref = SampleRef(shard_dir, row, int(rec["seq_len"]) - 1)
            if not ref.hs_file.is_file():
                skipped["missing_hidden_states"] += 1
            elif not any(shift_mask_left(rec["loss_mask"])[1:]):
                skipped["no_trainable_position"] += 1
            else:
                refs.append(ref)
    return SampleIndex(refs, metas[0][0], metas[0][1], skipped)


def _read_meta(shard_dir: Path) -> tuple[list[int], int]:
    path = shard_dir / "meta.json"
    if not path.is_file() or not (shard_dir / "data").is_dir():
        raise ArtifactError(f"{shard_dir}: missing meta.json or data/ (extract did not finish)")
    meta = json.loads(path.read_text())
    if meta.get("final_state", "pre_norm") != "pre_norm":
        raise ContractMismatchError(
            f"{path}: final_state is {meta.get('final_state')!r}; the trainer needs the "
            "final state before the norm (EAGLE-3 conventions §2)"
        )
    return [int(i) for i in meta["aux_layer_ids"]], int(meta["hidden_size"])


def split_train_val(
    refs: list[SampleRef], val_fraction: float, seed: int
) -> tuple[list[SampleRef], list[SampleRef]]:
    """Seeded split: a fixed permutation, the last `round(n * val_fraction)` held out.

    At least one sample is held out when `val_fraction > 0` and there are 2 or more.
    """
    import torch

    perm = torch.randperm(len(refs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(len(refs) * val_fraction)
    if val_fraction > 0 and len(refs) >= 2:
        n_val = max(n_val, 1)
    cut = len(refs) - n_val
    return [refs[i] for i in perm[:cut]], [refs[i] for i in perm[cut:]]


def load_sample(ref: SampleRef, loss_mask: list[int]) -> Sample:
    """Load one sample's hidden states and align them (see the module docstring).

    Args:
        ref: the sample.
        loss_mask: the row's unshifted loss mask from the shard's `data/`.

    Raises:
        ArtifactError: the file's shape or length disagrees with the shard's data.
    """
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(ref.hs_file))
    hs = tensors["hidden_states"]
    n = ref.positions + 1
    if hs.ndim != 3 or hs.shape[0] != n or hs.shape[1] != NUM_AUX_LAYERS + 1:
        raise ArtifactError(
            f"{ref.hs_file}: hidden_states shape {tuple(hs.shape)}, expected "
            f"[{n}, {NUM_AUX_LAYERS + 1}, H] (seq_len from data/ row {ref.row})"
        )
    mask = shift_mask_left(loss_mask)[1:]
    return Sample(
        input_ids=tensors["token_ids"][1:].to(torch.long),
        aux=hs[:-1, :NUM_AUX_LAYERS].flatten(1),
        final=hs[1:, NUM_AUX_LAYERS],
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        position_ids=torch.arange(1, n, dtype=torch.long),
    )


class SampleReader:
    """Loads samples by ref, caching each shard's loss masks (one `load_from_disk` per shard)."""

    def __init__(self) -> None:
        self._masks: dict[Path, list[list[int]]] = {}

    def __call__(self, ref: SampleRef) -> Sample:
        if ref.shard_dir not in self._masks:
            from datasets import load_from_disk

            data = load_from_disk(str(ref.shard_dir / "data")).with_format(None)
            self._masks[ref.shard_dir] = list(data["loss_mask"])
        return load_sample(ref, self._masks[ref.shard_dir][ref.row])
