#!/usr/bin/env python
"""Times the direct convolution engine's passes at given shapes (and, with --step,
cifar10_quick's training step) with the caffepar package of one tree: run in a process of its
own per revision by bench_direct_revisions.py and bench_scaling.py, so that each revision
builds and loads its own kernels. Prints JSON: the kernels' vector width, then for each shape
its passes' fastest ms ({"forward", "dx" where the shape needs it, "dw"}).

    python scripts/direct_passes.py TREE SHAPES_JSON [--step]

SHAPES_JSON: {name: [channels in, input size, channels out, kernel, stride, pad, batch,
dx needed]}.
"""
import json
import sys
import time


def best(fn, least=0.3):
    """Fastest ms of at least 5 runs and `least` seconds, after one untimed run."""
    fn()
    times = []
    while len(times) < 5 or sum(times) < least:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main():
    sys.path.insert(0, sys.argv[1])
    import caffepar  # noqa: F401  (before NumPy loads OpenBLAS: its idle threads must not spin)
    import numpy as np
    from caffepar.nn import native
    from caffepar.nn.conv import direct
    from caffepar.nn.conv.geometry import geom
    dt = np.dtype(np.float32)
    out = {"vector_bytes": native.kernels(dt).vector_bytes}
    for name, (c, h, o, k, s, p, n, need_dx) in json.loads(sys.argv[2]).items():
        g = geom((h, h), (k, k), (s, s), (p, p), (1, 1))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, c, h, h), dtype=np.float32)
        w = rng.standard_normal((o, c, k, k), dtype=np.float32)
        y = np.empty((n, o) + g.out, np.float32)
        dx = np.empty_like(x)
        out[name] = {"forward": best(lambda: direct.forward(g, x, w, None, y, 1, dt))}
        if need_dx:
            out[name]["dx"] = best(lambda: direct.backward(g, y, x, w, dx, 1, False, dt))
        out[name]["dw"] = best(lambda: direct.backward(g, y, x, w, None, 1, True, dt))
    if "--step" in sys.argv[3:]:
        from bench_train import caffepar_step
        out["training step"] = best(caffepar_step("cifar10_quick", 100)[0], 1.0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
