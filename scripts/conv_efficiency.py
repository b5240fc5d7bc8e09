#!/usr/bin/env python
"""How close the direct engine's passes (and PyTorch's, where installed) come to this CPU's
multiply-add peak, on cifar10_quick's convolutions: the figures behind skipping padding taps.

The peak is measured, not taken from a data sheet: a C loop of independent FMAs on vectors of
the width the kernels are built for, run on every core at once. Each pass's rate is given two
ways: counting every tap (what a padded loop or an im2col GEMM multiplies) and counting only
the taps that read inside the image (the work there is). A rate above the peak counting every
tap means the code skips the padding. Writes results/conv_efficiency_<cpu>[_<isa>].{md,csv,png}.

    python scripts/conv_efficiency.py [--rounds 40] [--out PATH]
"""
import argparse
import os
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
from figures import pyplot  # noqa: E402
from tables import write_tables  # noqa: E402

# name: (batch, channels in, size, channels out, kernel, pad, dx needed in training)
SHAPES = {"conv1": (100, 3, 32, 32, 5, 2, False), "conv2": (100, 32, 16, 32, 5, 2, True),
          "conv3": (100, 32, 8, 64, 5, 2, True)}

PEAK_C = r"""
#include <stdio.h>
#include <time.h>
typedef float v __attribute__((vector_size(BYTES)));
int main(void)
{
    v acc[12], x = {1}, y = {1e-9f};    /* 12 sums and 2 operands fit 16 registers */
    for (int i = 0; i < 12; i++)
        acc[i] = (v){} + (float)i;
    struct timespec a, b;
    const long reps = 50000000;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long r = 0; r < reps; r++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            acc[i] = acc[i] * y + x;
        __asm__ volatile("" : "+v"(x));
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    float s = 0;
    for (int i = 0; i < 12; i++)
        s += acc[i][0];
    double t = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
    printf("%f %f\n", reps * 12.0 * (BYTES / 4) * 2 / t / 1e9, s);
    return 0;
}
"""


def fma_peak(vector_bytes, cores):
    """GFLOP/s of `cores` copies of the FMA loop run at once (the best of 3 tries)."""
    work = Path(tempfile.mkdtemp(prefix="caffepar-peak-"))
    src, exe = work / "peak.c", work / "peak"
    src.write_text(PEAK_C)
    flags = os.environ.get("CAFFEPAR_CFLAGS", "-march=native").split()
    subprocess.run(["gcc", "-O2", *flags, "-ffp-contract=fast", f"-DBYTES={vector_bytes}",
                    str(src), "-o", str(exe)], check=True)
    best = 0.0
    for _ in range(3):
        runs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
                for _ in range(cores)]
        best = max(best, sum(float(p.communicate()[0].split()[0]) for p in runs))
    return best


def taps(size, kernel, pad):
    """(taps in all, taps reading inside the image) summed over a 1-D output, stride 1."""
    out = size + 2 * pad - kernel + 1
    inside = sum(1 for o in range(out) for k in range(kernel) if 0 <= o - pad + k < size)
    return out * kernel, inside


def fastest(fn, rounds):
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ours(shape, rounds):
    from caffepar.nn.conv import direct
    from caffepar.nn.conv.geometry import geom
    n, c, h, o, k, p, need_dx = shape
    dt = np.dtype(np.float32)
    g = geom((h, h), (k, k), (1, 1), (p, p), (1, 1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, h), dtype=np.float32)
    w = rng.standard_normal((o, c, k, k), dtype=np.float32)
    y = np.empty((n, o) + g.out, np.float32)
    dx = np.empty_like(x)
    passes = {"forward": fastest(lambda: direct.forward(g, x, w, None, y, 1, dt), rounds)}
    if need_dx:
        passes["dx"] = fastest(lambda: direct.backward(g, y, x, w, dx, 1, False, dt), rounds)
    passes["dw"] = fastest(lambda: direct.backward(g, y, x, w, None, 1, True, dt), rounds)
    return passes


