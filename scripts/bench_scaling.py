#!/usr/bin/env python
"""What a second thread (or more) gives cifar10_quick's training: each pass of the direct
convolution engine at conv1-3 (forward, dx where the net needs it, dw, timed alone by
direct_passes.py) and the whole training step (bench_train.py's solver
step), on 1 thread and on N, at one or more git revisions; each revision and thread count in a
process of its own, in alternating rounds, the fastest counting. Writes
results/scaling_<cpu>[_<isa>].{md,csv}.

    python scripts/bench_scaling.py [REV ...] [--threads 2] [--rounds 3] [--out PATH]

Ideal is the 1-thread time / N; lost = the N-thread time - ideal: the time threads spend
waiting (for the caller's serial work, for one another at the end of a pass, to be woken).
"""
import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from cpuinfo import build_isa, cpu_key, cpu_name, isa_suffix  # noqa: E402
from figures import pyplot  # noqa: E402
from revisions import extract, time_passes  # noqa: E402
from tables import write_tables  # noqa: E402

# name: (channels in, input size, channels out, kernel, stride, pad, batch, dx needed)
SHAPES = {"conv1": (3, 32, 32, 5, 1, 2, 100, False),
          "conv2": (32, 16, 32, 5, 1, 2, 100, True),
          "conv3": (32, 8, 64, 5, 1, 2, 100, True)}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revisions", nargs="*", default=["HEAD"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="the thread count compared with 1 (default: the cores)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    trees = extract(args.revisions, prefix="caffepar-scaling-")
    counts = (1, args.threads)
    best = {}
    vector_bytes = None
    for round_ in range(args.rounds + 1):       # the first round builds kernels and engines
        for rev, tree in trees.items():
            for threads in counts:
                vector_bytes, got = time_passes(tree, SHAPES, step=True, threads=threads)
                if round_ == 0:
                    continue
                step = {"training step": got.pop("training step")}
                for item, ms in [(f"{name} {p}", ms) for name, passes in got.items()
                                 for p, ms in passes.items()] + list(step.items()):
                    key = (rev, item, threads)
                    best[key] = min(best.get(key, float("inf")), ms)
    if args.rounds == 0:
        return
    load_end = os.getloadavg()[0]
    isa = build_isa(vector_bytes)
    suffix = isa_suffix(isa)
    out = Path(args.out) if args.out else ROOT / f"results/scaling_{cpu_key()}{suffix}"
    n = args.threads
    items = [item for (rev, item, threads) in best if rev == args.revisions[0] and threads == 1]
    rows = []
    for item in items:
        for rev in args.revisions:
            one, many = best[(rev, item, 1)], best[(rev, item, n)]
            rows.append({"item": item, "revision": rev, "threads": n, "ms_1": one, "ms_n": many,
                         "ideal_ms": one / n, "lost_ms": many - one / n,
                         "scaling": one / (n * many)})
    lines = [f"# cifar10_quick on 1 and {n} threads", "",
             f"Written by `python scripts/bench_scaling.py {' '.join(args.revisions)} --threads {n}"
             f" --rounds {args.rounds}{f' --out {args.out}' if args.out else ''}` ({started}, "
             f"alternating rounds, fastest counts). CPU: "
             f"{cpu_name()}; kernels built for {isa}"
             + (f" (CAFFEPAR_CFLAGS={os.environ['CAFFEPAR_CFLAGS']})"
                if os.environ.get("CAFFEPAR_CFLAGS") else "")
             + f". Load average (1 min) {load_start:.2f} at the start, {load_end:.2f} at the end.",
             "",
             "The direct engine's passes at cifar10_quick's convolutions (batch 100), each timed "
             "alone, and the training step (forward, backward, SGD update), ms. Ideal = the "
             f"1-thread time / {n}; lost = the {n}-thread time - ideal; scaling = ideal / the "
             f"{n}-thread time.", "",
             f"| item | revision | 1 thread | {n} threads | ideal | lost | scaling |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['item']} | {r['revision']} | {r['ms_1']:.2f} | {r['ms_n']:.2f} | "
              f"{r['ideal_ms']:.2f} | {r['lost_ms']:.2f} | {100 * r['scaling']:.1f}% |"
              for r in rows]
    print("\n".join(lines))
    write_tables(out, lines, rows)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(args.revisions)
    for k, rev in enumerate(args.revisions):
        ax.bar([i + k * width for i in range(len(items))],
               [r["lost_ms"] for r in rows if r["revision"] == rev], width, label=rev)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(items))], items, fontsize=7,
                  rotation=20)
    ax.set_ylabel(f"ms lost on {n} threads against 1-thread / {n}")
    ax.set_title(f"cifar10_quick, {cpu_key()} {isa}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
