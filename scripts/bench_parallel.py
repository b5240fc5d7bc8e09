#!/usr/bin/env python
"""VGG-16 training iterations on P ranks: pure data parallel vs the paper's hybrid (fc6 and fc7
model parallel), at several batch sizes per rank. One BLAS thread per rank.

    python scripts/bench_parallel.py [--np 2] [--batches 1,2,4,8] [--iterations 2]

Prints, per batch size and mode: compute ms (forward, backward and update), comm ms (every
collective: the gradient allreduce, and the model-parallel layers' allgather / all-to-all /
reduce-scatter), the total per iteration, and the MB communicated.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import dummy_solver_param  # noqa: E402


def measure(comm, batch, mode, iterations):
    from caffepar.parallel.data_parallel import make_parallel_solver
    from caffepar.parallel.plan import Planner
    planner = Planner("data") if mode == "DATA" else Planner("hybrid", ("fc6", "fc7"), 2 ** 62)
    solver = make_parallel_solver(dummy_solver_param("vgg16", batch), comm, planner=planner)
    solver.step(1)
    comm.barrier()
    comm.stats.reset()
    t0 = time.perf_counter()
    solver.step(iterations)
    comm.barrier()
    total = (time.perf_counter() - t0) / iterations
    stats = comm.stats.take()
    comm_s = sum(v[0] for v in stats.values()) / iterations
    mb = sum(v[1] for v in stats.values()) / iterations / 2 ** 20
    # Every rank's view differs a little; report the slowest rank's.
    total = comm.allreduce_scalar(total) / comm.size
    comm_s = comm.allreduce_scalar(comm_s) / comm.size
    del solver
    return total * 1e3, comm_s * 1e3, mb


def run_ranks(args):
    from caffepar.parallel.comm import MpiComm
    comm = MpiComm()
    rows = []
    for batch in args.batches:
        for mode in ("DATA", "HYBRID"):
            total, comm_ms, mb = measure(comm, batch, mode, args.iterations)
            rows.append((batch, mode, total - comm_ms, comm_ms, total, mb))
            if comm.rank == 0:
                print(f"batch {batch} {mode}: {total:.0f} ms", file=sys.stderr, flush=True)
    if comm.rank == 0:
        print(f"\nVGG-16 training iteration on {comm.size} ranks, 1 BLAS thread per rank")
        print(f"{'batch/rank':>10} {'mode':<7}{'compute ms':>11}{'comm ms':>9}{'total ms':>10}"
              f"{'comm MB':>9}{'DATA/HYBRID':>13}")
        for i, (batch, mode, compute, comm_ms, total, mb) in enumerate(rows):
            ratio = f"{rows[i - 1][4] / total:.2f}x" if mode == "HYBRID" else ""
            comm_ratio = f" (comm {rows[i - 1][3] / comm_ms:.1f}x)" if mode == "HYBRID" else ""
            print(f"{batch:>10} {mode:<7}{compute:>11.0f}{comm_ms:>9.1f}{total:>10.0f}{mb:>9.1f}"
                  f"{ratio:>13}{comm_ratio}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--ranks-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ranks_run:
        run_ranks(args)
        return
    from caffepar.parallel.launch import find_mpiexec
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [find_mpiexec(), "-n", str(args.np), sys.executable, __file__, "--ranks-run",
           "--batches", ",".join(map(str, args.batches)), "--iterations", str(args.iterations)]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
