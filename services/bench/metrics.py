"""vLLM `/metrics` counters over a benchmark window: scrape, delta, τ and acceptance.

vLLM exposes speculative-decoding counters in Prometheus text (vLLM
`v1/spec_decode/metrics.py`): `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`, plus
`vllm:generation_tokens_total`. Each carries `model_name` and `engine` labels; Eyrie sums
over those.

Invariants:
- Counters are cumulative since server start, so a window is always `after - before`: a
  server that has already served requests gives the same τ (shared/conventions.py §7).
- A counter that went down means the server restarted inside the window; that window is
  refused, never clamped.
- τ and the acceptance rate come from `shared.conventions` (one formula in the project).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shared.conventions import draft_acceptance_rate, mean_acceptance_length
from shared.errors import ArtifactError, ServiceUnavailableError

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TRACKED = (DRAFTS, DRAFT_TOKENS, ACCEPTED, GENERATION_TOKENS)


@dataclass
class CounterSnapshot:
    """The tracked counters at one instant, summed over engines and model names.

    Attributes:
        totals: counter sample name (with `_total`) → value; absent when the server does not
            export it (a baseline server has no spec-decode counters).
        per_position: draft position (0-based) → accepted tokens at that position.
    """

    totals: dict[str, float] = field(default_factory=dict)
    per_position: dict[int, float] = field(default_factory=dict)


def parse_counters(text: str) -> CounterSnapshot:
    """Parse Prometheus exposition text into a `CounterSnapshot`.

    Raises:
        ArtifactError: the text is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    snap = CounterSnapshot()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise ArtifactError(f"/metrics: not Prometheus text ({e})") from e
    for fam in families:
        for s in fam.samples:
            if s.name in TRACKED:
                snap.totals[s.name] = snap.totals.get(s.name, 0.0) + s.value
            elif s.name == ACCEPTED_PER_POS:
                pos = int(s.labels["position"])
                snap.per_position[pos] = snap.per_position.get(pos, 0.0) + s.value
    return snap


def scrape(base_url: str, timeout_s: float = 10.0) -> CounterSnapshot:
    """GET `<base_url>/metrics` and parse it.

    Raises:
        ServiceUnavailableError: the server cannot be reached or answers non-200.
    """
    import httpx

    url = base_url.rstrip("/") + "/metrics"
    try:
        r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ServiceUnavailableError(f"{url}: cannot scrape metrics ({e})") from e
    if r.status_code != 200:
        raise ServiceUnavailableError(f"{url}: HTTP {r.status_code} (expected 200)")
    return parse_counters(r.text)


@dataclass
class WindowDelta:
    """Counter deltas over one benchmark window, and what follows from them.

    Attributes:
        generation_tokens: output tokens the server generated in the window.
        drafts: speculative steps (None on a server without speculative decoding).
        draft_tokens: tokens proposed (drafts × k).
        accepted: draft tokens accepted.
        accepted_per_position: accepted tokens at each draft position, `[k]`.
    """

    generation_tokens: float
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    accepted_per_position: list[float] | None = None

    @property
    def tau(self) -> float | None:
        """Mean acceptance length τ = 1 + accepted/drafts; None without drafts."""
        if not self.drafts:
            return None
        return mean_acceptance_length(self.accepted or 0.0, self.drafts)

    @property
    def acceptance_rate(self) -> float | None:
        """Draft acceptance rate accepted / draft_tokens in 0..1; None without draft tokens."""
        if not self.draft_tokens:
            return None
        return draft_acceptance_rate(self.accepted or 0.0, self.draft_tokens)

    @property
    def per_position_rate(self) -> list[float] | None:
        """Share of drafts whose position i was accepted: per_pos[i] / drafts.

        vLLM's Grafana dashboard formula. Non-increasing in i: acceptance is a prefix.
        """
        if not self.drafts or self.accepted_per_position is None:
            return None
        return [a / self.drafts for a in self.accepted_per_position]

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            per_position_rate=self.per_position_rate,
        )
        return d


def _diff(name: str, before: float, after: float) -> float:
    if after < before:
        raise ArtifactError(
            f"/metrics: counter {name} went down ({before} -> {after}) inside the benchmark "
            "window: the server restarted; rerun the window"
        )
    return after - before


def window_delta(before: CounterSnapshot, after: CounterSnapshot) -> WindowDelta:
    """Deltas `after - before` of every tracked counter.

    Raises:
        ArtifactError: a counter decreased (server restart inside the window).
    """

    def d(name: str) -> float | None:
        if name not in after.totals:
            return None
        return _diff(name, before.totals.get(name, 0.0), after.totals[name])

    per_pos = None
    if after.per_position:
        k = max(after.per_position) + 1
        per_pos = [
            _diff(
                f"{ACCEPTED_PER_POS}{{position={i}}}",
                before.per_position.get(i, 0.0),
                after.per_position.get(i, 0.0),
            )
            for i in range(k)
        ]
    return WindowDelta(
        generation_tokens=d(GENERATION_TOKENS) or 0.0,
        drafts=d(DRAFTS),
        draft_tokens=d(DRAFT_TOKENS),
        accepted=d(ACCEPTED),
        accepted_per_position=per_pos,
    )
