"""The docker backend's container, checked as a spec: no Docker engine runs here.

The compose container below is a trimmed `docker inspect` of a compose-made `vllm` service
(compose labels, a named model volume, a bind mount of the run data, its env and network).
The engine client is a recording stand-in (the one thing that cannot run on this machine).
"""

from __future__ import annotations

import json

import pytest

from services.conductor.docker_backend import (
    COMPOSE_SERVICE_LABEL,
    DockerBackend,
    compose_template,
    container_spec,
)
from services.conductor.servers import get_backend
from shared.recipe import resolve_recipe
from shared.vllm import base_url

INSPECT = {
    "Id": "c0ffee",
    "Name": "/eyrie-vllm-1",
    "State": {"Status": "running"},
    "Config": {
        "Env": ["HF_TOKEN=hf_x", "HF_HUB_OFFLINE=0", "PATH=/usr/bin"],
        "Labels": {
            "com.docker.compose.project": "eyrie",
            "com.docker.compose.service": "vllm",
        },
    },
    "Mounts": [
        {
            "Type": "volume",
            "Name": "eyrie_models",
            "Source": "/var/lib/docker/volumes/eyrie_models/_data",
            "Destination": "/models",
            "Mode": "z",
        },
        {"Type": "bind", "Source": "/srv/eyrie", "Destination": "/data", "Mode": ""},
    ],
    "HostConfig": {
        "PortBindings": {
            "8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "8000"}],
            "8001/tcp": [{"HostIp": "10.0.0.5", "HostPort": "18001"}],
        }
    },
    "NetworkSettings": {"Networks": {"eyrie_default": {}}},
}


@pytest.fixture
def recipe(tmp_path):
    return resolve_recipe(
        {
            "name": "llama-gpu",
            "target": {"path": "/models/Llama-3.1-8B-Instruct"},
            "datasets": [{"path": "x.jsonl"}],
            "layers": [2, 16, 29],
            "bench": {"num_speculative_tokens": 5},
            "serve": {
                "backend": "docker",
                "host": "vllm",
                "port": 8000,
                "eagle3_port": 8001,
                "tensor_parallel_size": 2,
                "image": "vllm/vllm-openai:v0.33.1",
            },
        }
    )


def test_clients_reach_docker_servers_by_compose_alias(recipe):
    assert base_url(recipe, "baseline") == "http://vllm:8000"
    assert base_url(recipe, "eagle3") == "http://vllm-eagle3:8001"


def test_template_keeps_volumes_env_network():
    tpl = compose_template(INSPECT)
    assert tpl.name == "eyrie-vllm-1" and tpl.project == "eyrie"
    assert tpl.volumes == {
        "eyrie_models": {"bind": "/models", "mode": "z"},
        "/srv/eyrie": {"bind": "/data", "mode": "rw"},
    }
    assert tpl.network == "eyrie_default"


def test_baseline_container_spec(recipe):
    spec = container_spec(recipe, "baseline", compose_template(INSPECT), None, None)
    assert spec["image"] == "vllm/vllm-openai:v0.33.1"
    assert spec["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    cmd = spec["command"]
    assert cmd[cmd.index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--port") + 1] == "8000"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    (dev,) = spec["device_requests"]
    assert dev["Count"] == -1 and dev["Capabilities"] == [["gpu"]]
    assert spec["volumes"]["/srv/eyrie"] == {"bind": "/data", "mode": "rw"}
    assert spec["ports"] == {"8000/tcp": ("127.0.0.1", 8000)}
    assert "HF_TOKEN=hf_x" in spec["environment"]
    assert "HF_HUB_OFFLINE=1" in spec["environment"]
    assert "HF_HUB_OFFLINE=0" not in spec["environment"]
    assert spec["network"] == "eyrie_default"
    assert spec["networking_config"] == {"eyrie_default": {"Aliases": ["vllm"]}}
    assert spec["name"] == "eyrie-vllm-baseline"
    assert spec["ipc_mode"] == "host"


def test_eagle3_container_spec(recipe):
    spec = container_spec(
        recipe, "eagle3", compose_template(INSPECT), "/data/runs/r/export/vllm", None
    )
    cmd = spec["command"]
    sc = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert sc == {
        "method": "eagle3",
        "model": "/data/runs/r/export/vllm",
        "num_speculative_tokens": 5,
    }
    assert spec["ports"] == {"8001/tcp": ("10.0.0.5", 18001)}  # as compose published it
    assert spec["networking_config"] == {"eyrie_default": {"Aliases": ["vllm-eagle3"]}}


class _Container:
    def __init__(self, attrs, status="running"):
        self.attrs, self.status, self.id = attrs, status, attrs["Id"]
        self.calls = []

    def stop(self, timeout):
        self.calls.append(("stop", timeout))
        self.status = "exited"


class _Containers:
    def __init__(self, base):
        self.base, self.runs, self.filters = base, [], None

    def list(self, all, filters):
        self.filters = filters
        return [self.base]

    def get(self, name):
        import docker

        raise docker.errors.NotFound(name)

    def run(self, **kwargs):
        self.runs.append(kwargs)
        return _Container({"Id": "new1"})


class _Network:
    def __init__(self):
        self.calls = []

    def disconnect(self, c):
        self.calls.append(("disconnect", c.id))

    def connect(self, c, aliases):
        self.calls.append(("connect", c.id, aliases))


class _Client:
    def __init__(self):
        self.base = _Container(INSPECT)
        self.containers = _Containers(self.base)
        self.net = _Network()
        self.networks = type("N", (), {"get": lambda _self, name: self.net})()


def test_spawn_stops_compose_container_then_runs_image(recipe, tmp_path):
    client = _Client()
    backend = DockerBackend(tmp_path / "state", client=client)
    handle = backend._spawn(recipe, "baseline", tmp_path, None, None, 8000, "http://vllm:8000")
    assert client.containers.filters == {"label": [f"{COMPOSE_SERVICE_LABEL}=vllm"]}
    assert client.base.calls == [("stop", 30)]
    (run,) = client.containers.runs
    assert run["image"] == "vllm/vllm-openai:v0.33.1" and "networking_config" not in run
    assert client.net.calls == [("disconnect", "new1"), ("connect", "new1", ["vllm"])]
    assert handle.container == "new1" and handle.backend == "docker"


def test_prepare_stops_the_compose_container_before_the_gpu_check(tmp_path):
    client = _Client()
    DockerBackend(tmp_path / "state", client=client).prepare()
    assert client.base.calls == [("stop", 30)]


def test_get_backend_by_name(tmp_path):
    from services.conductor.servers import ProcessBackend
    from shared.errors import ConfigError

    assert isinstance(get_backend("docker", tmp_path), DockerBackend)
    assert isinstance(get_backend("process", tmp_path), ProcessBackend)
    with pytest.raises(ConfigError, match="known: process, docker"):
        get_backend("kubernetes")
