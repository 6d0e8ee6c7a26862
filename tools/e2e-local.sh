#!/usr/bin/env bash
# tools/e2e-local.sh: the e2e suite (tests/e2e/test_cluster.py) on ../shared/realk8s, in one command.
#
#   sudo tools/e2e-local.sh [-- PYTEST_ARGS...]      # as root; about 5-10 minutes
#
# 1. unpacks the kit (../shared/realk8s/unpack.sh);
# 2. builds the image exactly as docs/install.md says (`buildah bud -t ghcr.io/vgpu-project/vgpu:0.1.0 .`)
#    on the kit's stand-in for python:3.11-slim-bookworm (made by image/make-python-base.sh when the
#    buildah storage lacks it), with this machine's CA bundle mounted for pip; and the kube-scheduler
#    image (image/build-kube-scheduler.sh) when it is not there yet;
# 3. `python -m tests.e2e.local`: the control plane (ServiceAccount tokens on), its controllers, a node
#    importing those images, the suite with tests/e2e/profiles/realk8s.yaml, and the teardown by PID,
#    also on failure or Ctrl-C (its signal handlers; this script execs it);
# 4. then one run each of `python -m tests.e2e.kit_restarts --scenario kubelet` and `containerd`
#    (the kubelet and containerd restarted during a burst of slice pods; RESTARTS=0 leaves them out).
#
# Env: OUT (results, default /tmp/vgpu-e2e-local/<time>), SKIP_BUILD=1 (reuse the image in the buildah
#      storage), CONTAINERS_STORAGE_CONF (buildah storage; default the kit's, $REALK8S_HOME/image),
#      REALK8S_KIT (default ../shared/realk8s). Needs .venv with the test extra (README.md).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${REALK8S_KIT:-$REPO/../shared/realk8s}"
KIT="$(cd "$KIT" && pwd)"
IMAGE=ghcr.io/vgpu-project/vgpu:0.1.0
OUT="${OUT:-/tmp/vgpu-e2e-local/$(date +%Y%m%d-%H%M%S)}"
log() { echo "[e2e-local.sh $(date +%T)] $*" >&2; }
T0=$SECONDS
[ "$(id -u)" = 0 ] || { echo "e2e-local.sh: run as root (the kit needs it)" >&2; exit 2; }
[ -x "$REPO/.venv/bin/python" ] || { echo "e2e-local.sh: $REPO/.venv missing (README.md: pip install -e '.[test]')" >&2; exit 2; }
mkdir -p "$OUT/images"

REALK8S_HOME="$("$KIT/unpack.sh")"
export REALK8S_HOME
export W="${W:-$REALK8S_HOME/image}"
export CONTAINERS_STORAGE_CONF="${CONTAINERS_STORAGE_CONF:-$W/containers/storage.conf}"

if [ -z "$(buildah images -q python:3.11-slim-bookworm 2>/dev/null)" ]; then
  log "making the stand-in base image (image/make-python-base.sh)"
  "$KIT/image/make-python-base.sh" > "$OUT/base.log" 2>&1
fi
if [ "${SKIP_BUILD:-0}" != 1 ] || [ -z "$(buildah images -q "$IMAGE" 2>/dev/null)" ]; then
  log "building $IMAGE (buildah bud, as docs/install.md says)"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$OUT/pip.conf"
  old_id="$(buildah images -q --no-trunc "$IMAGE" 2>/dev/null | head -1 || true)"
  ( cd "$REPO" && buildah bud \
      -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
      -v "$OUT/pip.conf:/etc/pip.conf:ro" \
      -t "$IMAGE" . ) > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log" >&2; exit 2; }
  log "built in $((SECONDS - T0)) s"
  # the image this build replaced (untagged now), and only that one
  new_id="$(buildah images -q --no-trunc "$IMAGE" | head -1)"
  if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then buildah rmi "$old_id" > /dev/null 2>&1 || true; fi
fi
buildah push -q "$(buildah images -q --no-trunc "$IMAGE" | head -1)" \
  "docker-archive:$OUT/images/vgpu.tar:$IMAGE"
if [ -z "$(buildah images -q registry.k8s.io/kube-scheduler:v1.36.2 2>/dev/null)" ] || [ ! -f "$W/kube-scheduler.tar" ]; then
  log "building the kube-scheduler image (image/build-kube-scheduler.sh)"
  "$KIT/image/build-kube-scheduler.sh" > "$OUT/kube-scheduler-image.log" 2>&1
fi
cp "$W/kube-scheduler.tar" "$OUT/images/"
cp "$REALK8S_HOME/images/busybox.tar" "$REALK8S_HOME/images/pause.tar" "$OUT/images/"
log "images ready in $((SECONDS - T0)) s: $(ls "$OUT/images" | tr '\n' ' ')"

cd "$REPO"
exec .venv/bin/python -m tests.e2e.local --images "$OUT/images" --image "$IMAGE" --out "$OUT" \
  --restarts "${RESTARTS:-1}" "$@"
