#!/usr/bin/env python
"""The gradient communication options measured here: AlexNet and VGG-16, all layers data
parallel, at P=2 and P=4 ranks on this machine, plain / overlap / overlap+merge / top-k /
hierarchical.

    python scripts/bench_comm_opt.py [--nets alexnet,vgg16] [--np 2,4] [--rounds 2]
                                     [--iterations 3] [--fresh]

Each (net, P) is one mpiexec job (1 BLAS thread per rank, batch of the net's DummyData
prototxt per rank) that runs the options in alternating rounds: per round and option a fresh
solver, warm-up iterations (4 for the options whose buckets come from a 3-iteration profile,
else 1), then `--iterations` timed ones. Per option: iteration time, comm time (some bucket in
flight), exposed comm time (the solver waiting for gradients), top-k selection time, bytes.
The plain runs also record every layer's forward and backward time and the update's. A
finished (net, P) is kept in snapshots/comm_opt/ and skipped on a rerun (--fresh redoes it).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import dummy_solver_param  # noqa: E402

TOPK_RATIO = 0.01


def options_of(ranks):
    """option label -> CommOptions fields"""
    return {"plain": {},
            "overlap": {"overlap": True},
            "overlap+merge": {"merge": "auto"},
            "top-k": {"topk": TOPK_RATIO},
            "hierarchical": {"hierarchical": True, "ranks_per_node": max(1, ranks // 2)}}


class LayerClock:
    """Net observer: seconds of every layer's forward and backward."""

    def __init__(self, net):
        import numpy as np
        self.forward = np.zeros(len(net.layers))
        self.backward = np.zeros(len(net.layers))
        self.started = 0.0

    def layer_start(self, kind, i):
        self.started = time.perf_counter()

    def layer_end(self, kind, i):
        (self.forward if kind == "forward" else self.backward)[i] += \
            time.perf_counter() - self.started


def measure(comm, net_name, label, fields, iterations):
    from caffepar.parallel.data_parallel import make_parallel_solver
    from caffepar.parallel.gradsync import PROFILE_ITERATIONS, PROFILE_START
    from caffepar.parallel.options import CommOptions
    from caffepar.parallel.plan import Planner
    options = CommOptions().with_flags(**fields)
    solver = make_parallel_solver(dummy_solver_param(net_name, _batch(net_name)), comm,
                                  planner=Planner("data"), options=options)
    profiled = options.overlap and not options.bucket_mb
    solver.step(PROFILE_START + PROFILE_ITERATIONS if profiled else 1)
    clock = LayerClock(solver.net)
    solver.net.observers.insert(0, clock)
    update = solver.apply_update
    update_s = [0.0]

    def timed_update():
        t0 = time.perf_counter()
        update()
        update_s[0] += time.perf_counter() - t0

    solver.apply_update = timed_update
    solver.sync.take_totals()
    comm.barrier()
    t0 = time.perf_counter()
    solver.step(iterations)
    comm.barrier()
    seconds = (time.perf_counter() - t0) / iterations
    totals = solver.sync.take_totals()
    row = {"net": net_name, "np": comm.size, "option": label,
           "iteration_ms": seconds * 1e3, "comm_ms": totals["comm_s"] * 1e3,
           "exposed_ms": totals["exposed_s"] * 1e3, "sparsify_ms": totals["sparsify_s"] * 1e3,
           "bytes": totals["bytes"], "update_ms": update_s[0] * 1e3 / iterations,
           "buckets": [[u.layer for u in b.units] for b in getattr(solver.sync, "buckets", [])]}
    if label == "plain":
        row["layers"] = [l.name for l in solver.net.layers]
        row["forward_ms"] = list(clock.forward * 1e3 / iterations)
        row["backward_ms"] = list(clock.backward * 1e3 / iterations)
    # The slowest rank's iteration is the job's.
    row["iteration_ms"] = max(comm.gather_object(row["iteration_ms"]) or [row["iteration_ms"]])
    del solver
    return row


def _batch(net_name):
    from caffepar.proto.text import read_net_text
    net, _ = read_net_text(str(ROOT / f"models/{net_name}/train_val_dummy.prototxt"))
    return next(l.dummy_data_param.shape[0].dim[0] for l in net.layer if l.type == "DummyData")


def run_ranks(args):
    import gc
    from caffepar.parallel.comm import MpiComm
    comm = MpiComm()
    labels = [l for l in options_of(comm.size) if l in args.options]
    rows = []
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            row = measure(comm, args.net, label, options_of(comm.size)[label], args.iterations)
            row["round"] = r
            rows.append(row)
            gc.collect()
            if comm.rank == 0:
                print(f"{args.net} P={comm.size} round {r} {label}: "
                      f"{row['iteration_ms']:.0f} ms, comm {row['comm_ms']:.0f} ms, "
                      f"exposed {row['exposed_ms']:.0f} ms", file=sys.stderr, flush=True)
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"rows": rows, "load": os.getloadavg(),
                                              "when": time.strftime("%Y-%m-%d %H:%M")}))


def launch(net_name, ranks, args):
    from caffepar.parallel.launch import find_mpiexec
    out = args.work / f"{net_name}_p{ranks}.json"
    if out.exists() and not args.fresh:
        print(f"{net_name} P={ranks}: measured before ({out})", flush=True)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, __file__, "--ranks-run",
           "--net", net_name, "--out", str(out), "--rounds", str(args.rounds),
           "--iterations", str(args.iterations), "--options", ",".join(args.options)]
    status = subprocess.call(cmd, env=env)
    if status:
        sys.exit(f"{net_name} P={ranks}: the job exited with {status}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="alexnet,vgg16")
    ap.add_argument("--np", default="2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--options", default=",".join(options_of(2)),
                    type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument("--work", type=Path, default=ROOT / "snapshots/comm_opt")
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--ranks-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ranks_run:
        run_ranks(args)
        return
    for net_name in args.nets.split(","):
        for ranks in (int(p) for p in args.np.split(",")):
            launch(net_name, ranks, args)


if __name__ == "__main__":
    main()
