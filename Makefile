# Everything runs from the project's own virtual environment in .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test proto bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## The main job on a bundled default: time cifar10_quick's layers, forward and backward.
demo: $(STAMP)
	$(VENV)/bin/caffepar time --model models/cifar10_quick/train_val_dummy.prototxt --iterations 10

## The whole test suite (gradient checks, Caffe goldens, real models, CLI, MPI).
test: $(STAMP)
	$(PY) -m pytest -q

## Regenerate caffepar/proto/caffe_pb2.py from proto/caffe.proto.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=caffepar/proto proto/caffe.proto

bench: $(STAMP)
	$(PY) scripts/bench_layers.py

clean:
	rm -rf $(VENV) build *.egg-info
