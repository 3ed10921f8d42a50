"""The target (verifier) model's config: one loader, checked against the recipe.

Every stage that needs the target's shape (layer count, hidden size, vocab) reads it here,
so a wrong path fails the same way everywhere: with the path in the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.recipe import Recipe, looks_local


def target_config(recipe: Recipe) -> dict[str, Any]:
    """The target's `config.json` as a dict (text config for multimodal models).

    A local folder is read directly; anything else is treated as a hub id and loaded with
    transformers' AutoConfig (revision and trust_remote_code from the recipe).

    Raises:
        ConfigError: the path does not exist (named in the message), the config cannot be
            loaded, or it disagrees with the recipe's expected `num_hidden_layers`,
            `hidden_size` or `vocab_size`.
    """
    t = recipe.target
    path = Path(t.path)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"target.path: {path} has no config.json (not an HF model folder)")
        cfg = read_config_file(cfg_file)
    elif path.exists():
        raise ConfigError(f"target.path: {t.path} is a file; give the model's folder")
    elif looks_local(t.path):
        raise ConfigError(
            f"target.path: model folder {t.path} does not exist "
            "(for the CPU demo, scripts/setup converts SmolLM2 into $EYRIE_CACHE/models)"
        )
    else:
        cfg = _hub_config(recipe)
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    check_expected(recipe, cfg)
    return cfg


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
