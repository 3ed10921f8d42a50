"""vLLM arguments per mode, ports/URLs, and which stages need which servers.

Expected values are written by hand from the recipe below and vLLM's flag names.
"""

from __future__ import annotations

import json

import pytest

from services.serve.launcher import (
    auth_headers,
    base_url,
    modes_for_stage,
    speculative_config,
    vllm_args,
)
from shared.errors import ConfigError
from shared.recipe import resolve_recipe


@pytest.fixture
def recipe(smollm2_path):
    return resolve_recipe(
        {
            "name": "launch-test",
            "target": {"path": str(smollm2_path), "dtype": "bfloat16"},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 15, 27],
            "eval": {"num_speculative_tokens": 4},
            "serve": {
                "port": 9100,
                "eagle3_port": 9101,
                "max_model_len": 1536,
                "tensor_parallel_size": 2,
                "enable_prefix_caching": True,
                "served_model_name": "smol",
                "extra_args": ["--seed", "7"],
            },
        }
    )


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_baseline_args(recipe, smollm2_path):
    args = vllm_args(recipe, "baseline")
    assert _flag(args, "--model") == str(smollm2_path)
    assert _flag(args, "--served-model-name") == "smol"
    assert _flag(args, "--dtype") == "bfloat16"
    assert _flag(args, "--tensor-parallel-size") == "2"
    assert _flag(args, "--max-model-len") == "1536"
    assert _flag(args, "--port") == "9100"
    assert "--enable-prefix-caching" in args
    assert "--speculative-config" not in args and "--kv-transfer-config" not in args
    assert args[-2:] == ["--seed", "7"]


def test_eagle3_args_name_method_explicitly(recipe, tmp_path):
    args = vllm_args(recipe, "eagle3", draft_dir=tmp_path)
    spec = json.loads(_flag(args, "--speculative-config"))
    assert spec == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 4}
    assert _flag(args, "--port") == "9101"
    assert base_url(recipe, "eagle3") == "http://127.0.0.1:9101"
    assert base_url(recipe, "baseline") == "http://127.0.0.1:9100"


def test_eagle3_without_draft_is_refused(recipe):
    with pytest.raises(ConfigError, match="needs a draft folder"):
        speculative_config(recipe, "eagle3", None)


def test_extract_args_add_final_layer_and_connector(recipe, tmp_path):
    args = vllm_args(recipe, "extract", hs_dir=tmp_path)
    spec = json.loads(_flag(args, "--speculative-config"))
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}},
    }
    kv = json.loads(_flag(args, "--kv-transfer-config"))
    assert kv["kv_connector_module_path"] == "services.extract.connector"
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    # A prefix-cache hit would skip the forward that yields those tokens' hidden states.
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args


def test_unknown_mode(recipe):
    with pytest.raises(ConfigError, match="known: baseline, eagle3, extract"):
        vllm_args(recipe, "eagle")


def test_modes_for_stage(recipe):
    assert modes_for_stage("regen", recipe, [0, 1, 2]) == ["baseline"]
    assert modes_for_stage("eval", recipe, [0, 1]) == ["baseline", "eagle3"]
    assert modes_for_stage("eval", recipe, [1]) == ["eagle3"]
    assert modes_for_stage("extract", recipe, [0]) == []  # backend hf
    assert modes_for_stage("train", recipe, [0]) == []
    off = resolve_recipe(
        {
            **recipe.model_dump(mode="json"),
            "regen": {"enabled": False},
            "extract": {"backend": "vllm"},
        }
    )
    assert modes_for_stage("regen", off, [0]) == []
    assert modes_for_stage("extract", off, [0]) == ["extract"]


def test_api_key_header(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert auth_headers() == {}
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    assert auth_headers() == {"Authorization": "Bearer s3cret"}
