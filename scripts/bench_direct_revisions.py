#!/usr/bin/env python
"""The direct convolution engine of two or more git revisions side by side: forward, dx
(where the net needs it) and dw, each pass timed alone, at the convolution shapes of the bundled nets that
run on it, each revision in a process of its own (its own compiled kernels), in alternating
rounds, the fastest counting. Writes results/direct_revisions_<cpu>[_<isa>].{md,csv}.

    python scripts/bench_direct_revisions.py REV [REV ...] [--rounds 3] [--out PATH]

A kernel change is kept when it helps, or is neutral, for the kernels built for each
instruction set (run it again with CAFFEPAR_CFLAGS=-march=haswell for AVX2 code).
"""
import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from cpuinfo import build_isa, cpu_key, cpu_name, isa_suffix  # noqa: E402
from revisions import extract, time_passes  # noqa: E402
from tables import write_tables  # noqa: E402

# name: (channels in, input size, channels out, kernel, stride, pad, batch, dx needed)
SHAPES = {"cifar10_quick conv1": (3, 32, 32, 5, 1, 2, 100, False),
          "cifar10_quick conv2": (32, 16, 32, 5, 1, 2, 100, True),
          "cifar10_quick conv3": (32, 8, 64, 5, 1, 2, 100, True),
          "alexnet conv1": (3, 227, 96, 11, 4, 0, 16, False),
          "alexnet conv2 (one group)": (48, 27, 128, 5, 1, 2, 16, True),
          "vgg16 conv1_1": (3, 224, 64, 3, 1, 1, 4, False),
          "vgg16 conv3_1": (128, 56, 256, 3, 1, 1, 4, True)}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revisions", nargs="+")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed rounds (0: only build each revision's kernels)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    trees = extract(args.revisions)
    best = {rev: {} for rev in trees}
    vector_bytes = None
    for _ in range(args.rounds + 1):        # the first round builds the kernels, untimed
        for rev, tree in trees.items():
            vector_bytes, got = time_passes(tree, SHAPES)
            if _ == 0:
                continue
            for name, passes in got.items():
                times = (passes["forward"], passes.get("dx", 0.0), passes["dw"])
                old = best[rev].get(name, (float("inf"),) * len(times))
                best[rev][name] = tuple(map(min, old, times))
    if args.rounds == 0:
        return
    load_end = os.getloadavg()[0]
    isa = build_isa(vector_bytes)
    suffix = isa_suffix(isa)
    out = Path(args.out) if args.out else ROOT / f"results/direct_revisions_{cpu_key()}{suffix}"
    base = args.revisions[0]
    rows = []
    for name in SHAPES:
        for rev in args.revisions:
            f, dx, dw = best[rev][name]
            rows.append({"shape": name, "revision": rev, "forward_ms": f,
                         "dx_ms": dx if SHAPES[name][-1] else None, "dw_ms": dw,
                         "vs_first": sum(best[rev][name]) / sum(best[base][name])})
    lines = [f"# The direct convolution engine at {len(args.revisions)} revisions", "",
             f"Written by `python scripts/bench_direct_revisions.py {' '.join(args.revisions)}`"
             f" ({started}, {args.rounds} alternating rounds, fastest counts). CPU: "
             f"{cpu_name()}; kernels built for {isa}"
             + (f" (CAFFEPAR_CFLAGS={os.environ['CAFFEPAR_CFLAGS']})"
                if os.environ.get("CAFFEPAR_CFLAGS") else "")
             + f"; {os.environ.get('OPENBLAS_NUM_THREADS', os.cpu_count())} thread(s). Load "
             f"average (1 min) {load_start:.2f} at the start, {load_end:.2f} at the end.", "",
             "Forward, dx (where the net needs it) and dw, each pass timed alone, ms; ratio = "
             f"their sum against {base}'s.", "",
             "| shape | revision | forward ms | dx ms | dw ms | vs first |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['revision']} | {r['forward_ms']:.2f} | "
              + ("-" if r["dx_ms"] is None else f"{r['dx_ms']:.2f}")
              + f" | {r['dw_ms']:.2f} | {r['vs_first']:.2f} |" for r in rows]
    print("\n".join(lines))
    write_tables(out, lines, rows)


if __name__ == "__main__":
    main()
