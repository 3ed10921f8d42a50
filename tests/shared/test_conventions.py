"""Every convention in shared/conventions.py against known values from its own examples."""

import numpy as np
import pytest

from shared import conventions as c
from shared.errors import ConfigError, ContractMismatchError


@pytest.mark.parametrize(("n", "ids"), [(30, [2, 15, 27]), (61, [2, 30, 58]), (32, [2, 16, 29])])
def test_default_aux_ids(n, ids):
    assert c.default_aux_layer_ids(n) == ids


def test_default_aux_ids_tiny_model_rejected():
    # N=4 gives [2, 2, 1]: duplicates, so tiny models need explicit ids.
    with pytest.raises(ConfigError, match="distinct"):
        c.default_aux_layer_ids(4)


@pytest.mark.parametrize(
    ("ids", "msg"),
    [
        ([2, 15], "exactly 3"),
        ([2, 15, 27, 30], "exactly 3"),
        ([2, 2, 27], "distinct"),
        ([0, 15, 27], "out of range"),
        ([2, 15, 30], "out of range"),
    ],
)
def test_invalid_aux_ids(ids, msg):
    with pytest.raises(ConfigError, match=msg):
        c.validate_aux_layer_ids(ids, 30)


def test_resolve_default_and_list():
    assert c.resolve_aux_layer_ids("default", 30) == [2, 15, 27]
    assert c.resolve_aux_layer_ids([3, 10, 20], 30) == [3, 10, 20]


def test_sglang_ids_known_value():
    assert c.sglang_layer_ids([2, 15, 27]) == [1, 14, 26]
    assert c.sglang_layer_ids([2, 30, 58]) == [1, 29, 57]


def test_sglang_refuses_ids_not_starting_at_2():
    with pytest.raises(ContractMismatchError, match="25454"):
        c.sglang_layer_ids([1, 15, 27])
    with pytest.raises(ContractMismatchError):
        c.sglang_layer_ids([3, 15, 27])


def test_d2t_t2d_doc_example():
    # shared/conventions.py §3: target vocab 10, selected [0, 2, 3, 7].
    d2t, t2d = c.build_d2t_t2d([0, 2, 3, 7], 10)
    assert d2t.tolist() == [0, 1, 1, 4]
    assert t2d.astype(int).tolist() == [1, 0, 1, 1, 0, 0, 0, 1, 0, 0]
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    c.check_d2t_t2d(d2t, t2d, 4, lm_head_rows=4)


def test_identity_mapping_is_zeros_not_arange():
    d2t, t2d = c.build_d2t_t2d(list(range(5)), 5)
    assert d2t.tolist() == [0, 0, 0, 0, 0]
    assert t2d.all()


def test_select_vocab_top_k_ties_by_lower_id_sorted():
    freq = np.zeros(10, dtype=np.int64)
    freq[[7, 3, 5, 1]] = [9, 4, 4, 4]  # 7 first, then a three-way tie at 4: ids 1, 3 win
    ids = c.select_draft_vocab(freq, 3)
    assert ids.tolist() == [1, 3, 7]


def test_select_vocab_pads_with_lowest_unused():
    freq = np.zeros(10, dtype=np.int64)
    freq[[8, 4]] = [5, 2]
    assert c.select_draft_vocab(freq, 4).tolist() == [0, 1, 4, 8]


def test_select_vocab_pins_ids_ahead_of_counts():
    freq = np.array([3, 0, 3, 4, 0, 3, 0, 5, 0, 0], dtype=np.int64)
    # Pinned 1 (never counted) takes a row; the other 3 rows go to 7 (5), 3 (4), then the
    # tie at 3 between 0, 2 and 5: the lowest id, 0.
    assert c.select_draft_vocab(freq, 4, pinned=[1, 1]).tolist() == [0, 1, 3, 7]
    with pytest.raises(ConfigError, match="cannot hold the 3 pinned"):
        c.select_draft_vocab(freq, 2, pinned=[0, 1, 2])


def test_auto_vocab_size_is_the_fewest_ids_reaching_the_coverage():
    freq = np.array([3, 0, 3, 4, 0, 3, 0, 5, 0, 0], dtype=np.int64)  # 18 tokens
    # By count: 7 (5), 3 (4), then 0, 2, 5 (3 each). 50% = 9 tokens: 7 and 3 reach it.
    assert c.auto_draft_vocab_size(freq, 0.5) == 2
    assert c.auto_draft_vocab_size(freq, 0.51) == 3  # 9.18 tokens: a third id is needed
    assert c.auto_draft_vocab_size(freq, 1.0) == 5  # every seen id
    # Pinned 0, 1, 2 cover 6 tokens; 9 - 6 = 3 more: 7 alone (5). 3 pinned + 1.
    assert c.auto_draft_vocab_size(freq, 0.5, [0, 1, 2]) == 4
    # 90% = 16.2 tokens: pinned 6, then 7, 3, 5 (5 + 4 + 3 = 12 -> 18). 3 pinned + 3.
    assert c.auto_draft_vocab_size(freq, 0.9, [0, 1, 2]) == 6
    with pytest.raises(ConfigError, match="no assistant token"):
        c.auto_draft_vocab_size(np.zeros(4, dtype=np.int64), 0.9)


