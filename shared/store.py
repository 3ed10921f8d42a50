"""The run store on the shared volume: `$EYRIE_DATA/runs/<run_id>/<stage>/...`.

Invariants:
- every write is atomic: a temp file in the same folder, fsync, rename (`atomic_path`);
- a stage shard is done exactly when its manifest exists (`Manifest`); the manifest is
  written last, after every file it lists;
- the code creates every directory it writes into.

The layout of each stage's files is documented in `shared/artifacts.py`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import __version__
from shared.errors import ArtifactError, ConfigError
from shared.recipe import Recipe, recipe_to_yaml, resolve_recipe


def data_root() -> Path:
    """The shared volume: `$EYRIE_DATA`, default `./data`."""
    return Path(os.environ.get("EYRIE_DATA", "data")).resolve()


def cache_root() -> Path:
    """Download/conversion cache: `$EYRIE_CACHE`, default `~/.cache/eyrie`."""
    return Path(os.environ.get("EYRIE_CACHE", Path.home() / ".cache" / "eyrie")).resolve()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(final: Path | str) -> Iterator[Path]:
    """Yield a temp path next to `final`; on success fsync it and rename it over `final`.

    Works for files and folders (e.g. `datasets.save_to_disk`): whatever the caller creates
    at the yielded path is moved into place in one rename. On error the temp is removed, so a
    reader never sees a partial `final`. A hard kill may leave a `.tmp-*` sibling, which is
    never read and is swept by `sweep_temps`.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent)) / final.name
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        elif not tmp.exists():
            raise ArtifactError(f"{final}: the writer created nothing at {tmp}")
        if final.is_dir() and tmp.is_dir():
            # A folder cannot be renamed over a non-empty folder: move the old one aside.
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def atomic_write_bytes(final: Path | str, data: bytes) -> Path:
    """Write `data` to `final` atomically (temp + fsync + rename). Returns `final`."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)
    return Path(final)


def atomic_write_json(final: Path | str, obj: Any) -> Path:
    """Write `obj` as indented JSON atomically."""
    return atomic_write_bytes(final, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sweep_temps(folder: Path) -> int:
    """Remove `.tmp-*` leftovers of hard-killed writers under `folder`. Returns the count."""
    n = 0
    for p in folder.rglob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        n += 1
    return n


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: Path) -> str:
    """sha256 of a file, or of a folder's (relative path, file sha256) list, sorted."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


@dataclass
class Manifest:
    """Proof that one stage shard finished. Written last; its existence means done.

    Attributes:
        run_id, stage, shard: what finished.
        counts: named integer counts (rows in/out, tokens, skips per reason...).
        files: relative path (to the stage folder) → sha256 of each output.
        recipe_hash: sha256 of the resolved recipe the outputs came from.
        eyrie_version: Eyrie's version that wrote them.
        extra: stage-specific metadata (JSON-serializable).
    """

    run_id: str
    stage: str
    shard: int
    counts: dict[str, int] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    recipe_hash: str = ""
    eyrie_version: str = __version__
    created_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RunStore:
    """Paths and manifests of one run: `<data_root>/runs/<run_id>/`.

    Args:
        run_id: the sanitized run id (`Recipe.run_id()`).
        root: the data root; default `data_root()`.
    """

    def __init__(self, run_id: str, root: Path | None = None):
        self.run_id = run_id
        self.root = (root or data_root()) / "runs" / run_id

    # -- creation / loading --------------------------------------------------------------
    @classmethod
    def create(cls, recipe: Recipe, command: str = "", root: Path | None = None) -> RunStore:
        """Create (or reopen) the run folder and write `recipe.yaml`, `recipe.json`, command."""
        store = cls(recipe.run_id(), root)
        store.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(store.root / "recipe.yaml", recipe_to_yaml(recipe).encode())
        atomic_write_bytes(store.root / "recipe.json", recipe.canonical_json().encode())
        if command:
            with open(store.root / "commands.log", "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {command}\n")
        return store

    def recipe(self) -> Recipe:
        """The resolved recipe stored with the run (what every job reads)."""
        path = self.root / "recipe.json"
        if not path.is_file():
            raise ArtifactError(f"{path}: run {self.run_id!r} has no resolved recipe")
        recipe = resolve_recipe(json.loads(path.read_text()))
        if recipe.run_id() != self.run_id:
            raise ArtifactError(
                f"{path}: recipe hashes to run {recipe.run_id()!r}, not {self.run_id!r}"
            )
        return recipe

    # -- paths ---------------------------------------------------------------------------
    def stage_dir(self, stage: str) -> Path:
        """`runs/<run_id>/<stage>/` (created)."""
        p = self.root / stage
        p.mkdir(parents=True, exist_ok=True)
        return p

    def shard_path(self, stage: str, shard: int, suffix: str) -> Path:
        """`<stage>/shard-<NNNNN><suffix>`, e.g. `prep/shard-00003.jsonl`."""
        return self.stage_dir(stage) / f"shard-{shard:05d}{suffix}"

    def manifest_path(self, stage: str, shard: int = 0) -> Path:
        return self.root / stage / f"manifest-{shard:05d}.json"

    # -- manifests -----------------------------------------------------------------------
    def is_done(self, stage: str, shard: int = 0) -> bool:
        return self.manifest_path(stage, shard).is_file()

    def write_manifest(
        self,
        stage: str,
        shard: int,
        counts: dict[str, int],
        files: list[Path] | None = None,
        extra: dict[str, Any] | None = None,
        recipe_hash: str | None = None,
    ) -> Manifest:
        """Hash `files`, then write the manifest atomically: the shard is now done."""
        sdir = self.stage_dir(stage)
        hashes = {str(Path(f).relative_to(sdir)): sha256_tree(Path(f)) for f in files or []}
        if recipe_hash is None:
            recipe_hash = self.recipe().recipe_hash()
        m = Manifest(
            run_id=self.run_id,
            stage=stage,
            shard=shard,
            counts={k: int(v) for k, v in counts.items()},
            files=hashes,
            recipe_hash=recipe_hash,
            extra=extra or {},
        )
        atomic_write_json(self.manifest_path(stage, shard), m.to_json())
        return m

    def read_manifest(self, stage: str, shard: int = 0) -> Manifest:
        path = self.manifest_path(stage, shard)
        if not path.is_file():
            raise ArtifactError(f"{path}: stage {stage!r} shard {shard} has not finished")
        return Manifest(**json.loads(path.read_text()))

    def manifests(self, stage: str) -> list[Manifest]:
        """All manifests of a stage, by shard."""
        d = self.root / stage
        return [Manifest(**json.loads(p.read_text())) for p in sorted(d.glob("manifest-*.json"))]


def check_free_space(path: Path, needed_bytes: int, what: str = "output") -> None:
    """Disk preflight: refuse, with both numbers, when `needed_bytes` exceed free space.

    Raises:
        ConfigError: not enough free space on the volume holding `path`.
    """
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if needed_bytes > free:
        raise ConfigError(
            f"{path}: {what} needs an estimated {needed_bytes / 2**30:.2f} GiB "
            f"({needed_bytes} bytes) but only {free / 2**30:.2f} GiB ({free} bytes) are free"
        )
