"""`shared.vllm`: vLLM arguments per mode, ports/URLs, model name and the API key header.

Expected values are written by hand from the recipe below and vLLM's flag names.
"""

from __future__ import annotations

import json

import pytest

from shared.errors import ConfigError
from shared.recipe import resolve_recipe
from shared.vllm import (
    DOCKER_HOSTS,
    api_key,
    auth_headers,
    base_url,
    mode_port,
    served_model_name,
    speculative_config,
    vllm_args,
)


@pytest.fixture
def recipe(smollm2_path):
    return resolve_recipe(
        {
            "name": "launch-test",
            "target": {"path": str(smollm2_path), "dtype": "bfloat16"},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 15, 27],
            "bench": {"num_speculative_tokens": 4},
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
    assert kv["kv_connector_extra_config"] == {
        "shared_storage_path": str(tmp_path),
        "output_root": str(tmp_path.parent),  # the run's extract folder, for the real one
        "dtype": "bfloat16",  # extract.dtype: stored in bf16 whatever the target runs in
    }
    # A prefix-cache hit would skip the forward that yields those tokens' hidden states.
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args


def test_unknown_mode(recipe):
    with pytest.raises(ConfigError, match="known: baseline, eagle3, extract"):
        vllm_args(recipe, "eagle")


def test_ports_and_model_name(recipe):
    # baseline and extract share serve.port (never in the same GPU phase); eagle3 has its own.
    assert [mode_port(recipe, m) for m in ("baseline", "extract", "eagle3")] == [9100, 9100, 9101]
    assert served_model_name(recipe) == "smol"
    unnamed = resolve_recipe({**recipe.model_dump(mode="json"), "serve": {"port": 9100}})
    assert served_model_name(unnamed) == "launch-test"


def test_wildcard_bind_is_reached_through_loopback(recipe):
    wild = resolve_recipe(
        {**recipe.model_dump(mode="json"), "serve": {"host": "0.0.0.0", "port": 9200}}
    )
    assert base_url(wild, "baseline") == "http://127.0.0.1:9200"
    assert _flag(vllm_args(wild, "baseline"), "--host") == "0.0.0.0"


def test_docker_servers_answer_at_their_compose_alias(recipe):
    docker = resolve_recipe(
        {**recipe.model_dump(mode="json"), "serve": {"backend": "docker", "port": 9100}}
    )
    assert DOCKER_HOSTS == {"baseline": "vllm", "extract": "vllm", "eagle3": "vllm-eagle3"}
    assert base_url(docker, "baseline") == "http://vllm:9100"
    assert base_url(docker, "extract") == "http://vllm:9100"
    assert base_url(docker, "eagle3") == "http://vllm-eagle3:8001"  # serve.eagle3_port default


def test_api_key_header(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert auth_headers() == {} and api_key() is None
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert auth_headers() == {} and api_key() is None
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    assert auth_headers() == {"Authorization": "Bearer s3cret"} and api_key() == "s3cret"
