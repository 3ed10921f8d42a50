"""The target's tokenizer: one loader for every stage (prep, regen, vocab, bench).

Every stage loads the tokenizer the same way: from `target.tokenizer` (else `target.path`),
at `target.revision`, with `target.trust_remote_code`, and refuses a tokenizer without a chat
template (the loss mask and regeneration both render through it). Loaded tokenizers are
cached per process: a forking prep worker loads each once and its jobs inherit it.

Invariant: the ids of the loaded tokenizer are the ids of the model's own `tokenizer.json`
(what `tokenizers.Tokenizer.from_file` and the serving engine produce), checked on probe
strings with spaces, digits, accents and CJK at every load. transformers 5 builds a
`LlamaTokenizer(Fast)`-declared tokenizer with its own Metaspace pre-tokenizer and decoder even
where the file holds a byte-level BPE (DeepSeek-V3; transformers issues #45488, #45920, #45812;
vLLM special-cases `deepseek_v3` in its tokenizer registry for the same reason). Where the
class transformers picks fails the check, the file is loaded as is through the generic fast
class; where that fails too, or where a tokenizer without a `tokenizer.json` (tiktoken-based,
remote code) does not decode its own ids back to the text, the load is refused, naming the
cause.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import ConfigError
from shared.store import check_readable

if TYPE_CHECKING:
    from shared.recipe import Recipe

log = logging.getLogger(__name__)

#: Texts every loaded tokenizer must encode as its `tokenizer.json` does and decode back to
#: themselves: single and double spaces, digits, accents, CJK, punctuation, tab and newline.
PROBES = (
    "a b",
    "  two  spaces and a trailing one ",
    "digits 12345, 3.14 and 1,000,000",
    "café naïve Ångström façade",
    "中文测试，你好世界。日本語のテキスト",
    "Hello, world!\n\tIndented line\n\nNew paragraph",
)


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
        ConfigError: it cannot be loaded, it has no chat template, or its ids differ from
            its `tokenizer.json`'s (or do not decode back) on `PROBES`; the message names the
            recipe field to fix and the cause.
    """
    if not isinstance(spec, TokenizerSpec):
        spec = TokenizerSpec.of(spec)
    return _load(spec)


def tokenizer_file(spec: TokenizerSpec) -> Path | None:
    """The `tokenizer.json` of `spec`: in its folder, or in the local hub cache; else None.

    Never downloads: the hub is reached only where the model step fetched the files.
    """
    local = Path(spec.path)
    if local.is_dir():
        f = local / "tokenizer.json"
        return f if f.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec.path, "tokenizer.json", revision=spec.revision)
    except (ValueError, OSError):  # not a valid hub id either
        return None
    return Path(found) if isinstance(found, str) else None


def _component(backend: Any, name: str) -> str:
    part = getattr(backend, name, None)
    return "none" if part is None else type(part).__name__


def round_trip_problem(tok: Any, raw: Any | None) -> str | None:
    """Why `tok` is not the model's tokenizer, or None when it is.

    Args:
        tok: a loaded transformers tokenizer.
        raw: the `tokenizers.Tokenizer` of the model's `tokenizer.json`, or None (then only
            `decode(encode(p)) == p` is checked).

    Returns:
        One line naming the first probe that fails and, where the ids differ from the file's,
        the pre-tokenizer and decoder each side uses (the usual cause).
    """
    for p in PROBES:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        if raw is not None:
            want = raw.encode(p, add_special_tokens=False).ids
            if ids != want:
                backend = getattr(tok, "backend_tokenizer", None)
                return (
                    f"{type(tok).__name__} encodes {p!r} as {ids[:8]}, the tokenizer.json as "
                    f"{want[:8]} (pre-tokenizer {_component(backend, 'pre_tokenizer')} vs "
                    f"{_component(raw, 'pre_tokenizer')}, decoder "
                    f"{_component(backend, 'decoder')} vs {_component(raw, 'decoder')})"
                )
        back = tok.decode(ids)
        if back != p:
            return f"{type(tok).__name__} decodes its ids of {p!r} to {back!r}"
    return None


@functools.lru_cache(maxsize=8)
def _load(spec: TokenizerSpec) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    check_readable(spec.path, "target.tokenizer")
    kwargs: dict[str, Any] = {
        "revision": spec.revision,
        "trust_remote_code": spec.trust_remote_code,
    }
    try:
        tok = AutoTokenizer.from_pretrained(spec.path, **kwargs)
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
    raw = _raw(spec)
    problem = round_trip_problem(tok, raw)
    if problem and raw is not None:
        # The file as written, through the generic class (no class-specific rebuild).
        plain = PreTrainedTokenizerFast.from_pretrained(spec.path, **kwargs)
        if plain.chat_template and round_trip_problem(plain, raw) is None:
            log.info("tokenizer %s: %s; loaded tokenizer.json as is", spec.path, problem)
            return plain
    if problem:
        raise ConfigError(
            f"target.tokenizer: {spec.path}: the loaded tokenizer is not the model's: "
            f"{problem}. Point target.tokenizer at a folder whose tokenizer.json is the "
            "model's, or fix its tokenizer_config.json's tokenizer_class"
        )
    return tok


def _raw(spec: TokenizerSpec) -> Any | None:
    from tokenizers import Tokenizer

    f = tokenizer_file(spec)
    if f is None:
        return None
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises plain Exception on a malformed file
        raise ConfigError(f"target.tokenizer: {f}: not a tokenizers file ({e})") from e


def generation_stop_ids(path: str, revision: str | None = None) -> frozenset[int]:
    """The `eos_token_id`(s) of a model's `generation_config.json` (what the server stops on).

    A local folder is read directly; a hub id is read from the local hub cache only. A model
    without the file gives an empty set (the tokenizer's EOS still counts: `stop_ids`).

    Raises:
        ConfigError: the file is there but is not JSON.
    """
    local = Path(path)
    if local.is_dir():
        f: Path | None = local / "generation_config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(path, "generation_config.json", revision=revision)
        except (ValueError, OSError):
            found = None
        f = Path(found) if isinstance(found, str) else None
    if f is None or not f.is_file():
        return frozenset()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ConfigError(f"target.path: {f}: not JSON ({e})") from e
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def stop_ids(recipe: Recipe, tok: Any, end_of_turn: int | None = None) -> frozenset[int]:
    """Every id the target's server stops on.

    The union of the target's generation-config `eos_token_id`(s) (vLLM stops on each),
    the tokenizer's EOS, and the template's end-of-turn id. Llama-3.1: `<|end_of_text|>`,
    `<|eom_id|>`, `<|eot_id|>`; Qwen3: `<|im_end|>`, `<|endoftext|>`.
    """
    t = recipe.target
    ids = set(generation_stop_ids(t.path, t.revision))
    ids |= {x for x in (tok.eos_token_id, end_of_turn) if x is not None}
    return frozenset(ids)
