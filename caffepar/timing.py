"""`caffepar time`: per-layer forward and backward timing in the shape of `caffe time`."""
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Benchmark:
    iterations: int
    forward_ms: np.ndarray
    backward_ms: np.ndarray
    iteration_ms: list = field(default_factory=list)
    total_ms: float = 0.0


def benchmark(net, iterations, progress=None):
    """Run `iterations` forward+backward passes layer by layer, timing each layer. Backward runs
    for every layer as in Caffe's tool, bottoms getting diffs only where the net needs them."""
    n = len(net.layers)
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    laps = []
    clock = time.perf_counter
    net.forward_from_to()
    start_all = clock()
    for it in range(iterations):
        start = clock()
        for i, layer in enumerate(net.layers):
            bottoms, tops = net._blobs_of(net.bottom_ids[i]), net._blobs_of(net.top_ids[i])
            t0 = clock()
            layer.reshape(bottoms, tops)
            layer.forward(bottoms, tops)
            fwd[i] += clock() - t0
        for i in range(n - 1, -1, -1):
            t0 = clock()
            net.layers[i].backward(net._blobs_of(net.top_ids[i]), net.bottom_need_backward[i],
                                   net._blobs_of(net.bottom_ids[i]))
            bwd[i] += clock() - t0
        laps.append((clock() - start) * 1e3)
        if progress:
            progress(it + 1, laps[-1])
    total = (clock() - start_all) * 1e3
    return Benchmark(iterations, fwd * 1e3 / iterations, bwd * 1e3 / iterations, laps, total)


def format_benchmark(net, result):
    width = max([10] + [len(name) for name in net._layer_names])
    lines = ["Average time per layer:"]
    for name, f, b in zip(net._layer_names, result.forward_ms, result.backward_ms):
        lines.append(f"{name:>{width}}\tforward: {f:.4f} ms.")
        lines.append(f"{name:>{width}}\tbackward: {b:.4f} ms.")
    fsum, bsum = result.forward_ms.sum(), result.backward_ms.sum()
    lines += [f"Average Forward pass: {fsum:.4f} ms.",
              f"Average Backward pass: {bsum:.4f} ms.",
              f"Average Forward-Backward: {np.mean(result.iteration_ms):.4f} ms.",
              f"Total Time: {result.total_ms:.4f} ms.",
              "*** Benchmark ends ***"]
    return "\n".join(lines)
