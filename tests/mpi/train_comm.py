"""Run under mpiexec: train the nets of nets.py with each gradient communication option of
COMM_CONFIGS at batch M per rank; rank 0 keeps each run's final snapshot in FOLDER and writes
comm_p{P}.json (bytes sent per iteration, and, for top-k, the largest difference between the
reduced gradient and a NumPy top-k of every rank's gradient, and the bytes sent over those of
exactly k pairs per layer). At P=2 also the top-k runs
whose snapshots are resumed (binary and HDF5)."""
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nets import NETS, solver_param  # noqa: E402
from train_modes import planner  # noqa: E402

from caffepar.parallel.comm import MpiComm  # noqa: E402
from caffepar.parallel.data_parallel import make_parallel_solver  # noqa: E402
from caffepar.parallel.options import CommOptions  # noqa: E402
from caffepar.proto import caffe_pb2  # noqa: E402

ITERATIONS = 4
RESUME_AT = 2
NET_MODES = {"cifar10_quick": "data", "alexnet_small": "mixed"}


def comm_configs(ranks):
    return {
        "plain": {},
        "overlap": {"overlap": True},
        "buckets": {"bucket_mb": 0.1},
        "overlap_buckets": {"overlap": True, "bucket_mb": 0.1},
        "hierarchical": {"hierarchical": True},
        "hierarchical_nodes": {"hierarchical": True, "ranks_per_node": ranks // 2,
                               "overlap": True},
        "topk_dense": {"topk": 1.0, "topk_refresh": 1, "overlap": True},
        "merge": {"merge": "auto"},
    }


#: label -> (options, reference label): top-k at ratio 1 with momentum correction sends every
#: value and clears its momentum every iteration, so it is SGD without momentum (on a net all
#: of whose layers are data parallel: model-parallel ones keep the solver's momentum).
NO_MOMENTUM = {"topk_dense_momentum": ({"topk": 1.0, "topk_refresh": 1,
                                        "momentum_correction": True}, "plain_no_momentum")}


TOPK = {"topk": 0.05, "topk_refresh": 3, "overlap": True}
#: label -> (options, snapshot format) of the top-k runs whose snapshots are resumed at P=2
RESUMED = {"topk": (TOPK, caffe_pb2.SolverParameter.BINARYPROTO),
           "topk_h5": (TOPK, caffe_pb2.SolverParameter.HDF5),
           "topk_momentum": (dict(TOPK, momentum_correction=True),
                             caffe_pb2.SolverParameter.BINARYPROTO)}


def param_for(folder, name, batch, prefix, snapshot=0, snapshot_format=None):
    mode = NET_MODES[name]
    param = solver_param(folder, name, batch, mode, prefix, snapshot=snapshot,
                         max_iter=ITERATIONS)
    if snapshot_format is not None:
        param.snapshot_format = snapshot_format
    return param, planner(mode)


def train(comm, folder, name, batch, label, options, resume=None, momentum=None, iter_size=1,
          **kw):
    prefix = folder / f"p{comm.size}_{name}_{label}"
    param, plan = param_for(folder, name, batch, prefix, **kw)
    if momentum is not None:
        param.momentum = momentum
    param.iter_size = iter_size
    solver = make_parallel_solver(param, comm, planner=plan, options=CommOptions(**options))
    solver.solve(resume_file=resume)
    totals = solver.sync.take_totals()
    return solver, totals


def reference_topk(acc, units, ratio):
    """NumPy top-k of one rank's accumulated gradient: the k largest |values| of every unit."""
    out = np.zeros_like(acc)
    for u in units:
        part = acc[u.lo:u.hi]
        k = max(1, math.ceil(ratio * part.size))
        keep = np.argsort(-np.abs(part), kind="stable")[:k]
        out[u.lo + keep] = part[keep]
    return out


def check_topk(comm, folder, name, batch):
    """Largest relative difference between top-k's reduced gradient and the sum over ranks
    of a NumPy top-k of every rank's gradient plus residual (thresholds exact every time), and
    the bytes sent over those of k pairs per layer."""
    prefix = folder / f"p{comm.size}_{name}_topk_check"
    param, plan = param_for(folder, name, batch, prefix)
    ratio = 0.05
    solver = make_parallel_solver(param, comm, planner=plan,
                                  options=CommOptions(topk=ratio, topk_refresh=1))
    sync = solver.sync
    finish = sync.finish
    worst = [0.0]

    def checked_finish():
        acc = sync.grad + sync.topk.residual
        finish()
        every = comm.comm.allgather(reference_topk(acc, sync.units, ratio))
        want = np.sum(every, axis=0, dtype=np.float64)
        scale = max(np.abs(want).max(), 1e-30)
        worst[0] = max(worst[0], float(np.abs(sync.grad - want).max() / scale))

    sync.finish = checked_finish
    solver.solve()
    pairs = sum(max(1, math.ceil(ratio * u.count)) for u in sync.units)
    expected = pairs * (4 + sync.grad.itemsize) + 8 * len(sync.buckets)
    return worst[0], sync.take_totals()["bytes"] / expected


def main():
    folder, batch = Path(sys.argv[1]), int(sys.argv[2])
    comm = MpiComm()
    summary = {"bytes": {}}
    for name in NETS:
        for label, options in comm_configs(comm.size).items():
            _solver, totals = train(comm, folder, name, batch, label, options)
            summary["bytes"][f"{name}/{label}"] = totals["bytes"]
        # Gradients accumulated over iter_size passes: buckets start in the last one only.
        train(comm, folder, name, batch, "iter_size_plain", {}, iter_size=2)
        train(comm, folder, name, batch, "iter_size_overlap", {"overlap": True,
                                                                "bucket_mb": 0.1}, iter_size=2)
        for label, (options, reference) in NO_MOMENTUM.items():
            if NET_MODES[name] == "data":
                train(comm, folder, name, batch, label, options)
                train(comm, folder, name, batch, reference, {}, momentum=0.0)
        _solver, totals = train(comm, folder, name, batch, "topk", TOPK, snapshot=RESUME_AT)
        summary["bytes"][f"{name}/topk"] = totals["bytes"]
        summary[f"{name}/topk_check"], summary[f"{name}/topk_bytes"] = \
            check_topk(comm, folder, name, batch)
    if comm.size == 2:
        for name in NETS:
            for label, (options, fmt) in RESUMED.items():
                if label != "topk":
                    train(comm, folder, name, batch, label, options, snapshot=RESUME_AT,
                          snapshot_format=fmt)
                ext = ".solverstate.h5" if fmt == caffe_pb2.SolverParameter.HDF5 \
                    else ".solverstate"
                state = folder / f"p2_{name}_{label}_iter_{RESUME_AT}{ext}"
                train(comm, folder, name, batch, f"{label}_resumed", options,
                      resume=str(state), snapshot_format=fmt)
    if comm.rank == 0:
        (folder / f"comm_p{comm.size}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
