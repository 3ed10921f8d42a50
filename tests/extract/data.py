"""Real tokenized shards for extraction and vocab tests.

Real ShareGPT V3 conversations (`services.prep.sharegpt_pkg`), adapted by the prep adapter,
rendered with SmolLM2's real ChatML template and tokenized once (`add_special_tokens=False`).
The loss mask marks each assistant turn's content and its `<|im_end|>`, found by rendering
prefixes (shared/conventions.py §4); the newline after `<|im_end|>` stays 0.

This is test data, not the tokenize stage (services/prep owns that): the rows are made here,
independently of the stage, and written through the run store's tokenize writer
(`shared.artifacts.TokenizeArtifacts`) so extract and vocab can be tested alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.prep.formats import RowRejected, adapt_sharegpt
from services.prep.sharegpt_pkg import iter_sharegpt
from shared.artifacts import RunStore, TokenizedSample, write_model
from shared.records import Plan, Split


def sharegpt_messages(n: int, skip: int = 0) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(id, messages) of the first `n` usable ShareGPT conversations after `skip` usable ones.

    Usable: adapts cleanly, starts with a user turn, has an assistant turn.
    """
    seen = 0
    for rec in iter_sharegpt():
        try:
            msgs = adapt_sharegpt(rec).messages
        except RowRejected:
            continue
        if not msgs or msgs[0]["role"] != "user" or not any(m["role"] == "assistant" for m in msgs):
            continue
        seen += 1
        if seen <= skip:
            continue
        yield str(rec.get("id", seen)), msgs
        if seen - skip >= n:
            return


def tokenize_chat(tok: Any, messages: list[dict[str, Any]], max_len: int) -> dict[str, Any]:
    """input_ids and loss_mask of one conversation, truncated to `max_len` tokens."""

    def n_tokens(msgs: list[dict[str, Any]], gen: bool) -> int:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    text = tok.apply_chat_template(messages, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = n_tokens(messages[:i], gen=True)
        end = n_tokens(messages[: i + 1], gen=False) - 1  # drop the "\n" after <|im_end|>
        mask[start:end] = [1] * (end - start)
    return {"input_ids": ids[:max_len], "loss_mask": mask[:max_len]}


def tokenized_rows(tok: Any, n: int, max_len: int, skip: int = 0) -> list[dict[str, Any]]:
    """`n` tokenized ShareGPT rows with at least one trainable token after truncation."""
    rows = []
    for sid, msgs in sharegpt_messages(10 * n + 100, skip):
        r = tokenize_chat(tok, msgs, max_len)
        if sum(r["loss_mask"]) == 0:
            continue
        rows.append(
            {
                **r,
                "seq_len": len(r["input_ids"]),
                "id": sid,
                "conversation_id": sid,
                "source": "sharegpt-v3",
            }
        )
        if len(rows) == n:
            break
    return rows


def write_tokenized_shard(store: RunStore, shard: int, rows: list[dict[str, Any]]) -> Path:
    """Write `rows` as `tokenize/shard-N/` through the run store's tokenize writer."""
    samples = [
        TokenizedSample(
            id=r["id"],
            conversation_id=r.get("conversation_id", r["id"]),
            source=r["source"],
            input_ids=list(r["input_ids"]),
            loss_mask=list(r["loss_mask"]),
        )
        for r in rows
    ]
    store.tokenize.write(shard, samples, {"samples": len(samples)})
    return store.tokenize.dataset_path(shard)


def write_plan(store: RunStore, num_shards: int, shard_rows: int = 1000) -> Path:
    """A plan of `num_shards` shards for a run whose inputs a test writes by hand (no datasets
    are read: the per-shard stages only take their shard count from it)."""
    plan = Plan(
        recipe_hash=store.recipe().recipe_hash(),
        num_shards=num_shards,
        shard_rows=shard_rows,
        selected=num_shards * shard_rows,
        datasets=[],
    )
    return write_model(store.plan.plan_path, plan)


def write_split(store: RunStore, conversation_ids: list[str], val_ids: list[str]) -> None:
    """The run's held-out split: `val_ids` of `conversation_ids` (no benchmark prompts)."""
    recipe = store.recipe()
    split = Split(
        seed=recipe.train.seed,
        val_fraction=recipe.train.val_fraction,
        conversations=len(conversation_ids),
        val_ids=list(val_ids),
    )
    store.split.write(split, [])
