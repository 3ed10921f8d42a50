"""Every EAGLE-3 convention Eyrie depends on, written down once.

A wrong convention does not crash: the server starts and acceptance length sits near 1.0.
So each rule lives here, is tested with a known value (`tests/shared/test_conventions.py`),
and is checked again at export time. Sources: EAGLE-3 (arXiv 2503.01840); vLLM
`model_executor/models/llama_eagle3.py` and the gpu_model_runner aux-layer code; speculators
0.9.0 `models/eagle3/`, `train/vocab_mapping.py`; SpecForge `specforge/export/to_sglang.py`;
sglang PR #25454.

This module imports numpy only (no torch), so the CLI and workers can use it cheaply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from shared.errors import ConfigError, ContractMismatchError

# -- 1. Aux layer ids ----------------------------------------------------------------------

#: Eyrie's single meaning of an aux layer id: id i is the residual stream *entering* decoder
#: layer i, i.e. HF `output_hidden_states[i]` (index 0 = embedding output). vLLM agrees.
AUX_ID_CONVENTION = "input_of_layer_k (== hf output_hidden_states[k]; vLLM)"

#: SGLang reads a configured id as the *output* of layer i; Eyrie writes i-1 for it.
SGLANG_ID_CONVENTION = "output_of_layer_i (sglang; eyrie id i written as i-1)"

#: Number of aux layers an EAGLE-3 draft consumes. fc input width is this times H_target.
NUM_AUX_LAYERS = 3


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default aux ids for an N-layer target: `[2, N//2, N-3]`.

    SmolLM2-135M (N=30) gives [2, 15, 27]; Kimi-K2.5 (N=61) gives [2, 30, 58]. Small targets
    give duplicates (N=4 → [2, 2, 1]) and are rejected: such models need explicit ids.

    Raises:
        ConfigError: the default is invalid for this N.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    validate_aux_layer_ids(ids, num_layers)
    return ids


def validate_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check that `ids` are 3 distinct aux ids in [1, N-1] for an N-layer target.

    Id 0 (the embeddings) and id N (the final state, used for teacher logits) never go into a
    draft config: listing a 4th id makes vLLM expect an fc of width 4·H.

    Raises:
        ConfigError: wrong count, duplicates, or out of range; the message says which.
    """
    ids = [int(i) for i in ids]
    if len(ids) != NUM_AUX_LAYERS:
        raise ConfigError(f"layers: need exactly {NUM_AUX_LAYERS} aux layer ids (got {ids})")
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"layers: aux layer ids must be distinct (got {ids}); a {num_layers}-layer target "
            "needs explicit ids in the recipe"
        )
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad:
        raise ConfigError(
            f"layers: ids {bad} out of range for a {num_layers}-layer target "
            f"(valid: 1..{num_layers - 1}; id i = residual entering layer i)"
        )
    return ids


def resolve_aux_layer_ids(layers: Sequence[int] | str, num_layers: int) -> list[int]:
    """Recipe `layers` (a list or 'default') → validated aux ids."""
    if isinstance(layers, str):
        if layers != "default":
            raise ConfigError(f"layers: must be a list of 3 ids or 'default' (got {layers!r})")
        return default_aux_layer_ids(num_layers)
    return validate_aux_layer_ids(layers, num_layers)


def sglang_layer_ids(ids: Sequence[int]) -> list[int]:
    """Eyrie aux ids → the ids written into an SGLang draft config (`i-1` each).

    Older SGLang always adds 1 to configured ids; newer SGLang (after PR #25454) adds 1 only
    when the first id is 1. Writing i-1 is right for both only when the first Eyrie id is 2,
    e.g. [2, 15, 27] → [1, 14, 26]. Any other ids are refused.

    Raises:
        ContractMismatchError: the first id is not 2.
    """
    ids = list(ids)
    if not ids or ids[0] != 2:
        raise ContractMismatchError(
            f"SGLang export refused for aux ids {ids}: SGLang's id convention depends on its "
            "version (sglang PR #25454) and only ids starting with 2 map the same way in "
            "both. Use layers [2, ..., ...] or export for vLLM only."
        )
    return [i - 1 for i in ids]


# -- 2. Final hidden state -----------------------------------------------------------------

#: Eyrie stores the final state *before* the final norm (vLLM's capture of layer N). Teacher
#: logits are `lm_head(final_norm(h_N))`. HF's last output_hidden_states entry is post-norm.
FINAL_STATE_CONVENTION = "pre_norm"


# -- 3. Draft vocabulary -------------------------------------------------------------------


