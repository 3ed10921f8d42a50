"""The docker backend: the official vLLM image, swapped in for the compose `vllm` container.

It finds the compose-made `vllm` container by its compose labels, stops it (it holds the
GPUs while it runs), and runs the official image with `shared.vllm.vllm_args` (binding
0.0.0.0), the same volumes, environment and network, the mode's port published as compose
published it, all GPUs and host IPC. On the compose network the new container answers at
the mode's alias (`shared.vllm.DOCKER_HOSTS`). Needs the Docker socket, which compose mounts
into the conductor only. `container_spec` is a pure function, so the container it would
create is testable where no engine runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.conductor.servers import API_SERVER_MODULE, STOP_GRACE_S, Backend, ServerHandle
from shared import vllm
from shared.errors import ServiceUnavailableError
from shared.recipe import Recipe

log = logging.getLogger("eyrie.serve")

COMPOSE_SERVICE_LABEL = "com.docker.compose.service"
COMPOSE_PROJECT_LABEL = "com.docker.compose.project"
#: The entrypoint is set explicitly so both backends run the same module with the same args
#: (the image's own entrypoint has changed across releases).
DOCKER_ENTRYPOINT = ["python3", "-m", API_SERVER_MODULE]


@dataclass
class ComposeTemplate:
    """What the new container keeps from the compose-made `vllm` container.

    Attributes:
        name: its container name; project: its compose project.
        volumes: docker-py `volumes` dict (host path or volume name → bind spec).
        environment: its env list (`KEY=VALUE`), minus image defaults we override.
        network: the compose network, so other services keep reaching `vllm`.
        port_bindings: its `HostConfig.PortBindings` (`"8000/tcp"` → [{HostIp, HostPort}]).
    """

    name: str
    project: str
    volumes: dict[str, dict[str, str]]
    environment: list[str]
    network: str | None
    port_bindings: dict[str, list[dict[str, str]]] = field(default_factory=dict)


def compose_template(attrs: dict[str, Any]) -> ComposeTemplate:
    """Read a container's `attrs` (docker inspect JSON) into a `ComposeTemplate`."""
    volumes = {
        m.get("Name") or m["Source"]: {"bind": m["Destination"], "mode": m.get("Mode") or "rw"}
        for m in attrs.get("Mounts", [])
    }
    labels = attrs.get("Config", {}).get("Labels") or {}
    networks = list((attrs.get("NetworkSettings") or {}).get("Networks") or {})
    return ComposeTemplate(
        name=attrs.get("Name", "").lstrip("/"),
        project=labels.get(COMPOSE_PROJECT_LABEL, "eyrie"),
        volumes=volumes,
        environment=list(attrs.get("Config", {}).get("Env") or []),
        network=networks[0] if networks else None,
        port_bindings=dict((attrs.get("HostConfig") or {}).get("PortBindings") or {}),
    )


def host_binding(tpl: ComposeTemplate, port: int) -> tuple[str, int]:
    """(host IP, host port) publishing container `port`, as the compose container did.

    Without such a binding: loopback, never every interface by default.
    """
    for b in tpl.port_bindings.get(f"{port}/tcp") or []:
        return b.get("HostIp") or "127.0.0.1", int(b.get("HostPort") or port)
    return "127.0.0.1", port


