PY ?= .venv/bin/python
PROTOS := proto/vgpu/pb/deviceplugin_v1beta1.proto proto/vgpu/pb/podresources_v1.proto proto/vgpu/pb/dra_v1.proto proto/vgpu/pb/pluginregistration_v1.proto proto/vgpu/pb/drahealth_v1alpha1.proto

.PHONY: proto check lint type test hooks bench deploy constraints e2e e2e-local

# Regenerate the committed gRPC stubs under vgpu/pb/ (needs grpcio-tools).
proto:
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

hooks:
	$(MAKE) -C hooks

lint:
	$(PY) -m ruff check vgpu tests bench
	$(PY) -m ruff format --check vgpu tests bench

type:
	$(PY) -m mypy

check: lint type

test: hooks
	$(PY) -m pytest -q

bench:
	$(PY) -m bench

# Render deploy/ and charts/vgpu/values.schema.json from the chart (needs the
# test extra: helm-python-sdk). tests/deploy/test_chart.py fails when stale.
deploy:
	$(PY) deploy/render.py

# Pin the installed runtime closure into constraints.txt (the image's pip steps
# use it; tests/deploy/test_constraints.py checks it).
constraints:
	$(PY) tools/freeze_constraints.py

# The e2e suite on a real cluster (tests/e2e/README.md): not part of `make test`.
#   make e2e KUBECONFIG=~/.kube/config IMAGE=registry.example.com/vgpu:0.1.0 [PROFILE=...]
e2e:
	@test -n "$(KUBECONFIG)" || { echo "make e2e: set KUBECONFIG (and IMAGE)" >&2; exit 2; }
	VGPU_E2E_KUBECONFIG="$(KUBECONFIG)" VGPU_E2E_IMAGE="$(IMAGE)" VGPU_E2E_PROFILE="$(PROFILE)" \
		$(PY) -m pytest -n0 -v tests/e2e

# The same on ../shared/realk8s, image built and kit started and stopped (as root).
e2e-local:
	tools/e2e-local.sh
