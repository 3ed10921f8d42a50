"""The target (verifier) model's config: one loader, checked against the recipe.

Every stage that needs the target's shape (layer count, hidden size, vocab) reads it here,
so a wrong path fails the same way everywhere: with the path in the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.recipe import Recipe
from shared.store import check_readable

_LOCAL_PREFIXES = ("/", "./", "../", "~")


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
        check_readable(path, "target.path")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"target.path: {path} has no config.json (not an HF model folder)")
        cfg = json.loads(cfg_file.read_text())
    elif t.path.startswith(_LOCAL_PREFIXES) or path.exists():
        raise ConfigError(
            f"target.path: model folder {t.path} does not exist "
            "(for the CPU demo, scripts/setup converts SmolLM2 into $EYRIE_CACHE/models)"
        )
    else:
        cfg = _hub_config(recipe)
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    _check_expected(recipe, cfg)
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


def _check_expected(recipe: Recipe, cfg: dict[str, Any]) -> None:
    t = recipe.target
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        want = getattr(t, key)
        if want is not None and cfg.get(key) != want:
            raise ConfigError(
                f"target.{key}: recipe expects {want}, but {t.path} has {cfg.get(key)}"
            )
