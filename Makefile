# Everything runs from the project's own virtual environment in .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo time test proto bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

SAMPLE := data/cifar10_sample

## The main job on a bundled default: unpack the bundled CIFAR-10 sample (5000 train + 1000 test
## JPEGs), convert it to LMDB, compute its mean, train cifar10_quick for 500 iterations and test.
demo: $(STAMP) $(SAMPLE)/mean.binaryproto
	mkdir -p snapshots
	$(VENV)/bin/caffepar train --solver models/cifar10_quick/solver_sample.prototxt

$(SAMPLE)/mean.binaryproto: samples/cifar10/cifar10_sample.tar.xz | $(STAMP)
	rm -rf $(SAMPLE) && mkdir -p $(SAMPLE)
	$(PY) -c "import tarfile; tarfile.open('$<').extractall('$(SAMPLE)/images', filter='data')"
	$(VENV)/bin/caffepar data imageset $(SAMPLE)/images samples/cifar10/train.txt $(SAMPLE)/train_lmdb
	$(VENV)/bin/caffepar data imageset $(SAMPLE)/images samples/cifar10/test.txt $(SAMPLE)/test_lmdb
	$(VENV)/bin/caffepar data mean $(SAMPLE)/train_lmdb $@

## Time the bundled models' layers, as `caffe time`.
time: $(STAMP)
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
