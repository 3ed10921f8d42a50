"""Benchmark: hidden-state extraction vs a bare forward pass, side by side in one run.

Real ShareGPT V3 samples, tokenized with SmolLM2's chat template, on CPU in bf16. The samples
are split into chunks; for each chunk the bare decoder forward (no hooks, no writes) runs
over exactly the batches extraction uses, and the extract stage runs on that chunk; which
goes first alternates per chunk. Interleaving keeps both under the same machine load.

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
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--tokens-per-batch", type=int, default=4096)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from services.extract.backend import HFExtractor
    from services.extract.jobs import extract_shard
    from services.train.vocab import run_vocab
    from shared.recipe import resolve_recipe
    from shared.store import RunStore, cache_root
    from tests.extract.data import tokenized_rows, write_tokenized_shard

    target = cache_root() / "models" / "SmolLM2-135M-Instruct"
    tok = AutoTokenizer.from_pretrained(str(target))
    t0 = time.perf_counter()
    rows = tokenized_rows(tok, args.samples, args.max_len)
    print(
        f"tokenized {len(rows)} ShareGPT samples in {time.perf_counter() - t0:.1f}s "
        f"({sum(r['seq_len'] for r in rows)} tokens, max_len {args.max_len})"
    )

    with tempfile.TemporaryDirectory(prefix="bench-extract-") as tmp:
        os.environ["EYRIE_DATA"] = tmp
        recipe = resolve_recipe(
            {
                "name": "bench-extract",
                "target": {"path": str(target)},
                "datasets": [{"preset": "sharegpt-v3-wheel"}],
                "extract": {"device": "cpu", "tokens_per_batch": args.tokens_per_batch},
                "draft": {"draft_vocab_size": args.draft_vocab},
            }
        )
        store = RunStore.create(recipe)
        per = -(-len(rows) // args.chunks)
        chunks = [rows[i : i + per] for i in range(0, len(rows), per)]
        for shard, chunk in enumerate(chunks):
            write_tokenized_shard(store, shard, chunk)
        extractor = HFExtractor(recipe)
        model = extractor.model
        # Warm-up (oneDNN kernel selection) outside both timings.
        bare_forward_s(model, [r["input_ids"] for r in rows[:8]], args.tokens_per_batch)

        bare_s = extract_s = 0.0
        tokens = written_bytes = 0
        for shard, chunk in enumerate(chunks):
            samples = [r["input_ids"] for r in chunk]
            # The first pass over new batch shapes pays oneDNN's kernel set-up; alternate
            # which side goes first so neither gets the warm cache every time.
            bare_first = shard % 2 == 0
            if bare_first:
                bare_s += bare_forward_s(model, samples, args.tokens_per_batch)
            t0 = time.perf_counter()
            m = extract_shard(store, recipe, shard, extractor)
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

        m = run_vocab(store, recipe, 0)
        import json

        cov = json.loads((store.root / "vocab" / "coverage.json").read_text())
        print(
            f"\nvocab: {cov['target_vocab']} -> {cov['draft_vocab']} covers "
            f"{cov['coverage']:.4%} of {cov['assistant_tokens']} assistant tokens "
            f"({cov['distinct_seen']} distinct seen, {cov['left_out_distinct']} left out)"
        )
        for t in cov["top_left_out"][:10]:
            print(f"  left out: id {t['id']:6d} {t['text']!r:20} x{t['count']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
