# syntax=docker/dockerfile:1
# specfleet's one image: the router, the verifier, the drafter services and every Ray node
# (KubeRay, the Ray cluster launcher) run it; the entry point is `specfleet`.
#
#   docker build -t specfleet:0.1.0 .                              # GPU: CUDA runtime, CUDA torch
#   docker build --build-arg VARIANT=cpu -t specfleet:0.1.0-cpu .  # CPU only: a much smaller image
#   docker run --rm specfleet:0.1.0-cpu --help
#
# The tag is the package version (pyproject.toml); deploy/README.md says which manifest uses which.
# The demo models (models/demo) are inside, at /opt/specfleet/models/demo; real models come from a
# volume mounted at /models (deploy/README.md).

ARG VARIANT=gpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-gpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM ubuntu:24.04 AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# hadolint ignore=DL3006
FROM base-${VARIANT}

# Ubuntu's own Python (3.12) in a virtual environment; the distribution pins the package versions.
# tmux: `ray exec --tmux` (deploy/ray) runs the command in the container under it.
# g++: a CPU service builds its kernels (bfloat16 linear layers, attention, norms) for the node's own CPU on first
# use (specfleet/engine/cpu_kernels.py); without it, passes run on torch's kernels alone.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tmux g++ \
    && rm -rf /var/lib/apt/lists/*

# uid 1000 matches the usual first user of a VM, so host directories the Ray cluster launcher
# mounts into the container are readable; the base image's own uid-1000 user makes way.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 --shell /bin/bash specfleet

ENV VIRTUAL_ENV=/opt/specfleet/venv \
    PATH=/opt/specfleet/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/specfleet

# torch first, from the variant's index (the resolver would otherwise pick the default CUDA build),
# then the package's other dependencies, both in layers that source edits do not invalidate.
ARG TORCH_VERSION=2.13.0
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY specfleet ./specfleet
COPY router ./router
COPY verifier_service ./verifier_service
COPY drafter_service ./drafter_service
# The `cluster` extra is Ray's dashboard and job API, which KubeRay's probes and RayJob submit through.
# Editable, so that specfleet finds the demo models next to its source (`specfleet serve` with no config).
RUN pip install -e ".[cluster]" \
    && ln -s "$VIRTUAL_ENV/bin/specfleet" "$VIRTUAL_ENV/bin/ray" /usr/local/bin/

COPY models/demo ./models/demo

# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 1000:1000
# gRPC of the router, the verifier and a drafter service; the router's OpenAI-compatible HTTP API.
EXPOSE 50051 50061 50062 8000
ENTRYPOINT ["specfleet"]
CMD ["--help"]
