"""Benchmark prompt sets, as chat messages the server renders with the chat template.

Prompts are sent as `messages` through `/v1/chat/completions`, so the server applies the
target's chat template with the recipe's `chat_template_kwargs` (shared/conventions.py §7:
raw prompts inflate τ through degenerate loops).

Sets:
- `mtbench`: MT-Bench questions (`shared.mtbench`). First turns by default; with
  `bench.second_turn` each question also gets its second turn after the target's own first
  answer (`second_turn_messages`).
- `heldout`: the first prompts of the run's held-out conversations (`split/heldout.jsonl`,
  written by the split stage): conversations the draft never trained on.
"""

from __future__ import annotations

from shared.artifacts import RunStore
from shared.errors import ArtifactError, ConfigError
from shared.mtbench import mtbench_first_turns, mtbench_second_turns
from shared.recipe import Recipe

Messages = list[dict[str, str]]


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
    turns2 = mtbench_second_turns()
    return [
        [*msgs, {"role": "assistant", "content": ans}, {"role": "user", "content": turns2[i]}]
        for i, (msgs, ans) in enumerate(zip(first, answers, strict=True))
    ]


def heldout_messages(store: RunStore, num_prompts: int) -> list[Messages]:
    """The first `num_prompts` held-out prompts of the run.

    Raises:
        ArtifactError: the split stage has not run, or it held out no usable prompt.
    """
    prompts = [
        [{"role": m.role, "content": m.content or ""} for m in c.messages]
        for c in store.split.heldout_prompts()
    ]
    if not prompts:
        raise ArtifactError(
            f"{store.split.heldout_path}: the held-out split has no usable prompt; raise "
            "train.val_fraction or use bench.prompt_set=mtbench"
        )
    return prompts[:num_prompts]


def benchmark_messages(store: RunStore, recipe: Recipe) -> tuple[list[Messages], str]:
    """Turn-1 conversations of the recipe's prompt set (`bench.prompt_set`), and its name."""
    if recipe.bench.prompt_set == "heldout":
        return heldout_messages(store, recipe.bench.num_prompts), "heldout"
    return mtbench_messages(recipe.bench.num_prompts), "mtbench"
