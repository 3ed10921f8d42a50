"""Which regenerated answers are worth training on.

A small target at low temperature often falls into a loop: the same sentence or line again
and again until `max_tokens`. Training a draft on such a tail teaches it to predict the loop,
which the target then rarely produces on real prompts, and it wastes extract and train time.
Two checks run on every answer the server returns:

- repetition: the share of the answer's tail (its last half) covered by n-grams of
  `regen.repeat_ngram_tokens` tokens that already occurred earlier in the answer. Prose
  and code rarely repeat long n-grams; a loop repeats them at every position, so the share
  is near 1. Answers shorter than `MIN_JUDGED_TOKENS` are not judged.
- length cut: the answer stopped at `max_tokens` (`finish_reason == "length"`);
  `regen.length_cut` keeps it (a prefix of a real answer is still the target's
  distribution) or drops it.

A failed answer is quarantined, never trained on and never silently dropped: the row goes to
the shard's errors file with status `skipped` and the reason (or, past the first turn, the
conversation keeps its earlier turns and records the reason in `stopped`), and the manifest
counts it. At temperature > 0 a failed answer can be drawn again (`regen.resample_attempts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

#: Answers shorter than this many tokens are never judged repetitive.
MIN_JUDGED_TOKENS = 32

#: Quarantine reasons (the `reason` of the errors record, or `stopped` of a kept record).
DEGENERATE, LENGTH_CUT = "degenerate_repetition", "length_cut"


def repeated_tail_share(ids: Sequence[int], n: int) -> float:
    """The share of the tail of `ids` covered by n-grams that occurred earlier in `ids`.

    The tail is the last half of `ids` (`ids[len(ids) // 2:]`). A tail position is covered
    when some n-gram containing it starts at a position `s` and the same n-gram also starts
    at a position before `s`.

    Args:
        ids: the answer's token ids, without the stop token.
        n: n-gram length in tokens (>= 1).

    Returns:
        A share in [0, 1]; 0.0 when `ids` is shorter than `MIN_JUDGED_TOKENS`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    if len(ids) < max(MIN_JUDGED_TOKENS, 2 * n):
        return 0.0
    start = len(ids) // 2
    seen: set[tuple[int, ...]] = set()
    covered_until = -1  # last covered position
    covered = 0
    for s in range(len(ids) - n + 1):
        gram = tuple(ids[s : s + n])
        if gram in seen:
            lo = max(s, covered_until + 1, start)
            hi = s + n - 1
            if hi >= lo:
                covered += hi - lo + 1
            covered_until = max(covered_until, hi)
        else:
            seen.add(gram)
    return covered / (len(ids) - start)


@dataclass(frozen=True)
class Verdict:
    """Why an answer is quarantined: `reason` (DEGENERATE or LENGTH_CUT) and a detail line."""

    reason: str
    detail: str


@dataclass(frozen=True)
class AnswerPolicy:
    """The regen recipe's answer checks (see the module docstring).

    Attributes:
        max_repeat_share: an answer whose `repeated_tail_share` exceeds this is degenerate;
            None = never.
        ngram_tokens: n of `repeated_tail_share`.
        length_cut: "keep" or "drop" answers cut at `max_tokens`.
        stop_ids: token ids that end an answer (removed before judging repetition).
    """

    max_repeat_share: float | None = 0.6
    ngram_tokens: int = 8
    length_cut: Literal["keep", "drop"] = "keep"
    stop_ids: frozenset[int] = frozenset()

    def verdict(self, ids: Sequence[int], finish_reason: str, text: str = "") -> Verdict | None:
        """None when the answer may be trained on, else why not.

        Args:
            ids: completion token ids as sampled (the stop token included, if any).
            finish_reason: `stop` or `length`.
            text: the answer text, quoted (its last 80 characters) in the detail.
        """
        body = list(ids)
        while body and body[-1] in self.stop_ids:
            body.pop()
        if self.max_repeat_share is not None:
            share = repeated_tail_share(body, self.ngram_tokens)
            if share > self.max_repeat_share:
                return Verdict(
                    DEGENERATE,
                    f"{share:.0%} of the last {len(body) - len(body) // 2} tokens repeat "
                    f"earlier {self.ngram_tokens}-grams (limit {self.max_repeat_share:.0%}); "
                    f"ends {text[-80:]!r}",
                )
        if self.length_cut == "drop" and finish_reason == "length":
            return Verdict(LENGTH_CUT, f"cut at max_tokens after {len(body)} tokens")
        return None
