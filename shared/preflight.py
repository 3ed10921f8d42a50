"""Checks of a recipe against the machine, before any work.

What `eyrie recipe check` and `eyrie run` refuse up front instead of failing a stage
minutes later.

`shared.recipe` validates a recipe's shape without touching the disk; this module checks
what the recipe points at:
- every local-looking dataset path exists and is a readable regular file of a type prep
  reads, not compressed and not UTF-16 (its first bytes tell); any other value must be a
  well-formed hub id;
- the target's config resolves (a local folder with a readable `config.json`, or a hub id
  whose config is in the local hub cache) and matches the recipe's expected sizes;
- the aux layer ids are valid for that target (in range, distinct);
- `draft.draft_vocab_size` fits in the target's vocab, `draft.hidden_size` is the target's;
- a local tokenizer folder (`target.tokenizer`, else `target.path`) has a tokenizer and a
  chat template.

A hub target whose config is not cached cannot be checked offline: the layer ids are then
checked against the recipe's `target.num_hidden_layers` when given, and a note says the rest
waits for the first stage that loads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shared.conventions import resolve_aux_layer_ids
from shared.errors import ConfigError
from shared.recipe import DATA_SUFFIXES, Recipe, looks_local
from shared.target import check_expected, read_config_file, target_config


def check_recipe_inputs(recipe: Recipe) -> list[str]:
    """Check everything `recipe` points at that can be checked without downloading.

    Returns:
        notes: what could not be checked here (e.g. a hub target not in the local cache).

    Raises:
        ConfigError: the first problem found; the message starts with the recipe field.
    """
    hub_datasets = []
    for i, spec in enumerate(recipe.datasets):
        if spec.path is not None:
            check_dataset_path(spec.path, f"datasets[{i}].path")
            if not Path(spec.path).exists():
                hub_datasets.append(
                    f"datasets[{i}].path: no local file {spec.path!r}, so it is taken for a "
                    "hub dataset id, loaded by the plan stage (a local path starts with / or "
                    "./, or ends in a data-file suffix)"
                )
    tok = recipe.target.tokenizer
    if tok and looks_local(tok) and not Path(tok).is_dir():
        raise ConfigError(f"target.tokenizer: tokenizer folder {tok} does not exist")
    cfg, notes = _target_config(recipe)
    notes = hub_datasets + notes
    layers = cfg.get("num_hidden_layers") if cfg else recipe.target.num_hidden_layers
    if layers is not None:
        if not isinstance(layers, int) or layers <= 0:
            raise ConfigError(
                f"target.path: {recipe.target.path} config has num_hidden_layers={layers!r}"
            )
        resolve_aux_layer_ids(recipe.layers, layers)
    elif cfg is not None:
        raise ConfigError(f"target.path: {recipe.target.path} config has no num_hidden_layers")
    hidden = cfg.get("hidden_size") if cfg else recipe.target.hidden_size
    if recipe.draft.hidden_size is not None and hidden is not None:
        if recipe.draft.hidden_size != hidden:
            # the same rule the train stage applies (services.train.draft_model)
            raise ConfigError(
                f"draft.hidden_size: EAGLE-3 drafts use the target's hidden size {hidden} "
                f"(got {recipe.draft.hidden_size}); leave it unset"
            )
    vocab = cfg.get("vocab_size") if cfg else recipe.target.vocab_size
    want = recipe.draft.draft_vocab_size
    if isinstance(vocab, int) and want != "auto" and want > vocab:
        raise ConfigError(
            f"draft.draft_vocab_size: {recipe.draft.draft_vocab_size} exceeds the target's "
            f"vocab_size {vocab}"
        )
    tok_dir = Path(tok or recipe.target.path)
    if tok_dir.is_dir():
        check_tokenizer_folder(tok_dir, "target.tokenizer" if tok else "target.path")
    return notes


#: Files a tokenizer folder may keep its chat template in (transformers 5 writes the .jinja).
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def check_tokenizer_folder(folder: Path, field: str) -> None:
    """A local tokenizer folder has a tokenizer and a chat template.

    Every stage renders conversations through the chat template (`shared.tokenizer`
    refuses a tokenizer without one); this finds a folder without it before any work.

    Raises:
        ConfigError: no `tokenizer.json`/`tokenizer_config.json`, an unreadable
            `tokenizer_config.json`, or no chat template; the message starts with `field`.
    """
    tc = folder / "tokenizer_config.json"
    if not tc.is_file() and not (folder / "tokenizer.json").is_file():
        raise ConfigError(
            f"{field}: {folder} holds no tokenizer (tokenizer.json or tokenizer_config.json); "
            "set target.tokenizer to a folder that does"
        )
    has_template = any((folder / f).is_file() for f in _TEMPLATE_FILES)
    if tc.is_file():
        has_template = has_template or bool(read_config_file(tc, field).get("chat_template"))
    if not has_template:
        raise ConfigError(
            f"{field}: {folder} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); set target.tokenizer to a folder whose tokenizer has one"
        )


def check_dataset_path(path: str, field: str) -> None:
    """A dataset `path` that means a local file must be one prep can read.

    A value that does not exist and does not look local (`org/name`) is a hub id: left for
    the plan stage, which loads it.

    Raises:
        ConfigError: a local-looking path that is missing, a folder, unreadable, or of an
            unsupported type; the message starts with `field`.
    """
    p = Path(path)
    if not p.exists():
        if looks_local(path):
            raise ConfigError(f"{field}: {path} does not exist")
        _check_hub_id(path, field)
        return
    if p.is_dir():
        raise ConfigError(f"{field}: {path} is a folder, not a data file")
    if not p.is_file():  # a FIFO or a device: indexing would block or never end
        raise ConfigError(f"{field}: {path} is not a regular file")
    if p.suffix not in DATA_SUFFIXES:
        raise ConfigError(
            f"{field}: {path}: unsupported file type {p.suffix!r}; use {', '.join(DATA_SUFFIXES)}"
        )
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{field}: {path} is not readable (permission denied)")
    if p.suffix in (".json", ".jsonl"):
        with open(p, "rb") as f:
            head = f.read(8)
        for magic, what in _NOT_UTF8_TEXT:
            if head.startswith(magic):
                raise ConfigError(
                    f"{field}: {path} is {what}; prep reads UTF-8 JSON and JSONL text"
                )


#: Leading bytes of files that are not UTF-8 text, and what to do about them. UTF-32's BOMs
#: start like UTF-16's, so the UTF-16 hint covers both (iconv names either).
_NOT_UTF8_TEXT = (
    (b"\x1f\x8b", "gzip-compressed (decompress it: gunzip)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed (decompress it: zstd -d)"),
    (b"BZh", "bzip2-compressed (decompress it: bunzip2)"),
    (b"\xfd7zXZ\x00", "xz-compressed (decompress it: unxz)"),
    (b"PK\x03\x04", "a zip archive (unzip it)"),
    (b"\xff\xfe", "UTF-16/32 text with a byte-order mark (convert it: iconv -t UTF-8)"),
    (b"\xfe\xff", "UTF-16/32 text with a byte-order mark (convert it: iconv -t UTF-8)"),
)


def _check_hub_id(repo_id: str, field: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(
            f"{field}: {repo_id!r} is neither an existing file nor a valid hub id ({e})"
        ) from None


def _target_config(recipe: Recipe) -> tuple[dict[str, Any] | None, list[str]]:
    t = recipe.target
    if Path(t.path).exists() or looks_local(t.path):
        return target_config(recipe), []
    cached = _cached_hub_config(t.path, t.revision)
    if cached is None:
        return None, [
            f"target.path: {t.path} is a hub id whose config is not in the local hub cache; "
            "it is checked when the first stage loads it"
        ]
    cfg = read_config_file(cached)
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    check_expected(recipe, cfg)
    return cfg, []


def _cached_hub_config(repo_id: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except HFValidationError as e:
        raise ConfigError(
            f"target.path: {repo_id!r} is neither an existing folder nor a valid hub id ({e})"
        ) from None
    return Path(found) if isinstance(found, str) else None
