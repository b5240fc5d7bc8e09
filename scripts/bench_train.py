#!/usr/bin/env python
"""caffepar's speed on the bundled nets against PyTorch and BVLC Caffe, measured side by side in
alternating rounds in one run, written under the CPU's name: results/cpu_speed_<vendor>_<family>
.{md,csv,png} (amd_zen4, intel_skylakex, ...), with _avx2 (or the build's instruction set) added
when the kernels are built for less than the host has (CAFFEPAR_CFLAGS=-march=haswell on an
AVX-512 host: the AVX2 result until a real AVX2 host is met).

    python scripts/bench_train.py [--nets cifar10_quick,alexnet,vgg16] [--rounds 3]
                                  [--caffe PATH/TO/caffe] [--out results/cpu_speed_<cpu>]

Per net, each round runs in turn:
- training iterations (forward + backward + SGD update) of caffepar and of the same
  architecture in PyTorch on the CPU with the same thread count (`pip install torch==2.13.0`),
  each side --repeat times and for --budget seconds at least;
- forward + backward as `caffepar time` runs it and, with --caffe, `caffe time` on the same
  prototxt (models/<net>/train_val_dummy.prototxt, Caffe in a subprocess, with the same
  OPENBLAS_* settings);
and the fastest of the rounds counts, so a noisy spell on a shared machine falls on every side.
Convolution engines are measured afresh at the start (unless --keep-engines).
Also: max pooling 3x3/2 on cifar10_quick's pool1 (100x32x32x32) forward + backward, the SGD
update alone, and the engine each convolution runs on. The machine's load average is recorded
with the figures: figures taken under load are marked as such.
"""
import argparse
import atexit
import csv
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402
from cpuinfo import build_isa, cpu_key, cpu_name, isa_suffix  # noqa: E402

NETS = {"cifar10_quick": 100, "alexnet": 16, "vgg16": 4}
TIME_ITERATIONS = {"cifar10_quick": 10, "alexnet": 3, "vgg16": 2}


def model_path(name):
    return ROOT / f"models/{name}/train_val_dummy.prototxt"


def dummy_solver_param(name, batch):
    """SGD on a bundled net's DummyData variant at `batch`, with constant input (no time spent
    drawing random data)."""
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import read_net_text
    net, _ = read_net_text(str(model_path(name)))
    for layer in net.layer:
        if layer.type == "DummyData":
            layer.dummy_data_param.data_filler[0].type = "constant"
            layer.dummy_data_param.data_filler[0].value = 0.5
            for shape in layer.dummy_data_param.shape:
                shape.dim[0] = batch
    param = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, weight_decay=0.0005,
                                      lr_policy="fixed", max_iter=10 ** 6, display=0,
                                      snapshot_after_train=False, random_seed=1,
                                      snapshot_prefix=os.path.join(tempfile.gettempdir(),
                                                                   "bench_train"))
    param.net_param.CopyFrom(net)
    return param


def iteration_flops(net):
    from bench_layers import layer_flops
    return sum(layer_flops(net, i) for i, l in enumerate(net.layers)
               if l.type in ("Convolution", "InnerProduct"))


def caffepar_step(name, batch):
    """One SGD iteration of the bundled net as a callable, its update alone (the solver's
    ApplyUpdate) as another, the solver, its GEMM FLOPs, and the seconds of the first
    iteration (which measures the convolution engines when they are not cached)."""
    from caffepar.solvers import get_solver
    solver = get_solver(dummy_solver_param(name, batch))
    start = time.perf_counter()
    solver.step(1)
    first = time.perf_counter() - start
    return ((lambda: solver.step(1)), solver.apply_update, solver, iteration_flops(solver.net),
            first)


def time_command(command, name, iterations):
    """`caffepar time` or `caffe time` (command: the program and its spelling of the flags) on
    the net's prototxt in a subprocess, as a callable returning its average forward-backward
    ms: the same prototxt, and each side in a process of its own."""
    def run():
        out = subprocess.run(command + ["time", "-model", str(model_path(name)),
                                        "-iterations", str(iterations)],
                             capture_output=True, text=True, cwd=ROOT)
        found = re.search(r"Average Forward-Backward: ([\d.]+) ms", out.stderr + out.stdout)
        if not found:
            raise SystemExit(f"{command[-1]} time failed on {name}: "
                             f"{(out.stderr or out.stdout)[-500:]}")
        return float(found.group(1))
    return run


