PY ?= .venv/bin/python
PROTOS := proto/vgpu/pb/deviceplugin_v1beta1.proto proto/vgpu/pb/podresources_v1.proto proto/vgpu/pb/dra_v1.proto proto/vgpu/pb/pluginregistration_v1.proto proto/vgpu/pb/drahealth_v1alpha1.proto

.PHONY: proto check lint type test hooks bench deploy constraints

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
