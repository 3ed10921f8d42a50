"""The vLLM launcher: recipe → server arguments per mode, and the `serving` context.

Modes:
- `baseline`: the target alone (regen, eval shard 0);
- `eagle3`: the target with an EAGLE-3 draft through `--speculative-config`, `"method":
  "eagle3"` always explicit (eval shard 1). `"eagle"` there starts fine and accepts ~nothing;
- `extract`: vLLM's `extract_hidden_states` method with Eyrie's KV connector, which writes
  the aux + final pre-norm hidden states of each prompt to files.

Invariants:
- one function (`vllm_args`) builds the command line; the process and docker backends and
  the test fixtures all use it, so there is no second copy of the flags;
- an eagle3 server is never started before `services.serve.preflight` passed;
- `serving` stops every server it started, also when the body raises.

This module imports no torch/vLLM (the CLI imports it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.conventions import resolve_aux_layer_ids
from shared.errors import ConfigError
from shared.recipe import Recipe
from shared.store import RunStore

log = logging.getLogger("eyrie.serve")

MODES = ("baseline", "eagle3", "extract")

#: Eyrie's CPU-safe hidden-states connector, loaded by vLLM by module path (a documented
#: plug-in point: `kv_connector_module_path`). Written by the extract service.
EXTRACT_CONNECTOR_MODULE = "services.extract.connector"
EXTRACT_CONNECTOR_CLASS = "EyrieHiddenStatesConnector"


def check_mode(mode: str) -> str:
    """Return `mode` if known. Raises ConfigError listing the known modes."""
    if mode not in MODES:
        raise ConfigError(f"serve mode {mode!r} unknown; known: {', '.join(MODES)}")
    return mode


def served_model_name(recipe: Recipe) -> str:
    """The model name clients send: `serve.served_model_name`, default the recipe name."""
    return recipe.serve.served_model_name or recipe.name


def mode_port(recipe: Recipe, mode: str) -> int:
    """TCP port of `mode`'s server: `serve.eagle3_port` for eagle3, else `serve.port`.

    baseline and extract share `serve.port`: they never run in the same GPU phase.
    """
    return recipe.serve.eagle3_port if check_mode(mode) == "eagle3" else recipe.serve.port


#: Compose-network aliases the docker backend gives each mode's container: clients on that
#: network (workers, conductor) reach the server by these names. `vllm` is the compose
#: service's own name, so a hand-started `--profile serve` server answers at the same URL.
DOCKER_HOSTS = {"baseline": "vllm", "extract": "vllm", "eagle3": "vllm-eagle3"}


def base_url(recipe: Recipe, mode: str) -> str:
    """Where clients reach `mode`'s server, e.g. `http://127.0.0.1:8000` (no `/v1`).

    process backend: `serve.host` (a wildcard bind is reached through loopback); docker
    backend: the mode's compose-network alias (`DOCKER_HOSTS`).
    """
    host = recipe.serve.host
    if recipe.serve.backend == "docker":
        host = DOCKER_HOSTS[check_mode(mode)]
    elif host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{mode_port(recipe, mode)}"


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $VLLM_API_KEY` when that variable is set, else {}.

    vLLM reads the same variable (vllm/envs.py) and then refuses /v1 requests without it;
    the compose deployment sets it for the server and every Eyrie container.
    """
    key = os.environ.get("VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def target_num_layers(recipe: Recipe) -> int:
    """Decoder layer count N of the target: the recipe's, else its config's.

    Raises:
        ConfigError: the target's config cannot be read (`shared.target.target_config`).
    """
    if recipe.target.num_hidden_layers:
        return recipe.target.num_hidden_layers
    from shared.target import target_config

    return int(target_config(recipe)["num_hidden_layers"])


def speculative_config(
    recipe: Recipe, mode: str, draft_dir: Path | str | None = None
) -> dict[str, Any] | None:
    """The `--speculative-config` JSON of `mode` (None for baseline).

    eagle3: `{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}` with k =
    `eval.num_speculative_tokens`. extract: vLLM's `extract_hidden_states` method with aux ids
    `[a, b, c, N]`: the 3 draft aux ids, then N = the final pre-norm state
    (speculators' data generation does the same).

    Raises:
        ConfigError: eagle3 without a draft folder.
    """
    if check_mode(mode) == "baseline":
        return None
    if mode == "eagle3":
        if draft_dir is None:
            raise ConfigError("serve --mode eagle3 needs a draft folder (--draft DIR)")
        return {
            "method": "eagle3",
            "model": str(Path(draft_dir).resolve()),
            "num_speculative_tokens": recipe.eval.num_speculative_tokens,
        }
    n = target_num_layers(recipe)
    ids = [*resolve_aux_layer_ids(recipe.layers, n), n]
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }


