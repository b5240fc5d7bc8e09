#!/usr/bin/env python
"""Per-layer speed of the heavy layers against this machine's SGEMM rate, and peak memory.

Times forward + backward of every Convolution and InnerProduct of VGG-16 (batch 8) and
cifar10_quick (batch 100) inside the real nets, each in alternating rounds with NumPy's float32
2048x2048 GEMM, and prints GFLOP/s and % of that SGEMM rate per layer. Then, in a fresh process, one VGG-16 forward+backward
at batch 8 and its peak RSS against the bytes of params, param diffs, activations and their diffs.

    python scripts/bench_layers.py [--rounds 3] [--skip-vgg] [--skip-rss]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402


def best_time(fn, repeat, budget=1.0):
    """Fastest of at least `repeat` runs, and of as many more as fit in `budget` seconds: on a
    shared machine the minimum is the figure least disturbed by other load, so the SGEMM rate
    and every layer are measured the same way."""
    times = [_timed(fn)]
    while len(times) < repeat or sum(times) < budget:
        times.append(_timed(fn))
    return min(times)


def fastest(steps, repeat, rounds, budget=0.0):
    """Fastest time of each step, measured in alternating rounds (each step at least `repeat`
    runs and `budget` seconds per round), so that a noisy spell on a shared machine falls on
    all of them alike."""
    best = [np.inf] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            best[i] = min(best[i], best_time(step, repeat, budget))
    return best


def sgemm(n=2048):
    """NumPy's float32 n x n matrix product as a callable, and its FLOPs: the reference rate."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.copy()
    a @ b
    return (lambda: a @ b), 2 * n ** 3


def sgemm_rate(n=2048, repeat=5):
    step, flops = sgemm(n)
    return flops / best_time(step, repeat) / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_net(model, batch):
    from caffepar.graph.net import TRAIN, Net
    from caffepar.proto.text import read_net_text
    param, _ = read_net_text(model)
    for layer in param.layer:
        if layer.type == "DummyData":
            for shape in layer.dummy_data_param.shape:
                shape.dim[0] = batch
    return Net(param, phase=TRAIN)


def layer_flops(net, i):
    """Multiply-adds x 2 of forward, weight gradient and (if needed) bottom gradient."""
    layer = net.layers[i]
    w = layer.blobs[0].data
    top = net.blob_list[net.top_ids[i][0]]
    if layer.type == "Convolution":
        per_pass = 2 * top.count * int(np.prod(w.shape[1:]))
    else:
        per_pass = 2 * top.count * net.layers[i].k
    passes = 2 + bool(net.bottom_need_backward[i][0])
    return per_pass * passes


def engine(net, i):
    """The engine a Convolution runs (GEMM for InnerProduct)."""
    layer = net.layers[i]
    if layer.type != "Convolution":
        return "gemm"
    return layer.engine(net.blob_list[net.bottom_ids[i][0]].shape)


def bench_net(name, model, batch, rounds):
    """Each Convolution and InnerProduct's forward+backward, against an SGEMM timed alongside it
    in alternating rounds (a changing machine speed then shifts both alike)."""
    net = load_net(model, batch)
    net.forward_from_to()
    reference, reference_flops = sgemm()
    rows = []
    for i, layer in enumerate(net.layers):
        if layer.type not in ("Convolution", "InnerProduct"):
            continue
        bottoms = net._blobs_of(net.bottom_ids[i])
        tops = net._blobs_of(net.top_ids[i])
        need = net.bottom_need_backward[i]

        def step():
            layer.forward(bottoms, tops)
            layer.backward(tops, need, bottoms)

        step()
        sgemm_seconds, seconds = fastest([reference, step], 1, rounds, 1.0 / rounds)
        rate = reference_flops / sgemm_seconds / 1e9
        gflops = layer_flops(net, i) / seconds / 1e9
        rows.append((name, layer.name, layer.type, engine(net, i), seconds * 1e3, gflops, rate,
                     100 * gflops / rate))
    return rows


def rss_child(model, batch):
    net = load_net(model, batch)
    net.forward_from_to()
    net.backward_from_to()
    act = sum(b.data.nbytes + b.diff.nbytes for b in net.blob_list)
    params = net.param_data.nbytes + net.param_diff.nbytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"activations_and_diffs": act, "params_and_diffs": params, "peak_rss": peak}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of SGEMM and layer runs per layer")
    ap.add_argument("--skip-vgg", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--rss-child", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]))
        return
    print(f"SGEMM: NumPy 2048x2048 float32, {os.environ.get('OPENBLAS_NUM_THREADS', 'default')} "
          f"threads, timed alongside each layer")
    nets = [("cifar10_quick", ROOT / "models/cifar10_quick/train_val_dummy.prototxt", 100)]
    if not args.skip_vgg:
        nets.append(("vgg16", ROOT / "models/vgg16/train_val_dummy.prototxt", 8))
    rows = []
    for name, model, batch in nets:
        rows += bench_net(name, str(model), batch, args.rounds)
    print(f"\n{'net':<14}{'layer':<10}{'type':<14}{'engine':<10}{'fwd+bwd ms':>11}"
          f"{'GFLOP/s':>10}{'SGEMM':>8}{'% SGEMM':>9}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:<10}{r[2]:<14}{r[3]:<10}{r[4]:>11.1f}{r[5]:>10.1f}{r[6]:>8.0f}"
              f"{r[7]:>8.0f}%")
    print("\nGFLOP/s counts a direct convolution's multiply-adds (x2), whatever the engine; "
          "Winograd\nF(2x2, 3x3) does 2.25x fewer, so it can pass 100%.")
    for label, keep in (("convolutions", lambda r: True),
                        ("GEMM-engine convolutions", lambda r: r[3] != "winograd")):
        convs = [r[7] for r in rows if r[2] == "Convolution" and keep(r)]
        if convs:
            print(f"{label}: mean {np.mean(convs):.0f}% of SGEMM, min {np.min(convs):.0f}%")
    if not args.skip_rss and not args.skip_vgg:
        out = subprocess.run([sys.executable, __file__, "--rss-child",
                              str(ROOT / "models/vgg16/train_val_dummy.prototxt"), "8"],
                             capture_output=True, text=True, check=True)
        m = json.loads(out.stdout.strip().splitlines()[-1])
        need = m["activations_and_diffs"] + m["params_and_diffs"]
        print(f"\nVGG-16 batch 8 forward+backward: peak RSS {m['peak_rss'] / 2**20:.0f} MiB; "
              f"params+diffs {m['params_and_diffs'] / 2**20:.0f} MiB, activations+diffs "
              f"{m['activations_and_diffs'] / 2**20:.0f} MiB; ratio {m['peak_rss'] / need:.2f}")


if __name__ == "__main__":
    main()
