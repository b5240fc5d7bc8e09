#!/usr/bin/env python
"""The ways one piece of work can run, side by side in alternating rounds (fastest counts):

- InnerProduct at the bundled nets' training shapes (AlexNet fc6-fc8 at batch 16, VGG-16 fc6 at
  batch 4): forward, dx and dW with each of `inner_product.ENGINES` (wide, rows, blas);
- normal draws for a DummyData top (16x3x227x227): caffepar's fill against NumPy's own
  float32 normals.

    python scripts/bench_kernels.py [--rounds 3]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402

from bench_layers import fastest  # noqa: E402

FC = {"alexnet fc6": (16, 9216, 4096), "alexnet fc7": (16, 4096, 4096),
      "alexnet fc8": (16, 4096, 1000), "vgg16 fc6": (4, 25088, 4096)}


def inner_product(rounds):
    from caffepar.nn import inner_product as ip
    rng = np.random.default_rng(0)
    for name, (m, k, n) in FC.items():
        x, dy = rng.standard_normal((m, k), np.float32), rng.standard_normal((m, n), np.float32)
        w = rng.standard_normal((n, k), np.float32)
        y, dx, dw = np.empty((m, n), np.float32), np.empty_like(x), np.zeros_like(w)
        steps = [step for e in ip.ENGINES for step in (
            lambda e=e: ip._forward(e, x, w, None, y),
            lambda e=e: ip._backward(e, dy, x, w, dx, None),
            lambda e=e: ip._backward(e, dy, x, w, None, dw))]
        best = fastest(steps, 3, rounds)
        print(f"InnerProduct {name} (batch {m}): forward + dx + dW ms")
        for i, e in enumerate(ip.ENGINES):
            f, d, g = (1e3 * t for t in best[3 * i:3 * i + 3])
            print(f"  {e:<5} {f:6.1f} + {d:6.1f} + {g:6.1f} = {f + d + g:6.1f}")


def normal_fill(rounds):
    from caffepar.fillers import _normal
    shape = (16, 3, 227, 227)
    out = np.empty(shape, np.float32)
    rng = np.random.default_rng(0)
    ours, numpy_own = (1e3 * t for t in fastest(
        [lambda: _normal(0.0, 1.0, shape, rng, out),
         lambda: rng.standard_normal(shape, dtype=np.float32, out=out)], 3, rounds))
    print(f"normal draws {shape}: caffepar {ours:.1f} ms, NumPy standard_normal {numpy_own:.1f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    inner_product(args.rounds)
    normal_fill(args.rounds)


if __name__ == "__main__":
    main()
