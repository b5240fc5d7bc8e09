#!/usr/bin/env python
"""One training iteration (forward + backward + SGD update) of the bundled nets in caffepar and,
when PyTorch is installed, the same architecture in PyTorch on the CPU with the same thread count.

    python scripts/bench_train.py [--nets cifar10_quick,alexnet,vgg16] [--repeat 3] [--rounds 3]

Prints ms per iteration side by side, caffepar / PyTorch, the fraction of this machine's SGEMM
rate the whole caffepar iteration achieves (GEMM FLOPs of its Convolution and InnerProduct
layers over the iteration time), and the ms of the iteration's SGD update step. PyTorch: `pip install torch==2.13.0` (a CPU build).
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402

NETS = {"cifar10_quick": 100, "alexnet": 16, "vgg16": 4}


def dummy_solver_param(name, batch):
    """SGD on a bundled net's DummyData variant at `batch`, with constant input (no time spent
    drawing random data)."""
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import read_net_text
    net, _ = read_net_text(str(ROOT / f"models/{name}/train_val_dummy.prototxt"))
    for layer in net.layer:
        if layer.type == "DummyData":
            layer.dummy_data_param.data_filler[0].type = "constant"
            layer.dummy_data_param.data_filler[0].value = 0.5
            for shape in layer.dummy_data_param.shape:
                shape.dim[0] = batch
    param = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, weight_decay=0.0005,
                                      lr_policy="fixed", max_iter=10 ** 6, display=0,
                                      snapshot_after_train=False, random_seed=1,
                                      snapshot_prefix=os.path.join(tempfile.gettempdir(), "bench_train"))
    param.net_param.CopyFrom(net)
    return param


def iteration_flops(net):
    from bench_layers import layer_flops
    return sum(layer_flops(net, i) for i, l in enumerate(net.layers)
               if l.type in ("Convolution", "InnerProduct"))


def caffepar_step(name, batch):
    """One SGD iteration of the bundled net as a callable, its update alone (the solver's
    ApplyUpdate) as another, and its GEMM FLOPs."""
    from caffepar.solvers import get_solver
    solver = get_solver(dummy_solver_param(name, batch))
    solver.step(1)
    return (lambda: solver.step(1)), solver.apply_update, iteration_flops(solver.net)


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--repeat", type=int, default=3, help="runs per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per net")
    args = ap.parse_args()
    from bench_layers import fastest, sgemm_rate
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    rate = sgemm_rate()
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    print(f"SGEMM {rate:.1f} GFLOP/s; {threads} thread(s); PyTorch "
          f"{'installed' if have_torch else 'not installed (pip install torch==2.13.0)'}")
    print(f"\n{'net':<14}{'batch':>6}{'caffepar ms':>13}{'PyTorch ms':>12}{'ratio':>8}"
          f"{'% SGEMM':>9}{'update ms':>11}")
    for name in args.nets.split(","):
        batch = NETS[name]
        ours_step, update, flops = caffepar_step(name, batch)
        steps = [ours_step] + ([torch_step(name, batch, threads)] if have_torch else [])
        best = fastest(steps, args.repeat, args.rounds) + [np.nan]
        update_ms = fastest([update], args.repeat, args.rounds)[0] * 1e3
        seconds = best[0]
        ours, theirs = best[0] * 1e3, best[1] * 1e3
        ratio = ours / theirs
        print(f"{name:<14}{batch:>6}{ours:>13.0f}{theirs:>12.0f}{ratio:>8.2f}"
              f"{100 * flops / seconds / 1e9 / rate:>8.0f}%{update_ms:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
