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
