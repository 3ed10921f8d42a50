"""Benchmark prompt sets, as chat messages the server renders with the chat template.

Prompts are sent as `messages` through `/v1/chat/completions`, so the server applies the
target's chat template with the recipe's `chat_template_kwargs` (eagle3-conventions §7: raw
prompts inflate τ through degenerate loops).

Sets:
- `mtbench`: MT-Bench questions shipped with Eyrie (FastChat, Apache-2.0; the file lives in
  `services/bench/data/`, a user's clone has no ../shared, see SOURCES.md). First turns by
  default; with `eval.second_turn` each question also gets its second turn after the target's
  own first answer (`second_turn_messages`).
- `heldout`: a held-out slice of the run's own data: the *last* `eval.num_prompts`
  conversations of the dedup'd prep output (prep shards in order, rows in `dedup/keep.json`
  order), cut before their first assistant turn. The trainer's validation split is the tail of
  the sample order too, so these rows are the ones least likely to be in training; a run whose
  data all went into training still benchmarks on its own distribution.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.errors import ArtifactError, ConfigError
from shared.recipe import Recipe
from shared.store import RunStore

MTBENCH_FILE = Path(__file__).parent / "data" / "mt_bench_questions.jsonl"

Messages = list[dict[str, str]]


def mtbench_questions() -> list[dict]:
    """All 80 MT-Bench records: `{question_id, category, turns: [str, str], reference?}`."""
    with open(MTBENCH_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench_first_turns() -> list[str]:
    """The 80 first-turn prompts, in file order."""
    return [q["turns"][0] for q in mtbench_questions()]


def mtbench_messages(num_prompts: int) -> list[Messages]:
    """The first `num_prompts` MT-Bench first turns as single-user-message conversations."""
    return [[{"role": "user", "content": t}] for t in mtbench_first_turns()[:num_prompts]]


def second_turn_messages(first: list[Messages], answers: list[str]) -> list[Messages]:
    """MT-Bench turn 2 after the target's own turn-1 answer, for each of `first`.

    Args:
        first: turn-1 conversations, in MT-Bench file order (`mtbench_messages`).
        answers: the target's answer to each, same order and length.

    Raises:
        ConfigError: lengths differ.
    """
    if len(first) != len(answers):
        raise ConfigError(f"second turn: {len(first)} prompts but {len(answers)} answers")
    turns2 = [q["turns"][1] for q in mtbench_questions()]
    return [
        [*msgs, {"role": "assistant", "content": ans}, {"role": "user", "content": turns2[i]}]
        for i, (msgs, ans) in enumerate(zip(first, answers, strict=True))
    ]


def _prompt_of(messages: list[dict]) -> Messages | None:
    """The conversation up to its first assistant turn; None if it has no user turn there."""
    out: Messages = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m.get("content") or ""})
    return out if any(m["role"] == "user" for m in out) else None


def heldout_messages(store: RunStore, num_prompts: int) -> list[Messages]:
    """The last `num_prompts` dedup'd prep conversations of the run, cut before turn 1.

    Rows come from `prep/shard-N.jsonl`, filtered by `dedup/keep.json` when it exists.

    Raises:
        ArtifactError: the run has no prep output, or too few usable rows.
    """
    prep = store.root / "prep"
    shards = sorted(prep.glob("shard-*.jsonl"))
    shards = [p for p in shards if not p.name.endswith(".quarantine.jsonl")]
    if not shards:
        raise ArtifactError(f"{prep}: no prep shards; the held-out prompt set needs `prep` done")
    keep_path = store.root / "dedup" / "keep.json"
    keep = json.loads(keep_path.read_text()) if keep_path.is_file() else None
    rows: list[Messages] = []
    for path in shards:
        lines = path.read_text(encoding="utf-8").splitlines()
        shard = str(int(path.name.split("-")[1].split(".")[0]))
        idx = keep[shard] if keep is not None else range(len(lines))
        for i in idx:
            prompt = _prompt_of(json.loads(lines[i])["messages"])
            if prompt is not None:
                rows.append(prompt)
    if len(rows) < num_prompts:
        raise ArtifactError(
            f"{prep}: {len(rows)} usable held-out conversations, eval.num_prompts asks "
            f"{num_prompts}; lower eval.num_prompts or use eval.prompt_set=mtbench"
        )
    return rows[-num_prompts:]


def benchmark_messages(store: RunStore, recipe: Recipe) -> list[Messages]:
    """Turn-1 conversations of the recipe's prompt set (`eval.prompt_set`)."""
    if recipe.eval.prompt_set == "heldout":
        return heldout_messages(store, recipe.eval.num_prompts)
    return mtbench_messages(recipe.eval.num_prompts)
