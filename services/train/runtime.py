"""Where the trainer runs: device, rank and world size, from the recipe and the environment.

Responsibility: one place that reads torchrun's environment (`RANK`, `LOCAL_RANK`,
`WORLD_SIZE`) and `train.device`, so the loop itself has no CUDA-only call on the CPU path;
and the CPU trainer process's allocator setting (`keep_freed_memory`).

Invariants: a single process (no torchrun) is rank 0 of world 1 and never touches
`torch.distributed`; only rank 0 writes files; under torchrun each rank takes every
world-th step of the shared plan (equal counts, the remainder dropped) and the model is
wrapped in DDP. FSDP can replace `wrap` without touching the loop, because the loop only
calls the wrapped module and reads `trainable_state` from `unwrap`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.errors import ConfigError
from shared.recipe import Recipe
from shared.target import cpu_has_bf16_kernels

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eyrie.train")


@dataclass(frozen=True)
class Runtime:
    """Device and process placement of one trainer process.

    Attributes:
        device: torch device string ('cpu', 'cuda:0', ...).
        rank: global rank (0 in a single process).
        world_size: number of processes.
        autocast_dtype: 'bf16' autocast, or None for fp32 compute.
        fused_loss: the loss's element-wise work through compiled kernels
            (`services.train.loss.loss_kernels`).
    """

    device: str
    rank: int = 0
    world_size: int = 1
    autocast_dtype: str | None = None
    fused_loss: bool = False

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard_steps(self, steps: list[Any]) -> list[Any]:
        """This rank's share of an epoch's steps: every world-th, equal counts per rank."""
        if self.world_size == 1:
            return steps
        per_rank = len(steps) // self.world_size
        return steps[self.rank :: self.world_size][:per_rank]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP under torchrun; the model itself in a single process."""
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [int(self.device.split(":")[1])] if self.device_type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)


#: glibc's `mallopt` parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next allocation instead of the kernel.

    A CPU training step allocates and frees `[positions, draft_vocab]` fp32 buffers of
    16-32 MB several times per micro-batch (the loss chunks). With glibc's defaults such a
    block is mmapped and unmapped when freed (or, from the heap, trimmed), so the next one
    is page-faulted in again, zero-filled, a page at a time. Here no block is mmapped and
    the heap is never trimmed: on the demo's 2-core AMX CPU the steps ran at 1.09-1.10x
    the tokens/s (`scripts/bench_train.py --allocator`, 2026-12-05). Intel's and vLLM's CPU
    guides preload tcmalloc or jemalloc for the same reason; this needs no extra library.
    The process keeps its peak heap, which every step reaches again anyway.

    Returns:
        True where both settings took (glibc), False elsewhere (musl, macOS: no change).
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # No block is mmapped (a freed one would be unmapped at once), and the heap is never
    # trimmed. Setting either also turns off glibc's dynamic thresholds.
    ok = mallopt(M_MMAP_MAX, 0) == 1
    return mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok


#: On CPU the row counts of the draft's matmuls are rounded up to a multiple of this: the
#: packed micro-batch's length (`services.train.packing.collate`'s padding), each TTT
#: step's rows (`services.train.ttt.ttt_rows`) and the loss's logits over the draft vocab
#: (`services.train.loss.Teacher`'s `multiple`). torch's CPU matmuls go through oneDNN,
#: which builds and caches a kernel per shape, and packed batches and TTT rows of every
#: length made nearly every product a new shape: on a 2-core AMX Xeon (torch 2.13) a bf16
#: `[r, 1536] @ [1536, 576]` took 5.9 ms at a new r against 1.5 ms at a cached one, and
#: the demo's steps ran at 1.4x the tokens/s with all three rounded to 64 (2026-12-07,
#: `scripts/bench_train.py --row-multiple`). 64 leaves 16 lengths per product at the
#: demo's 1,024-token micro-batches, well inside oneDNN's 1,024-kernel cache; 32 measured
#: level with 64, and 128 a little slower (more padding).
CPU_ROW_MULTIPLE = 64


def row_multiple(device_type: str) -> int:
    """What the draft's matmul row counts are rounded up to on `device_type`.

    `CPU_ROW_MULTIPLE` on "cpu" (why: its comment), 1 elsewhere (cuBLAS builds no kernel
    per shape; flex attention pads to its own block, `draft_model.length_multiple`).
    """
    return CPU_ROW_MULTIPLE if device_type == "cpu" else 1


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The draft inside a DDP/FSDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def resolve_runtime(recipe: Recipe) -> Runtime:
    """Read `train.device`, `train.precision`, `train.fused_loss` and torchrun's environment.

    Raises:
        ConfigError: CUDA requested but unavailable, or an unknown device string.
    """
    import torch

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = recipe.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device: {want!r} requested but CUDA is not available")
        device = want if ":" in want else f"cuda:{local}"
    elif want == "cpu":
        device = "cpu"
    else:
        raise ConfigError(f"train.device: must be 'auto', 'cpu' or 'cuda[:N]' (got {want!r})")
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(backend=backend)
    precision = recipe.train.precision
    fast = device.startswith("cuda") or cpu_has_bf16_kernels()
    if precision == "auto":
        precision = "bf16" if fast else "fp32"
    elif precision == "bf16" and not fast:
        log.warning(
            "train.precision: bf16 on a CPU without bf16 matmul kernels (no AVX-512/AMX): "
            "its matmuls run tens of times slower than fp32 here; 'auto' picks fp32"
        )
    fused = recipe.train.fused_loss
    fused_loss = device == "cpu" if fused == "auto" else fused
    return Runtime(device, rank, world, "bf16" if precision == "bf16" else None, fused_loss)