def theirs(shape, rounds, threads):
    """PyTorch's forward, and its backward (dx and dw together, as autograd runs them; dw
    alone for a first layer)."""
    import torch
    torch.set_num_threads(threads)
    n, c, h, o, k, p, need_dx = shape
    x = torch.randn(n, c, h, h, requires_grad=need_dx)
    conv = torch.nn.Conv2d(c, o, k, padding=p, bias=False)
    dy = torch.randn_like(conv(x))
    with torch.no_grad():
        forward = fastest(lambda: conv(x), rounds)

    wanted = [x, conv.weight] if need_dx else [conv.weight]

    def step():
        torch.autograd.grad(conv(x), wanted, dy)

    return {"forward": forward,
            "dx + dw" if need_dx else "dw": max(fastest(step, rounds) - forward, 1e-9)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="runs per pass, the fastest counts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from caffepar.nn import native
    from caffepar.nn.blas import blas_threads
    k = native.kernels(np.float32)
    if k is None:
        raise SystemExit("conv_efficiency: the compiled kernels are not available")
    threads = blas_threads()
    isa = build_isa(k.vector_bytes)
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    peak = fma_peak(k.vector_bytes, threads)
    rows = []
    for name, shape in SHAPES.items():
        n, c, h, o, kern, p, _ = shape
        every, inside = taps(h, kern, p)
        flops = {"every tap": 2 * n * o * c * every ** 2, "inside": 2 * n * o * c * inside ** 2}
        sides = [("caffepar", ours(shape, args.rounds))]
        if have_torch:
            sides.append(("PyTorch", theirs(shape, args.rounds, threads)))
        for side, passes in sides:
            for what, seconds in passes.items():
                scale = 2 if what == "dx + dw" else 1
                rows.append({
                    "layer": name, "side": side, "pass": what, "ms": seconds * 1e3,
                    "gflops_every_tap": scale * flops["every tap"] / seconds / 1e9,
                    "gflops_inside": scale * flops["inside"] / seconds / 1e9,
                    "share_of_peak_inside": scale * flops["inside"] / seconds / 1e9 / peak})
        print(f"{name}: " + ", ".join(f"{r['side']} {r['pass']} {r['ms']:.2f} ms"
                                      for r in rows if r["layer"] == name), flush=True)
    load_end = os.getloadavg()[0]
    suffix = isa_suffix(isa)
    out = Path(args.out) if args.out else ROOT / f"results/conv_efficiency_{cpu_key()}{suffix}"
    lines = ["# cifar10_quick's convolutions against this CPU's multiply-add peak", "",
             f"Written by `python scripts/conv_efficiency.py` ({started}, fastest of "
             f"{args.rounds} runs per pass). CPU: {cpu_name()}; caffepar kernels built for {isa}"
             + (f" (CAFFEPAR_CFLAGS={os.environ['CAFFEPAR_CFLAGS']})"
                if os.environ.get("CAFFEPAR_CFLAGS") else "")
             + f"; {threads} thread(s) each; PyTorch "
             + (f"{__import__('torch').__version__}" if have_torch else "not installed")
             + f". Load average (1 min) {load_start:.2f} at the start, {load_end:.2f} at the "
             "end.", "",
             f"Peak: **{peak:.0f} GFLOP/s**, {threads} copies of a loop of independent "
             f"{k.vector_bytes}-byte FMAs run at once. Batch 100, 5x5 kernels, pad 2, stride 1. "
             "GFLOP/s counted over every tap, and over the taps reading inside the image "
             "(the rest read zero padding); PyTorch's backward is dx and dw together (its "
             "step less its forward), conv1's dw alone (a first layer needs no dx).", "",
             "| layer | side | pass | ms | GFLOP/s, every tap | GFLOP/s, inside | "
             "share of peak (inside) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['side']} | {r['pass']} | {r['ms']:.2f} | "
              f"{r['gflops_every_tap']:.0f} | {r['gflops_inside']:.0f} | "
              f"{r['share_of_peak_inside']:.0%} |" for r in rows]
    print("\n".join(lines))
    write_tables(out, lines, rows, digits=4)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['layer']} {r['pass']}\n{r['side']}" for r in rows]
    ax.bar(range(len(rows)), [r["share_of_peak_inside"] * 100 for r in rows],
           color=["tab:blue" if r["side"] == "caffepar" else "tab:orange" for r in rows])
    ax.axhline(100, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("% of FMA peak (taps inside the image)")
    ax.set_title(f"cifar10_quick convolutions, {cpu_key()} {isa}, {threads} threads")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
