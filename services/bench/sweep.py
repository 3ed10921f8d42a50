"""One server's benchmark: the (temperature × concurrency) sweep with its counter windows.

For each window the sweep scrapes `/metrics`, sends every prompt once, and scrapes again;
the window's τ and acceptance come from the counter deltas (`services.bench.metrics`), so
requests the server served before (warm-up, turn-1 answers, earlier windows) never count.

The output is the JSON written to `bench/shard-N.json` (see `shared/artifacts.py`):
`{"mode", "url", "model", "num_prompts", "max_tokens", "windows": [{temperature, concurrency,
client: LevelResult, counters: WindowDelta}]}`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.bench.client import RequestSpec, complete, run_window, served_model, summarize
from services.bench.metrics import scrape, window_delta
from services.bench.prompts import Messages, second_turn_messages
from shared.errors import StageFailedError
from shared.recipe import BenchConfig
from shared.store import atomic_path


def sweep_server(
    base_url: str,
    mode: str,
    prompts: list[Messages],
    cfg: BenchConfig,
    on_window: Callable[[dict[str, Any]], None] | None = None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Benchmark one server over `cfg.temperatures` × `cfg.concurrency`.

    Args:
        base_url: server root, e.g. `http://127.0.0.1:8001`.
        mode: "baseline" or "eagle3" (recorded only).
        prompts: conversations sent once per window, identical for both servers.
        cfg: the recipe's `bench` section (max_tokens, temperatures, concurrency).
        on_window: called with each finished window (progress).
        extra_body: extra request fields for both servers (e.g. chat_template_kwargs).

    Raises:
        StageFailedError: every request of a window failed.
    """
    model = served_model(base_url)
    spec = RequestSpec(
        model=model, max_tokens=cfg.max_tokens, temperature=0.0, extra_body=dict(extra_body or {})
    )
    complete(base_url, prompts[:1], spec, 1)  # warm-up: not inside any window
    windows = []
    for temperature in cfg.temperatures:
        for conc in cfg.concurrency:
            spec.temperature = temperature
            before = scrape(base_url)
            results, wall = asyncio.run(run_window(base_url, prompts, spec, conc))
            after = scrape(base_url)
            level = summarize(results, conc, temperature, wall)
            if level.failed == level.requests:
                raise StageFailedError(
                    f"{base_url}: every request failed at temperature {temperature}, "
                    f"concurrency {conc}: {level.errors}"
                )
            w = {
                "temperature": temperature,
                "concurrency": conc,
                "client": level.to_json(),
                "counters": window_delta(before, after).to_json(),
            }
            windows.append(w)
            if on_window:
                on_window(w)
    return {
        "mode": mode,
        "url": base_url,
        "model": model,
        "num_prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "windows": windows,
    }


def _publish_once(path: Path, obj: Any) -> Any:
    """Write `obj` to `path` unless someone already did; return what `path` holds.

    The first writer wins (hard link of a complete temp file fails if `path` exists), so two
    shards running side by side end up sending the same second turns.
    """
    with atomic_path(path.with_name(path.name + ".mine")) as tmp:
        tmp.write_text(json.dumps(obj))
    mine = path.with_name(path.name + ".mine")
    try:
        os.link(mine, path)
    except FileExistsError:
        pass
    finally:
        mine.unlink(missing_ok=True)
    return json.loads(path.read_text())


def turn1_answers(
    path: Path,
    baseline_url: str,
    first: list[Messages],
    cfg: BenchConfig,
    extra_body: dict[str, Any] | None = None,
) -> list[str]:
    """The target's own greedy answers to `first`, shared by both shards through `path`.

    They come from the baseline server (the target alone) at temperature 0 and
    `cfg.max_tokens`; generated once per run, reused after.

    Raises:
        StageFailedError: an answer could not be generated.
    """
    if path.is_file():
        return json.loads(path.read_text())["answers"]
    spec = RequestSpec(
        model=served_model(baseline_url),
        max_tokens=cfg.max_tokens,
        temperature=0.0,
        extra_body=dict(extra_body or {}),
    )
    results = complete(baseline_url, first, spec, max(cfg.concurrency))
    bad = [i for i, r in enumerate(results) if r.error is not None]
    if bad:
        raise StageFailedError(
            f"{baseline_url}: turn-1 answers failed for prompts {bad[:10]} "
            f"({results[bad[0]].error}); the second turn needs every first answer"
        )
    return _publish_once(path, {"answers": [r.text for r in results]})["answers"]


def with_second_turns(
    path: Path,
    baseline_url: str,
    first: list[Messages],
    cfg: BenchConfig,
    extra_body: dict[str, Any] | None = None,
) -> list[Messages]:
    """`first` plus each MT-Bench turn 2 after the target's own turn-1 answer."""
    answers = turn1_answers(path, baseline_url, first, cfg, extra_body)
    return first + second_turn_messages(first, answers)