def conv_engines(solver):
    net = solver.net
    return "; ".join(f"{net._layer_names[i]}:{layer.engine(net.blob_list[net.bottom_ids[i][0]].shape)}"
                    for i, layer in enumerate(net.layers) if layer.type == "Convolution")


def torch_model(name):
    import torch.nn as nn

    def conv(c, o, k, s=1, p=0, g=1):
        return nn.Conv2d(c, o, k, stride=s, padding=p, groups=g)

    if name == "cifar10_quick":
        return nn.Sequential(
            conv(3, 32, 5, p=2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(inplace=True),
            conv(32, 32, 5, p=2), nn.ReLU(inplace=True), nn.AvgPool2d(3, 2, ceil_mode=True),
            conv(32, 64, 5, p=2), nn.ReLU(inplace=True), nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.Linear(64, 10)), (3, 32, 32)
    if name == "alexnet":
        lrn = lambda: nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)  # noqa: E731
        return nn.Sequential(
            conv(3, 96, 11, s=4), nn.ReLU(inplace=True), lrn(), nn.MaxPool2d(3, 2, ceil_mode=True),
            conv(96, 256, 5, p=2, g=2), nn.ReLU(inplace=True), lrn(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            conv(256, 384, 3, p=1), nn.ReLU(inplace=True),
            conv(384, 384, 3, p=1, g=2), nn.ReLU(inplace=True),
            conv(384, 256, 3, p=1, g=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Flatten(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 1000)), (3, 227, 227)
    layers, c = [], 3
    for n, reps in [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]:
        for _ in range(reps):
            layers += [conv(c, n, 3, p=1), nn.ReLU(inplace=True)]
            c = n
        layers.append(nn.MaxPool2d(2, 2))
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
               nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(4096, 1000)]
    return nn.Sequential(*layers), (3, 224, 224)


def torch_step(name, batch, threads):
    import torch
    torch.set_num_threads(threads)
    model, shape = torch_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, weight_decay=0.0005)
    x = torch.full((batch,) + shape, 0.5)
    y = torch.zeros(batch, dtype=torch.long)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        opt.step()

    step()
    return step


