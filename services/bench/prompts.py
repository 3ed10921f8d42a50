"""Benchmark prompt sets, as chat messages the server renders with the chat template.

Prompts are sent as `messages` through `/v1/chat/completions`, so the server applies the
target's chat template with the recipe's `chat_template_kwargs` (eagle3-conventions §7: raw
prompts inflate τ through degenerate loops).

Sets:
- `mtbench`: MT-Bench questions shipped with Eyrie (FastChat, Apache-2.0; the file lives in
  `services/bench/data/`, a user's clone has no ../shared, see SOURCES.md). First turns by
  default; with `eval.second_turn` each question also gets its second turn after the target's
  own first answer (`second_turn_messages`).
- `heldout`: a held-out slice of the run's own data. When the run has extract output, these
  are the conversations of the trainer's validation split (`services.train.samples.
  split_train_val` with `train.val_fraction` and `train.seed`, mapped to sample ids through
  `tokenize/shard-N`), cut before their first assistant turn: rows the draft never trained
  on. Before extraction exists, the last `eval.num_prompts` dedup'd prep conversations are
  used instead, and the result says so (`heldout_source`).
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


def _kept_conversations(store: RunStore) -> list[dict]:
    """The dedup'd prep conversations of the run, shard by shard, in keep order."""
    prep = store.root / "prep"
    shards = [p for p in sorted(prep.glob("shard-*.jsonl")) if p.name.count(".") == 1]
    if not shards:
        raise ArtifactError(f"{prep}: no prep shards; the held-out prompt set needs `prep` done")
    keep_path = store.root / "dedup" / "keep.json"
    keep = json.loads(keep_path.read_text()) if keep_path.is_file() else None
    rows: list[dict] = []
    for path in shards:
        lines = path.read_text(encoding="utf-8").splitlines()
        shard = str(int(path.name.split("-")[1].split(".")[0]))
        idx = keep[shard] if keep is not None else range(len(lines))
        rows += [json.loads(lines[i]) for i in idx]
    return rows


def validation_ids(store: RunStore, recipe: Recipe) -> list[str] | None:
    """Sample ids of the trainer's validation split, or None before extraction exists."""
    if not any((store.root / "extract").glob("shard-*")):
        return None
    from datasets import load_from_disk

    from services.train.samples import extract_shards, index_samples, split_train_val

    index = index_samples(extract_shards(store))
    _, val = split_train_val(index.refs, recipe.train.val_fraction, recipe.train.seed)
    ids: dict[str, list[str]] = {}
    out = []
    for ref in val:
        name = ref.shard_dir.name
        if name not in ids:
            tok = store.root / "tokenize" / name
            ids[name] = list(load_from_disk(str(tok)).select_columns(["id"])["id"])
        out.append(ids[name][ref.row])
    return out


def heldout_messages(
    store: RunStore, num_prompts: int, val_ids: list[str] | None = None
) -> list[Messages]:
    """Held-out prompts of the run (see the module docstring), cut before turn 1.

    Args:
        val_ids: the trainer's validation sample ids (`validation_ids`); None = the last
            `num_prompts` dedup'd prep conversations.

    Raises:
        ArtifactError: the run has no prep output, or no usable held-out row.
    """
    rows = _kept_conversations(store)
    if val_ids is not None:
        by_id = {r["id"]: r for r in rows}
        rows = [by_id[i] for i in val_ids if i in by_id]
    prompts = [p for p in (_prompt_of(r["messages"]) for r in rows) if p is not None]
    if val_ids is None and len(prompts) < num_prompts:
        raise ArtifactError(
            f"{store.root / 'prep'}: {len(prompts)} usable held-out conversations, "
            f"eval.num_prompts asks {num_prompts}; lower it or use eval.prompt_set=mtbench"
        )
    if not prompts:
        raise ArtifactError(
            f"{store.root}: the validation split holds no usable conversation; raise "
            "train.val_fraction or use eval.prompt_set=mtbench"
        )
    return prompts[-num_prompts:] if val_ids is None else prompts[:num_prompts]


def benchmark_messages(store: RunStore, recipe: Recipe) -> tuple[list[Messages], str]:
    """Turn-1 conversations of the recipe's prompt set (`eval.prompt_set`), and their source.

    The source is `mtbench`, `heldout:validation_split` or `heldout:prep_tail`.
    """
    if recipe.eval.prompt_set == "heldout":
        val = validation_ids(store, recipe)
        source = "heldout:prep_tail" if val is None else "heldout:validation_split"
        return heldout_messages(store, recipe.eval.num_prompts, val), source
    return mtbench_messages(recipe.eval.num_prompts), "mtbench"