def select_draft_vocab(
    token_freq: np.ndarray, draft_vocab_size: int, pinned: Sequence[int] = ()
) -> np.ndarray:
    """Choose the draft vocabulary from loss-masked token counts.

    Rule (speculators `train/vocab_mapping.py`): take the `draft_vocab_size` most frequent
    ids, ties broken by lower id; if fewer were seen, pad with the lowest unused ids; return
    the ids sorted ascending. Eyrie's addition: `pinned` ids (e.g. the target's special
    tokens, which end every answer) are always in, and take places from the least frequent.

    Args:
        token_freq: int64 `[target_vocab]`, count of each target id over assistant tokens.
        draft_vocab_size: rows of the draft lm_head.
        pinned: target ids always included (duplicates ignored).

    Returns:
        int64 `[draft_vocab_size]` target ids, ascending.

    Raises:
        ConfigError: draft_vocab_size > target vocab, or fewer rows than pinned ids.
    """
    freq = np.asarray(token_freq, dtype=np.int64)
    target_vocab = freq.shape[0]
    if draft_vocab_size > target_vocab:
        raise ConfigError(
            f"draft.draft_vocab_size: must be <= target vocab {target_vocab} "
            f"(got {draft_vocab_size})"
        )
    pin = np.unique(np.asarray(list(pinned), dtype=np.int64))
    if len(pin) > draft_vocab_size:
        raise ConfigError(
            f"draft.draft_vocab_size: {draft_vocab_size} rows cannot hold the {len(pin)} "
            "pinned special tokens"
        )
    # lexsort sorts by the last key first: descending count, then ascending id.
    order = np.lexsort((np.arange(target_vocab), -freq))
    order = order[~np.isin(order, pin)]
    room = draft_vocab_size - len(pin)
    seen = np.concatenate([pin, order[freq[order] > 0][:room]])
    if len(seen) < draft_vocab_size:
        unused = np.setdiff1d(np.arange(target_vocab), seen)
        seen = np.concatenate([seen, unused[: draft_vocab_size - len(seen)]])
    return np.sort(seen).astype(np.int64)


def auto_draft_vocab_size(
    token_freq: np.ndarray, coverage_target: float, pinned: Sequence[int] = ()
) -> int:
    """The smallest draft vocabulary whose ids cover `coverage_target` of the counted tokens.

    The n most frequent ids (ties by lower id, as `select_draft_vocab` takes them) with n the
    least such that their counts sum to >= `coverage_target` of all counts, plus the pinned
    ids not among them (so `select_draft_vocab(freq, size, pinned)` reaches the target).

    Args:
        token_freq: int64 `[target_vocab]` counts.
        coverage_target: share in (0, 1].
        pinned: ids always included.

    Returns:
        The size, >= 1 and <= target vocab.

    Raises:
        ConfigError: no token was counted.
    """
    freq = np.asarray(token_freq, dtype=np.int64)
    total = int(freq.sum())
    if total == 0:
        raise ConfigError("draft.draft_vocab_size auto: no assistant token was counted")
    pin = np.unique(np.asarray(list(pinned), dtype=np.int64))
    order = np.lexsort((np.arange(freq.shape[0]), -freq))
    order = order[~np.isin(order, pin)]
    pinned_count = int(freq[pin].sum()) if len(pin) else 0
    need = coverage_target * total - pinned_count
    cum = np.cumsum(freq[order])
    n = int(np.searchsorted(cum, need - 1e-9 * total)) + 1 if need > 0 else 0
    return max(1, min(freq.shape[0], n + len(pin)))


