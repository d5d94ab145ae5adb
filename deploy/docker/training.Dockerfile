# syntax=docker/dockerfile:1
# A training base image: PyTorch with CUDA, plus gpupool-lightning (GpuPoolCallback) and
# gpupool-torch (PoolSession for a plain loop), which bring the core (gpupool-sdk).
# Training code goes in a FROM layer on top of this.
#
#   docker build -f deploy/docker/training.Dockerfile -t gpupool/training:0.1.0 .
#
# Build context: the repository root. Not built in CI here (no Docker engine, and the base is
# several GB); the tests check its COPY sources and the packages its pip line names.
ARG BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

COPY pyproject.toml README.md LICENSE /src/
COPY gpupool_sdk /src/gpupool_sdk
COPY integrations/torch /src/integrations/torch
COPY integrations/lightning /src/integrations/lightning
# The three distributions from this tree at once (gpupool-lightning pins the other two); torch
# comes from the base image and is kept as it is.
RUN pip install /src /src/integrations/torch /src/integrations/lightning && rm -rf /src

# Where the node agent's runtime directory is mounted (hostPath /run/gpupool on Kubernetes).
ENV GPUPOOL_RUNTIME_DIR=/run/gpupool
