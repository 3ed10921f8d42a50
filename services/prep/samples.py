"""Training samples: canonical (or regenerated) conversations → `input_ids` + `loss_mask`.

Two inputs (`shared/artifacts.py`):
- prep rows: rendered with the target's chat template and masked (`services.prep.template`);
- regen rows: the server's own ids. `input_ids` = last turn's `prompt_token_ids` +
  `completion_token_ids`; mask 1 on the completion. vLLM includes the stop token in
  `token_ids` when it stops on EOS; if `finish_reason == "stop"` and the completion does not
  end with the end-of-turn id, that id is appended (mask 1), counted. Earlier assistant turns
  inside the prompt get the local prefix-render mask only if the local render's ids equal
  the server's prompt ids; otherwise they get 0 (counted `prompt_render_mismatch`), so a
  local and a server tokenization are never mixed.

Then truncation to `prep.max_len_tokens` (counted) and the `0 < mask.sum() < len` check
(dropped and counted). Counters are plain `Counter`s the job writes into its report.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from services.prep.formats import RowRejected
from services.prep.template import check_mask, mask_spans, tokenize_spans, turn_end


@dataclass
class Sample:
    """One training row. `input_ids`/`loss_mask`: equal-length int lists (mask in {0, 1})."""

    id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


def finish(sample: Sample, max_len: int, counts: Counter) -> Sample:
    """Truncate to `max_len` (counted) and check the mask.

    Raises:
        RowRejected: no trainable token left (e.g. after truncation), or all tokens trainable.
    """
    if len(sample.input_ids) > max_len:
        counts["truncated"] += 1
        sample.input_ids = sample.input_ids[:max_len]
        sample.loss_mask = sample.loss_mask[:max_len]
    check_mask(sample.loss_mask, sample.id)
    return sample


def from_conversations(
    tok: Any, rows: list[dict[str, Any]], kwargs: dict, max_len: int, counts: Counter
) -> list[Sample]:
    """Render, mask and tokenize prep rows in one tokenizer batch.

    Rejected rows are counted in `counts["dropped:<reason>"]`.
    """
    texts, spans, kept = [], [], []
    for row in rows:
        try:
            text, sp = mask_spans(tok, row["messages"], kwargs, row.get("tools"))
        except RowRejected as e:
            counts[f"dropped:{e.reason}"] += 1
            continue
        texts.append(text)
        spans.append(sp)
        kept.append(row)
    out = []
    for row, (ids, mask) in zip(kept, tokenize_spans(tok, texts, spans), strict=True):
        try:
            out.append(finish(Sample(row["id"], row["source"], ids, mask), max_len, counts))
        except RowRejected as e:
            counts[f"dropped:{e.reason}"] += 1
    return out


def _regen_prompt_mask(
    tok: Any, rec: dict[str, Any], k: int, prompt: list[int], kwargs: dict, counts: Counter
) -> list[int]:
    msgs = rec["messages"]
    asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if k >= len(asst):
        raise RowRejected(
            "regen_turns_mismatch", "turns", f"{k + 1} turns but {len(asst)} assistant messages"
        )
    try:
        text, spans = mask_spans(tok, msgs[: asst[k]], kwargs, rec.get("tools"), True)
        ((ids, mask),) = tokenize_spans(tok, [text], [spans])
    except RowRejected:
        ids, mask = [], []
    if ids == prompt:
        return mask
    counts["prompt_render_mismatch"] += 1
    return [0] * len(prompt)


def from_regen(
    tok: Any, rec: dict[str, Any], kwargs: dict, max_len: int, counts: Counter
) -> Sample:
    """One regenerated conversation → a sample built from the server's token ids.

    Raises:
        RowRejected: no turns, or the mask check fails.
    """
    turns = rec.get("turns") or []
    if not turns:
        raise RowRejected("regen_no_turns", "turns")
    last = turns[-1]
    prompt = [int(x) for x in last["prompt_token_ids"]]
    completion = [int(x) for x in last["completion_token_ids"]]
    eot = turn_end(tok, kwargs).token_id
    if (
        last.get("finish_reason") == "stop"
        and eot is not None
        and (not completion or completion[-1] != eot)
    ):
        completion.append(eot)
        counts["eot_appended"] += 1
    prompt_mask = _regen_prompt_mask(tok, rec, len(turns) - 1, prompt, kwargs, counts)
    sample = Sample(
        rec["id"], rec["source"], prompt + completion, prompt_mask + [1] * len(completion)
    )
    return finish(sample, max_len, counts)


def save_samples(samples: list[Sample], path: Any) -> None:
    """Write samples as an HF `save_to_disk` dataset at `path` (a folder, atomically).

    Columns: input_ids list[int32], loss_mask list[int8], seq_len int32, id str, source str
    (the speculators offline layout's `input_ids`/`loss_mask`/`seq_len`, plus provenance).
    The fingerprint is a hash of the content, so equal samples give byte-identical folders
    whichever worker wrote them.
    """
    import hashlib

    import datasets
    import pyarrow as pa

    from shared.store import atomic_path

    table = pa.table(
        {
            "input_ids": pa.array([s.input_ids for s in samples], pa.list_(pa.int32())),
            "loss_mask": pa.array([s.loss_mask for s in samples], pa.list_(pa.int8())),
            "seq_len": pa.array([len(s.input_ids) for s in samples], pa.int32()),
            "id": pa.array([s.id for s in samples], pa.string()),
            "source": pa.array([s.source for s in samples], pa.string()),
        }
    )
    h = hashlib.sha256()
    for s in samples:
        h.update(f"{s.id}\0{s.source}\0{s.input_ids}\0{s.loss_mask}\n".encode())
    ds = datasets.Dataset(table, fingerprint=h.hexdigest()[:16])
    with atomic_path(path) as tmp:
        ds.save_to_disk(str(tmp))
