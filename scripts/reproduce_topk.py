#!/usr/bin/env python
"""Top-k gradient sparsification with residuals (DLGS: Ju, Kang, Liu and Huo, 2024) against exact synchronous SGD:
cifar10_quick on all of CIFAR-10, P=2, 4000 iterations of Caffe's recipe (lr 0.001).

    python scripts/reproduce_topk.py [--configs exact,topk,topk_momentum] [--ratio 0.01]
                                     [--fresh]

All runs use the same initial weights (one random_seed), batch 50 per rank for training and
testing (global batch 100, as Caffe's recipe; test_iter 100 x 2 ranks x 50 images = the 10,000
test images), a test every 500 iterations. `exact` reduces the gradients with one allreduce per
iteration; `topk` runs `caffepar train --topk RATIO` (exact thresholds every 10 iterations,
reused in between); `topk_momentum` adds `--momentum-correction`. Bytes are what each rank
hands to MPI per iteration for the replicated (DATA) gradients, every layer of cifar10_quick
being data parallel: the gradient buffer for the allreduce, the rank's (index, value) pairs and
their count for top-k's allgathers (at P=2 also what each rank puts on the wire).

Resumable: a finished configuration (its result.json exists) is skipped; an unfinished one
resumes from its newest snapshot (one every 500 iterations). Work under snapshots/topk/<config>/.
Writes results/topk.csv, results/topk.md, results/topk.png. The data is prepared as
scripts/train_cifar10_full.py prepares it, when absent.
"""
import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from google.protobuf import text_format  # noqa: E402

from cpuinfo import cpu_name  # noqa: E402
from reproduce_table3 import curves_of, newest_snapshot, prepare_data  # noqa: E402

from caffepar.proto.text import read_net_text, read_solver_text  # noqa: E402

RANKS = 2
BATCH_PER_RANK = 50
MAX_ITER = 4000
SNAPSHOT_EVERY = 500
#: BVLC Caffe, same recipe and data, one process, after 4000 iterations.
CAFFE_ACCURACY_4000 = 0.6924


def configs(ratio):
    """name -> (caffepar train options, label)"""
    return {"exact": ([], "exact (one allreduce)"),
            "topk": (["--topk", f"{ratio:g}"], f"top-k {ratio:g} with residuals (DLGS)"),
            "topk_momentum": (["--topk", f"{ratio:g}", "--momentum-correction"],
                              f"top-k {ratio:g}, momentum correction")}


