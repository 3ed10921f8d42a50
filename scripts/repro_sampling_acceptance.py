"""Minimal reproduction: draft acceptance collapsing at temperature > 0 (issue 16, lever 7).

vLLM proposes draft tokens by argmax whatever the temperature, and the rejection sampler
then accepts a draft token x with probability min(1, p_target(x) / q_draft(x)); with an
argmax ("greedy") proposal q is one-hot, so x is accepted with probability p_target(x). At
T=0.3 the target's distribution is sharp, so acceptance should stay close to the T=0 one.
One served draft measured: accepted/drafts 92/413 at T=0 but 2/502 at T=0.3.

Two suspects can be told apart with one served draft and one copy of it:
- the reduced draft vocabulary: on the sampled path the draft id must be mapped to a target
  id through d2t before the target's probability is looked up; a path that skips the
  mapping scores the wrong token (right at T=0, where only argmax ids are compared after
  mapping, wrong once probabilities are used);
- the rejection sampler itself on this backend.

`expand` writes a copy of a llama-style draft with the FULL target vocabulary (identity
mapping, no d2t/t2d): lm_head rows placed at their target ids, zero rows elsewhere. Its
argmax is the same token as the original's whenever the original's best logit is positive
(the extra rows score 0), so at T=0 both drafts accept the same tokens. `sweep` measures
accepted/drafts per temperature on a running eagle3 server from vLLM's own counters.

If the full-vocabulary copy keeps its T=0.3 acceptance near T=0 and the reduced draft does
not, the d2t mapping on the sampled path is at fault; if both collapse, the sampler is.

Usage:
  .venv/bin/python scripts/repro_sampling_acceptance.py expand DRAFT_DIR OUT_DIR
  eyrie serve --mode eagle3 --draft DRAFT_DIR RECIPE        # then, in another shell:
  .venv/bin/python scripts/repro_sampling_acceptance.py sweep --url http://127.0.0.1:8001
  (repeat serve + sweep with --draft OUT_DIR; compare the two tables)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def expand(draft_dir: Path, out_dir: Path) -> None:
    """Write `out_dir`: `draft_dir` with a full-vocabulary lm_head and no d2t/t2d.

    Raises:
        SystemExit: the draft has no d2t (already full vocabulary) or no config.
    """
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((draft_dir / "config.json").read_text())
    weights = load_file(str(draft_dir / "model.safetensors"))
    if "d2t" not in weights:
        raise SystemExit(f"{draft_dir}: no d2t: the draft already uses the full vocabulary")
    d2t = weights.pop("d2t").to(torch.long)
    weights.pop("t2d", None)
    head = weights["lm_head.weight"]
    vocab = int(cfg["vocab_size"])
    full = torch.zeros(vocab, head.shape[1], dtype=head.dtype)
    full[torch.arange(len(d2t)) + d2t] = head  # target id = draft id + d2t[draft id]
    weights["lm_head.weight"] = full
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in draft_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out_dir / f.name)
    cfg["draft_vocab_size"] = vocab
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"))
    print(f"{out_dir}: lm_head {tuple(head.shape)} -> {tuple(full.shape)}, no d2t/t2d")


def sweep(url: str, temperatures: list[float], num_prompts: int, max_tokens: int) -> None:
    """Print accepted/drafts and per-position acceptance per temperature (concurrency 1)."""
    from services.bench.prompts import mtbench_messages
    from services.bench.sweep import sweep_server
    from shared.recipe import BenchConfig

    cfg = BenchConfig(
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        temperatures=temperatures,
        concurrency=[1],
    )
    prompts = mtbench_messages(num_prompts)
    result = sweep_server(url, "eagle3", prompts, cfg)
    print(f"{url}: {num_prompts} MT-Bench prompts, {max_tokens} tokens, concurrency 1")
    print("| T | accepted / drafts | tau | per-position acceptance |")
    print("|---|---|---|---|")
    for w in result["windows"]:
        c = w["counters"]
        pos = " / ".join(f"{p:.3f}" for p in c["per_position_rate"] or []) or "-"
        tau = "-" if c["tau"] is None else f"{c['tau']:.3f}"
        print(f"| {w['temperature']:g} | {c['accepted']:.0f} / {c['drafts']:.0f} | {tau} | {pos} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("expand", help="write a full-vocabulary copy of a llama-style draft")
    e.add_argument("draft_dir", type=Path)
    e.add_argument("out_dir", type=Path)
    s = sub.add_parser("sweep", help="accepted/drafts per temperature on a running server")
    s.add_argument("--url", required=True)
    s.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.3, 0.7, 1.0])
    s.add_argument("--num-prompts", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.cmd == "expand":
        expand(args.draft_dir, args.out_dir)
    else:
        sweep(args.url, args.temperatures, args.num_prompts, args.max_tokens)


if __name__ == "__main__":
    main()
