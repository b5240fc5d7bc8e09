"""Hybrid parallelism, end to end under mpiexec (oversubscribing this machine's cores): P ranks at
batch M compute what one process at batch P*M computes — every iteration's loss and the weights
after 20 iterations — in DATA, HYBRID and a mixed per-layer annotation, including InnerProducts
whose output count P does not divide; snapshots move between P=2 and one process; a failing rank
ends the whole job."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from caffepar.io.weights import read_caffemodel
from caffepar.parallel.launch import find_mpiexec
from caffepar.solvers import get_solver

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "mpi"))
from nets import ITERATIONS, MODES, NETS, solver_param, write_data  # noqa: E402

M = 4
RTOL, ATOL = 1e-4, 1e-5
MPIEXEC = find_mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec installed")


def run_mpi(ranks, args, timeout=240):
    """mpiexec -n ranks python args..., one BLAS thread per rank; returns the finished process."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def weights(path):
    return {(name, i): v.reshape(shape) for name, _t, blobs in read_caffemodel(path).layers
            for i, (v, shape, _l) in enumerate(blobs)}


def assert_same_weights(got, want, what):
    assert got.keys() == want.keys(), what
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The P=2 and P=4 runs and their one-process references (batch P*M)."""
    folder = tmp_path_factory.mktemp("parallel")
    for name in NETS:
        write_data(folder, name)
    reference = {}
    for ranks in (2, 4):
        for name in NETS:
            prefix = folder / f"ref{ranks}_{name}"
            solver = get_solver(solver_param(folder, name, ranks * M, "data", prefix, snapshot=10))
            solver.solve()
            reference[(ranks, name)] = [r["loss"] for r in solver.history_rows if "lr" in r]
    parallel = {}
    for ranks in (2, 4):
        proc = run_mpi(ranks, [HERE / "mpi" / "train_modes.py", folder, M])
        assert proc.returncode == 0, proc.stderr[-3000:]
        parallel[ranks] = json.loads((folder / f"losses_p{ranks}.json").read_text())
    return folder, reference, parallel


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_p_ranks_equal_one_process(runs, ranks, name, mode):
    folder, reference, parallel = runs
    losses = parallel[ranks][f"{name}/{mode}"]
    assert len(losses) == ITERATIONS
    np.testing.assert_allclose(losses, reference[(ranks, name)], rtol=RTOL, atol=ATOL)
    assert_same_weights(weights(folder / f"p{ranks}_{name}_{mode}_iter_{ITERATIONS}.caffemodel"),
                        weights(folder / f"ref{ranks}_{name}_iter_{ITERATIONS}.caffemodel"),
                        f"{name} {mode} P={ranks}")


def test_p2_snapshot_resumes_in_one_process(runs):
    folder = runs[0]
    for name in NETS:
        prefix = folder / f"one_from_p2_{name}"
        solver = get_solver(solver_param(folder, name, 2 * M, "hybrid", prefix))
        solver.solve(resume_file=str(folder / f"p2_{name}_hybrid_iter_10.solverstate"))
        assert_same_weights(weights(f"{prefix}_iter_{ITERATIONS}.caffemodel"),
                            weights(folder / f"p2_{name}_hybrid_iter_{ITERATIONS}.caffemodel"),
                            f"{name}: P=2 snapshot resumed in one process")


def test_one_process_snapshot_resumes_at_p2(runs):
    folder = runs[0]
    specs = [f"{name}:hybrid:{folder / f'ref2_{name}_iter_10.solverstate'}" for name in NETS]
    proc = run_mpi(2, [HERE / "mpi" / "train_modes.py", folder, M] + specs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in NETS:
        assert_same_weights(
            weights(folder / f"p2_{name}_hybrid_resumed_iter_{ITERATIONS}.caffemodel"),
            weights(folder / f"ref2_{name}_iter_{ITERATIONS}.caffemodel"),
            f"{name}: one-process snapshot resumed at P=2")


FAILING_LAYER = '''
import os
import caffe


class FailOnRankOne(caffe.Layer):
    def setup(self, bottom, top):
        rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        if rank == 1:
            raise RuntimeError("rank 1 cannot open its data shard")

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data
'''


def test_failing_rank_ends_the_job_with_its_error(tmp_path):
    (tmp_path / "failing.py").write_text(FAILING_LAYER)
    (tmp_path / "net.prototxt").write_text("""
      layer { name: "data" type: "DummyData" top: "x" top: "label"
              dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
      layer { name: "fail" type: "Python" bottom: "x" top: "y"
              python_param { module: "failing" layer: "FailOnRankOne" } }
      layer { name: "ip" type: "InnerProduct" bottom: "y" top: "ip"
              inner_product_param { num_output: 2 } }
      layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """)
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.1\nmax_iter: 1000\n'
        f'snapshot_prefix: "{tmp_path / "snap"}"\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                           str(tmp_path / "solver.prototxt"), "--np", "2"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "rank 1 cannot open its data shard" in proc.stderr
    assert time.perf_counter() - t0 < 30


def test_tcp_transport_runs_a_job_and_unknown_transport_is_one_line(tmp_path):
    """CAFFEPAR_TRANSPORT=tcp puts the ranks on MPI's network path (loopback)."""
    from caffepar.parallel.launch import transport_environment
    assert transport_environment("shm") == {}
    assert transport_environment("tcp")["MPIR_CVAR_NOLOCAL"] == "1"
    model = Path(__file__).resolve().parents[1] / "models/cifar10_quick/train_val_dummy.prototxt"
    command = [sys.executable, "-m", "caffepar.cli", "time", "--model", str(model), "--np", "2",
               "--iterations", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, CAFFEPAR_TRANSPORT="tcp"))
    assert proc.returncode == 0, proc.stderr
    assert "Average Forward-Backward" in proc.stdout + proc.stderr
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=dict(os.environ, CAFFEPAR_TRANSPORT="udp"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "caffepar: error: unknown transport 'udp': expected one of shm, tcp"]
