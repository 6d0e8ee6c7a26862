# The vgpu image: the `vgpu` daemon, extender and webhook, and the libvgpu.so hook.
#
#   DOCKER_BUILDKIT=1 docker build -t <registry>/vgpu:0.1.0 .
#   docker buildx build -t <registry>/vgpu:0.1.0 .       # the same, with buildx
#   buildah bud -t <registry>/vgpu:0.1.0 .                # or podman build
#
# BuildKit (or buildah/podman) is required: the runtime stage uses
# `RUN --mount`, which the legacy builder (plain `docker build` of Docker
# before 23.0 without DOCKER_BUILDKIT=1) refuses. No `# syntax=` line: the
# builder's own Dockerfile frontend is used, so an offline or mirrored build
# fetches nothing from Docker Hub but the base image.
#
# The chart's image.repository (and deploy/) name ghcr.io/vgpu-project/vgpu, a
# placeholder: push the image to your own registry and set that value.
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

# The vgpu wheel and wheels of all its dependencies, at the exact versions of
# constraints.txt, so that the runtime stage installs from local files only.
# constraints.txt goes along in /wheels: the runtime stage then needs one bind
# mount, outside any directory it cleans.
COPY . .
RUN pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt . \
    && cp constraints.txt /wheels/constraints.txt

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
# network, and the wheels do not end up in a layer of this image. Then drop
# what only installing needs (pip, setuptools, wheel; the runtime never
# installs anything) and smoke-test the result without them: every third-party
# module the daemon loads, and `vgpu demo` (mock cards, the kubelet simulator
# and the real daemon over gRPC; about 5 s, no network), so that a broken
# dependency set fails the build instead of the first node. Dropping pip does
# not make the image smaller: pip lives in the base image's layer, and removing
# it here only adds whiteouts (BENCHMARKS.md, "Image size by dependency").
# Nothing this RUN removes may be a mount target of it (a bind mount cannot be
# removed: buildah and BuildKit stop with "Device or resource busy"), so the
# constraints come in /wheels, not in the /tmp that the last step empties
# (tests/deploy/test_dockerfile.py checks this).
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels -c /wheels/constraints.txt vgpu \
    && python -m pip uninstall --yes --no-cache-dir pip setuptools wheel \
    && rm -rf /root/.cache /usr/local/lib/python3.11/ensurepip \
    && python -c "import grpc, google.protobuf, kubernetes, pynvml, prometheus_client, yaml, psutil" \
    && vgpu --version \
    && vgpu config default > /tmp/vgpu-default.yaml \
    && vgpu config check /tmp/vgpu-default.yaml \
    && rm /tmp/vgpu-default.yaml \
    && vgpu demo \
    && rm -rf /tmp/* /root/.cache

# The path the ConfigMap's hook_library names (charts/vgpu, deploy/03-configmap.yaml).
COPY --from=build /src/hooks/build/libvgpu.so /usr/lib/vgpu/libvgpu.so

# Root on purpose: the daemon creates its sockets in the kubelet's root-owned
# /var/lib/kubelet/device-plugins and connects to the kubelet's root-only
# sockets. The DaemonSet drops every capability and keeps privileged off, so
# root here means "owner of those files", nothing more.
USER root

EXPOSE 9400
ENTRYPOINT ["vgpu", "serve"]
CMD ["--config", "/etc/vgpu/config.yaml"]
