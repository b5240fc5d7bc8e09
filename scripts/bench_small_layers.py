#!/usr/bin/env python
"""Forward and backward time of the non-GEMM layers (Pooling, LRN, ReLU, Dropout) inside the
real nets: cifar10_quick at batch 100 and AlexNet at batch 16 (VGG-16 at batch 8 with --vgg).

Each layer runs on the activations of one real forward pass; forward includes the layer's
reshape, which the net calls before every forward. Times are best-of --repeat, since a shared
machine makes averages meaningless. In-place layers get their input restored before every run
(untimed), so each run sees the same data.

    python scripts/bench_small_layers.py [--repeat 7] [--vgg] [--types Pooling,LRN]
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402

from bench_layers import load_net  # noqa: E402

TYPES = ("Pooling", "LRN", "ReLU", "Dropout")


def best_of(fn, repeat, before=None):
    best = float("inf")
    for _ in range(repeat):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def bench_net(model, batch, repeat, types):
    net = load_net(model, batch)
    net.forward_from_to()
    rows = []
    for i, layer in enumerate(net.layers):
        if layer.type not in types:
            continue
        bottoms = net._blobs_of(net.bottom_ids[i])
        tops = net._blobs_of(net.top_ids[i])
        need = [True] * len(bottoms)
        saved = [b.data.copy() for b in bottoms]
        rng = np.random.default_rng(0)
        for t in tops:
            t.diff[...] = rng.standard_normal(t.shape, dtype=t.diff.dtype)
        saved_diff = [t.diff.copy() for t in tops]

        def restore_data():
            for b, s in zip(bottoms, saved):
                b.data[...] = s

        def restore_diff():
            for t, s in zip(tops, saved_diff):
                t.diff[...] = s

        def forward():
            layer.reshape(bottoms, tops)
            layer.forward(bottoms, tops)

        restore_data()
        forward()
        fwd = best_of(forward, repeat, restore_data)
        restore_data()
        layer.forward(bottoms, tops)
        bwd = best_of(lambda: layer.backward(tops, need, bottoms), repeat, restore_diff)
        shape = "x".join(map(str, bottoms[0].shape))
        rows.append((layer.name, layer.type, shape, fwd, bwd))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--vgg", action="store_true", help="also VGG-16 at batch 8")
    ap.add_argument("--types", default=",".join(TYPES))
    args = ap.parse_args()
    types = set(args.types.split(","))
    nets = [("cifar10_quick", "models/cifar10_quick/train_val_dummy.prototxt", 100),
            ("alexnet", "models/alexnet/train_val_dummy.prototxt", 16)]
    if args.vgg:
        nets.append(("vgg16", "models/vgg16/train_val_dummy.prototxt", 8))
    print(f"{'net':<14}{'layer':<10}{'type':<9}{'bottom':<18}{'fwd ms':>9}{'bwd ms':>9}")
    for name, model, batch in nets:
        total_f = total_b = 0.0
        for lname, ltype, shape, f, b in bench_net(str(ROOT / model), batch, args.repeat, types):
            print(f"{name:<14}{lname:<10}{ltype:<9}{shape:<18}{f:>9.2f}{b:>9.2f}")
            total_f += f
            total_b += b
        print(f"{name:<14}{'total':<10}{'':<9}{'':<18}{total_f:>9.2f}{total_b:>9.2f}")


if __name__ == "__main__":
    main()
