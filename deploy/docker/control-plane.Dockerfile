# syntax=docker/dockerfile:1
# The control-plane image: etcd client, coordinator, node agent, metrics exporter, CLI.
# The core only (`gpupool-sdk[server]`): no torch, no Lightning, no CUDA wheels (NVML comes from
# the driver through the NVIDIA container runtime on GPU nodes).
#
#   docker build -f deploy/docker/control-plane.Dockerfile -t gpupool/control-plane:0.1.0 .
#
# Build context: the repository root. Not built in CI here (no Docker engine); the tests check
# that its COPY sources exist and that its pip line resolves to a set without torch
# (tests/deploy/test_systemd_and_docker.py).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

RUN useradd --system --uid 10001 --user-group --no-create-home gpupool

COPY pyproject.toml README.md LICENSE /src/
COPY gpupool_sdk /src/gpupool_sdk
RUN pip install "/src[server]" && rm -rf /src

USER 10001
EXPOSE 9400 9401
ENTRYPOINT ["gpupool"]
CMD ["--help"]
