# Redis for the compose CPU profile (docker-compose.cpu.yml), where no registry serves the
# GPU node's redis:7.4.2-alpine: Debian bookworm's redis-server 7.0 and redis-cli, so the
# service's command (`sh -c "exec redis-server ..."`) and healthcheck run unchanged.
#
# Build arg: BASE_IMAGE (a Debian bookworm image; scripts/docker-engine makes
# eyrie-base:bookworm without a registry).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      redis-server=5:7.0.* redis-tools=5:7.0.* \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data \
 && chown redis:redis /data
WORKDIR /data
USER redis
CMD ["redis-server", "--dir", "/data"]
