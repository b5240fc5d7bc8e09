#!/usr/bin/env python
"""Where the wall time of `blas.run_parts` goes in a training step of a bundled net, per
layer pass, at git revisions side by side (alternating rounds, each revision's code and
kernels in a process of its own).

Every part is wrapped to note which thread ran it and when. Per call (medians over the
steps, in us): the wall; the idle (wall - the parts' busy time / 2 on 2 threads); the
caller's start (call to its first part); the worker's lag (the caller's first part to the
worker's); the end imbalance (between the two threads' last parts); the return (the last part
to the call's end). The sums over a step of these medians are printed per round.

    python scripts/run_parts_timeline.py [--net cifar10_quick] [--batch 100]
                                         [--revisions HEAD~1 HEAD] [--rounds 3] [--steps 40]
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("wall", "idle", "start", "lag", "imbalance", "return")


def measure(net, batch, steps):
    """{layer pass: [per-call tuples of FIELDS]} and the median step, in this process."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import caffepar  # noqa: F401  (before NumPy: OpenBLAS's idle threads then sleep)
    import bench_train
    from caffepar.nn import blas
    real = blas.run_parts
    calls = defaultdict(list)
    current = ["outside layers"]
    main = threading.get_ident()
    clock = time.perf_counter

    def run_parts(fn, parts, workers=None):
        ran = []

        def timed(part):
            start = clock()
            result = fn(part)
            ran.append((threading.get_ident() == main, start, clock()))
            return result

        t0 = clock()
        results = real(timed, parts, workers)
        t1 = clock()
        first = {m: min((a for mm, a, _ in ran if mm == m), default=t1) for m in (True, False)}
        last = {m: max((b for mm, _, b in ran if mm == m), default=t0) for m in (True, False)}
        busy = sum(b - a for _, a, b in ran)
        calls[current[0]].append((t1 - t0, t1 - t0 - busy / 2, first[True] - t0,
                                  first[False] - first[True], abs(last[True] - last[False]),
                                  t1 - max(last.values())))
        return results

    for module in list(sys.modules.values()):
        if getattr(module, "run_parts", None) is real and module is not blas:
            module.run_parts = run_parts
    step, _, solver, _, _ = bench_train.caffepar_step(net, batch)
    names = solver.net._layer_names

    class Observer:
        def layer_start(self, phase, i):
            current[0] = f"{names[i]} {phase}"

        def layer_end(self, phase, i):
            current[0] = "outside layers"

    for _ in range(5):
        step()
    solver.net.observers.append(Observer())
    calls.clear()
    walls = []
    for _ in range(steps):
        start = clock()
        step()
        walls.append(clock() - start)
    return calls, statistics.median(walls)


def report(calls, step, steps):
    sums = defaultdict(float)
    lines = [f"{'layer pass':18s}" + "".join(f"{f:>10s}" for f in FIELDS)]
    for key, rows in calls.items():
        medians = [statistics.median(r[i] for r in rows) * 1e6 for i in range(len(FIELDS))]
        for f, v in zip(FIELDS, medians):
            sums[f] += v * len(rows) / steps
        lines.append(f"{key:18s}" + "".join(f"{v:10.0f}" for v in medians))
    lines.append(f"step {step * 1e3:.2f} ms (median); per step, ms: "
                 + ", ".join(f"{f} {sums[f] / 1e3:.2f}" for f in FIELDS))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="cifar10_quick")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--revisions", nargs="*", default=[],
                    help="git revisions to time (default: this tree only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--here", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.here or not args.revisions:
        if not args.here:
            sys.path.insert(0, str(ROOT))       # this tree's code
        calls, step = measure(args.net, args.batch, args.steps)
        print(report(calls, step, args.steps))
        return
    from revisions import extract
    trees = extract(args.revisions)
    for r in range(args.rounds):
        for rev, tree in trees.items():
            out = subprocess.run([sys.executable, __file__, "--here", "--net", args.net,
                                  "--batch", str(args.batch), "--steps", str(args.steps)],
                                 capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(tree)))
            if out.returncode:
                raise SystemExit(f"{rev}: {out.stderr[-500:]}")
            print(f"round {r + 1} {rev}: {out.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
