#!/usr/bin/env python
"""The compiled kernels of git revisions side by side in one process: each revision's kernel
library is built from its own sources, then a bundled net's training step (bench_train.py's
solver step) runs on each library in turn, in alternating rounds, on this tree's Python.

On a noisy virtual machine the same code measured 15-25% apart in processes minutes apart;
alternating libraries every dozen steps inside one process is what told changes of a few
percent apart. The revisions' kernels must take the arguments this tree's Python passes (the
same `caffepar.nn.native.SIGNATURES`): the script says which differ and stops otherwise.
Prints each revision's fastest, 10th-percentile and median step and its ratio to the first.

    python scripts/ab_kernels.py REV [REV ...] [--net cifar10_quick] [--batch 100]
                                 [--rounds 10] [--steps 12]
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from revisions import extract  # noqa: E402

BUILD = ("import json; from caffepar.nn import native; "
         "k = native.kernels('float32'); "
         "print(json.dumps({'path': str(native.library_path()) if k else None, "
         "'signatures': native.SIGNATURES}))")


def build(tree):
    """(library path, its SIGNATURES) of the kernels built from `tree`'s sources."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True,
                         env=env, cwd=tree)
    if out.returncode:
        raise SystemExit(f"building the kernels of {tree.name} failed:\n{out.stderr.strip()}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["path"] is None:
        raise SystemExit(f"{tree.name}: no compiled kernels (is a C compiler installed?)")
    return got["path"], got["signatures"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revisions", nargs="+")
    ap.add_argument("--net", default="cifar10_quick")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per library and round")
    args = ap.parse_args()

    import bench_train
    from caffepar.nn import native

    libraries = {}
    for rev, tree in extract(args.revisions, prefix="caffepar-ab-").items():
        path, signatures = build(tree)
        differ = sorted(k for k in set(signatures) | set(native.SIGNATURES)
                        if signatures.get(k) != native.SIGNATURES.get(k))
        if differ:
            raise SystemExit(f"{rev}'s kernels take other arguments than this tree passes "
                             f"({', '.join(differ)}): compare revisions with the same "
                             f"SIGNATURES")
        funcs = native._bind(ctypes.CDLL(path))
        libraries[rev] = {dt: native.Kernels(funcs, s) for dt, s in native.SUFFIX.items()}

    step = bench_train.caffepar_step(args.net, args.batch)[0]
    mode = native.mode()
    load_start = os.getloadavg()[0]
    for lib in libraries.values():
        native._loaded[mode] = lib
        for _ in range(3):
            step()
    times = {rev: [] for rev in libraries}
    order = list(libraries)
    for round_ in range(args.rounds):
        for rev in order if round_ % 2 == 0 else order[::-1]:
            native._loaded[mode] = libraries[rev]
            step()
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times[rev].append(time.perf_counter() - start)
    print(f"{args.net} batch {args.batch}: training step (ms), {args.rounds} alternating rounds "
          f"of {args.steps} steps per revision; load average {load_start:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    first = None
    for rev, got in times.items():
        got.sort()
        fastest = got[0] * 1e3
        first = first or fastest
        print(f"  {rev:12s} fastest {fastest:7.2f}  p10 {got[len(got) // 10] * 1e3:7.2f}  "
              f"median {statistics.median(got) * 1e3:7.2f}  ratio {fastest / first:.3f}")


if __name__ == "__main__":
    main()
