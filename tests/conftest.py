import os
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
# Tests take the engines of the fixed rules (deterministic, no timing); tests of the measured
# choice set it themselves.
os.environ.setdefault("CAFFEPAR_CONV_ENGINES", "rules")
# On contended cores big GEMMs run in single-threaded parts, which round like one BLAS thread,
# not two: tests that compare runs exactly keep one way whatever else runs on the machine;
# tests of the contended way set it themselves.
os.environ.setdefault("CAFFEPAR_CONTENDED", "0")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CAFFE_REF = SHARED / "caffe_ref"
DATA = SHARED / "data"


def need_shared(path=SHARED):
    """Skip when the shared reference data (Caffe outputs, real models) is not beside the repo."""
    if not Path(path).exists():
        pytest.skip(f"reference data not available ({path.name} missing beside the repository)")
    return Path(path)


def pytest_addoption(parser):
    parser.addoption("--kernels", choices=("both", "native", "numpy"), default="both",
                     help="which kernel path the kernel_paths tests run on (default: both)")


CLUSTER_VAR = "CAFFEPAR_CLUSTER_TESTS"


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts Slurm or Open MPI on the network lab "
                            "(minutes); run with -m cluster or CAFFEPAR_CLUSTER_TESTS=1")


def pytest_collection_modifyitems(config, items):
    """The cluster group runs when asked for (-m cluster, or $CAFFEPAR_CLUSTER_TESTS=1):
    scripts/cluster_tests.sh installs what it needs and runs it."""
    if os.environ.get(CLUSTER_VAR) == "1" or "cluster" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the cluster group (Slurm, Open MPI on the lab, a few "
                            "minutes): scripts/cluster_tests.sh runs it")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """test_native_isa's compilations start now, in the background at the lowest priority:
    they take the core the tests leave idle most of the time, instead of the ~45 s the test
    would wait for them."""
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.endswith("test_native_isa") and \
                "objects" in item.fixturenames:
            module.start_builds()
            _started.append(module)
            break


_started = []       # the test modules whose background work ends with the session


def pytest_sessionfinish(session):
    for module in _started:
        module.stop_builds()


def pytest_generate_tests(metafunc):
    """Tests using the kernel_path fixture (whole modules through usefixtures) run on the
    compiled kernels and on the NumPy code."""
    if "kernel_path" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--kernels")
        paths = ["native", "numpy"] if chosen == "both" else [chosen]
        metafunc.parametrize("kernel_path", paths, indirect=True)


@pytest.fixture
def kernel_path(request):
    from caffepar.nn import native
    if request.param == "native":
        try:
            with native.use("native"):
                native.kernels("float32")
        except native.KernelBuildError as e:
            pytest.skip(f"compiled kernels unavailable: {e}")
    with native.use(request.param):
        yield request.param
