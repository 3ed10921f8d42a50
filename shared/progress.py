"""Progress for long work: a tqdm bar in the terminal and `job.meta` for `eyrie status`."""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import RedisError
from tqdm import tqdm

log = logging.getLogger("eyrie.progress")


class Progress:
    """A tqdm progress bar that also reports to the current rq job's meta.

    When running inside an rq job, `job.meta["progress"]` gets `{done, total, unit, rate,
    eta_s, ...}` at most every `meta_every_s` seconds, for `eyrie status`.

    Args:
        total: units of work expected (rows, tokens, steps).
        unit: what one unit is, e.g. "rows".
        desc: bar label.
    """

    def __init__(self, total: int, unit: str, desc: str, meta_every_s: float = 2.0):
        from rq import get_current_job

        self.job = get_current_job()
        self.total, self.unit, self.done = total, unit, 0
        self.start = time.monotonic()
        self.meta_every_s = meta_every_s
        self._last = 0.0
        self.bar = tqdm(total=total, unit=unit, desc=desc, dynamic_ncols=True, mininterval=1.0)

    def update(self, n: int = 1, **extra: Any) -> None:
        self.done += n
        self.bar.update(n)
        if extra:
            self.bar.set_postfix(extra, refresh=False)
        now = time.monotonic()
        if self.job is not None and (
            now - self._last >= self.meta_every_s or self.done >= self.total
        ):
            self._last = now
            elapsed = max(now - self.start, 1e-9)
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else None
            self.job.meta["progress"] = {
                "done": self.done,
                "total": self.total,
                "unit": self.unit,
                "rate": round(rate, 2),
                "eta_s": None if eta is None else round(eta, 1),
                **{k: v for k, v in extra.items() if isinstance(v, int | float | str)},
            }
            try:
                self.job.save_meta()
            except RedisError as e:  # progress is a courtesy: a Redis outage must not fail a shard
                log.debug("progress of %s not saved: %s", self.bar.desc, e)

    def set_total(self, total: int) -> None:
        """Change the units expected (a time-budgeted train run re-plans its end as it goes)."""
        if total != self.total:
            self.total = total
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
