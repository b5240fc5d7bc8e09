"""SSD training over 2 ranks equals one process at twice the batch: the augmented records follow
their stream position, BatchNorm's statistics and MultiBoxLoss's normalizer are the whole
batch's (every iteration's loss and the final weights)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from caffepar.parallel.launch import find_mpiexec
from caffepar.solvers import get_solver
from ssd_nets import ssd_solver_param, voc_folder
from test_parallel import HERE, assert_same_weights, run_mpi, weights

MPIEXEC = find_mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec installed")
ITERATIONS = 4


def test_ssd_p2_equals_one_process_at_twice_the_batch(tmp_path):
    voc_folder(tmp_path, train=8, test=2)
    proc = run_mpi(2, [HERE / "mpi" / "train_ssd.py", tmp_path, 2, ITERATIONS])
    assert proc.returncode == 0, proc.stderr[-3000:]
    solver = get_solver(ssd_solver_param(tmp_path, 4, ITERATIONS, tmp_path / "p1"))
    solver.solve()
    losses = [row["loss"] for row in solver.history_rows if "lr" in row]
    np.testing.assert_allclose(json.loads((tmp_path / "losses_p2.json").read_text()), losses,
                               rtol=1e-4, atol=1e-5)
    assert_same_weights(weights(tmp_path / f"p2_iter_{ITERATIONS}.caffemodel"),
                        weights(tmp_path / f"p1_iter_{ITERATIONS}.caffemodel"), "SSD P=2")