def container_spec(
    recipe: Recipe, mode: str, tpl: ComposeTemplate, draft_dir: Path | None, hs_dir: Path | None
) -> dict[str, Any]:
    """The docker-py `containers.run` kwargs for `mode`'s server.

    The official image, all GPUs, the compose container's volumes, env and network, the
    mode's port published as the compose container published it, host IPC (vLLM's
    shared-memory workers).
    """
    from docker.types import DeviceRequest

    port = vllm.mode_port(recipe, mode)
    env = [e for e in tpl.environment if not e.startswith(("HF_HUB_OFFLINE=", "VLLM_NO_USAGE"))]
    env += ["HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1"]
    spec: dict[str, Any] = {
        "image": recipe.serve.image,
        "entrypoint": DOCKER_ENTRYPOINT,
        "command": vllm.vllm_args(recipe, mode, draft_dir, port, hs_dir, host="0.0.0.0"),
        "name": f"{tpl.project}-vllm-{mode}",
        "detach": True,
        "device_requests": [DeviceRequest(count=-1, capabilities=[["gpu"]])],
        "volumes": tpl.volumes,
        "environment": env,
        "ports": {f"{port}/tcp": host_binding(tpl, port)},
        "ipc_mode": "host",
        "labels": {"eyrie.managed": "true", "eyrie.mode": mode, COMPOSE_PROJECT_LABEL: tpl.project},
    }
    if tpl.network:
        spec["network"] = tpl.network
        spec["networking_config"] = {tpl.network: {"Aliases": [vllm.DOCKER_HOSTS[mode]]}}
    return spec


class DockerBackend(Backend):
    """The official vLLM image, swapped in for the compose-made `vllm` container."""

    name = "docker"

    def __init__(self, state_dir: Path | None = None, client: Any = None):
        super().__init__(state_dir)
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker

            try:
                self._client = docker.from_env()
                self._client.ping()
            except Exception as e:
                raise ServiceUnavailableError(
                    f"cannot reach the Docker engine ({e}); the docker backend needs "
                    "/var/run/docker.sock (mounted into the conductor only)"
                ) from e
        return self._client

    def find_compose_vllm(self) -> Any:
        """The compose-made `vllm` container (by compose labels; running or not).

        Raises:
            ServiceUnavailableError: none exists (start the stack with docker compose).
        """
        filters = {"label": [f"{COMPOSE_SERVICE_LABEL}=vllm"]}
        project = os.environ.get("COMPOSE_PROJECT_NAME")
        if project:
            filters["label"].append(f"{COMPOSE_PROJECT_LABEL}={project}")
        found = self.client.containers.list(all=True, filters=filters)
        if not found:
            raise ServiceUnavailableError(
                f"no container labelled {COMPOSE_SERVICE_LABEL}=vllm: create it with "
                "`docker compose --profile serve create vllm` (README, Run on a GPU node)"
            )
        return found[0]

    def prepare(self) -> None:
        """Stop the compose-made `vllm` container: it holds the GPUs while it runs."""
        self._stop_compose(self.find_compose_vllm())

    @staticmethod
    def _stop_compose(base: Any) -> None:
        if base.status == "running":
            log.info("stopping compose container %s", base.attrs.get("Name", base.id))
            base.stop(timeout=int(STOP_GRACE_S))

    def _spawn(self, recipe, mode, log_path, draft_dir, hs_dir, port, url) -> ServerHandle:
        base = self.find_compose_vllm()
        tpl = compose_template(base.attrs)
        self._stop_compose(base)
        spec = container_spec(recipe, mode, tpl, draft_dir, hs_dir)
        self._remove_stale(spec["name"])
        networking = spec.pop("networking_config", None)
        container = self.client.containers.run(**spec)
        if networking:
            # run() joins `network` without aliases; reconnect with the compose alias.
            net = self.client.networks.get(spec["network"])
            net.disconnect(container)
            net.connect(container, aliases=networking[spec["network"]]["Aliases"])
        return ServerHandle(
            mode=mode,
            url=url,
            model=vllm.served_model_name(recipe),
            backend=self.name,
            container=container.id,
        )

    def _remove_stale(self, name: str) -> None:
        import docker

        try:
            old = self.client.containers.get(name)
        except docker.errors.NotFound:
            return
        old.remove(force=True)

    def alive(self, handle: ServerHandle) -> bool:
        import docker

        try:
            c = self.client.containers.get(handle.container)
        except docker.errors.NotFound:
            return False
        return c.status in ("created", "running", "restarting")

    def _kill(self, handle: ServerHandle) -> None:
        import docker

        try:
            c = self.client.containers.get(handle.container)
        except docker.errors.NotFound:
            return
        c.stop(timeout=int(STOP_GRACE_S))
        c.remove()
