"""Benchmark prompt sets: MT-Bench questions shipped with Eyrie (FastChat, Apache-2.0).

The file lives in `services/bench/data/` (a user's clone has no ../shared), see SOURCES.md.
"""

from __future__ import annotations

import json
from pathlib import Path

MTBENCH_FILE = Path(__file__).parent / "data" / "mt_bench_questions.jsonl"


def mtbench_questions() -> list[dict]:
    """All 80 MT-Bench records: `{question_id, category, turns: [str, str], reference?}`."""
    with open(MTBENCH_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_first_turns() -> list[str]:
    """The 80 first-turn prompts, in file order."""
    return [q["turns"][0] for q in mtbench_questions()]
