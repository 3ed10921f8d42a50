"""Exercise Eyrie's GPU-only paths on a CUDA machine: one short, prepared run.

What it runs, in-process and without Redis (`eyrie stage`'s path):
  1. the environment: GPU, driver, torch/transformers versions, Eyrie's GPU-free check;
  2. a target shaped exactly like SmolLM2-135M (config + tokenizer carried, weights
     random, built on the device: no 269 MB model has to travel), saved in bf16;
  3. the pipeline plan → prep → dedup → split → tokenize → vocab → extract (hf backend on
     CUDA) → train (CUDA, bf16 autocast, flex attention) → export (+ lint) on real sample
     data;
  4. checks: captured aux states equal HF `output_hidden_states[k]` on the GPU, the loss
     falls, every export passes the lint; prints tokens/s of extraction and training.

Usage (GPU machine): python3 scripts/gpu_check.py --target-config DIR [--device cuda]
It also runs on CPU (`--device cpu`) so it can be tried before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SAMPLES = [
    ROOT / "tests" / "fixtures" / "samples" / name
    for name in ("sharegpt_fastchat_dummy.json", "glaive_toolcall_en_demo.json")
]
RESULTS: list[tuple[str, bool, str]] = []
#: The stages run, in order (regen is off: no vLLM server on the GPU machine).
PIPELINE = ("plan", "prep", "dedup", "split", "tokenize", "vocab", "extract", "train", "export")


def check(name: str):
    """Run one named check; record pass/fail and keep going on failure."""

    def wrap(fn):
        t0 = time.monotonic()
        try:
            detail = fn() or ""
            RESULTS.append((name, True, f"{detail} ({time.monotonic() - t0:.1f}s)"))
            print(f"[gpu-check] PASS {name}: {detail}", flush=True)
        except Exception as e:  # a check's failure is reported, the next check still runs
            RESULTS.append((name, False, f"{type(e).__name__}: {e}"))
            print(f"[gpu-check] FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        return fn

    return wrap


def build_random_target(config_dir: Path, out: Path, device: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, out / name)


def write_recipe(run_dir: Path, target: Path, device: str) -> Path:
    import yaml

    recipe = {
        "name": "gpu-check",
        "target": {"path": str(target), "dtype": "bfloat16"},
        "datasets": [{"path": str(path), "format": "auto"} for path in SAMPLES],
        "prep": {"shard_rows": 128, "max_len_tokens": 2048},
        "regen": {"enabled": False},
        "layers": [2, 15, 27],
        "extract": {"backend": "hf", "device": device, "tokens_per_batch": 16384},
        "draft": {"draft_vocab_size": 4096},
        "train": {"epochs": 3, "lr": 3e-4, "device": device, "tokens_per_step": 4096},
        "bench": {"num_prompts": 4},
    }
    path = run_dir / "gpu-check.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description="Eyrie GPU-path check")
    ap.add_argument(
        "--target-config",
        type=Path,
        required=True,
        help="folder with SmolLM2's config.json and tokenizer files",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="eyrie-gpu-check-"))
    os.environ["EYRIE_DATA"] = str(work / "data")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = work / "target"
    state: dict = {}

    @check("environment")
    def _env():
        import torch
        import transformers

        smi = shutil.which("nvidia-smi")
        if smi:
            print(subprocess.run([smi], capture_output=True, text=True).stdout, flush=True)
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
        return (
            f"python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {gpu}"
        )

    @check("gpus free before a GPU phase (services.conductor.gpu)")
    def _free():
        from services.conductor.gpu import check_gpus_free

        check_gpus_free()
        return "no GPU memory in use (or no nvidia-smi: skipped)"

    @check("random SmolLM2-shaped target on disk")
    def _target():
        build_random_target(args.target_config, target, args.device)
        return str(target)

    @check("aux states == HF output_hidden_states[k] on device")
    def _aux():
        import torch
        from transformers import AutoModelForCausalLM

        from services.extract.hf_backend import extract_batch

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).to(args.device)
        ids = torch.randint(0, 49152, (1, 256), device=args.device)
        with torch.no_grad():
            ref = model(ids, output_hidden_states=True).hidden_states
        states = extract_batch(model, [ids[0].tolist()], [2, 15, 27])[0]
        diffs = [
            float((states[:, j].float().cpu() - ref[k][0].float().cpu()).abs().max())
            for j, k in enumerate([2, 15, 27])
        ]
        if max(diffs) != 0.0:
            raise AssertionError(f"max abs diff per aux layer {diffs}")
        return f"exact on 256 tokens, final state shape {tuple(states.shape)}"

    @check("pipeline plan..export on device")
    def _pipeline():
        from shared.artifacts import RunStore
        from shared.recipe import resolve_recipe
        from shared.stage import execute, get_stage

        recipe = resolve_recipe(write_recipe(work, target, args.device))
        store = RunStore.create(recipe, command="scripts/gpu-check")
        timings = {}
        for name in PIPELINE:
            stage = get_stage(name)
            t0 = time.monotonic()
            for shard in stage.shard_numbers(store):
                m = execute(stage, store, shard)
                totals = state.setdefault(name, {})
                for key, value in m.counts.items():
                    totals[key] = totals.get(key, 0) + value
            timings[name] = round(time.monotonic() - t0, 1)
        state["timings"] = timings
        state["store"] = store
        return json.dumps(timings)

    @check("training loss falls; exports pass lint")
    def _results():
        store = state["store"]
        rows = [
            json.loads(x) for x in store.train.metrics_path.read_text().splitlines() if x.strip()
        ]
        losses = [r["loss"] for r in rows if r.get("kind") == "step"]
        if not losses or not losses[-1] < losses[0]:
            raise AssertionError(f"loss did not fall: first {losses[:1]}, last {losses[-1:]}")
        lint = json.loads(store.export.lint_path.read_text())
        bad = {k: v for k, v in lint.items() if not v["ok"]}
        if bad:
            raise AssertionError(f"lint problems: {bad}")
        tps = [r["tokens_per_s"] for r in rows if r.get("kind") == "step"]
        taus = [r["tau"] for r in rows if r.get("kind") == "epoch"]
        return (
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
            f"train {sum(tps) / max(len(tps), 1):.0f} tok/s; simulated tau per epoch {taus}; "
            f"exports {sorted(lint)}; "
            f"extract {state['extract']['tokens'] / state['timings']['extract']:.0f} tok/s, "
            f"counts over all shards {state['extract']}"
        )

    print("\n[gpu-check] summary")
    for name, ok, detail in RESULTS:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
