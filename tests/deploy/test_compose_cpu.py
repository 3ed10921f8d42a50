"""The compose CPU profile (docker-compose.cpu.yml on top of docker-compose.yml), read through
the real Compose binary: the same deployment as the GPU node's but for images and device
reservations, every image built here from images/ (no registry), no GPU anywhere.

scripts/docker-cpu runs it under a real Docker engine; these checks need none.
"""

from __future__ import annotations

import json

import pytest
from compose_helpers import CPU_FILES, ROOT, compose_config

#: The keys of a service the CPU override may change, and nothing else.
CPU_ONLY_KEYS = {"image", "build", "deploy"}


@pytest.fixture(scope="module")
def gpu() -> dict:
    return compose_config()


@pytest.fixture(scope="module")
def cpu() -> dict:
    return compose_config(files=CPU_FILES)


def _without(svc: dict, keys: set[str]) -> dict:
    return {k: v for k, v in svc.items() if k not in keys}


def test_cpu_profile_differs_from_the_gpu_node_only_in_images_and_devices(gpu, cpu):
    assert set(cpu["services"]) == set(gpu["services"])
    for name, svc in gpu["services"].items():
        assert _without(cpu["services"][name], CPU_ONLY_KEYS) == _without(svc, CPU_ONLY_KEYS), name
    for key in ("volumes", "networks"):
        assert cpu.get(key) == gpu.get(key), key


def test_the_gpu_build_settings_are_kept_and_only_extended(gpu, cpu):
    for name, svc in gpu["services"].items():
        if "build" in svc:
            b = cpu["services"][name]["build"]
            assert (b["context"], b["dockerfile"]) == (
                svc["build"]["context"],
                svc["build"]["dockerfile"],
            ), name


def test_no_cpu_service_reserves_a_device(cpu):
    for name, svc in cpu["services"].items():
        assert not svc.get("deploy"), f"{name}: {svc.get('deploy')}"
    assert "nvidia" not in json.dumps(cpu["services"])


def test_every_cpu_image_is_built_here_on_the_local_base(cpu):
    for name, svc in cpu["services"].items():
        b = svc.get("build")
        assert b, f"{name}: image {svc['image']} would need a registry"
        assert (ROOT / b["dockerfile"]).is_file(), name
        # Builds reach PyPI and Debian through the host (dockerd runs with --bridge=none).
        assert b.get("network") == "host", name
        assert b["args"]["BASE_IMAGE"] == "eyrie-base:bookworm", name
        assert not svc["image"].startswith(("vllm/", "redis:", "python:")), name


def test_cpu_images_are_the_cpu_builds(cpu):
    s = cpu["services"]
    assert s["redis"]["build"]["dockerfile"] == "images/redis.Dockerfile"
    assert s["vllm"]["build"]["dockerfile"] == "images/vllm-cpu.Dockerfile"
    for name in ("extractor", "trainer", "prep-worker", "conductor", "vllm"):
        assert s[name]["build"]["args"]["TORCH_INDEX_URL"] == "https://pypi.org/simple", name
    # The CPU build of the GPU Dockerfile gets its own tag: it must never be pushed or run as
    # the CUDA image.
    assert s["extractor"]["image"] == s["trainer"]["image"] == "eyrie-gpu:0.1.0-cpu"
    assert s["prep-worker"]["image"] == s["conductor"]["image"] == "eyrie-cpu:0.1.0"


def test_cpu_images_are_configurable(cpu):
    cfg = compose_config(
        files=CPU_FILES,
        EYRIE_BASE_IMAGE="my-base:1",
        EYRIE_REDIS_CPU_IMAGE="r:1",
        EYRIE_TORCH_CPU_IMAGE="t:1",
        VLLM_CPU_IMAGE="v:1",
    )
    s = cfg["services"]
    assert (s["redis"]["image"], s["trainer"]["image"], s["vllm"]["image"]) == ("r:1", "t:1", "v:1")
    assert {svc["build"]["args"]["BASE_IMAGE"] for svc in s.values()} == {"my-base:1"}
