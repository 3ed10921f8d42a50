"""Durable writes on the shared volume: atomic files and folders, manifests, hashes.

Invariants every writer in Eyrie relies on:
- a write is atomic: a temp file or folder in the same folder, fsync, rename
  (`atomic_path`), so a reader never sees half an artifact and a hard kill leaves at most a
  `.tmp-*` sibling, which no reader opens and `sweep_temps` removes;
- what Eyrie writes is readable by the other services: file modes follow the process umask
  (0666 & ~umask, folders 0777 & ~umask), also for libraries that create files 0600
  (safetensors, `save_pretrained`), because the services run as different users in
  different containers;
- a stage shard is done exactly when its manifest exists (`Manifest`); it is written last.

Where each artifact lives is `shared.artifacts`; this module knows no run layout.
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

TEMP_PREFIX = ".tmp-"


def data_root() -> Path:
    """The shared volume: `$EYRIE_DATA`, default `./data`."""
    return Path(os.environ.get("EYRIE_DATA", "data")).resolve()


def cache_root() -> Path:
    """Download/conversion cache: `$EYRIE_CACHE`, default `~/.cache/eyrie`."""
    return Path(os.environ.get("EYRIE_CACHE", Path.home() / ".cache" / "eyrie")).resolve()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_modes(path: Path) -> None:
    """Give `path` (and everything under it) the umask's default modes.

    Libraries such as safetensors write 0600 files; on a volume shared by services running
    as other users those files would be unreadable. Symbolic links are left alone.
    """
    mask = _umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    if path.is_symlink():
        return
    if path.is_dir():
        os.chmod(path, dir_mode)
        for p in path.rglob("*"):
            if not p.is_symlink():
                os.chmod(p, dir_mode if p.is_dir() else file_mode)
    elif path.exists():
        os.chmod(path, file_mode)


def check_readable(path: Path | str, what: str) -> None:
    """Refuse, naming owner, mode and our uid, a file (or a file in a folder) we cannot read.

    Libraries report an unreadable file misleadingly (safetensors: "No such file or
    directory"), so callers check before loading. On a shared volume the cause is a writer
    that ran as another user and left its files private.

    Raises:
        ConfigError: `what` (e.g. `target.path`) names the setting; the message has the
            file, its owner uid:gid and mode, and this process's uid.
    """
    path = Path(path)
    files = [path] if not path.is_dir() else [path, *sorted(path.rglob("*"))]
    for f in files:
        if not f.exists():
            continue
        need = os.R_OK | (os.X_OK if f.is_dir() else 0)
        if not os.access(f, need):
            st = f.stat()
            raise ConfigError(
                f"{what}: permission denied reading {f} (owner {st.st_uid}:{st.st_gid}, mode "
                f"{st.st_mode & 0o777:04o}; this process runs as uid {os.getuid()}). The file "
                "exists: make it readable by every service on the volume (chmod -R a+rX), or "
                "run the writer as the same uid"
            )


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dirs(path: Path) -> Path:
    """`mkdir -p` with the umask's modes (the code creates every folder it writes into)."""
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_path(final: Path | str) -> Iterator[Path]:
    """Yield a temp path next to `final`; on success fsync it and rename it over `final`.

    Works for files and folders (e.g. `datasets.save_to_disk`): whatever the caller creates
    at the yielded path is moved into place in one rename, with shared modes
    (`share_modes`). On error the temp is removed, so a reader never sees a partial `final`.
    A hard kill may leave a `.tmp-<name>-*` sibling, which is never read and is swept by
    `sweep_temps`.

    Raises:
        ArtifactError: the caller created nothing at the yielded path.
        OSError: the write failed (disk full, ...); one raised without a file name (a
            failed `write()` has none) is re-raised naming `final`, so the CLI can say
            which artifact could not be written.
    """
    final = Path(final)
    make_dirs(final.parent)
    holder = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{final.name}-", dir=final.parent))
    tmp = holder / final.name
    try:
        try:
            yield tmp
            if tmp.is_file():
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
        except OSError as e:
            named = e.filename is not None and str(holder) not in os.fsdecode(e.filename)
            if named or e.errno is None:
                raise
            raise OSError(e.errno, e.strerror, str(final)) from e
        if not tmp.exists():
            raise ArtifactError(f"{final}: the writer created nothing at {tmp}")
        share_modes(tmp)
        if final.is_dir() and tmp.is_dir():
            # A folder cannot be renamed over a non-empty folder: move the old one aside.
            old = final.with_name(f"{TEMP_PREFIX}old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def read_json_file(path: Path) -> Any:
    """A JSON artifact Eyrie wrote (a manifest, a run's recipe.json), parsed.

    Raises:
        ArtifactError: it is not UTF-8 JSON (damaged on disk, or not Eyrie's); the
            message names the file.
    """
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: damaged, not UTF-8 JSON ({e})") from None


def append_text(path: Path | str, text: str) -> None:
    """Append `text` to the log file `path` (not atomic: for append-only logs).

    Raises:
        OSError: naming `path` even when the failing `write()` or `close()` (disk full)
            raised without a file name.
    """
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def atomic_write_bytes(final: Path | str, data: bytes) -> Path:
    """Write `data` to `final` atomically (temp + fsync + rename). Returns `final`."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)
    return Path(final)


def atomic_write_json(final: Path | str, obj: Any) -> Path:
    """Write `obj` as indented, key-sorted JSON atomically. Returns `final`."""
    return atomic_write_bytes(final, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sweep_temps(folder: Path, prefix: str = "") -> int:
    """Remove leftovers of hard-killed writers under `folder`; returns how many.

    Args:
        folder: where to look, recursively.
        prefix: only temps of artifacts whose name starts with it (e.g. `shard-00003`), so
            a job never removes the in-progress temps of another shard in the same folder.
    """
    if not folder.is_dir():
        return 0
    n = 0
    for p in list(folder.rglob(f"{TEMP_PREFIX}{prefix}*")):
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
        created_at: Unix time of the write.
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


def check_free_space(path: Path, needed_bytes: int, what: str = "output") -> None:
    """Disk preflight: refuse, with both numbers, when `needed_bytes` exceed free space.

    Raises:
        ConfigError: not enough free space on the volume holding `path`.
    """
    make_dirs(path)
    free = shutil.disk_usage(path).free
    if needed_bytes > free:
        raise ConfigError(
            f"{path}: {what} needs an estimated {needed_bytes / 2**30:.2f} GiB "
            f"({needed_bytes} bytes) but only {free / 2**30:.2f} GiB ({free} bytes) are free"
        )
