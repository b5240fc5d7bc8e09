#!/usr/bin/env python
"""The GEMM-only floor of a training iteration: every Convolution and InnerProduct of a bundled
net as the plain GEMMs of an im2col formulation (forward, weight gradient, and the bottom
gradient when the net needs it), timed alone on operands laid out for them, with no im2col,
layout copies, pooling or update. No GEMM-based engine can run an iteration faster than this
on this machine's BLAS.

    python scripts/bench_gemm_floor.py [--net cifar10_quick] [--batch 100]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402

from bench_layers import best_time, load_net  # noqa: E402
from bench_train import NETS  # noqa: E402
from caffepar.nn.blas import gemm_views  # noqa: E402


def layer_gemms(net, i):
    """(name, m, k, n, trans_a, trans_b) of one layer's GEMMs, per group."""
    layer = net.layers[i]
    top = net.blob_list[net.top_ids[i][0]]
    w = layer.blobs[0].data
    if layer.type == "Convolution":
        group = layer.group
        o, k = w.shape[0] // group, int(np.prod(w.shape[1:]))
        cols = top.count // top.shape[0] // w.shape[0] * top.shape[0]
    else:
        group, o, k = 1, layer.blobs[0].shape[0], layer.k
        cols = top.count // o
    gemms = [("forward", o, k, cols, False, False), ("weight grad", o, cols, k, False, True)]
    if net.bottom_need_backward[i][0]:
        gemms.append(("bottom grad", k, o, cols, True, False))
    return [g for g in gemms for _ in range(group)]


def time_gemm(m, k, n, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    return best_time(lambda: gemm_views(a, b, c, trans_a, trans_b), 3, 0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="cifar10_quick", choices=sorted(NETS))
    ap.add_argument("--batch", type=int)
    args = ap.parse_args()
    batch = args.batch or NETS[args.net]
    net = load_net(str(ROOT / f"models/{args.net}/train_val_dummy.prototxt"), batch)
    print(f"{args.net} at batch {batch}: GEMMs of an im2col formulation, each timed alone\n")
    print(f"{'layer':<8}{'GEMM':<13}{'m x k x n':>22}{'ms':>9}{'GFLOP/s':>9}")
    total = 0.0
    for i, layer in enumerate(net.layers):
        if layer.type not in ("Convolution", "InnerProduct"):
            continue
        for name, m, k, n, ta, tb in layer_gemms(net, i):
            seconds = time_gemm(m, k, n, ta, tb)
            total += seconds
            print(f"{layer.name:<8}{name:<13}{f'{m} x {k} x {n}':>22}{seconds * 1e3:>9.2f}"
                  f"{2 * m * k * n / seconds / 1e9:>9.0f}")
    print(f"\nGEMM-only floor of one iteration: {total * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
