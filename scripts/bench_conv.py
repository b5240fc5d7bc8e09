"""Convolution forward+backward speed on VGG-16 and cifar10_quick conv layers.

For every layer it times conv_forward plus conv_backward with dx, dw and db
all requested (with --as-net, first layers skip dx as in the real nets),
writing into preallocated outputs as the layers do (out=, dx_out=), and
compares the rate with NumPy's float32 matrix product of 2048x2048 timed
alongside it in alternating rounds.

FLOPs per layer = (3 or 2) * 2 * N * O * (C/group) * prod(K) * prod(S_out).

Usage: python scripts/bench_conv.py [--net vgg|cifar|all] [--rounds R] [--as-net]
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402

from bench_layers import fastest, sgemm  # noqa: E402
from caffepar.nn import conv as cm  # noqa: E402

# name, batch, C, O, spatial, kernel, pad
VGG16 = [
    ("conv1_1", 8, 3, 64, 224, 3, 1),
    ("conv1_2", 8, 64, 64, 224, 3, 1),
    ("conv2_1", 8, 64, 128, 112, 3, 1),
    ("conv2_2", 8, 128, 128, 112, 3, 1),
    ("conv3_1", 8, 128, 256, 56, 3, 1),
    ("conv3_2", 8, 256, 256, 56, 3, 1),
    ("conv3_3", 8, 256, 256, 56, 3, 1),
    ("conv4_1", 8, 256, 512, 28, 3, 1),
    ("conv4_2", 8, 512, 512, 28, 3, 1),
    ("conv4_3", 8, 512, 512, 28, 3, 1),
    ("conv5_1", 8, 512, 512, 14, 3, 1),
    ("conv5_2", 8, 512, 512, 14, 3, 1),
    ("conv5_3", 8, 512, 512, 14, 3, 1),
]
CIFAR10_QUICK = [
    ("cifar conv1", 100, 3, 32, 32, 5, 2),
    ("cifar conv2", 100, 32, 32, 16, 5, 2),
    ("cifar conv3", 100, 32, 64, 8, 5, 2),
]


def bench_layer(n, c, o, size, k, pad, rounds, need_dx=True):
    """(seconds, GFLOP/s, SGEMM GFLOP/s timed alongside in alternating rounds)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, size, size), dtype=np.float32)
    w = rng.standard_normal((o, c, k, k), dtype=np.float32) * 0.05
    b = rng.standard_normal(o, dtype=np.float32)
    conv = ((1, 1), (pad, pad), (1, 1), 1)
    y = cm.conv_forward(x, w, b, *conv)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx = np.empty_like(x) if need_dx else None

    def step():
        cm.conv_forward(x, w, b, *conv, out=y)
        cm.conv_backward(dy, x, w, *conv, need_dx=need_dx, dx_out=dx)

    step()
    reference, reference_flops = sgemm()
    t_ref, t = fastest([reference, step], 1, rounds, 1.0 / rounds)
    flops = (2 + need_dx) * 2 * n * o * c * k * k * dy.shape[2] * dy.shape[3]
    return t, flops / t / 1e9, reference_flops / t_ref / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", choices=("vgg", "cifar", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of SGEMM and layer runs per layer")
    ap.add_argument("--as-net", action="store_true",
                    help="skip dx on each net's first layer, as training does")
    args = ap.parse_args()
    layers = (VGG16 if args.net in ("vgg", "all") else []) + \
             (CIFAR10_QUICK if args.net in ("cifar", "all") else [])
    print("% SGEMM: against NumPy's float32 2048x2048 GEMM, timed alongside each layer")
    print("forward + backward (" + ("no dx on first layers, as in the nets)" if args.as_net
                                     else "dx, dw, db all computed, also on first layers)"))
    print(f"{'layer':<12} {'batch':>5} {'C->O':>9} {'size':>5} {'k':>3} "
          f"{'time ms':>9} {'GFLOP/s':>8} {'SGEMM':>6} {'% SGEMM':>8}")
    pcts = []
    totals = {}
    for name, n, c, o, size, k, pad in layers:
        first = name in ("conv1_1", "cifar conv1")
        t, rate, ref = bench_layer(n, c, o, size, k, pad, args.rounds,
                                   need_dx=not (args.as_net and first))
        pct = 100 * rate / ref
        pcts.append(pct)
        net = "cifar10_quick" if name.startswith("cifar") else "VGG-16"
        totals[net] = totals.get(net, 0.0) + t
        print(f"{name:<12} {n:>5} {f'{c}->{o}':>9} {size:>5} {k:>3} "
              f"{1e3 * t:>9.1f} {rate:>8.1f} {ref:>6.0f} {pct:>7.1f}%", flush=True)
    for net, t in totals.items():
        print(f"{net} convolutions together: {1e3 * t:.1f} ms")
    print(f"average {sum(pcts) / len(pcts):.1f}% of SGEMM, minimum {min(pcts):.1f}%")


if __name__ == "__main__":
    main()
