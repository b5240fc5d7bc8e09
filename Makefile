# Everything runs from the project's own virtual environment in .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo time test cluster-test proto bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## A second venv for the cluster tests: mpi4py built from source against the machine's Open MPI
## (Debian: apt-get install openmpi-bin libopenmpi-dev), caffepar's other dependencies, no mpich.
OMPI_VENV := .venv-openmpi
$(OMPI_VENV)/.installed: pyproject.toml | $(STAMP)
	test -x $(OMPI_VENV)/bin/python || $(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_VENV)/bin/python -m pip install --quiet --upgrade pip
	MPICC=mpicc $(OMPI_VENV)/bin/python -m pip install --quiet --no-cache-dir --no-binary mpi4py 'mpi4py>=4.0'
	$(PY) -c "import tomllib; print('\n'.join(d for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] if not d.startswith(('mpich', 'mpi4py'))))" > $(OMPI_VENV)/requirements.txt
	$(OMPI_VENV)/bin/python -m pip install --quiet -r $(OMPI_VENV)/requirements.txt pytest
	$(OMPI_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

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

## The cluster group (Slurm and Open MPI on the network lab; root): installs what it needs.
cluster-test:
	bash scripts/cluster_tests.sh

## Regenerate caffepar/proto/caffe_pb2.py from proto/caffe.proto.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=caffepar/proto proto/caffe.proto

bench: $(STAMP)
	$(PY) scripts/bench_layers.py

clean:
	rm -rf $(VENV) $(OMPI_VENV) build *.egg-info
