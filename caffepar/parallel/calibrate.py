"""`caffepar calibrate`: time each collective caffepar runs over a sweep of message sizes on the
ranks at hand and fit the cost model's alpha and beta to them (caffepar.parallel.cost)."""
import os
import platform
import time

import numpy as np

from caffepar.parallel.cost import OPS, CostModel, fit_alpha_beta


def _calls(comm, nbytes):
    """op -> a callable running it once on buffers whose recorded size is `nbytes`, as the
    communicator records them (allgather: what is received; reduce-scatter, all-to-all: what
    is sent)."""
    p = comm.size
    n = max(p, nbytes // 4 // p * p)          # float32 elements, a multiple of P
    buf = np.ones(n, np.float32)
    part = np.ones(n // p, np.float32)
    out = np.empty(n, np.float32)
    counts = [n // p] * p
    return {
        "allreduce": lambda: comm.allreduce_sum(buf, tag="calibrate"),
        "allgather": lambda: comm.allgather(part, out, tag="calibrate"),
        "reduce_scatter": lambda: comm.reduce_scatter_block(buf, part, tag="calibrate"),
        "alltoall": lambda: comm.alltoallv(buf, counts, out, counts, tag="calibrate"),
        "bcast": lambda: comm.bcast(buf, tag="calibrate"),
    }, n * 4


def measure(comm, max_bytes=16 * 2 ** 20, repeats=5, progress=None, ops=OPS):
    """{op: [(P, bytes, seconds)]}: per size the median over `repeats` (after one warm-up) of
    the slowest rank's time, ranks lined up by a barrier before every call."""
    sizes = []
    size = 4
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    samples = {op: [] for op in ops}
    for nbytes in sizes:
        calls, actual = _calls(comm, nbytes)
        for op in ops:
            times = []
            for rep in range(repeats + 1):
                comm.barrier()
                t0 = time.perf_counter()
                calls[op]()
                times.append(time.perf_counter() - t0)
            slowest = np.array(times[1:])
            if comm.size > 1:
                comm.comm.Allreduce(comm.MPI.IN_PLACE, slowest, op=comm.MPI.MAX)
            samples[op].append((comm.size, actual, float(np.median(slowest))))
        if progress:
            progress(actual, {op: samples[op][-1][2] for op in ops})
    comm.stats.reset()
    return samples


def calibrate(comm, transport, max_bytes=16 * 2 ** 20, repeats=5, progress=None):
    """A CostModel fitted at this P, with what was measured kept in its info."""
    load = os.getloadavg()[0]
    samples = measure(comm, max_bytes, repeats, progress)
    fits = {op: fit_alpha_beta(op, samples[op]) for op in OPS}
    info = {f"P{comm.size}": {
        "measured": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
        "cpus": os.cpu_count(), "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2), "repeats": repeats,
        "samples": {op: [[b, s] for _p, b, s in samples[op]] for op in OPS}}}
    return CostModel({comm.size: fits}, f"caffepar calibrate --np {comm.size}", transport, info)


def fit_error(model, ranks):
    """Median relative error of the fit on its own samples (every op and size)."""
    samples = model.info.get(f"P{ranks}", {}).get("samples", {})
    errs = [abs(model.collective_s(op, ranks, b) - s) / s
            for op, rows in samples.items() for b, s in rows if s > 0]
    return float(np.median(errs)) if errs else float("nan")


def allreduce_model(comm, max_bytes=4 * 2 ** 20, repeats=3):
    """A quick model of the allreduce alone (merge auto without a calibration): about a
    second on the ranks at hand; every rank must call it."""
    samples = measure(comm, max_bytes, repeats, ops=("allreduce",))
    fit = fit_alpha_beta("allreduce", samples["allreduce"])
    return CostModel({comm.size: {op: fit for op in OPS}},
                     f"allreduce measured on these {comm.size} ranks", "", {})
