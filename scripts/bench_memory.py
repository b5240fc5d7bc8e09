#!/usr/bin/env python
"""Peak memory training a bundled net against its floor: a few SGD iterations (momentum) and a
snapshot, in a fresh process each, and the floor -- parameters, their diffs, the momentum
history, every blob's data and diff (`caffepar.timing.memory_floor`). Two runs: the
convolution engines measured afresh at the first iteration (an empty engine cache: the first
run on a machine), and read from the cache that run filled.

    python scripts/bench_memory.py [--net vgg16] [--batch 4] [--iterations 3]
                                   [--out results/memory_vgg16]
"""
import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def child(net_name, batch, iterations, folder):
    """In a fresh process: train, snapshot, print the figures as JSON."""
    from caffepar.timing import largest_blobs, memory_floor, peak_rss
    start = peak_rss()
    from bench_train import dummy_solver_param
    from caffepar.solvers import get_solver
    param = dummy_solver_param(net_name, batch)
    param.snapshot_prefix = os.path.join(folder, "snap")
    solver = get_solver(param)
    t0 = time.perf_counter()
    solver.step(iterations)
    steps = time.perf_counter() - t0
    after_steps = peak_rss()
    solver.snapshot()
    print(json.dumps({"start": start, "after_steps": after_steps, "peak": peak_rss(),
                      "floor": memory_floor(solver.net, solver.rule.num_history),
                      "largest": largest_blobs(solver.net, 5), "seconds": steps}))


def run(args, cache, folder):
    env = dict(os.environ, CAFFEPAR_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, __file__, "--child", "--net", args.net, "--batch",
                           str(args.batch), "--iterations", str(args.iterations),
                           "--folder", folder], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"training failed: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="vgg16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--out", default=None, help="OUT.md/.csv/.png (default: results/"
                                                "memory_<net>)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.net, args.batch, args.iterations, args.folder)
    from cpuinfo import cpu_name
    mb = 2 ** 20
    started = time.strftime("%Y-%m-%d %H:%M")
    cache = tempfile.mkdtemp(prefix="caffepar-memory-")
    # The compiled kernels come from the usual cache: building them is not what is measured.
    from caffepar.nn import native
    shutil.copy(native.library_path(), cache) if native.kernels("float32") else None
    rows = []
    try:
        for case in ("engines measured", "engines cached"):
            with tempfile.TemporaryDirectory() as folder:
                found = run(args, cache, folder)
            floor = sum(found["floor"].values())
            rows.append({"case": case, "floor_mb": floor / mb, "peak_mb": found["peak"] / mb,
                         "ratio": found["peak"] / floor, "before_net_mb": found["start"] / mb,
                         "steps_peak_mb": found["after_steps"] / mb,
                         "parts": {k: v / mb for k, v in found["floor"].items()},
                         "largest": found["largest"]})
            print(f"{case}: floor {floor / mb:.0f} MB, peak {found['peak'] / mb:.0f} MB "
                  f"({found['peak'] / floor:.2f}x; {found['after_steps'] / mb:.0f} MB before "
                  f"the snapshot, {found['start'] / mb:.0f} MB before the net)", flush=True)
    finally:
        shutil.rmtree(cache, True)
    out = Path(args.out) if args.out else ROOT / f"results/memory_{args.net}"
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "floor_mb", "peak_mb", "peak_over_floor", "before_snapshot_mb",
                    "before_net_mb"])
        for r in rows:
            w.writerow([r["case"], f"{r['floor_mb']:.1f}", f"{r['peak_mb']:.1f}",
                        f"{r['ratio']:.3f}", f"{r['steps_peak_mb']:.1f}",
                        f"{r['before_net_mb']:.1f}"])
    parts = rows[0]["parts"]
    lines = [f"# Peak memory training {args.net} at batch {args.batch}", "",
             f"Written by `python scripts/bench_memory.py` ({started}). CPU: {cpu_name()}. "
             f"{args.iterations} SGD iterations (momentum 0.9) on models/{args.net}/"
             f"train_val_dummy.prototxt, then a snapshot (weights and solver state), in a fresh "
             f"process; peak = the process's peak resident set (VmHWM), everything included "
             f"(Python, NumPy, BLAS, work arrays).", "",
             "Floor: " + ", ".join(f"{k} {v:.0f} MB" for k, v in parts.items() if v) +
             f" = **{rows[0]['floor_mb']:.0f} MB**.", "",
             "| run | floor MB | peak MB | peak / floor | peak before the snapshot MB | "
             "before the net MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['floor_mb']:.0f} | {r['peak_mb']:.0f} | "
                     f"**{r['ratio']:.2f}** | {r['steps_peak_mb']:.0f} | "
                     f"{r['before_net_mb']:.0f} |")
    lines += ["", "Largest arrays:", ""]
    lines += [f"- {size / mb:.1f} MB: {what}" for size, what in rows[0]["largest"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [r["case"] for r in rows]
    ax.bar(names, [r["peak_mb"] for r in rows], 0.5, label="measured peak")
    ax.axhline(rows[0]["floor_mb"], color="k", ls="--", lw=1, label="floor")
    ax.axhline(1.3 * rows[0]["floor_mb"], color="C3", ls=":", lw=1, label="1.3x floor")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
