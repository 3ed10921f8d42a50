"""The target's tokenizer: one loader for every stage (prep, regen, vocab, bench).

Every stage loads the tokenizer the same way: from `target.tokenizer` (else `target.path`),
at `target.revision`, with `target.trust_remote_code`, and refuses a tokenizer without a chat
template (the loss mask and regeneration both render through it). Loaded tokenizers are
cached per process: a forking prep worker loads each once and its jobs inherit it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.errors import ConfigError
from shared.store import check_readable

if TYPE_CHECKING:
    from shared.recipe import Recipe


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a tokenizer comes from (the cache key).

    Attributes:
        path: local folder or hub id.
        revision: hub revision, or None.
        trust_remote_code: allow the tokenizer's own code (only if the recipe says so).
    """

    path: str
    revision: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def of(cls, recipe: Recipe) -> TokenizerSpec:
        """The spec the recipe's target asks for."""
        t = recipe.target
        return cls(t.tokenizer or t.path, t.revision, t.trust_remote_code)


def load_tokenizer(spec: TokenizerSpec | Recipe) -> Any:
    """The tokenizer of `spec` (or of a recipe's target), cached per process.

    Raises:
        ConfigError: it cannot be loaded, or it has no chat template; the message names
            the recipe field to fix.
    """
    if not isinstance(spec, TokenizerSpec):
        spec = TokenizerSpec.of(spec)
    return _load(spec)


@functools.lru_cache(maxsize=8)
def _load(spec: TokenizerSpec) -> Any:
    from transformers import AutoTokenizer

    check_readable(spec.path, "target.tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(
            spec.path, revision=spec.revision, trust_remote_code=spec.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"target.tokenizer: cannot load a tokenizer from {spec.path!r} ({e}); set "
            "target.tokenizer to a folder holding tokenizer.json and tokenizer_config.json"
        ) from e
    if not tok.chat_template:
        raise ConfigError(
            f"target.tokenizer: {spec.path} has no chat_template; set target.tokenizer "
            "to a folder whose tokenizer_config.json carries one"
        )
    return tok
