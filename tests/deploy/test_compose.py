"""Invariants of docker-compose.yml, read through the real Compose binary (see conftest.py).

What the GPU node needs and a typo would silently break: GPU reservations, Redis kept off
the host's ports, grace periods long enough for rq's warm shutdown, the env variables and
volumes the code reads, and the vllm service's health, cache and IPC settings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from compose_helpers import (
    CPU_FILES,
    GPU_DOCKERFILE,
    REDIS_PASSWORD,
    ROOT,
    VLLM_API_KEY,
    compose_binary,
    compose_config,
    eyrie_services,
    gpu_services,
    worker_queues,
)

#: Variables the code reads that the compose file deliberately does not set, with why.
#: A new variable in shared/ or services/ fails test_every_env_var_the_code_reads_is_wired
#: until it is wired in docker-compose.yml (x-eyrie-env) or listed here with a reason.
NOT_WIRED: dict[str, str] = {
    "RANK": "set per process by torchrun (multi-GPU training); one trainer process is rank 0",
    "WORLD_SIZE": "set by torchrun; a single trainer process defaults to a world of 1",
    "LOCAL_RANK": "set per process by torchrun; a single trainer process is local rank 0",
    "EYRIE_PREP_TOKENIZERS": "optional speed-up: tokenizer folders a prep worker loads before "
    "forking; unset, each job loads its own",
    "HF_HUB_OFFLINE": "huggingface_hub's own switch: set by an operator whose HF cache is "
    "complete, so `eyrie up` downloads nothing; unset, it checks the cache against the hub",
}

#: Secrets, and the Eyrie services that use them (no other container gets them).
SECRET_USERS: dict[str, set[str]] = {
    # regen and bench (prep-worker), the extractor's vllm backend, the conductor's readiness
    # checks and servers; the trainer never calls vLLM.
    "VLLM_API_KEY": {"prep-worker", "extractor", "conductor"},
    # every service that loads a tokenizer, config or weights by hub id
    "HF_TOKEN": {"prep-worker", "extractor", "trainer", "conductor"},
}

#: Set by Compose itself (the project name), never by .env.
COMPOSE_BUILTINS = {"COMPOSE_PROJECT_NAME"}

#: Variables that name a folder: each must be the mount point of a named volume.
PATH_VARS = ("EYRIE_DATA", "EYRIE_CACHE", "HF_HOME")

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}

# Reads of the environment: os.environ.get("X"), os.getenv("X"), os.environ["X"] not being
# assigned, and "X" in os.environ. setdefault/assignments only write for child processes.
_ENV_READS = [
    re.compile(r"""os\.environ\.get\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""),
    re.compile(r"""os\.getenv\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""),
    re.compile(r"""os\.environ\[\s*["']([A-Za-z_][A-Za-z0-9_]*)["']\s*\](?!\s*=[^=])"""),
    re.compile(r"""["']([A-Za-z_][A-Za-z0-9_]*)["']\s+(?:not\s+)?in\s+os\.environ"""),
]


def duration_s(text: str) -> float:
    """Seconds in a Go duration as Compose prints it (`1m30s`, `15m0s`, `500ms`)."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Go duration: {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def env_vars_read_by_code() -> dict[str, list[str]]:
    """Variable name -> the files under shared/ and services/ that read it."""
    found: dict[str, list[str]] = {}
    for pkg in ("shared", "services"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for rx in _ENV_READS:
                for name in rx.findall(text):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def mounts(svc: dict) -> dict[str, dict]:
    """Mount target -> the volume entry."""
    return {v["target"]: v for v in svc.get("volumes", [])}


def test_duration_parser_reads_compose_durations():
    assert duration_s("1m0s") == 60
    assert duration_s("10m0s") == 600
    assert duration_s("1h2m3s") == 3723
    assert duration_s("30s") == 30
    with pytest.raises(ValueError):
        duration_s("10 minutes")


def test_the_expected_services_exist(services):
    assert {"redis", "prep-worker", "extractor", "trainer", "conductor", "vllm"} <= set(services)


def reserved_capabilities(svc: dict) -> list[list[str]]:
    devices = (svc.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return [d.get("capabilities", []) for d in devices.get("devices", [])]


def test_every_gpu_service_reserves_gpus(services):
    assert gpu_services(services) == {"extractor", "trainer", "vllm"}
    for name in gpu_services(services):
        assert any("gpu" in caps for caps in reserved_capabilities(services[name])), name


def test_the_conductor_sees_the_gpus_for_the_free_check(services):
    # services.conductor.gpu runs nvidia-smi before a GPU phase; the toolkit only mounts it into
    # containers that request the GPUs with the utility capability.
    assert any(
        {"gpu", "utility"} <= set(caps) for caps in reserved_capabilities(services["conductor"])
    )


def test_cpu_services_reserve_no_gpu(services):
    for name in ("redis", "prep-worker"):
        assert reserved_capabilities(services[name]) == [], name


def test_no_service_publishes_redis(services):
    assert not services["redis"].get("ports"), "redis must not publish a port"
    assert services["redis"].get("network_mode") != "host"
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port["target"] != 6379 and str(port.get("published")) != "6379", name


def test_redis_has_password_persistence_and_healthcheck(services):
    redis = services["redis"]
    cmd = " ".join(redis["command"])
    assert "--requirepass" in cmd and "--appendonly yes" in cmd
    assert redis["environment"]["REDIS_PASSWORD"] == REDIS_PASSWORD
    assert redis["environment"].keys() == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
    assert mounts(redis)["/data"]["type"] == "volume"
    assert redis["healthcheck"]["test"]
    assert redis.get("restart") == "unless-stopped"


def test_redis_runs_as_its_own_user_without_dangerous_commands(services):
    redis = services["redis"]
    # `sh -c` bypasses the image's switch to the redis user, so compose sets it.
    assert redis.get("user") == "redis"
    cmd = redis["command"][-1]
    for command in ("CONFIG", "DEBUG", "MODULE"):
        assert f"--rename-command {command} ''" in cmd


def test_secrets_reach_only_the_services_that_use_them(services):
    for secret, users in SECRET_USERS.items():
        have = {n for n in eyrie_services(services) if secret in services[n]["environment"]}
        assert have == users, secret
    assert services["vllm"]["environment"]["VLLM_API_KEY"] == VLLM_API_KEY
    assert "EYRIE_REDIS_URL" not in services["vllm"]["environment"]  # vLLM never needs Redis
    assert services["trainer"]["environment"].get("VLLM_API_KEY") is None


def test_missing_secrets_stop_compose_with_a_named_error():
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    r = subprocess.run(
        [str(compose_binary()), "-f", "docker-compose.yml", "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "set REDIS_PASSWORD in .env" in r.stderr
    assert "set VLLM_API_KEY in .env" in r.stderr


def test_workers_have_a_long_stop_grace_period(services):
    workers = worker_queues(services)
    assert set(workers) == {"prep-worker", "extractor", "trainer"}
    for name in workers:
        assert duration_s(services[name]["stop_grace_period"]) >= 60, name


def test_workers_serve_every_queue_with_the_right_worker_kind(services, redis_url):
    from rq import SimpleWorker

    from shared.queue import QUEUES, connect, make_worker

    workers = worker_queues(services)
    assert workers == {
        "prep-worker": ["prep", "regen", "bench"],
        "extractor": ["extract"],
        "trainer": ["train"],
    }
    assert sorted(q for qs in workers.values() for q in qs) == sorted(QUEUES)
    conn = connect(redis_url)
    for name, queues in workers.items():
        w = make_worker(queues, conn)  # raises ConfigError on a forking/non-forking mix
        assert isinstance(w, SimpleWorker) == (name != "prep-worker"), name


def test_prep_worker_scales(services):
    assert "container_name" not in services["prep-worker"]


def test_eyrie_services_wait_for_a_healthy_redis(services):
    for name in eyrie_services(services):
        dep = services[name]["depends_on"]["redis"]
        assert dep["condition"] == "service_healthy", name


def test_long_running_services_restart_and_have_healthchecks(services):
    for name in ("redis", "prep-worker", "extractor", "trainer", "vllm"):
        assert services[name]["restart"] == "unless-stopped", name
        assert services[name]["healthcheck"]["test"], name


def test_only_the_conductor_mounts_the_docker_socket(services):
    holders = {
        name
        for name, svc in services.items()
        if any("docker.sock" in (v.get("source") or "") for v in svc.get("volumes", []))
    }
    assert holders == {"conductor"}


def test_vllm_service(services):
    from shared.recipe import ServeConfig, resolve_recipe

    vllm = services["vllm"]
    assert vllm["ipc"] == "host"
    assert vllm["entrypoint"] == ["python3", "/opt/eyrie/vllm-serve.py"]
    env = vllm["environment"]
    assert env["VLLM_MODE"] == "standby" and env["VLLM_API_KEY"] == VLLM_API_KEY
    health = vllm["healthcheck"]
    assert any("/health" in part for part in health["test"])
    assert duration_s(health["start_period"]) >= 600
    # HF_HOME is the mount point of the shared HF cache volume.
    hf_mount = mounts(vllm)[env["HF_HOME"]]
    assert (hf_mount["type"], hf_mount["source"]) == ("volume", "hf-cache")
    # The image is pinned, and the same one recipes give the docker backend (serve.image).
    image = vllm["image"]
    assert image.startswith("vllm/vllm-openai:v") and not image.endswith(":latest")
    assert image == ServeConfig().image
    for recipe in ("llama-3.1-8b", "kimi-k2.5"):
        assert resolve_recipe(ROOT / "recipes" / f"{recipe}.yaml").serve.image == image


def test_vllm_runs_the_repository_entrypoint_and_code_read_only(services):
    vllm = services["vllm"]
    ms = mounts(vllm)
    src = vllm["environment"]["PYTHONPATH"]
    expected = {
        "/opt/eyrie/vllm-serve.py": ROOT / "images" / "vllm-serve.py",
        f"{src}/shared": ROOT / "shared",
        f"{src}/services": ROOT / "services",
        f"{src}/recipes": ROOT / "recipes",
    }
    for target, source in expected.items():
        assert (Path(ms[target]["source"]), ms[target].get("read_only")) == (source, True)
    # The recipe the service serves by default exists at that path.
    assert (ROOT / vllm["environment"]["EYRIE_RECIPE"]).is_file()


def test_vllm_publishes_the_recipe_ports_on_loopback(services):
    from shared.recipe import resolve_recipe

    serve = resolve_recipe(ROOT / "recipes" / "llama-3.1-8b.yaml").serve
    ports = {p["target"]: p for p in services["vllm"]["ports"]}
    assert set(ports) == {serve.port, serve.eagle3_port}
    assert {p["host_ip"] for p in ports.values()} == {"127.0.0.1"}


def test_vllm_mode_comes_from_the_environment():
    cfg = compose_config(VLLM_MODE="eagle3", EYRIE_SERVE_DRAFT="/data/runs/r/export/vllm")
    env = cfg["services"]["vllm"]["environment"]
    assert env["VLLM_MODE"] == "eagle3"
    assert env["EYRIE_SERVE_DRAFT"] == "/data/runs/r/export/vllm"


def test_gpu_count_is_configurable():
    cfg = compose_config(EYRIE_GPU_COUNT="2")
    for name in ("extractor", "trainer", "vllm"):
        devices = cfg["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["count"] == 2, name


def test_vllm_sees_the_runs_volume_where_the_workers_do(services):
    # An exported draft path written by the trainer must resolve the same inside vllm.
    data = services["trainer"]["environment"]["EYRIE_DATA"]
    for name in ("trainer", "extractor", "prep-worker", "conductor", "vllm"):
        assert services[name]["environment"]["EYRIE_DATA"] == data, name
        m = mounts(services[name])[data]
        assert (m["type"], m["source"]) == ("volume", "runs"), name


def test_every_env_var_the_code_reads_is_wired():
    read = env_vars_read_by_code()
    # The foundation reads these; if the grep stops finding them the test itself is broken.
    assert {"EYRIE_DATA", "EYRIE_CACHE", "EYRIE_REDIS_URL"} <= set(read)
    cfg = compose_config()
    missing = []
    for name in eyrie_services(cfg["services"]):
        env = cfg["services"][name]["environment"]
        missing += [
            f"{var} (read in {', '.join(sorted(set(read[var])))}) not set for {name}"
            for var in read
            if var not in env and var not in NOT_WIRED and name in SECRET_USERS.get(var, {name})
        ]
    assert not missing, (
        "wire these in docker-compose.yml (x-eyrie-env) or explain them in "
        "NOT_WIRED:\n" + "\n".join(missing)
    )


def test_eyrie_services_reach_redis_with_the_password(services):
    for name in eyrie_services(services):
        url = services[name]["environment"]["EYRIE_REDIS_URL"]
        assert url == f"redis://:{REDIS_PASSWORD}@redis:6379/0", name


def test_every_path_variable_is_a_shared_named_volume(services):
    read = env_vars_read_by_code()
    path_vars = set(PATH_VARS) | {v for v in read if re.search(r"_(DATA|CACHE|DIR|HOME)$", v)}
    sources: dict[str, set[str]] = {}
    for name in eyrie_services(services):
        env, ms = services[name]["environment"], mounts(services[name])
        for var in path_vars:
            assert var in env, f"{var} not set for {name}"
            m = ms.get(env[var])
            where = f"{var}={env[var]} in {name}"
            assert m is not None and m["type"] == "volume", f"{where}: not a named volume"
            sources.setdefault(var, set()).add(m["source"])
    # One volume per variable across services: the workers share runs/, caches and weights.
    assert {v: len(s) for v, s in sources.items()} == {v: 1 for v in path_vars}
    assert sources["EYRIE_DATA"] == {"runs"} and sources["HF_HOME"] == {"hf-cache"}


def test_gpu_image_is_the_one_the_gpu_workers_build(services):
    for name in ("extractor", "trainer"):
        assert services[name]["build"]["dockerfile"] == GPU_DOCKERFILE, name
        assert services[name]["ipc"] == "host", name


def test_env_example_documents_every_compose_variable():
    text = "\n".join((ROOT / f).read_text() for f in CPU_FILES)  # the GPU file + the CPU override
    used = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    used -= COMPOSE_BUILTINS
    documented = set(
        re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)=", (ROOT / ".env.example").read_text(), re.M)
    )
    assert used - documented == set(), "add these to .env.example"
    assert documented - used == set(), ".env.example names settings compose never reads"


def test_dot_env_with_the_secrets_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert r.returncode == 0, ".env must be in .gitignore: it holds REDIS_PASSWORD and keys"
    r = subprocess.run(["git", "check-ignore", "-q", ".env.example"], cwd=ROOT)
    assert r.returncode == 1  # the template stays tracked


# -- `docker compose up` does the job ------------------------------------------------------


def test_plain_up_runs_the_recipe_named_in_env():
    """No profile: `up` starts the conductor, which runs `eyrie up` on .env's EYRIE_RECIPE,
    and the vllm container the docker backend copies, in standby."""
    cfg = compose_config(EYRIE_RECIPE="recipes/smollm2-135m-cpu.yaml")
    services = cfg["services"]
    assert {"redis", "prep-worker", "extractor", "trainer", "conductor", "vllm"} <= set(services)
    assert [n for n, svc in services.items() if svc.get("profiles")] == []
    conductor = services["conductor"]
    assert conductor["command"] == ["eyrie", "up"]
    assert conductor["environment"]["EYRIE_RECIPE"] == "recipes/smollm2-135m-cpu.yaml"
    assert (ROOT / conductor["environment"]["EYRIE_RECIPE"]).is_file()
    assert conductor["restart"] == "no"  # exits after the report; a rerun resumes
    assert conductor["depends_on"]["vllm"]["condition"] == "service_started"
    assert services["vllm"]["environment"]["VLLM_MODE"] == "standby"


def test_vllm_runs_as_the_workers_uid(services):
    """What vLLM writes on the runs volume (extract mode's hidden states) is the workers'."""
    assert services["vllm"]["user"] == "10001:10001"
    for dockerfile in ("cpu", "gpu", "vllm-cpu"):
        text = (ROOT / "images" / f"{dockerfile}.Dockerfile").read_text()
        assert "USER 10001:10001" in text and "--uid 10001" in text, dockerfile


def test_worker_node_runs_only_workers_on_the_remote_redis_and_shared_runs():
    cfg = compose_config(
        files=("docker-compose.yml", "docker-compose.worker.yml"),
        EYRIE_REDIS_URL="redis://:pw@10.0.0.5:6379/0",
        EYRIE_SHARED_DATA="/mnt/eyrie-runs",
    )
    started = {n: svc for n, svc in cfg["services"].items() if not svc.get("profiles")}
    assert set(started) == {"prep-worker", "extractor", "trainer"}  # what a plain `up` starts
    assert {cfg["services"][n]["profiles"][0] for n in ("redis", "conductor", "vllm")} == {
        "main-node"
    }
    services = started
    for name, svc in services.items():
        assert svc["environment"]["EYRIE_REDIS_URL"] == "redis://:pw@10.0.0.5:6379/0", name
        assert not svc.get("depends_on"), name  # no local Redis to wait for
        assert mounts(svc)["/data"]["source"] == "runs", name
    runs = cfg["volumes"]["runs"]
    assert runs["driver_opts"] == {"type": "none", "o": "bind", "device": "/mnt/eyrie-runs"}
