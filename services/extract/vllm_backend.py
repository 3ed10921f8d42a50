"""The `vllm` extraction backend: a client of a vLLM server in extract mode.

The server (started by the conductor in mode "extract" during the extract GPU phase, with
the flags of `shared.vllm`) runs vLLM's `extract_hidden_states` speculative method with aux
ids `[a, b, c, N]` and Eyrie's KV connector (`services.extract.connector`). For each sample
this client sends `/v1/completions` with the prompt as token ids and `max_tokens: 1`.
A row that names its destination (`services.extract.backend.RowTokens.dest`) asks the
connector to write a staging file next to it (`kv_transfer_params.eyrie_hidden_states_path`),
so the states are written once, in the shard's folder; the writer checks and renames it.
Otherwise the client reads the file named by `kv_transfer_params.hidden_states_path` and
deletes it.

Invariants: the 4 slots are the 3 aux ids (residual entering layer i, vLLM's reading) and id
N, which vLLM captures before the final norm, i.e. the same layout as the hf backend. The
token ids the server ran come back with the states and are checked by the writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.extract.backend import SampleStates, base_metadata
from shared.conventions import resolve_aux_layer_ids
from shared.errors import ContractMismatchError, ServiceUnavailableError
from shared.recipe import Recipe
from shared.store import TEMP_PREFIX, check_readable
from shared.target import target_config
from shared.vllm import auth_headers, served_model_name


class VLLMExtractor:
    """Extract through a running vLLM server in extract mode.

    Args:
        recipe: the run's recipe (served model name, layers).
        url: the extract-mode server's base URL (`StageContext.server_url("extract")`).
        timeout_s: per-request timeout.
    """

    def __init__(self, recipe: Recipe, url: str, timeout_s: float = 600):
        cfg = target_config(recipe)
        n = int(cfg["num_hidden_layers"])
        self.aux_ids = resolve_aux_layer_ids(recipe.layers, n)
        self.hidden_size = int(cfg["hidden_size"])
        self.url = url
        self.headers = auth_headers()
        self.model = served_model_name(recipe)
        self.timeout_s = timeout_s
        self._meta = base_metadata(recipe, self.aux_ids, self.hidden_size)
        self._meta.update(
            num_hidden_layers=n,
            server=self.url,
            target_revision=recipe.target.revision or f"local:{Path(recipe.target.path).resolve()}",
        )

    def extract(self, batch: list[Sequence[int]]) -> list[SampleStates]:
        """One request per sample, all in flight at once (the server batches them)."""
        with ThreadPoolExecutor(max_workers=max(1, min(len(batch), 64))) as pool:
            return list(pool.map(self._one, batch))

    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    def _wait_for(self, path: Path) -> Path:
        """Wait until the connector has renamed the finished file into place.

        vLLM answers a request when its last token is sampled; the connector writes the
        file in the engine's next step. The rename makes its appearance mean "complete".
        """
        import time

        deadline = time.monotonic() + self.timeout_s
        delay = 0.002
        while not path.is_file():
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"{path}: the vLLM extract server never wrote this file within "
                    f"{self.timeout_s:.0f}s; see the server log for connector errors"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return path

    def _one(self, ids: Sequence[int]) -> SampleStates:
        import httpx
        from safetensors.torch import load_file

        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [int(t) for t in ids],
            "max_tokens": 1,
            "temperature": 0.0,
        }
        dest = getattr(ids, "dest", None)
        staging = staging_path(Path(dest)) if dest is not None else None
        if staging is not None:
            body["kv_transfer_params"] = {"eyrie_hidden_states_path": str(staging)}
        try:
            r = httpx.post(
                f"{self.url}/v1/completions",
                json=body,
                headers=self.headers,
                timeout=self.timeout_s,
            )
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ServiceUnavailableError(
                f"vLLM extract server at {self.url}: {e}; is `eyrie serve --mode extract` up?"
            ) from e
        params = r.json().get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise ContractMismatchError(
                f"{self.url}: response has no kv_transfer_params.hidden_states_path; the server "
                "must run with Eyrie's KV connector (services.extract.connector)"
            )
        ready = self._wait_for(Path(path))
        check_readable(ready, "extract hidden states (written by the vLLM server)")
        data = load_file(ready)
        in_place = staging is not None and Path(path) == staging
        if not in_place:
            Path(path).unlink(missing_ok=True)
        states = data["hidden_states"]
        if states.ndim != 3 or states.shape[1] != len(self.aux_ids) + 1:
            Path(path).unlink(missing_ok=True)
            raise ContractMismatchError(
                f"{path}: hidden_states shape {tuple(states.shape)}, expected "
                f"[seq, {len(self.aux_ids) + 1}, H]: the server's layer ids differ"
            )
        return SampleStates(states, data["token_ids"].tolist(), Path(path) if in_place else None)


def staging_path(dest: Path) -> Path:
    """Where the connector writes `dest`'s states: a temp name in the same folder.

    The `.tmp-` prefix makes a leftover of a killed run invisible to readers and swept by
    the stage's `sweep_temps`; the rename to `dest` stays within one folder.
    """
    return dest.parent / f"{TEMP_PREFIX}{dest.name}.vllm"
