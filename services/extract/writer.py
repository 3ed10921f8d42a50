"""Per-sample checks and the background writer of `hidden_states/hs_<row>.safetensors`.

Responsibility: check every extracted sample, then write it in the speculators offline
layout (`shared/artifacts.py`, extract/) on a writer thread, so disk I/O overlaps the next
forward pass.

Invariants:
- a file is written atomically (`shared.store.atomic_path`): it exists only when complete,
  so its existence marks the sample done and a rerun skips it;
- a sample that fails a check is quarantined with a reason and never written:
  rows != len(input_ids), a non-finite value, or token ids that differ from the tokenized
  shard's;
- an exception on the writer thread is re-raised by `close()`; no sample is lost silently.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.records import QuarantinedSample
from shared.store import atomic_path, share_modes

if TYPE_CHECKING:
    import torch


def check_sample(
    states: torch.Tensor, token_ids: Any, expected_ids: Any, num_slots: int
) -> str | None:
    """The reason a sample must be quarantined, or None when it is good.

    Args:
        states: `[seq_len, num_slots, H]` hidden states of one sample.
        token_ids: the token ids the backend says it ran (list or 1-D tensor).
        expected_ids: the tokenized shard's `input_ids` for this row.
        num_slots: 3 aux layers + 1 final state.
    """
    import torch

    expected = [int(t) for t in expected_ids]
    got = [int(t) for t in token_ids]
    if states.ndim != 3 or states.shape[1] != num_slots:
        return f"shape {tuple(states.shape)}, expected [seq_len, {num_slots}, H]"
    if states.shape[0] != len(expected):
        return f"rows {states.shape[0]} != len(input_ids) {len(expected)}"
    if got != expected:
        first = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None
        )
        return (
            f"token_ids differ from the tokenized shard (len {len(got)} vs "
            f"{len(expected)}, first difference at position {first})"
        )
    # aminmax over the whole tensor: one pass, and inf/nan propagate into min or max.
    lo, hi = torch.aminmax(states.float() if states.dtype == torch.float16 else states)
    if not bool(torch.isfinite(torch.stack((lo, hi))).all()):
        return f"non-finite hidden state values (min={lo.item()}, max={hi.item()})"
    return None


@dataclass
class WriteResult:
    """Totals of one writer's life.

    Attributes:
        written: samples written (files).
        tokens: tokens of the written samples.
        bytes: bytes of the written files.
        quarantined: one record per quarantined sample.
    """

    written: int = 0
    tokens: int = 0
    bytes: int = 0
    quarantined: list[QuarantinedSample] = field(default_factory=list)


class StateWriter:
    """Checks and writes samples on a background thread.

    Args:
        path_of: row → its hidden-state file (`ExtractArtifacts.hs_path`).
        num_slots: 3 aux layers + 1 final state.
        dtype: the stored dtype (a torch dtype), e.g. torch.bfloat16.
        max_pending: samples queued before `submit` blocks (bounds memory held in flight).
    """

    def __init__(
        self, path_of: Callable[[int], Path], num_slots: int, dtype: Any, max_pending: int = 64
    ):
        self.path_of = path_of
        self.num_slots = num_slots
        self.dtype = dtype
        self.result = WriteResult()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hs-writer")
        self._thread.start()

    def submit(
        self,
        row: int,
        sample_id: str,
        states: Any,
        token_ids: Any,
        expected: Any,
        file: Path | None = None,
    ) -> None:
        """Queue one sample; raises the writer thread's error if it has failed.

        Args:
            file: a file the backend already wrote with these states (same folder as the
                final file): checked, then renamed into place (or removed if quarantined).
        """
        if self._error is not None:
            raise self._error
        self._queue.put((row, sample_id, states, token_ids, expected, file))

    def close(self) -> WriteResult:
        """Drain the queue, stop the thread, re-raise its error. Returns the totals."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.result

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write(*item)
                except BaseException as e:  # re-raised on the caller's thread
                    self._error = e

    def _write(
        self,
        row: int,
        sample_id: str,
        states: Any,
        token_ids: Any,
        expected: Any,
        file: Path | None = None,
    ) -> None:
        import torch
        from safetensors.torch import save_file

        reason = check_sample(states, token_ids, expected, self.num_slots)
        if reason is not None:
            if file is not None:
                file.unlink(missing_ok=True)
            self.result.quarantined.append(QuarantinedSample(row=row, id=sample_id, reason=reason))
            return
        final = self.path_of(row)
        if file is not None and states.dtype == self.dtype:
            # Written once by the backend, in this folder: checked, now moved into place.
            if file.stat().st_uid == os.getuid():  # else the server's uid set its modes
                share_modes(file)
            size = file.stat().st_size
            os.replace(file, final)
            self._count(states, size)
            return
        if file is not None:
            file.unlink(missing_ok=True)  # another dtype: rewritten below
        tensors = {
            "hidden_states": states.to(self.dtype).contiguous(),
            "token_ids": torch.as_tensor([int(t) for t in expected], dtype=torch.long),
        }
        with atomic_path(final) as tmp:
            save_file(tensors, str(tmp))
            size = tmp.stat().st_size
        self._count(states, size)

    def _count(self, states: Any, size: int) -> None:
        self.result.written += 1
        self.result.tokens += int(states.shape[0])
        self.result.bytes += size
