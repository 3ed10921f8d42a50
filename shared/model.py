"""The target's weights on this node: where the local copy is, whether it is whole, pulling it.

vLLM servers run with the hub offline (`HF_HUB_OFFLINE=1`, both backends), so a recipe that
names a hub id is served from a local copy in the Hugging Face cache (`$HF_HOME/hub`, the
`hf-cache` volume the workers and the vLLM container share). `eyrie pull RECIPE` makes that
copy with `huggingface_hub.snapshot_download` (resumable: interrupted files continue from
their `.incomplete` part; progress bars; `target.revision`; each file's size checked against
the hub's as it lands), then checks the copy as a whole:

- every file named by `model.safetensors.index.json` exists and holds the tensors the index
  maps to it;
- every safetensors file is as long as its own header says (a cut-off download is caught
  without reading the tensor data).

`model_path` is what servers and stages load: the target folder when the recipe names one,
else the local snapshot, else the hub id unchanged (then `plan_problems` has refused the run).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from shared.errors import ArtifactError, ConfigError
from shared.recipe import Recipe, looks_local

INDEX_NAME = "model.safetensors.index.json"


#: Hub files no Eyrie service or vLLM reads: original (non-HF) checkpoints, duplicates of
#: the safetensors weights.
HUB_IGNORE = ["original/*", "*.pth", "consolidated*"]


def is_hub_id(path: str) -> bool:
    """Whether `target.path` names a hub repo (`owner/name`) rather than a local folder."""
    return not (looks_local(path) or Path(path).exists())


def local_snapshot(recipe: Recipe) -> Path | None:
    """The target's local folder, or None.

    `target.path` itself, or the cached hub snapshot at `target.revision`; None when the hub
    id has no snapshot in the cache.

    Uses `snapshot_download(local_files_only=True)`, which resolves the revision through the
    cache's refs without any network access.
    """
    t = recipe.target
    if not is_hub_id(t.path):
        return Path(t.path) if Path(t.path).is_dir() else None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(t.path, revision=t.revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def model_path(recipe: Recipe) -> str:
    """What a server or stage loads the target from.

    The local folder when there is one (`local_snapshot`), else `target.path` as written.
    """
    if not is_hub_id(recipe.target.path):
        return recipe.target.path
    snap = local_snapshot(recipe)
    return str(snap) if snap is not None else recipe.target.path


def target_weight_bytes(recipe: Recipe) -> int:
    """Bytes of the target's weights.

    Its local safetensors files when they are complete, else the estimate from its config
    (`shared.sizing.estimate_target_weight_bytes`).

    Raises:
        ConfigError: there are no local weights and the config cannot be read.
    """
    from shared.sizing import estimate_target_weight_bytes
    from shared.target import raw_target_config

    snap = local_snapshot(recipe)
    if snap is not None and not weights_problems(snap):
        return weight_bytes(snap)
    return estimate_target_weight_bytes(raw_target_config(recipe))


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the file length its header implies."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"header length {n} is not plausible")
        head = f.read(n)
        if len(head) != n:
            raise ValueError(f"header cut off ({len(head)} of {n} bytes)")
        meta = json.loads(head)
    ends = (int(v["data_offsets"][1]) for k, v in meta.items() if k != "__metadata__")
    end = max(ends, default=0)
    return meta, 8 + n + end


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, sorted."""
    return sorted(folder.glob("*.safetensors"))


def weight_bytes(folder: Path) -> int:
    """Total size in bytes of the folder's safetensors files (0 when there are none)."""
    return sum(os.path.getsize(p) for p in weight_files(folder))


def weights_problems(folder: Path) -> list[str]:
    """Every reason the model folder's weights are not a complete safetensors checkpoint.

    Returns:
        [] when complete; else one line per problem, naming the file (and tensor).
    """
    if not (folder / "config.json").is_file():
        return [f"{folder}: no config.json"]
    files = weight_files(folder)
    if not files:
        return [f"{folder}: no *.safetensors weights"]
    problems: list[str] = []
    headers: dict[str, dict] = {}
    for p in files:
        try:
            meta, want = _header(p)
        except (OSError, ValueError) as e:
            problems.append(f"{p.name}: unreadable safetensors header ({e})")
            continue
        have = os.path.getsize(p)
        if have != want:
            problems.append(f"{p.name}: {have} bytes, its header says {want} (incomplete)")
        headers[p.name] = meta
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        missing_files = sorted(set(weight_map.values()) - {p.name for p in files})
        for name in missing_files:
            problems.append(f"{INDEX_NAME}: names {name}, which is missing")
        for tensor, name in weight_map.items():
            if name in headers and tensor not in headers[name]:
                problems.append(f"{INDEX_NAME}: {tensor} should be in {name}, which lacks it")
    elif len(files) > 1:
        problems.append(f"{folder}: {len(files)} safetensors files but no {INDEX_NAME}")
    return problems


def pull_command(recipe_path: str) -> str:
    """The command that makes the local copy a recipe needs."""
    return f"eyrie pull {recipe_path}"


def plan_problems(recipe: Recipe, recipe_path: str) -> list[str]:
    """Why the target cannot be served from this node as the recipe stands ([] = it can).

    A hub id without a complete local copy is refused (vLLM runs with the hub offline),
    naming the command that fixes it; a local folder must exist.
    """
    t = recipe.target
    snap = local_snapshot(recipe)
    if snap is None:
        if is_hub_id(t.path):
            return [
                f"target.path: {t.path} (revision {t.revision or 'main'}) has no local copy "
                f"in the Hugging Face cache and vLLM ({recipe.serve.backend} backend) runs "
                f"with the hub offline; run `{pull_command(recipe_path)}` first"
            ]
        return [f"target.path: model folder {t.path} does not exist"]
    problems = weights_problems(snap)
    if problems and is_hub_id(t.path):
        problems = [
            f"target.path: the local copy of {t.path} at {snap} is incomplete; run "
            f"`{pull_command(recipe_path)}` (it resumes): " + "; ".join(problems[:5])
        ]
    return problems


def pull(recipe: Recipe, *, local_files_only: bool = False, max_workers: int = 8) -> Path:
    """Download the target (hub id at `target.revision`) into the HF cache and check it.

    Args:
        recipe: the resolved recipe; `target.path` must be a hub id.
        local_files_only: resolve the cached snapshot only (no network).
        max_workers: parallel file downloads.

    Returns:
        the local snapshot folder.

    Raises:
        ConfigError: `target.path` is a local folder (nothing to pull).
        ArtifactError: the download failed, or the copy is incomplete (each problem named).
    """
    from huggingface_hub import snapshot_download

    t = recipe.target
    if not is_hub_id(t.path):
        raise ConfigError(f"target.path: {t.path} is a local folder; there is nothing to pull")
    try:
        folder = Path(
            snapshot_download(
                t.path,
                revision=t.revision,
                local_files_only=local_files_only,
                max_workers=max_workers,
                ignore_patterns=HUB_IGNORE,
            )
        )
    except Exception as e:  # hub, network and cache errors all end the pull the same way
        raise ArtifactError(
            f"pull {t.path} (revision {t.revision or 'main'}) failed: {type(e).__name__}: {e}"
        ) from e
    problems = weights_problems(folder)
    if problems:
        raise ArtifactError(
            f"pull {t.path}: the copy at {folder} is incomplete:\n  - " + "\n  - ".join(problems)
        )
    return folder
