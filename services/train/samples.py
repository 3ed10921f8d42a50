"""The draft's training and validation samples, read from the extract stage's shards.

Responsibility: index every extracted sample of a run, sort it into the training or the
validation side by the run's split (`split/split.json`: held-out conversations), and load
one sample as the draft's aligned inputs.

Layout read (`shared.artifacts.ExtractArtifacts`): per shard the rows dataset at the shard
root (`input_ids`, `loss_mask`, `seq_len`), `hidden_states/hs_<row>.safetensors`
(`hidden_states` bf16 `[seq_len, 3+1, H]`: the 3 aux layers, then the final PRE-norm state;
`token_ids` int64 `[seq_len]`) and `meta.json`; the conversation of each row from
`tokenize/shard-N/`.

Alignment (speculators `models/eagle3/data.py: shift_batch`, vLLM's eagle proposer): the
draft at position t sees the target's aux states `g_t` and the next token `x_{t+1}`, and is
trained against the teacher logits taken at `t+1`, which predict `x_{t+2}`. So a sample of n
tokens gives n-1 positions: `input_ids = x[1:]`, `aux = g[:-1]`, `final = y[1:]`,
`position_ids = 1..n-1`. The loss mask shifts with the targets as
`shared.conventions.shift_mask_left` says (a position is trained when the token it predicts
is assistant-generated): `mask = shift_mask_left(l)[1:]`. This differs from speculators'
`shift_batch` (which keeps `l[1:]`, training the prediction after the end-of-turn token and
skipping the first answer token), on purpose: shared/conventions.py §4.

Invariants: a row whose hidden-state file is missing (quarantined by extract) is skipped and
counted, never trained; a sample with no trainable position after the shift is skipped and
counted; a held-out conversation is never on the training side; a file whose shape
disagrees with the shard's data raises `ArtifactError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.artifacts import RunStore
from shared.conventions import NUM_AUX_LAYERS, shift_mask_left
from shared.errors import ArtifactError, ContractMismatchError
from shared.records import ExtractMeta
from shared.store import check_readable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SampleRef:
    """One extracted sample: where it lives and how many aligned positions it gives.

    Attributes:
        shard: the extract shard.
        row: row index in the shard's rows dataset (and the `hs_<row>` file number).
        positions: aligned positions after the shift (seq_len - 1).
        hs_file: its hidden-state file.
    """

    shard: int
    row: int
    positions: int
    hs_file: Path


@dataclass
class AlignedSample:
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

    def truncated(self, n: int) -> AlignedSample:
        """The first `n` positions."""
        return AlignedSample(*(t[:n] for t in self.__dict__.values()))


@dataclass
class SampleIndex:
    """The usable samples of a run, on each side of the split, and the skipped ones.

    Attributes:
        train: training samples, in (shard, row) order.
        val: validation samples (held-out conversations), in (shard, row) order.
        aux_layer_ids: the aux ids every shard was extracted with.
        hidden_size: H.
        skipped: reason → count (missing_hidden_states, no_trainable_position).
    """

    train: list[SampleRef]
    val: list[SampleRef]
    aux_layer_ids: list[int]
    hidden_size: int
    skipped: dict[str, int]


def _check_meta(path: Path, meta: ExtractMeta, first: ExtractMeta) -> None:
    if meta.final_state != "pre_norm":
        raise ContractMismatchError(
            f"{path}: final_state is {meta.final_state!r}; the trainer needs the final "
            "state before the norm (shared/conventions.py §2)"
        )
    if (meta.aux_layer_ids, meta.hidden_size) != (first.aux_layer_ids, first.hidden_size):
        raise ContractMismatchError(
            f"{path}: aux ids {meta.aux_layer_ids} / hidden size {meta.hidden_size} differ "
            f"from the first shard's {first.aux_layer_ids} / {first.hidden_size}; re-extract "
            "the run with one recipe"
        )


def index_samples(store: RunStore) -> SampleIndex:
    """Index the usable extracted samples of the run, split into train and validation.

    Raises:
        ArtifactError: no extract shard has finished, or a shard lacks data or meta.
        ContractMismatchError: shards disagree on aux ids or hidden size, or a shard did not
            store the final state pre-norm.
    """
    art = store.extract
    shards = art.shards()
    if not shards:
        raise ArtifactError(f"{art.dir}: no finished extract shard; run the extract stage")
    val_ids = store.split.val_ids()
    train: list[SampleRef] = []
    val: list[SampleRef] = []
    skipped = {"missing_hidden_states": 0, "no_trainable_position": 0}
    metas = [art.meta(s) for s in shards]
    for shard, meta in zip(shards, metas, strict=True):
        _check_meta(art.meta_path(shard), meta, metas[0])
        data = art.data(shard)
        convs = store.tokenize.dataset(shard)["conversation_id"]
        for row, (mask, seq_len) in enumerate(zip(data["loss_mask"], data["seq_len"], strict=True)):
            ref = SampleRef(shard, row, int(seq_len) - 1, art.hs_path(shard, row))
            if not ref.hs_file.is_file():
                skipped["missing_hidden_states"] += 1
            elif not any(shift_mask_left(mask)[1:]):
                skipped["no_trainable_position"] += 1
            else:
                (val if convs[row] in val_ids else train).append(ref)
    return SampleIndex(train, val, metas[0].aux_layer_ids, metas[0].hidden_size, skipped)


def load_sample(ref: SampleRef, loss_mask: list[int]) -> AlignedSample:
    """Load one sample's hidden states and align them (see the module docstring).

    Args:
        ref: the sample.
        loss_mask: the row's unshifted loss mask from the shard's rows dataset.

    Raises:
        ArtifactError: the file's shape or length disagrees with the shard's data.
    """
    from safetensors.torch import load_file

    check_readable(ref.hs_file, "train hidden states")
    tensors = load_file(str(ref.hs_file))
    hs = tensors["hidden_states"]
    n = ref.positions + 1
    if hs.ndim != 3 or hs.shape[0] != n or hs.shape[1] != NUM_AUX_LAYERS + 1:
        raise ArtifactError(
            f"{ref.hs_file}: hidden_states shape {tuple(hs.shape)}, expected "
            f"[{n}, {NUM_AUX_LAYERS + 1}, H] (seq_len from the rows dataset, row {ref.row})"
        )
    return align(hs, tensors["token_ids"], loss_mask)


def align(states: torch.Tensor, token_ids: torch.Tensor, loss_mask: list[int]) -> AlignedSample:
    """One extracted sequence as the draft's aligned inputs (see the module docstring).

    Args:
        states: `[n, 3+1, H]`, an extractor's output (`SampleStates.states`).
        token_ids: int `[n]`, the tokens the target ran.
        loss_mask: the sequence's unshifted loss mask, n entries.

    Returns:
        the sample's n - 1 positions: position t holds aux states of token t, the target's
        final state and the id of token t + 1, and the loss mask shifted to match. No
        checks here: `load_sample` checks a stored file's shapes before calling it.
    """
    import torch

    n = states.shape[0]
    return AlignedSample(
        input_ids=token_ids[1:].to(torch.long),
        aux=states[:-1, :NUM_AUX_LAYERS].flatten(1),
        final=states[1:, NUM_AUX_LAYERS],
        loss_mask=torch.tensor(shift_mask_left(loss_mask)[1:], dtype=torch.bool),
        position_ids=torch.arange(1, n, dtype=torch.long),
    )


class SampleReader:
    """Loads samples by ref, caching each shard's loss masks (one dataset load per shard)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._masks: dict[int, list[list[int]]] = {}

    def __call__(self, ref: SampleRef) -> AlignedSample:
        if ref.shard not in self._masks:
            self._masks[ref.shard] = list(self.store.extract.data(ref.shard)["loss_mask"])
        return load_sample(ref, self._masks[ref.shard][ref.row])
