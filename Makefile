# The README's two commands. Each sets up what it needs by itself: a virtual environment in
# .venv, the build requirements, lamina built in place (editable) with its extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.lamina-installed
SOURCES := $(wildcard pyx/*.pyx pyx/*.pxi pyx/*.h) setup.py pyproject.toml

.PHONY: demo test test-all bench build clean wheel-check grpc-stubs

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --timeout=600

test-all: $(STAMP)
	$(PY) -m pytest -q --timeout=1200

# The package as a user installs it, without this Makefile: a wheel built by pip in its isolated
# build environment, installed with its serve extra in a new virtual environment, smoke-tested
# from a folder outside the repository.
WHEELS := build/wheel-check
wheel-check:
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(PYTHON) -m pip wheel -q --no-deps -w $(WHEELS) .
	$(PYTHON) -m venv $(WHEELS)/venv
	$(WHEELS)/venv/bin/python -m pip install -q "$$(ls $(WHEELS)/lamina-*.whl)[serve]"
	cd $(WHEELS) && venv/bin/python $(CURDIR)/tests/smoke_installed.py $(CURDIR)/models

# The gRPC service's Python modules, generated from runtime/serve/grpc/inference.proto (committed;
# regenerate after editing the .proto)
grpc-stubs:
	$(PY) -m grpc_tools.protoc -I runtime/serve/grpc --python_out=runtime/serve/grpc \
		--grpc_python_out=runtime/serve/grpc runtime/serve/grpc/inference.proto
	sed -i 's/^import inference_pb2 as/from . import inference_pb2 as/' runtime/serve/grpc/inference_pb2_grpc.py

bench: $(STAMP)
	$(PIP) install -q --no-build-isolation -e ".[test,bench]"
	$(PY) -m bench --json bench/results/latest.json

build: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"

# Build requirements go into the venv and the build runs without isolation, so the rpaths that
# setup.py records point at the MKL and OpenBLAS this environment keeps.
$(STAMP): $(VENV)/bin/python $(SOURCES)
	$(PIP) install -q "setuptools>=77" wheel "Cython==3.3.1" "numpy>=2.0,<3" \
		"mkl-devel==2026.2.1; platform_machine == 'x86_64'" "scipy-openblas32==0.3.34.481.3"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

clean:
	rm -rf build *.egg-info runtime/*.so pyx/*.c
