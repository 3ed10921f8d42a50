"""MT-Bench questions: the benchmark prompts and the decontamination list.

The 80 two-turn questions ship with Eyrie (`shared/data/mt_bench_questions.jsonl`, from
FastChat, Apache-2.0; origin in `shared/data/SOURCES.md`): a user's clone has no other copy,
and no hub is reached at run time. Prep drops training conversations whose first prompt is
one of these (decontamination); the bench sends them as chat messages.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.errors import ArtifactError

MTBENCH_FILE = Path(__file__).parent / "data" / "mt_bench_questions.jsonl"


def mtbench_questions() -> list[dict]:
    """All 80 records: `{question_id, category, turns: [str, str], reference?}`.

    Raises:
        ArtifactError: the data file is missing (an install without package data).
    """
    if not MTBENCH_FILE.is_file():
        raise ArtifactError(
            f"{MTBENCH_FILE}: missing; reinstall Eyrie (the file is package data of `shared`)"
        )
    with open(MTBENCH_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_first_turns() -> list[str]:
    """The 80 first-turn prompts, in file order."""
    return [q["turns"][0] for q in mtbench_questions()]


def mtbench_second_turns() -> list[str]:
    """The 80 second-turn prompts, in file order."""
    return [q["turns"][1] for q in mtbench_questions()]
