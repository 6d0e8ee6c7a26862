# syntax=docker/dockerfile:1
# The vgpu device-plugin image: the `vgpu` daemon and the libvgpu.so hook.
#
#   docker build -t <registry>/vgpu:0.1.0 .
#
# deploy/04-daemonset.yaml names ghcr.io/vgpu-project/vgpu:0.1.0, a placeholder:
# push the image to your own registry and change that line.
#
# Both stages use the same Debian release. The hook library runs in the tenants'
# containers, not here: hooks/glibc_floor.h keeps what it needs at GLIBC_2.17
# whatever glibc this stage has (tests/hooks/test_build.py checks the floor).
# Pin the base by digest (python:3.11-slim-bookworm@sha256:…) for reproducible
# releases.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src

# The C hook first: it changes less often than the Python code, so this layer
# stays cached across Python-only changes.
COPY hooks/ hooks/
RUN make -C hooks && test -f hooks/build/libvgpu.so

# The vgpu wheel and wheels of all its dependencies, so that the runtime stage
# installs from local files only.
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# -------------------------------------------------------------- runtime stage
FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vgpu" \
      org.opencontainers.image.description="Kubernetes device plugin that slices NVIDIA GPUs into fractional, enforced shares" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/vgpu-project/vgpu"

# No .pyc writes: the DaemonSet mounts the root file system read-only.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Install from the build stage's wheels through a bind mount: no compiler, no
# network, and the wheels do not end up in a layer of this image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels vgpu \
    && vgpu --version \
    && vgpu config default > /tmp/vgpu-default.yaml \
    && vgpu config check /tmp/vgpu-default.yaml \
    && rm /tmp/vgpu-default.yaml

# The path the ConfigMap's hook_library names (deploy/03-configmap.yaml).
COPY --from=build /src/hooks/build/libvgpu.so /usr/lib/vgpu/libvgpu.so

# Root on purpose: the daemon creates its sockets in the kubelet's root-owned
# /var/lib/kubelet/device-plugins and connects to the kubelet's root-only
# sockets. The DaemonSet drops every capability and keeps privileged off, so
# root here means "owner of those files", nothing more.
USER root

EXPOSE 9400
ENTRYPOINT ["vgpu", "serve"]
CMD ["--config", "/etc/vgpu/config.yaml"]
