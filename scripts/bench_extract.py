"""Benchmark: hidden-state extraction vs a bare forward pass, side by side in one run.

Real ShareGPT V3 samples, planned, prepped, deduplicated and tokenized with SmolLM2's chat
template by the prep stages (in this process), on CPU in bf16. The samples are split into
chunks (one prep shard each); for each chunk the bare decoder forward (no hooks, no writes)
runs over exactly the batches extraction uses, and the extract stage runs on that shard;
which goes first alternates per chunk. Interleaving keeps both under the same machine load.

Prints:
- extraction tokens/s ÷ bare-forward tokens/s (goal >= 0.85: I/O overlaps compute);
- bytes written per token against the 4 x H x 2 formula;
- the draft-vocab coverage report for SmolLM2 (49,152 → the recipe's draft size).

Usage: .venv/bin/python scripts/bench_extract.py [--samples 500] [--max-len 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from scripts.benchdata import SHAREGPT, run_stages, smollm2_path, smollm2_target  # noqa: E402


def bare_forward_s(model, samples, budget) -> float:
    """Seconds for a plain decoder forward over the extraction batches (no hooks, no I/O)."""
    import torch

    from services.extract.batching import plan_batches
    from services.extract.hf_backend import decoder_parts, input_device, pad_batch

    decoder = decoder_parts(model)[0]
    t0 = time.perf_counter()
    for batch in plan_batches([len(s) for s in samples], budget):
        ids, mask = pad_batch([samples[i] for i in batch], input_device(model))
        with torch.inference_mode():
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--samples", type=int, default=500, help="ShareGPT rows planned (prep/tokenize drop some)"
    )
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    args = ap.parse_args()

    from services.extract.hf_backend import HFExtractor
    from shared.artifacts import RunStore
    from shared.recipe import resolve_recipe
    from shared.stage import execute, get_stage

    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        os.environ["EYRIE_DATA"] = tmp
        recipe = resolve_recipe(
            {
                "name": "bench-extract",
                "target": smollm2_target(smollm2_path()),
                "datasets": [{**SHAREGPT, "max_samples": args.samples}],
                "prep": {
                    "shard_rows": -(-args.samples // args.chunks),
                    "max_len_tokens": args.max_len,
                },
                "regen": {"enabled": False},
                "extract": {
                    "backend": "hf",
                    "device": "cpu",
                    "tokens_per_batch": args.tokens_per_batch,
                },
                "draft": {"draft_vocab_size": args.draft_vocab},
            }
        )
        store = RunStore.create(recipe)
        t0 = time.perf_counter()
        run_stages(store, ["plan", "prep", "dedup", "split", "tokenize"])
        shards = range(store.plan.num_shards())
        chunks = [[list(x) for x in store.tokenize.dataset(s)["input_ids"]] for s in shards]
        print(
            f"prepped and tokenized {sum(len(c) for c in chunks)} ShareGPT samples in "
            f"{time.perf_counter() - t0:.1f}s ({sum(len(x) for c in chunks for x in c)} tokens, "
            f"max_len {args.max_len}, {len(chunks)} shards)"
        )
        # Loads the model into the backend's per-process cache, which the stage then uses.
        extractor = HFExtractor(recipe)
        model = extractor.model
        # Warm-up (oneDNN kernel selection) outside both timings.
        bare_forward_s(model, chunks[0][:8], args.tokens_per_batch)

        bare_s = extract_s = 0.0
        tokens = written_bytes = 0
        for shard, samples in enumerate(chunks):
            # The first pass over new batch shapes pays oneDNN's kernel set-up; alternate
            # which side goes first so neither gets the warm cache every time.
            bare_first = shard % 2 == 0
            if bare_first:
                bare_s += bare_forward_s(model, samples, args.tokens_per_batch)
            t0 = time.perf_counter()
            m = execute(get_stage("extract"), store, shard)
            extract_s += time.perf_counter() - t0
            if not bare_first:
                bare_s += bare_forward_s(model, samples, args.tokens_per_batch)
            tokens += m.counts["tokens"]
            written_bytes += m.counts["bytes_this_run"]
            print(
                f"  chunk {shard}: {m.counts['tokens']} tokens, bare {bare_s:.1f}s, "
                f"extract {extract_s:.1f}s (cumulative)",
                flush=True,
            )

        bare_tps, extract_tps = tokens / bare_s, tokens / extract_s
        formula = 4 * extractor.hidden_size * 2
        print(f"\nbare forward:  {bare_tps:8.0f} tokens/s ({bare_s:.1f}s)")
        print(
            f"extraction:    {extract_tps:8.0f} tokens/s ({extract_s:.1f}s, incl. checks "
            "and writes)"
        )
        print(f"ratio extraction / bare = {extract_tps / bare_tps:.3f}  (goal >= 0.85)")
        print(
            f"bytes per token: {written_bytes / tokens:.1f} written vs 4 x H x 2 = {formula} "
            f"(+8 for the int64 token id = {formula + 8}); {written_bytes / 2**20:.1f} MiB"
        )

        run_stages(store, ["vocab"])
        cov = store.vocab.coverage()
        print(
            f"\nvocab: {cov.target_vocab} -> {cov.draft_vocab} covers "
            f"{cov.coverage:.4%} of {cov.assistant_tokens} assistant tokens of the training "
            f"split ({cov.distinct_seen} distinct seen, {cov.left_out_distinct} left out)"
        )
        for t in cov.top_left_out[:10]:
            print(f"  left out: id {t.id:6d} {t.text!r:20} x{t.count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
