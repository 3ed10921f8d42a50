"""Entrypoint of the compose `vllm` service: a recipe and VLLM_MODE in, `vllm` serving out.

Runs inside the official vllm/vllm-openai image, with Eyrie's `shared/`, `services/` and
`recipes/` mounted read-only on PYTHONPATH (docker-compose.yml). The command line comes from
`shared.vllm.vllm_args`, the one function that builds vLLM's flags for the
process backend, the docker backend and the tests, so the compose service and the servers
the conductor starts can never drift apart. Mode-specific inputs come from the environment:

  VLLM_MODE              baseline | eagle3 | extract | standby (default baseline)
  EYRIE_RECIPE           recipe YAML (relative paths resolve against /opt/eyrie/src)
  EYRIE_RECIPE_OVERRIDES space-separated dotted overrides, e.g. serve.tensor_parallel_size=2
  EYRIE_SERVE_DRAFT      eagle3: the exported draft folder, /data/runs/<run_id>/export/vllm
  EYRIE_SERVE_HS_DIR     extract: where hidden states are written (on the runs volume)

`standby` serves nothing and loads nothing: the container `docker compose up` makes so that the
conductor's docker backend finds the service's settings (image, user, devices, volumes,
network) and runs each mode's server in its image. It waits for SIGTERM and reports healthy.
Every start runs the same preflight as the conductor (`shared.vllm.preflight_launch`) on the
final arguments first.
The server binds 0.0.0.0 on the mode's recipe port (serve.port, serve.eagle3_port); the port
goes to PORT_FILE for the compose healthcheck. `--print` prints the command instead of
running it. Exit code 2 and a message naming the variable on bad input.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

SRC = Path(os.environ.get("EYRIE_SRC", "/opt/eyrie/src"))
PORT_FILE = Path(os.environ.get("EYRIE_VLLM_PORT_FILE", "/tmp/eyrie-vllm-port"))
API_SERVER = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
STANDBY = "standby"


def _die(msg: str) -> None:
    print(f"vllm-serve: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _recipe_path() -> Path:
    raw = os.environ.get("EYRIE_RECIPE", "")
    if not raw:
        _die("EYRIE_RECIPE is empty: set it in .env, e.g. recipes/llama-3.1-8b.yaml")
    path = Path(raw)
    return path if path.is_absolute() else SRC / path


def _optional_dir(var: str) -> Path | None:
    raw = os.environ.get(var, "")
    return Path(raw) if raw else None


def command() -> list[str]:
    """The full server command for the environment's mode and recipe.

    Raises:
        SystemExit(2): a missing or bad input (message on stderr).
    """
    from shared import vllm
    from shared.errors import EyrieError
    from shared.recipe import resolve_recipe

    mode = os.environ.get("VLLM_MODE", "baseline")
    try:
        vllm.check_mode(mode)
        recipe = resolve_recipe(
            _recipe_path(), shlex.split(os.environ.get("EYRIE_RECIPE_OVERRIDES", ""))
        )
        draft = _optional_dir("EYRIE_SERVE_DRAFT")
        if mode == "eagle3":
            if draft is None:
                _die(
                    "VLLM_MODE=eagle3 needs EYRIE_SERVE_DRAFT: the exported draft folder, "
                    "/data/runs/<run_id>/export/vllm (`eyrie status` lists runs)"
                )
        hs_dir = _optional_dir("EYRIE_SERVE_HS_DIR") or Path("/data/vllm-hidden-states")
        port = vllm.mode_port(recipe, mode)
        args = vllm.vllm_args(recipe, mode, draft, port, hs_dir, host="0.0.0.0")
        vllm.preflight_launch(recipe, mode, draft, args, local_engine=True)
    except EyrieError as e:
        _die(f"VLLM_MODE={mode}: {e}")
    return [*API_SERVER, *args]


def standby() -> int:
    """Wait for SIGTERM without loading anything (VLLM_MODE=standby)."""
    import signal

    # As PID 1 (no init in this service) SIGTERM is ignored unless handled.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    PORT_FILE.write_text(STANDBY)
    print("vllm-serve: standby (the conductor starts each mode's server)", file=sys.stderr)
    while True:
        signal.pause()


def main(argv: list[str]) -> int:
    if os.environ.get("VLLM_MODE") == STANDBY and "--print" not in argv:
        return standby()
    cmd = command()
    if "--print" in argv:
        print(json.dumps(cmd))
        return 0
    mode = os.environ.get("VLLM_MODE", "baseline")
    # vLLM warns about VLLM_* variables it does not know; VLLM_MODE is Eyrie's.
    os.environ.pop("VLLM_MODE", None)
    port = cmd[cmd.index("--port") + 1]
    PORT_FILE.write_text(port)
    print(f"vllm-serve: mode {mode} on port {port}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
    return 1  # not reached: execvp replaces the process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
