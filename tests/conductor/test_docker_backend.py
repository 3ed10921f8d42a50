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
        "Image": "vllm/vllm-openai:v0.32.0",
        "User": "10001:10001",
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
        "NetworkMode": "eyrie_default",
        # What compose makes of `deploy.resources.reservations.devices` (count: all).
        "DeviceRequests": [
            {
                "Driver": "nvidia",
                "Count": -1,
                "DeviceIDs": None,
                "Capabilities": [["gpu"]],
                "Options": None,
            }
        ],
        "PortBindings": {
            "8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "8000"}],
            "8001/tcp": [{"HostIp": "10.0.0.5", "HostPort": "18001"}],
        },
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
                "cpu_kvcache_space_gib": 3,
                "image": "vllm/vllm-openai:v0.32.0",
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
    assert spec["image"] == "vllm/vllm-openai:v0.32.0"
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
    assert spec["user"] == "10001:10001"
    assert "VLLM_CPU_KVCACHE_SPACE=3" in spec["environment"]


def _cpu_host_network(attrs):
    """The CPU profile's compose container under host networking: no GPUs, no ports."""
    attrs = json.loads(json.dumps(attrs))
    attrs["Config"]["Image"] = "eyrie-vllm-cpu:0.32.0"
    attrs["HostConfig"] = {"NetworkMode": "host", "PortBindings": {}}
    attrs["NetworkSettings"] = {"Networks": {"host": {}}}
    return attrs


def test_cpu_host_network_spec_has_no_gpus_ports_or_aliases(recipe):
    tpl = compose_template(_cpu_host_network(INSPECT))
    assert tpl.network == "host" and tpl.device_requests == []
    spec = container_spec(recipe, "baseline", tpl, None, None)
    assert spec["image"] == "eyrie-vllm-cpu:0.32.0"
    assert spec["device_requests"] == []
    assert spec["network_mode"] == "host"
    assert not {"ports", "network", "networking_config"} & set(spec)
    assert spec["user"] == "10001:10001"


def test_image_falls_back_to_the_recipe(recipe):
    attrs = json.loads(json.dumps(INSPECT))
    del attrs["Config"]["Image"], attrs["Config"]["User"]
    spec = container_spec(recipe, "baseline", compose_template(attrs), None, None)
    assert spec["image"] == recipe.serve.image and "user" not in spec


def test_eagle3_container_spec(recipe):
    spec = container_spec(
        recipe, "eagle3", compose_template(INSPECT), "/data/runs/r/export/vllm", None
    )
    cmd = spec["command"]
    sc = json.loads(cmd[cmd.index("--speculative-config") + 1])
    (dev,) = spec["device_requests"]
    assert dev["Driver"] == "nvidia" and dev["Count"] == -1
    assert sc == {
        "method": "eagle3",
        "model": "/data/runs/r/export/vllm",
        "num_speculative_tokens": 5,
    }
    assert spec["ports"] == {"8001/tcp": ("10.0.0.5", 18001)}  # as compose published it
    assert spec["networking_config"] == {"eyrie_default": {"Aliases": ["vllm-eagle3"]}}


class _Container:
    def __init__(self, attrs, status="running", output=b""):
        self.attrs, self.status, self.id = attrs, status, attrs["Id"]
        self.calls = []
        self.output = output

    def stop(self, timeout):
        self.calls.append(("stop", timeout))
        self.status = "exited"

    def remove(self):
        self.calls.append(("remove",))

    def logs(self, stdout, stderr):
        return self.output


class _Containers:
    def __init__(self, base):
        self.base, self.runs, self.filters = base, [], None
        self.started: list[_Container] = []
        self.output = b""

    def list(self, all, filters):
        self.filters = filters
        return [self.base]

    def get(self, name):
        import docker

        for c in self.started:
            if name in (c.id, c.name):
                return c
        raise docker.errors.NotFound(name)

    def run(self, **kwargs):
        self.runs.append(kwargs)
        c = _Container({"Id": f"new{len(self.runs)}"}, output=self.output)
        c.name = kwargs["name"]
        self.started.append(c)
        return c


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
    log = tmp_path / "baseline.log"
    handle = backend._spawn(recipe, "baseline", log, None, None, 8000, "http://vllm:8000")
    assert client.containers.filters == {"label": [f"{COMPOSE_SERVICE_LABEL}=vllm"]}
    assert client.base.calls == [("stop", 30)]
    (run,) = client.containers.runs
    assert run["image"] == "vllm/vllm-openai:v0.32.0" and "networking_config" not in run
    assert client.net.calls == [("disconnect", "new1"), ("connect", "new1", ["vllm"])]
    assert handle.container == "new1" and handle.backend == "docker"


def test_container_log_lands_in_the_run_store_before_removal(recipe, tmp_path):
    client = _Client()
    backend = DockerBackend(tmp_path / "state", client=client)
    log = tmp_path / "serve" / "baseline.log"
    log.parent.mkdir()
    log.write_text("earlier start\n")
    client.containers.output = b"INFO loading\nERROR no GPU found\n"
    handle = backend._spawn(recipe, "baseline", log, None, None, 8000, "http://vllm:8000")
    c = client.containers.started[0]
    c.status = "exited"  # it died during startup
    assert backend.alive(handle) is False
    text = log.read_text()
    assert text.startswith("earlier start\n\n=== ")
    assert text.endswith("INFO loading\nERROR no GPU found\n")
    # Saved again on stop, at the same offset: the output is not duplicated.
    c.output += b"shutdown\n"
    backend.stop(handle)
    assert c.calls[-1] == ("remove",)
    text = log.read_text()
    assert text.count("ERROR no GPU found") == 1 and text.endswith("ERROR no GPU found\nshutdown\n")


def test_failed_start_quotes_the_container_log(recipe, tmp_path):
    from shared.errors import ServiceUnavailableError

    client = _Client()
    client.containers.output = b"RuntimeError: Failed to infer device type\n"
    backend = DockerBackend(tmp_path / "state", client=client)
    orig_run = client.containers.run

    def run_and_die(**kw):
        c = orig_run(**kw)
        c.status = "exited"
        return c

    client.containers.run = run_and_die
    log = tmp_path / "serve" / "baseline.log"
    with pytest.raises(ServiceUnavailableError, match="Failed to infer device type"):
        backend.start(recipe, "baseline", log)
    assert "Failed to infer device type" in log.read_text()


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
