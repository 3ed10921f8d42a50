# syntax=docker/dockerfile:1
# Eyrie's CPU image: prep workers (queues prep, regen, eval) and the conductor. Slim Python,
# no CUDA: torch comes from PyTorch's CPU index. Built by `docker compose build` from the
# repository root (context `.`; .dockerignore keeps .venv, data and caches out).
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EYRIE_DATA=/data \
    EYRIE_CACHE=/cache \
    HF_HOME=/hf-cache

# A fixed uid, so files on the shared volumes keep one owner across images.
RUN groupadd --gid 10001 eyrie \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin eyrie \
 && mkdir -p /app /data /cache /hf-cache /opt/eyrie \
 && chown eyrie:eyrie /app /data /cache /hf-cache
WORKDIR /app

# Dependencies first, in their own layer. Versions: images/constraints.txt (exact pins).
COPY images/constraints.txt images/requirements.py /opt/eyrie/
COPY pyproject.toml /tmp/eyrie/pyproject.toml
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && python /opt/eyrie/requirements.py pyproject /tmp/eyrie/pyproject.toml > /tmp/eyrie/req.txt \
 && pip install --no-cache-dir -c /opt/eyrie/constraints.txt -r /tmp/eyrie/req.txt \
 && rm -rf /tmp/eyrie

COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY recipes ./recipes
COPY images/worker-health.py /opt/eyrie/worker-health.py
RUN pip install --no-cache-dir --no-deps -c /opt/eyrie/constraints.txt . \
 && eyrie --help > /dev/null

USER 10001:10001
CMD ["eyrie", "--help"]