def test_select_vocab_too_large():
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        c.select_draft_vocab(np.ones(5, dtype=np.int64), 6)


@pytest.mark.parametrize(
    ("d2t", "t2d", "n", "rows", "msg"),
    [
        ([0, 1, 1, 4], [1, 0, 1, 1, 0, 0, 0, 1, 0, 0], 5, None, "len\\(d2t\\)"),
        ([0, 1, 1], [1, 0, 1, 1, 0, 0, 0, 1, 0, 0], 3, None, "t2d.sum"),
        ([0, 1, 1, 4], [1, 0, 1, 1, 0, 0, 0, 1, 0, 0], 4, 5, "lm_head"),
        ([0, 1, 2, 3], [1, 0, 1, 1, 0, 0, 0, 1, 0, 0], 4, None, "offsets"),
        ([0, 2, 3, 7], [1, 0, 1, 1, 0, 0, 0, 1, 0, 0], 4, None, "offsets"),
    ],
)
def test_check_d2t_t2d_catches(d2t, t2d, n, rows, msg):
    with pytest.raises(ContractMismatchError, match=msg):
        c.check_d2t_t2d(np.array(d2t), np.array(t2d, dtype=bool), n, rows)


def test_coverage():
    freq = np.array([5, 0, 3, 2], dtype=np.int64)
    assert c.coverage(freq, np.array([1, 0, 1, 0], dtype=bool)) == pytest.approx(0.8)


def test_shift_mask_doc_example():
    assert c.shift_mask_left([0, 0, 0, 1, 1, 1, 1]) == [0, 0, 1, 1, 1, 1, 0]


def test_tau_doc_example():
    # k=4, accept vectors [1,1,0,0], [0,1,1,1], [1,1,1,1] accept prefixes 2, 0, 4.
    vectors = [[1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]]
    prefixes = [c.accepted_prefix_len(v) for v in vectors]
    assert prefixes == [2, 0, 4]
    accepted, drafts, draft_tokens = sum(prefixes), len(vectors), 4 * len(vectors)
    assert c.mean_acceptance_length(accepted, drafts) == pytest.approx(3.0)
    assert c.draft_acceptance_rate(accepted, draft_tokens) == pytest.approx(0.5)


def test_tau_undefined_without_drafts():
    with pytest.raises(ContractMismatchError):
        c.mean_acceptance_length(0, 0)


def test_replay_steps_doc_example():
    assert c.replay_steps([2, 0, 1, 0, 3, 0], 0) == [2, 0, 3]
    assert c.replay_steps([2, 0, 1, 0, 3, 0], 1) == [0, 1, 3]
    assert c.replay_steps([], 0) == []


@pytest.mark.parametrize("seed", range(5))
def test_replay_steps_match_a_greedy_speculative_decoder(seed):
    """A plain decode loop (draft k, keep the leading matches, add the target's token) over
    a fixed greedy answer takes the same steps as the replay of per-anchor lengths."""
    import random

    rng = random.Random(seed)
    k, p, m = 3, rng.randint(2, 6), rng.randint(5, 40)
    text = [rng.randrange(5) for _ in range(p + m)]  # prompt + the target's greedy answer
    # The draft's guess for position i (the same wherever it drafts from): right 60 % of the
    # time.
    guess = [t if rng.random() < 0.6 else t + 10 for t in text]

    steps = []
    n = p + 1  # the prefill produced the answer's first token
    while n < p + m:
        accepted = 0
        while accepted < k and n + accepted < p + m and guess[n + accepted] == text[n + accepted]:
            accepted += 1
        steps.append(accepted)
        n += accepted + 1

    # Anchor a holds the token x_{a+1} just produced; its chain checks x_{a+2}...x_{a+1+k}.
    lengths = []
    for a in range(p + m - 2):
        length = 0
        while (
            length < k and a + 2 + length < p + m and guess[a + 2 + length] == text[a + 2 + length]
        ):
            length += 1
        lengths.append(length)
    assert c.replay_steps(lengths, p - 1) == steps
