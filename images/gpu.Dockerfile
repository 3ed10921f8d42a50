# Eyrie's GPU image: the extractor and trainer workers (queues extract, train). CUDA torch
# from PyPI (its Linux wheels bundle the CUDA runtime; the host's driver comes in through
# the NVIDIA container toolkit), Eyrie, and speculators 0.9.0. vLLM is not here: it runs in
# its official image (the compose `vllm` service). The compose CPU profile
# (docker-compose.cpu.yml) builds the same file with the CPU torch wheel in images/local/:
# pip prefers 2.13.0+cpu found there to PyPI's 2.13.0.
#
# Build args: BASE_IMAGE (a Debian bookworm image with python3 and python3-venv; default the
# official python image), TORCH_INDEX_URL. images/local/README.md: extra wheels and CA
# certificates.
ARG BASE_IMAGE=python:3.11.11-slim-bookworm

# --- dependencies, in a venv (Debian's python3 refuses system-wide pip installs) ----------
FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://pypi.org/simple
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
COPY images/constraints.txt images/requirements.py /opt/eyrie/
COPY pyproject.toml /tmp/eyrie/pyproject.toml
# torch 2.13.0, transformers 5.19.0: the versions speculators 0.9.0 accepts
# (torch<=2.14.1, transformers<=5.19.0). speculators and hs-connectors go in with --no-deps:
# their torchvision/torchaudio requirements would pull another torch, and speculators
# imports neither; the rest of their requirements are installed from their metadata.
RUN pip install --no-cache-dir --find-links /opt/eyrie/local --index-url "$TORCH_INDEX_URL" \
      -c /opt/eyrie/constraints.txt torch==2.13.0 \
 && python /opt/eyrie/requirements.py pyproject /tmp/eyrie/pyproject.toml > /tmp/eyrie/req.txt \
 && pip install --no-cache-dir -c /opt/eyrie/constraints.txt -r /tmp/eyrie/req.txt \
 && pip install --no-cache-dir --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
 && python /opt/eyrie/requirements.py dist speculators --drop torchvision torchaudio \
      hs-connectors > /tmp/eyrie/spec.txt \
 && pip install --no-cache-dir -c /opt/eyrie/constraints.txt -r /tmp/eyrie/spec.txt \
 && python -c "import speculators, torch, transformers; print(torch.__version__, transformers.__version__)"

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

RUN groupadd --gid 10001 eyrie \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin eyrie \
 && mkdir -p /app /data /cache /hf-cache /opt/eyrie \
 && chown eyrie:eyrie /app /data /cache /hf-cache
COPY images/compiler.sh /opt/eyrie/compiler.sh
RUN sh /opt/eyrie/compiler.sh install
WORKDIR /app
COPY --from=deps /opt/eyrie/ca-bundle.crt /opt/eyrie/constraints.txt /opt/eyrie/
COPY --from=deps /opt/venv /opt/venv

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY recipes ./recipes
COPY images/worker-health.py /opt/eyrie/worker-health.py
# The check (python -P: not from /app) imports the installed package: its package data (the
# MT-Bench questions of dedup and bench) must have been installed with it.
RUN pip install --no-cache-dir --no-deps -c /opt/eyrie/constraints.txt . \
 && eyrie --help > /dev/null \
 && python -P -c "import shared.mtbench as m; assert '/site-packages/' in m.__file__, m.__file__; assert len(m.mtbench_questions()) == 80"

RUN sh /opt/eyrie/compiler.sh check

USER 10001:10001
CMD ["eyrie", "--help"]