def write_config(run_dir, data_dir, seed):
    net, _ = read_net_text(str(ROOT / "models/cifar10_quick/train_val.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.batch_size = BATCH_PER_RANK
            split = "train" if layer.include[0].phase == 0 else "test"
            layer.data_param.source = str(data_dir / f"cifar10_{split}_lmdb")
            layer.transform_param.mean_file = str(data_dir / "mean.binaryproto")
    (run_dir / "train_val.prototxt").write_text(text_format.MessageToString(net))
    solver = read_solver_text(str(ROOT / "models/cifar10_quick/solver.prototxt"))
    solver.net = str(run_dir / "train_val.prototxt")
    solver.max_iter = MAX_ITER
    solver.snapshot = SNAPSHOT_EVERY
    solver.snapshot_prefix = str(run_dir / "cifar10_quick")
    solver.random_seed = seed
    (run_dir / "solver.prototxt").write_text(text_format.MessageToString(solver))


def bytes_per_iteration(run_dir):
    """Mean replicated-gradient bytes sent per iteration by rank 0, over every segment."""
    values = []
    for path in run_dir.glob("segment_*.csv"):
        with open(path, newline="") as f:
            values += [float(r["grad_bytes"]) for r in csv.DictReader(f) if r.get("grad_bytes")]
    return sum(values) / len(values) if values else None


def run_config(name, args):
    options, _label = configs(args.ratio)[name]
    run_dir = args.work / name
    result_file = run_dir / "result.json"
    if result_file.exists():
        print(f"{name}: done before ({result_file})", flush=True)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "solver.prototxt").exists():
        write_config(run_dir, args.data.resolve(), args.seed)
    n = len(list(run_dir.glob("segment_*.log")))
    cmd = [sys.executable, "-m", "caffepar.cli", "train", "--solver",
           str(run_dir / "solver.prototxt"), "--np", str(RANKS),
           "--log", str(run_dir / f"segment_{n}.log"),
           "--csv", str(run_dir / f"segment_{n}.csv")] + options
    resume = newest_snapshot(run_dir)
    if resume is not None:
        cmd += ["--snapshot", str(resume)]
    print(f"{name}: " + " ".join(cmd[2:]), flush=True)
    start = time.time()
    try:
        status = subprocess.call(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    finally:
        with open(run_dir / "wall_seconds.txt", "a") as f:
            f.write(f"{time.time() - start:.1f}\n")
    if status != 0:
        sys.exit(f"{name}: caffepar train exited with {status}; rerun to resume")
    test, train = curves_of(run_dir)
    final = test.get(MAX_ITER)
    if not final or "accuracy" not in final:
        sys.exit(f"{name}: no test output at iteration {MAX_ITER} in {run_dir}")
    wall = sum(float(x) for x in (run_dir / "wall_seconds.txt").read_text().split())
    result = {"config": name, "options": options, "final_test_accuracy": final["accuracy"],
              "final_test_loss": final.get("loss"), "wall_s": round(wall, 1),
              "grad_bytes_per_iter": bytes_per_iteration(run_dir),
              "load_at_end": os.getloadavg()[0],
              "test": {str(k): v for k, v in sorted(test.items())},
              "train_loss": {str(k): v for k, v in sorted(train.items())}}
    result_file.write_text(json.dumps(result, indent=1))
    print(f"{name}: test accuracy {final['accuracy']:.4f} after {MAX_ITER} iterations, "
          f"{wall / 60:.1f} min", flush=True)


def write_results(args):
    table = configs(args.ratio)
    results = {n: json.loads((args.work / n / "result.json").read_text())
               for n in table if (args.work / n / "result.json").exists()}
    if not results:
        return
    out = args.results
    out.mkdir(exist_ok=True)
    with open(out / "topk.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "iter", "test_accuracy", "test_loss", "grad_bytes_per_iter"])
        for name, r in results.items():
            for it, values in sorted(r["test"].items(), key=lambda kv: int(kv[0])):
                w.writerow([name, it, f"{values['accuracy']:.4f}", f"{values['loss']:.4f}",
                            f"{r['grad_bytes_per_iter']:.0f}"])
    _plot(results, table, out / "topk.png")
    _markdown(results, table, out / "topk.md", args)
    print(f"wrote {out / 'topk.csv'}, topk.md, topk.png")


def _plot(results, table, png):
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        its = sorted(int(k) for k in r["test"])
        ax.plot(its, [r["test"][str(i)]["accuracy"] for i in its], marker="o", markersize=3,
                label=f"{table[name][1]}: {r['final_test_accuracy']:.4f}")
    ax.axhline(CAFFE_ACCURACY_4000, color="grey", linestyle=":",
               label=f"BVLC Caffe at 4000: {CAFFE_ACCURACY_4000}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("test accuracy (10,000 images)")
    ax.set_title(f"cifar10_quick on CIFAR-10, P={RANKS}, batch {BATCH_PER_RANK} per rank")
    ax.set_ylim(0, 0.8)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _markdown(results, table, path, args):
    import platform
    lines = [
        "# Top-k sparsification with residuals on cifar10_quick",
        "",
        "Produced by `python scripts/reproduce_topk.py` (resumable; `--fresh` reruns). Caffe's",
        "recipe on all of CIFAR-10 for 4000 iterations at lr 0.001 (momentum 0.9, weight decay",
        f"0.004), P={RANKS} ranks with batch {BATCH_PER_RANK} each (global batch 100), the same "
        f"initial weights (random_seed {args.seed}) in every run. Top-k: per layer, gradient plus",
        "residual, values with |g| >= the layer's threshold sent as (index, value) pairs by",
        "allgather, the rest kept as the residual; exact thresholds (the k-th largest |g|,",
        "k = ceil(ratio x n)) every 10 iterations, reused in between.",
        "",
        "| run | test accuracy at 4000 | test loss | DATA-layer bytes per iteration per rank "
        "| wall |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {table[name][1]} | **{r['final_test_accuracy']:.4f}** | "
                     f"{r['final_test_loss']:.4f} | {r['grad_bytes_per_iter']:,.0f} | "
                     f"{r['wall_s'] / 60:.1f} min |")
    lines.append("")
    exact = results.get("exact")
    for name, r in results.items():
        if name == "exact" or exact is None:
            continue
        gap = 100 * (exact["final_test_accuracy"] - r["final_test_accuracy"])
        fewer = exact["grad_bytes_per_iter"] / r["grad_bytes_per_iter"]
        lines.append(f"- {table[name][1]}: ends {abs(gap):.2f} points "
                     f"{'below' if gap >= 0 else 'above'} the exact run (target: within 2), "
                     f"with {fewer:.1f}x fewer bytes for the DATA layers (target: >= 30x).")
    lines += [
        "- One run per configuration: late in training the test accuracy of one run moves by "
        "about a point from one test to the next, so differences of that size are noise.",
        f"- At ratio {args.ratio:g} a layer sends k of its n values as 8-byte pairs instead of "
        "4-byte values, so 50x fewer bytes when exactly k travel; thresholds reused between "
        "refreshes let somewhat more or fewer through.",
        "- Momentum correction (DGC, Lin et al. 2018; `--momentum-correction`): each rank's "
        "residual accumulates its momentum velocity (weight decay included) instead of its "
        "gradient, and the solver steps without its own momentum. Without it, a value held "
        "back for many iterations reaches the solver's momentum only when it is sent.",
    ]
    lines += [
        "- Bytes are what each rank hands to MPI per iteration for the replicated gradients:",
        "  the whole gradient for the allreduce; its own pairs and their count for top-k's",
        "  allgathers. With 2 ranks that is also what each rank puts on the wire.",
        f"- BVLC Caffe, same recipe and data, one process: {CAFFE_ACCURACY_4000} at 4000.",
        "- Wall time: both ranks share this machine's 2 cores, with other work running at the",
        "  same time (load average at the end of each run in result.json); it is here to plan",
        "  a rerun, not a speed result.",
        f"- Machine: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}.",
        "",
        "![test accuracy against iteration](topk.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="exact,topk,topk_momentum")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--data", type=Path, default=ROOT / "data/cifar10",
                    help="prepared CIFAR-10 (LMDBs + mean); made here when absent")
    ap.add_argument("--jpeg-dir", type=Path, default=ROOT.parent / "shared/data/cifar10_jpeg")
    ap.add_argument("--work", type=Path, default=ROOT / "snapshots/topk")
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--seed", type=int, default=1701)
    ap.add_argument("--fresh", action="store_true", help="forget earlier runs of these configs")
    ap.add_argument("--report-only", action="store_true",
                    help="only rewrite results/ from finished configurations")
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in configs(args.ratio)]
    if unknown:
        ap.error(f"unknown configuration(s): {', '.join(unknown)}")
    if not args.report_only:
        prepare_data(args.data, args.jpeg_dir)
        for name in names:
            if args.fresh:
                shutil.rmtree(args.work / name, ignore_errors=True)
            run_config(name, args)
    write_results(args)


if __name__ == "__main__":
    main()
