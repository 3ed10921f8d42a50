"""Row indexes of local sources (`services.prep.sources`) against an independent JSON parse.

The expected rows and byte ranges come from Python's own `json` module: `json.loads` per
line for JSONL, `json.JSONDecoder.raw_decode` element by element for JSON arrays, with
character positions converted to byte offsets. Inputs are the real sample files, and files
built from their records with the hard cases added: escaped quotes and backslashes inside
strings, CJK text, blank and whitespace-only lines, CRLF, files cut mid-record (also
mid-escape and mid-character), empty arrays.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.prep.sources import (
    RowError,
    index_json_array,
    index_jsonl,
    read_rows,
    resolve_source,
)
from shared.errors import InputError
from shared.recipe import DatasetSpec
from shared.records import DataSource

SAMPLES = Path(__file__).parents[1] / "fixtures" / "samples"
JSON_WS = " \t\r\n"


# -- the independent parse -------------------------------------------------------------------


def oracle_jsonl(data: bytes) -> list[tuple[int, int, Any]]:
    """(start, end, value) of every line holding more than JSON whitespace."""
    out, pos = [], 0
    for line in data.split(b"\n"):
        if line.strip(JSON_WS.encode()):
            out.append((pos, pos + len(line), json.loads(line)))
        pos += len(line) + 1
    return out


class ArrayParse:
    """A JSON array read element by element with `raw_decode`; byte offsets throughout."""

    def __init__(self, data: bytes):
        # surrogateescape: a file cut inside a UTF-8 character still decodes, one char per
        # stray byte, and encodes back to the same bytes
        self.text = data.decode("utf-8", "surrogateescape")
        self._char, self._byte = 0, 0
        self.elements: list[tuple[int, int, Any]] = []
        self.truncated_at: int | None = None  # byte where the first incomplete element starts
        self._parse()

    def byte(self, char: int) -> int:
        assert char >= self._char  # offsets are asked in increasing order
        self._byte += len(self.text[self._char : char].encode("utf-8", "surrogateescape"))
        self._char = char
        return self._byte

    def _skip(self, i: int) -> int:
        while i < len(self.text) and self.text[i] in JSON_WS:
            i += 1
        return i

    def _parse(self) -> None:
        text, dec = self.text, json.JSONDecoder()
        i = self._skip(1 if text.startswith("\ufeff") else 0)
        assert text[i] == "["
        i = self._skip(i + 1)
        if text[i : i + 1] == "]":
            return
        while True:
            if i >= len(text):
                self.truncated_at = self.byte(len(text))
                return
            try:
                value, end = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                self.truncated_at = self.byte(i)
                return
            self.elements.append((self.byte(i), self.byte(end), value))
            j = self._skip(end)
            if j >= len(text):
                self.truncated_at = self.byte(len(text))
                return
            if text[j] == "]":
                return
            assert text[j] == ",", f"not a JSON array at char {j}"
            i = self._skip(j + 1)


def check_jsonl(path: Path) -> np.ndarray:
    data = path.read_bytes()
    expected = oracle_jsonl(data)
    ranges, load = index_jsonl(path)
    assert ranges.dtype == np.int64 and ranges.shape == (len(expected), 2)
    assert ranges.tolist() == [[s, e] for s, e, _ in expected]
    assert [json.loads(data[s:e]) for s, e in ranges.tolist()] == [v for _, _, v in expected]
    assert (load.rows, load.truncated, load.file) == (len(expected), False, str(path))
    return ranges


def check_array(path: Path) -> tuple[np.ndarray, ArrayParse]:
    data = path.read_bytes()
    want = ArrayParse(data)
    ranges, load = index_json_array(path)
    assert ranges.dtype == np.int64 and ranges.shape == (len(want.elements), 2)
    assert ranges.tolist() == [[s, e] for s, e, _ in want.elements]
    assert [json.loads(data[s:e]) for s, e in ranges.tolist()] == [v for *_, v in want.elements]
    assert load.rows == len(want.elements)
    assert load.truncated is (want.truncated_at is not None)
    assert load.error_byte_offset == want.truncated_at
    assert (load.error is None) is (want.truncated_at is None)
    return ranges, want


# -- inputs ------------------------------------------------------------------------------------


def _records() -> list[Any]:
    """Real records with escaped quotes, backslashes and CJK text, plus hand-made edge cases."""
    alpaca = json.loads((SAMPLES / "alpaca_en_demo.json").read_text())
    quoted = [r for r in alpaca if '"' in r["output"]][:2]
    reason = [json.loads(x) for x in (SAMPLES / "reason_tool_use_demo_50.jsonl").open()]
    backslashed = [r for r in reason if "\\\\" in json.dumps(r)][:1]
    golden = json.loads((SAMPLES / "specforge_golden" / "inputs.json").read_text())
    cjk = {"messages": golden["message_sets"]["tool_use_messages"][0]}  # Chinese + JSON text
    assert quoted and backslashed and "北京" in json.dumps(cjk, ensure_ascii=False)
    edge = [
        {"s": "ends with a backslash \\"},
        {"s": "\\\\"},
        {"s": 'a quote " then ] } , [ { outside nothing'},
        {"s": '\\"', "t": ["]", "}", ",", "\\\\\\"]},
        {"nested": [[{"a": []}, {}], [], "[,]"], "n": -1.5e3, "z": None, "b": True},
        {"s": "日本語のテキスト、中文，한국어 and emoji 🦅"},
    ]
    return quoted + backslashed + [cjk] + edge


@pytest.fixture(scope="module")
def records() -> list[Any]:
    return _records()


def _tricky_array(records: list[Any]) -> bytes:
    """A JSON array in mixed layouts: indented, compact, odd whitespace around commas."""
    parts = []
    for i, r in enumerate(records):
        indent = 2 if i % 3 == 0 else None
        parts.append(json.dumps(r, ensure_ascii=False, indent=indent))
    body = "".join(p + (" ,\r\n\n\t" if i % 2 else ",") for i, p in enumerate(parts[:-1]))
    return ("\ufeff [\n" + body + parts[-1] + "\n ]\n").encode("utf-8")


# -- JSONL -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("mt_bench_questions.jsonl", 80),
        ("reason_tool_use_demo_50.jsonl", 50),
        ("toy_chat_fine_tuning.jsonl", 5),
    ],
)
def test_real_jsonl_samples(name, rows):
    assert len(check_jsonl(SAMPLES / name)) == rows  # SOURCES.md record counts


def test_jsonl_with_blank_lines_crlf_and_no_final_newline(tmp_path, records):
    lines = [json.dumps(r, ensure_ascii=not i % 2) for i, r in enumerate(records)]
    text = "\n\n   \t\n" + lines[0] + "\r\n"  # blank and whitespace-only lines first
    for i, line in enumerate(lines[1:-1]):
        text += ("  " if i % 2 else "") + line + ("\r\n" if i % 3 else "\n") + "\n" * (i % 2)
    text += " \r\n\t\n" + lines[-1]  # whitespace lines, then the last row without "\n"
    path = tmp_path / "tricky.jsonl"
    path.write_bytes(text.encode("utf-8"))
    ranges = check_jsonl(path)
    data = path.read_bytes()
    assert [json.loads(data[s:e]) for s, e in ranges.tolist()] == records


def test_jsonl_only_blank_lines_has_no_rows(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n \n\t\r\n")
    assert index_jsonl(path)[0].shape == (0, 2)
    path.write_bytes(b"")
    assert index_jsonl(path)[1].rows == 0


# -- JSON arrays -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("alpaca_en_demo.json", 999),
        ("glaive_toolcall_en_demo.json", 300),
        ("sharegpt_fastchat_dummy.json", 500),
        ("sharegpt_fastchat_dummy_with_system.json", 500),
    ],
)
def test_real_json_array_samples(name, rows):
    ranges, want = check_array(SAMPLES / name)
    assert len(ranges) == rows and want.truncated_at is None  # SOURCES.md record counts
    assert [v for *_, v in want.elements] == json.loads((SAMPLES / name).read_text())


def test_array_with_escapes_cjk_and_odd_whitespace(tmp_path, records):
    path = tmp_path / "tricky.json"
    path.write_bytes(_tricky_array(records))
    ranges, want = check_array(path)
    assert [v for *_, v in want.elements] == records


def _cut_points(data: bytes) -> dict[str, int]:
    """Byte positions to cut the tricky array at, each inside a different construct."""
    cjk = "北".encode()
    return {
        "after a backslash in a string": data.index(b"ends with a backslash \\") + 23,
        "inside an escaped quote": data.index(b'a quote \\"') + len(b"a quote \\"),
        "mid CJK character": data.index(cjk) + 1,
        "inside a nested array": data.index(b'[[{"a"') + 4,
        "after a complete element": data.index(b'"b": true}') + len(b'"b": true}'),
        "just after the array's [": data.index(b"[") + 1,
        "before the closing ]": data.rindex(b"]"),
    }


@pytest.mark.parametrize(
    "where",
    [
        "after a backslash in a string",
        "inside an escaped quote",
        "mid CJK character",
        "inside a nested array",
        "after a complete element",
        "just after the array's [",
        "before the closing ]",
    ],
)
def test_array_cut_mid_record_keeps_complete_ones(tmp_path, records, where):
    data = _tricky_array(records)
    cut = _cut_points(data)[where]
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    ranges, want = check_array(path)
    assert want.truncated_at is not None  # the cut really broke the file
    assert [v for *_, v in want.elements] == records[: len(ranges)]
    if where == "before the closing ]":
        assert len(ranges) == len(records) and want.truncated_at == cut


def test_real_sample_cut_mid_record(tmp_path):
    data = (SAMPLES / "glaive_toolcall_en_demo.json").read_bytes()
    cut = data.index(b'\\"', len(data) // 2) + 1  # between a backslash and its quote
    path = tmp_path / "glaive_cut.json"
    path.write_bytes(data[:cut])
    ranges, want = check_array(path)
    full = json.loads(data)
    assert 100 < len(ranges) < 300 and [v for *_, v in want.elements] == full[: len(ranges)]
    assert data[want.truncated_at : want.truncated_at + 1] == b"{"


@pytest.mark.parametrize("text", [b"[]", b" [ \n ] \n", b"\xef\xbb\xbf[]"])
def test_empty_array(tmp_path, text):
    path = tmp_path / "empty.json"
    path.write_bytes(text)
    ranges, load = index_json_array(path)
    assert ranges.shape == (0, 2) and load.rows == 0 and load.truncated is False


@pytest.mark.parametrize("text", [b"[", b"[\n  ", b"[\n{", b'[{"a": "x'])
def test_array_cut_before_its_first_element_is_truncated(tmp_path, text):
    path = tmp_path / "cut.json"
    path.write_bytes(text)
    ranges, want = check_array(path)
    assert len(ranges) == 0 and want.truncated_at is not None


@pytest.mark.parametrize("text", [b"", b'{"a": 1}', b"  \n", b"x["])
def test_not_an_array_is_refused(tmp_path, text):
    path = tmp_path / "obj.json"
    path.write_bytes(text)
    with pytest.raises(InputError, match=r"obj\.json: expected a JSON array"):
        index_json_array(path)


# -- reading rows back (what a prep worker does) -----------------------------------------------


def test_read_rows_by_byte_range_in_any_order(tmp_path, records):
    path = tmp_path / "tricky.json"
    path.write_bytes(_tricky_array(records))
    source = resolve_source(DatasetSpec(path=str(path)), 0)
    assert (source.reader, source.name, source.adapter) == ("json_array", "tricky", "auto")
    ranges, _ = index_json_array(path)
    order = [5, 0, len(records) - 1, 5, 2]
    assert read_rows(source, ranges, order) == [records[i] for i in order]


def test_read_rows_reports_undecodable_rows(tmp_path):
    rows = [b'{"a": 1}', b"{not json", b'{"s": "caf\xe9"}', b'{"s": "\xc3\xa9"}']
    path = tmp_path / "mixed.json"  # a .json file holding JSONL is read as JSONL
    path.write_bytes(b"\n".join(rows) + b"\n")
    source = resolve_source(DatasetSpec(path=str(path)), 0)
    assert source.reader == "jsonl"
    ranges, _ = index_jsonl(path)
    got = read_rows(source, ranges, [0, 1, 2, 3])
    assert got[0] == {"a": 1} and got[3] == {"s": "é"}
    assert isinstance(got[1], RowError) and got[1].reason == "bad_json"
    # json.loads(b"{not json") fails at its byte 1; the line starts after row 0 and "\n"
    expected = f"byte {len(rows[0]) + 2}: Expecting property name enclosed in double quotes"
    assert got[1].detail == expected
    assert isinstance(got[2], RowError) and got[2].reason == "invalid_utf8"
    offset = len(rows[0]) + len(rows[1]) + 2 + rows[2].index(b"\xe9")
    assert got[2].detail.startswith(f"byte {offset}: ")


def test_source_kinds(tmp_path):
    from shared.errors import ConfigError

    assert resolve_source(DatasetSpec(path=str(SAMPLES / "alpaca_en_demo.json")), 0) == DataSource(
        name="alpaca_en_demo",
        adapter="auto",
        reader="json_array",
        path=str(SAMPLES / "alpaca_en_demo.json"),
    )
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.path: .*unsupported file type '\.csv'"):
        resolve_source(DatasetSpec(path=str(csv)), 0)
    with pytest.raises(ConfigError, match=r"datasets\[2\]\.path: .*nope\.jsonl does not exist"):
        resolve_source(DatasetSpec(path=str(tmp_path / "nope.jsonl")), 2)
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.path: .* is a folder"):
        resolve_source(DatasetSpec(path=str(tmp_path)), 0)
    hub = resolve_source(DatasetSpec(path="HuggingFaceH4/ultrachat_200k", split="train_sft"), 0)
    assert (hub.reader, hub.name, hub.split) == ("hf", "ultrachat_200k", "train_sft")