def kv_transfer_config(hs_dir: Path | str) -> dict[str, Any]:
    """`--kv-transfer-config` of extract mode: Eyrie's connector writing under `hs_dir`."""
    return {
        "kv_connector": EXTRACT_CONNECTOR_CLASS,
        "kv_connector_module_path": EXTRACT_CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(hs_dir)},
    }


def vllm_args(
    recipe: Recipe,
    mode: str,
    draft_dir: Path | str | None = None,
    port: int | None = None,
    hs_dir: Path | str | None = None,
    host: str | None = None,
) -> list[str]:
    """The vLLM api_server arguments for `mode` (without the program name).

    Args:
        recipe: the resolved recipe (target, serve.*, eval.num_speculative_tokens, layers).
        mode: `baseline`, `eagle3` or `extract`.
        draft_dir: the EAGLE-3 draft folder (eagle3 only).
        port: listening port; default `mode_port(recipe, mode)`.
        hs_dir: where the extract connector writes hidden states (extract only); default
            `$TMPDIR/eyrie-hidden-states`.
        host: bind address; default `serve.host` (the docker backend binds 0.0.0.0).

    Raises:
        ConfigError: unknown mode, eagle3 without a draft.
    """
    s = recipe.serve
    # fmt: off
    args = [
        "--model", recipe.target.path,
        "--served-model-name", served_model_name(recipe),
        "--dtype", recipe.target.dtype,
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--max-model-len", str(s.max_model_len),
        "--host", host or s.host,
        "--port", str(port or mode_port(recipe, mode)),
        "--gpu-memory-utilization", str(s.gpu_memory_utilization),
        # Sampling defaults come from the request only, never from the model's
        # generation_config.json (which could add e.g. a repetition penalty unseen by regen).
        "--generation-config", "vllm",
    ]
    # fmt: on
    if recipe.target.revision:
        args += ["--revision", recipe.target.revision]
    if recipe.target.trust_remote_code:
        args.append("--trust-remote-code")
    # Extract mode must run every prompt token through the model: a prefix-cache hit would
    # skip the forward that produces those tokens' hidden states.
    caching = s.enable_prefix_caching and mode != "extract"
    args.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    if s.enforce_eager:
        args.append("--enforce-eager")
    spec = speculative_config(recipe, mode, draft_dir)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    if mode == "extract":
        import tempfile

        hs = hs_dir or Path(tempfile.gettempdir()) / "eyrie-hidden-states"
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(hs), sort_keys=True)]
    return args + list(s.extra_args)


def modes_for_stage(stage_name: str, recipe: Recipe, shards: list[int]) -> list[str]:
    """The server modes a stage's `shards` need while they run.

    regen → baseline (when regen.enabled); extract → extract (when extract.backend is
    vllm); eval → baseline for shard 0, eagle3 for shard 1; anything else → none.
    """
    if stage_name == "regen":
        return ["baseline"] if recipe.regen.enabled else []
    if stage_name == "extract":
        return ["extract"] if recipe.extract.backend == "vllm" else []
    if stage_name == "eval":
        by_shard = {0: "baseline", 1: "eagle3"}
        return [by_shard[s] for s in sorted(set(shards)) if s in by_shard]
    return []


def draft_dir_of(store: RunStore) -> Path:
    """The draft an eval eagle3 server loads: `<run>/export/vllm`."""
    return store.root / "export" / "vllm"


@contextlib.contextmanager
def serving(recipe: Recipe, store: RunStore, modes: list[str]) -> Iterator[dict[str, str]]:
    """Start the servers of `modes`, wait until each is ready, yield, then stop them all.

    Runs the GPU-free check first (`services.serve.gpu`, after the docker backend stopped
    the compose `vllm` container), and the eagle3 preflight before an eagle3 start. Logs go
    to `<run>/serve/<mode>.log`.

    Yields:
        mode → base URL.

    Raises:
        ContractMismatchError: the eagle3 preflight refused the draft.
        ServiceUnavailableError: a server died or was not ready in serve.startup_timeout_s.
    """
    from services.serve.backends import get_backend
    from services.serve.gpu import check_gpus_free
    from services.serve.preflight import preflight_eagle3

    if "eagle3" in modes:  # refuse before any server starts, not after the baseline's
        spec = speculative_config(recipe, "eagle3", draft_dir_of(store)) or {}
        preflight_eagle3(recipe, draft_dir_of(store), spec)
    backend = get_backend(recipe.serve.backend)
    backend.prepare()  # docker: the compose vllm container would fail the GPU-free check
    check_gpus_free()
    started = []
    try:
        for mode in modes:
            draft = draft_dir_of(store) if mode == "eagle3" else None
            hs = store.stage_dir("extract") / "vllm-hidden-states" if mode == "extract" else None
            started.append(backend.start(recipe, mode, store.root / "serve", draft, hs))
        yield {h.mode: h.url for h in started}
    finally:
        for handle in reversed(started):
            backend.stop(handle)