def build_d2t_t2d(selected_ids: Sequence[int], target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Build vLLM's `d2t` (offsets) and `t2d` (mask) from the selected target ids.

    `target_id = draft_id + d2t[draft_id]`; the identity mapping is all zeros, not arange.
    Example: target vocab 10, ids [0, 2, 3, 7] → d2t [0, 1, 1, 4], t2d [1,0,1,1,0,0,0,1,0,0].

    Args:
        selected_ids: ascending, distinct target ids (`select_draft_vocab`).
        target_vocab: target vocab size.

    Returns:
        (d2t int64 `[draft_vocab]`, t2d bool `[target_vocab]`).

    Raises:
        ContractMismatchError: ids are not ascending and distinct, or out of range.
    """
    ids = np.asarray(selected_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size > 1 and np.any(np.diff(ids) <= 0)):
        raise ContractMismatchError("draft vocab ids must be strictly ascending")
    if ids.size and (ids[0] < 0 or ids[-1] >= target_vocab):
        raise ContractMismatchError(f"draft vocab ids must lie in [0, {target_vocab})")
    d2t = ids - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[ids] = True
    return d2t, t2d


def check_d2t_t2d(
    d2t: np.ndarray, t2d: np.ndarray, draft_vocab_size: int, lm_head_rows: int | None = None
) -> None:
    """Check the §3 invariants; raise ContractMismatchError naming the first broken one.

    `t2d.sum() == draft_vocab_size == len(d2t) (== lm_head rows)` and
    `arange + d2t == nonzero(t2d)`.
    """
    d2t = np.asarray(d2t)
    t2d = np.asarray(t2d).astype(bool)
    if d2t.ndim != 1 or t2d.ndim != 1:
        raise ContractMismatchError(f"d2t and t2d must be 1-D (got {d2t.shape}, {t2d.shape})")
    if len(d2t) != draft_vocab_size:
        raise ContractMismatchError(
            f"len(d2t) = {len(d2t)} but draft_vocab_size = {draft_vocab_size}"
        )
    if int(t2d.sum()) != draft_vocab_size:
        raise ContractMismatchError(
            f"t2d.sum() = {int(t2d.sum())} but draft_vocab_size = {draft_vocab_size}"
        )
    if lm_head_rows is not None and lm_head_rows != draft_vocab_size:
        raise ContractMismatchError(
            f"lm_head has {lm_head_rows} rows but draft_vocab_size = {draft_vocab_size}"
        )
    if not np.array_equal(np.arange(len(d2t)) + d2t, np.nonzero(t2d)[0]):
        raise ContractMismatchError(
            "arange(draft_vocab) + d2t != nonzero(t2d): d2t must hold offsets "
            "(target = draft + d2t[draft]) for the ids t2d marks"
        )


def coverage(token_freq: np.ndarray, t2d: np.ndarray) -> float:
    """Share of assistant-token occurrences whose id is in the draft vocab (0..1)."""
    freq = np.asarray(token_freq, dtype=np.int64)
    total = int(freq.sum())
    return float(freq[np.asarray(t2d, dtype=bool)].sum() / total) if total else 0.0


# -- 4. Loss mask --------------------------------------------------------------------------


def shift_mask_left(mask: Sequence[int]) -> list[int]:
    """Shift a loss mask with the inputs for next-token targets.

    Position t predicts token t+1, so the mask of position t is mask[t+1]; the last position
    has no target. `[0,0,0,1,1,1,1]` → `[0,0,1,1,1,1,0]`.
    """
    m = list(mask)
    return m[1:] + [0] if m else []


# -- 7. Acceptance -------------------------------------------------------------------------


def accepted_prefix_len(accept_vector: Iterable[int | bool]) -> int:
    """Tokens accepted in one speculative step: the length of the leading run of accepts.

    `[1,1,0,0]` → 2, `[0,1,1,1]` → 0, `[1,1,1,1]` → 4.
    """
    n = 0
    for a in accept_vector:
        if not a:
            break
        n += 1
    return n


def mean_acceptance_length(accepted_tokens: float, num_drafts: float) -> float:
    """τ = 1 + accepted / drafts (vLLM `spec_decode_num_*` counter deltas).

    Raises:
        ContractMismatchError: no drafts were made (τ undefined).
    """
    if num_drafts <= 0:
        raise ContractMismatchError("no speculative drafts were counted: tau is undefined")
    return 1.0 + accepted_tokens / num_drafts


def draft_acceptance_rate(accepted_tokens: float, draft_tokens: float) -> float:
    """Accepted / draft_tokens, in 0..1."""
    if draft_tokens <= 0:
        raise ContractMismatchError("no draft tokens were counted: acceptance rate undefined")
    return accepted_tokens / draft_tokens


def replay_steps(accepted_at: Sequence[int], start: int) -> list[int]:
    """The accepted counts of the speculative steps a greedy server takes over one answer.

    A step drafts from anchor position a (the target has just produced the token after a),
    accepts `accepted_at[a]` draft tokens and adds the target's own next token, so the next
    step's anchor is `a + accepted_at[a] + 1` (vLLM v1: the bonus token ends every step).
    The walk stops past the last anchor (the answer's last token: the request ends there).

    Args:
        accepted_at: per anchor position, the draft tokens the target would accept there.
        start: the first step's anchor: the prompt's last position (the prefill produced
            the answer's first token; `services.train.samples` aligns position t with the
            next token x_{t+1}).

    Returns:
        accepted tokens per step, in order: `[2, 0, 1, 0, 3, 0]` from 0 gives `[2, 0, 3]`
        (steps at 0, 3 and 4), from 1 gives `[0, 1, 3]` (steps at 1, 2 and 4).
    """
    steps = []
    a = start
    while 0 <= a < len(accepted_at):
        steps.append(int(accepted_at[a]))
        a += steps[-1] + 1
    return steps


#: τ below this with a trained draft is a misconfiguration until proven otherwise.
TAU_MISCONFIG_THRESHOLD = 1.1