def pool1_ms(rounds):
    """cifar10_quick pool1 (MAX 3x3/2 on 100x32x32x32) forward + backward, fastest of the
    rounds."""
    from bench_layers import best_time
    from caffepar.nn import pooling
    x = np.random.default_rng(0).standard_normal((100, 32, 32, 32), dtype=np.float32)
    g = pooling.PoolGeometry(3, 3, 0, 0, 2, 2)
    g.reshape(32, 32)
    y = np.empty((100, 32, g.oh, g.ow), np.float32)
    dy, dx = np.ones_like(y), np.empty_like(x)

    def step():
        pooling.max_pool_backward(g, pooling.max_pool_forward(g, x, y), dy, dx)

    step()
    return min(best_time(step, 10) for _ in range(rounds)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--repeat", type=int, default=3, help="runs per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per net")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="seconds of training steps per side and round at least (runs beyond "
                         "--repeat): a short step (cifar10_quick's 40 ms) gets a dozen samples "
                         "where host noise moves single runs by 15-25%%")
    ap.add_argument("--caffe", default=None, help="a BVLC Caffe `caffe` binary to compare with")
    ap.add_argument("--out", default=None,
                    help="write OUT.md, OUT.csv and OUT.png (default: results/cpu_speed_<cpu>; "
                         "empty: print only)")
    ap.add_argument("--fresh", action="store_true",
                    help="drop the rows of OUT.csv for nets not run now (by default they are "
                         "kept, so the nets can be measured one run each and the file resumed)")
    ap.add_argument("--keep-engines", action="store_true",
                    help="use the convolution engines measured earlier on this machine (by "
                         "default they are measured afresh, in a temporary cache)")
    args = ap.parse_args()
    if not args.keep_engines:
        os.environ["CAFFEPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="caffepar-bench-")
        atexit.register(shutil.rmtree, os.environ["CAFFEPAR_CACHE_DIR"], True)
    from bench_layers import fastest, sgemm_rate
    from caffepar.nn import native
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    rate = sgemm_rate()
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    k = native.kernels(np.float32)
    kernels = (f"compiled for {build_isa(k.vector_bytes)} ({k.vector_bytes}-byte vectors, "
               f"{k.registers} registers)" if k is not None else "NumPy")
    if args.out is None:
        suffix = isa_suffix(build_isa(k.vector_bytes) if k is not None else "numpy")
        args.out = str(ROOT / f"results/cpu_speed_{cpu_key()}{suffix}")
    print(f"{cpu_name()}; {threads} thread(s); SGEMM {rate:.1f} GFLOP/s; kernels: {kernels}; "
          f"PyTorch {'installed' if have_torch else 'not installed'}; "
          f"Caffe {args.caffe or 'not given'}; load average {load_start:.2f}")
    head = (f"{'net':<14}{'batch':>6}{'step ms':>9}{'PyTorch':>9}{'ratio':>7}"
            f"{'f+b ms':>9}{'Caffe':>9}{'ratio':>7}{'% SGEMM':>9}{'update':>8}")
    print("\n" + head)
    rows = []
    for name in args.nets.split(","):
        batch = NETS[name]
        ours_step, update, solver, flops, first = caffepar_step(name, batch)
        steps = [ours_step] + ([torch_step(name, batch, threads)] if have_torch else [])
        timers = [time_command([sys.executable, "-m", "caffepar.cli"], name,
                               TIME_ITERATIONS[name])]
        if args.caffe:
            timers.append(time_command([args.caffe], name, TIME_ITERATIONS[name]))
        step_s = [np.inf] * len(steps)
        fb_ms = [np.inf] * len(timers)
        for _ in range(args.rounds):        # alternating: every side in every round
            step_s = [min(a, b) for a, b in zip(step_s, fastest(steps, args.repeat, 1,
                                                                args.budget))]
            fb_ms = [min(a, t()) for a, t in zip(fb_ms, timers)]
        update_ms = fastest([update], args.repeat, args.rounds)[0] * 1e3
        row = {"net": name, "batch": batch, "caffepar_step_ms": step_s[0] * 1e3,
               "pytorch_step_ms": step_s[1] * 1e3 if have_torch else np.nan,
               "caffepar_fb_ms": fb_ms[0], "caffe_fb_ms": fb_ms[1] if args.caffe else np.nan,
               "sgemm_pct": 100 * flops / step_s[0] / 1e9 / rate, "update_ms": update_ms,
               "first_s": first, "engines": conv_engines(solver)}
        row["vs_pytorch"] = row["caffepar_step_ms"] / row["pytorch_step_ms"]
        row["vs_caffe"] = row["caffepar_fb_ms"] / row["caffe_fb_ms"]
        rows.append(row)
        print(f"{name:<14}{batch:>6}{row['caffepar_step_ms']:>9.1f}{row['pytorch_step_ms']:>9.1f}"
              f"{row['vs_pytorch']:>7.2f}{row['caffepar_fb_ms']:>9.1f}{row['caffe_fb_ms']:>9.1f}"
              f"{row['vs_caffe']:>7.2f}{row['sgemm_pct']:>8.0f}%{update_ms:>8.1f}", flush=True)
        print(f"{'':14}engines: {row['engines']} (first iteration {first:.1f} s)", flush=True)
        del ours_step, update, solver, steps        # one net's memory at a time
        gc.collect()
    pool = pool1_ms(args.rounds)
    load_end = os.getloadavg()[0]
    for row in rows:
        row.update(started=started, load=f"{load_start:.2f}-{load_end:.2f}", pool1_ms=pool,
                   caffe="yes" if args.caffe else "no")
    print(f"\ncifar10_quick pool1 (MAX 3x3/2, 100x32x32x32) forward + backward: {pool:.2f} ms")
    print(f"load average (1 min): {load_start:.2f} at the start, {load_end:.2f} at the end")
    if args.out:
        if not args.fresh:
            rows = kept_rows(Path(args.out), rows)
        write_results(Path(args.out), rows, pool, dict(
            cpu=f"{cpu_name()} [{cpu_key()}; {native.cpu_model()}]", threads=threads, sgemm=rate, kernels=kernels, started=started,
            load=(load_start, load_end), caffe=args.caffe, rounds=args.rounds,
            repeat=args.repeat, budget=args.budget,
            coretype=os.environ.get("OPENBLAS_CORETYPE", "(OpenBLAS's choice)"),
            builds=", ".join(f"{v}={os.environ[v]}" for v in ("CAFFEPAR_CFLAGS",
                                                             "ATEN_CPU_CAPABILITY",
                                                             "ONEDNN_MAX_CPU_ISA")
                             if os.environ.get(v))))


FIELDS = ["net", "batch", "caffepar_step_ms", "pytorch_step_ms", "vs_pytorch", "caffepar_fb_ms",
          "caffe_fb_ms", "vs_caffe", "sgemm_pct", "update_ms", "first_s", "engines", "started",
          "load", "pool1_ms", "caffe"]


def kept_rows(out, rows):
    """This run's rows after the rows of OUT.csv for the other nets (each row keeps when it was
    measured and the load then), in the bundled nets' order: a file measured one net per run."""
    done = {r["net"] for r in rows}
    old = []
    try:
        with open(out.with_suffix(".csv"), newline="") as f:
            for r in csv.DictReader(f):
                if r["net"] in done or "started" not in r:
                    continue
                old.append({k: (r[k] if k in ("net", "engines", "started", "load", "caffe")
                                else int(r[k]) if k == "batch" else float(r[k]))
                            for k in FIELDS if k in r})
    except (OSError, ValueError, KeyError):
        return rows
    order = list(NETS)
    return sorted(old + rows, key=lambda r: order.index(r["net"]) if r["net"] in order else 99)


def write_results(out, rows, pool, info):
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = FIELDS
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})
    # The benchmark's own threads count in the load at the end: only more than that is others'.
    def loaded(load):
        start, end = (float(v) for v in load.split("-"))
        return start > 0.5 or end > info["threads"] + 0.5

    lines = [
        "# CPU speed: caffepar vs PyTorch 2.13 and BVLC Caffe",
        "",
        f"Written by `python scripts/bench_train.py` ({info['rounds']} alternating rounds per "
        f"net, each side's training step run at least {info['repeat']} times and "
        f"{info['budget']:g} s per round, fastest counts; the nets may be measured in runs of "
        f"their own, each row with its time and load). CPU: {info['cpu']}; {info['threads']} "
        f"thread(s); OPENBLAS_CORETYPE {info['coretype']}; NumPy SGEMM {info['sgemm']:.0f} "
        f"GFLOP/s; caffepar kernels: {info['kernels']}" +
        (f" ({info['builds']}: code for another instruction set than the host's best)"
         if info.get("builds") else "") + ".",
        "",
        "Training step = forward + backward + SGD update (caffepar solver step vs PyTorch). "
        "Forward+backward = `caffepar time` vs `caffe time` on models/<net>/"
        "train_val_dummy.prototxt (Caffe with the same OPENBLAS_* settings). Ratio < 1: "
        "caffepar faster. Load = 1-minute load average at the start and end of the row's run "
        "(the benchmark's own threads count at the end); a load above that marks the row as "
        "**loaded** (other jobs shared the cores: ratios from alternating rounds, absolute "
        "times noisy).",
        "",
        "| net | batch | caffepar step ms | PyTorch step ms | ratio | caffepar f+b ms | "
        "Caffe f+b ms | ratio | update ms | measured | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['net']} | {r['batch']} | {r['caffepar_step_ms']:.1f} | "
                     f"{r['pytorch_step_ms']:.1f} | **{r['vs_pytorch']:.2f}** | "
                     f"{r['caffepar_fb_ms']:.1f} | {r['caffe_fb_ms']:.1f} | "
                     f"**{r['vs_caffe']:.2f}** | {r['update_ms']:.1f} | {r['started']} | "
                     f"{r['load']}{' **loaded**' if loaded(r['load']) else ''} |")
    pools = ", ".join(f"{r['pool1_ms']:.2f}" for r in rows)
    lines += ["", f"cifar10_quick pool1 (MAX 3x3/2, 100x32x32x32) forward + backward: "
                  f"**{pool:.2f} ms** in the latest run (in each row's run: {pools} ms).", "",
              "Convolution engines (measured on this machine at the first iteration, which "
              "took the time given):", ""]
    lines += [f"- {r['net']}: {r['engines']} (first iteration {r['first_s']:.1f} s)"
              for r in rows]
    if any(r["caffe"] != "yes" for r in rows):
        lines += ["", "Caffe columns are empty where no `--caffe` binary was given."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["vs_pytorch"] for r in rows], 0.4, label="vs PyTorch (training step)")
    ax.bar(x + 0.2, [r["vs_caffe"] for r in rows], 0.4, label="vs Caffe (forward+backward)")
    ax.axhline(0.9, color="C0", ls="--", lw=0.8)
    ax.axhline(0.6, color="C1", ls="--", lw=0.8)
    ax.set_xticks(x, [f"{r['net']}\nbatch {r['batch']}" for r in rows])
    ax.set_ylabel("caffepar time / other's time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
