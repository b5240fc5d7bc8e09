"""`caffepar time`: per-layer forward and backward timing in the shape of `caffe time`; in a
parallel run also each layer's communication (ms and MB) and the gradient allreduce."""
import time
from array import array
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Benchmark:
    iterations: int
    forward_ms: np.ndarray
    backward_ms: np.ndarray
    iteration_ms: list = field(default_factory=list)
    total_ms: float = 0.0
    comm_ms: dict = field(default_factory=dict)
    comm_mb: dict = field(default_factory=dict)
    ranks: int = 1
    reduction: dict = field(default_factory=dict)
    options: str = ""


def benchmark(net, iterations, progress=None, comm=None, options=None, cost_model=None):
    """Run `iterations` forward+backward passes layer by layer, timing each layer. Backward runs
    for every layer as in Caffe's tool, bottoms getting diffs only where the net needs them.
    Communication inside a layer is counted in its time and also reported on its own. In a
    parallel run the replicated gradients are then reduced as a training iteration reduces them
    (`options`: CommOptions, whose timeline, if any, is written at the end)."""
    from caffepar.parallel.gradsync import GradientSync
    from caffepar.parallel.options import CommOptions
    from caffepar.parallel.timeline import ITERATIONS, Timeline
    options = options or CommOptions()
    timeline = None
    if options.timeline:
        timeline = Timeline(comm) if comm is not None else None
        if timeline is not None:
            comm.timeline = timeline
            timeline.watch(net)
    sync = None
    if comm is not None and comm.size > 1:
        sync = GradientSync(net, comm, options, timeline=timeline, cost_model=cost_model)
        if not sync.plain:
            net.observers.append(sync)
    n = len(net.layers)
    # Seconds, as C doubles: a NumPy scalar's += costs a net of millions of layers time, and a
    # list's a float object a layer (150 MB for 3 million layers' two passes).
    fwd = array("d", bytes(8 * n))
    bwd = array("d", bytes(8 * n))
    laps = []
    clock = time.perf_counter
    # One untimed pass without communication: first-touch allocations, and the first run of a
    # layer shape on this machine measures its engines (caffepar.nn.calibrate); in one process
    # a second when it did, since a measurement frees the work arrays the passes before it had
    # allocated (ranks run as many passes as each other: model-parallel layers communicate).
    # A TEST net times its inference plan (Net.inference_plan), after passes layer by layer
    # that leave every layer what its backward reads: one forward more makes the plan. The
    # passes ignore floating-point errors once for all layers (Net.float_errors_ignored).
    from caffepar.nn import calibrate
    observers, net.observers = net.observers, []
    try:
        with net.float_errors_ignored():
            for _ in range(2 if comm is None or comm.size == 1 else 1):
                before = calibrate.measured()
                with net.unfused():
                    for i in range(n):
                        net.forward_layer(i, 0.0, 0, n - 1)
                for i in range(n - 1, -1, -1):
                    net.backward_layer(i, True, n - 1, 0)
                if calibrate.measured() == before:
                    break
            if net.inference_enabled():
                for i in range(n):
                    net.forward_layer(i, 0.0, 0, n - 1)
    finally:
        net.observers = observers
    if comm is not None:
        comm.barrier()
        comm.stats.reset()
    start_all = clock()
    for it in range(iterations):
        start = clock()
        if sync is not None:
            sync.begin_pass(it, armed=True)
        with net.float_errors_ignored():
            for i in range(n):
                t0 = clock()
                net.forward_layer(i, 0.0, 0, n - 1)     # whole passes: ReLUs folded as in
                fwd[i] += clock() - t0                  # training
            for i in range(n - 1, -1, -1):
                t0 = clock()
                net.backward_layer(i, True, n - 1, 0)
                bwd[i] += clock() - t0
        if sync is not None:
            sync.finish()
            net.param_diff *= net.param_diff.dtype.type(1.0 / comm.size)
        end = clock()
        laps.append((end - start) * 1e3)
        if timeline is not None:
            timeline.span(f"iteration {it}", "iteration", ITERATIONS, start, end)
        if progress:
            progress(it + 1, laps[-1])
    total = (clock() - start_all) * 1e3
    result = Benchmark(iterations, np.frombuffer(fwd) * 1e3 / iterations,
                       np.frombuffer(bwd) * 1e3 / iterations, laps, total)
    if comm is not None:
        result.ranks = comm.size
        for (tag, _op), (seconds, nbytes, _calls) in comm.stats.take().items():
            result.comm_ms[tag] = result.comm_ms.get(tag, 0.0) + seconds * 1e3 / iterations
            result.comm_mb[tag] = result.comm_mb.get(tag, 0.0) + nbytes / 2 ** 20 / iterations
    if sync is not None:
        result.reduction = sync.take_totals()
        result.options = options.describe()
    if timeline is not None:
        timeline.write(options.timeline)
    return result


def engine_lines(net):
    """Per layer with a choice of engines (Convolution, InnerProduct): the engine each of its
    passes runs on and by how much it won when it was measured (the runner-up's time / its
    own)."""
    from caffepar.nn import calibrate
    lines = []
    for i, layer in enumerate(net.layers):
        if not hasattr(layer, "engine_choices"):
            continue
        choices = layer.engine_choices(net.blob_list[net.bottom_ids[i][0]].shape)
        how = "; ".join(f"{part} {engine}: {_margin_words(entry)}"
                        for part, (engine, entry) in choices.items())
        lines.append(f"{net._layer_names[i]}\t{layer.type}\t{calibrate.describe(choices)}\t"
                     f"{how}")
    return lines


def _margin_words(entry):
    from caffepar.nn import calibrate
    won = calibrate.margin(entry) if entry else None
    if won is None:
        return "no measured alternative (one engine able, forced, or rules)"
    runner, ratio = won
    ms = entry["ms"]
    return (f"{ms[entry['engine']]:.2f} ms vs {runner} {ms[runner]:.2f} ms, " +
            (f"won by {ratio:.2f}x" if ratio >= 1 + calibrate.TIE else
             f"a tie (within {100 * calibrate.TIE:.0f}%), the first listed kept"))


def format_benchmark(net, result, engines=False):
    return "\n".join(benchmark_lines(net, result, engines))


_LINES_AT_ONCE = 1 << 16


def benchmark_lines(net, result, engines=False):
    """format_benchmark's lines one at a time (a net of millions of layers prints millions)."""
    width = max([10] + [len(name) for name in net._layer_names])
    yield "Average time per layer:"
    names, layers, blob_list, bottom_ids = net._layer_names, net.layers, net.blob_list, \
        net.bottom_ids
    comm_ms, comm_mb = result.comm_ms, result.comm_mb
    folded_forward, stepped_forward = net.relu_in_producer, net.step_forward
    folded_backward, stepped_backward = net.relu_in_consumer, net.step_backward
    planned = net.forward_host_table()
    for lo in range(0, len(names), _LINES_AT_ONCE):
        hi = lo + _LINES_AT_ONCE        # Python floats format faster than NumPy's
        for i, f, b in zip(range(lo, len(names)), result.forward_ms[lo:hi].tolist(),
                           result.backward_ms[lo:hi].tolist()):
            name = names[i]
            label = f"{name:>{width}}"
            layer = layers[i]
            engine = ""
            if hasattr(layer, "engine"):
                engine = f"\tengine: {layer.engine(blob_list[bottom_ids[i][0]].shape)}"
            host = planned.get(i) if planned is not None else \
                i - 1 if i in folded_forward else stepped_forward.get(i)
            fold = f"\t(runs inside {names[host]})" if host is not None else ""
            yield f"{label}\tforward: {f:.4f} ms.{engine}{fold}"
            comm = ""
            if name in comm_ms:
                comm = f"\tcomm: {comm_ms[name]:.4f} ms, {comm_mb[name]:.3f} MB"
            host = i + 1 if i in folded_backward else stepped_backward.get(i)
            fold = f"\t(runs inside {names[host]})" if host is not None else ""
            yield f"{label}\tbackward: {b:.4f} ms.{comm}{fold}"
    fsum, bsum = result.forward_ms.sum(), result.backward_ms.sum()
    lines = [f"Average Forward pass: {fsum:.4f} ms.",
             f"Average Backward pass: {bsum:.4f} ms."]
    if result.ranks > 1:
        from caffepar.parallel.gradsync import TAG
        reduce_ms = result.comm_ms.get(TAG, 0.0)
        reduce_mb = result.comm_mb.get(TAG, 0.0)
        comm_ms = sum(result.comm_ms.values())
        comm_mb = sum(result.comm_mb.values())
        lines.append(f"Average gradient reduction: {reduce_ms:.4f} ms waited, {reduce_mb:.3f} "
                     "MB.")
        if result.reduction:
            r = result.reduction
            selection = f", top-k selection {r['sparsify_s'] * 1e3:.4f} ms" \
                if r["sparsify_s"] else ""
            lines.append(f"    ({result.options}: {r['comm_s'] * 1e3:.4f} ms in flight, "
                         f"{r['exposed_s'] * 1e3:.4f} ms waited for{selection})")
        lines.append(f"Average communication ({result.ranks} ranks): {comm_ms:.4f} ms, "
                     f"{comm_mb:.3f} MB per iteration.")
    lines += [f"Average Forward-Backward: {np.mean(result.iteration_ms):.4f} ms.",
              f"Total Time: {result.total_ms:.4f} ms."]
    if engines:
        lines += ["Engines (layer, type, engine, each pass's measured time vs the runner-up's):"]
        lines += ["    " + line for line in engine_lines(net)]
    lines += ["*** Benchmark ends ***"]
    yield from lines


def _base(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def memory_floor(net, history=0):
    """{part: bytes} the memory a pass cannot do without: the parameters, their diffs and
    `history` solver histories of them (momentum: 1), and every blob's data and diff, each array
    counted once however many blobs share it (in-place layers, the flat parameter buffers)."""
    seen = set()

    def unique(arrays):
        total = 0
        for a in arrays:
            base = _base(a)
            if id(base) not in seen:
                seen.add(id(base))
                total += base.nbytes
        return total

    params = unique([net.param_data])
    diffs = unique([net.param_diff])
    return {"parameters": params, "parameter diffs": diffs, "solver history": history * params,
            "activations": unique(b.data for b in net.blob_list),
            "activation diffs": unique(b.diff for b in net.blob_list)}


def largest_blobs(net, count=8):
    """[(bytes, what)]: the largest arrays of the net (blob data and diffs, parameters)."""
    found = {}
    for name, blob in zip(net.blob_names, net.blob_list):
        for part, a in (("data", blob.data), ("diff", blob.diff)):
            base = _base(a)
            found.setdefault(id(base), (base.nbytes, f"blob {name} {part} {blob.shape}"))
    for i, layer in enumerate(net.layers):
        for k, blob in enumerate(layer.blobs):
            found[id(blob.data)] = (blob.data.nbytes, f"layer {net._layer_names[i]} param {k} "
                                                      f"{blob.shape} (and its diff)")
    return sorted(found.values(), key=lambda x: -x[0])[:count]


def peak_rss():
    """This process's peak resident memory (bytes), or None where the OS does not tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


def format_memory(net, start_rss=None, history=0):
    """`caffepar time --memory`: the floor, the measured peak and the largest blobs."""
    mb = 2 ** 20
    floor = memory_floor(net, history)
    total = sum(floor.values())
    peak = peak_rss()
    lines = ["Memory:", f"    floor {total / mb:.1f} MB (" +
             ", ".join(f"{k} {v / mb:.1f}" for k, v in floor.items() if v) + ")"]
    if peak is not None:
        extra = f", {(peak - start_rss) / mb:.1f} MB above the {start_rss / mb:.1f} MB the " \
                f"process held before the net" if start_rss else ""
        lines.append(f"    measured peak {peak / mb:.1f} MB: {peak / total:.2f}x the floor{extra}")
    lines.append("    largest:")
    lines += [f"        {size / mb:9.1f} MB  {what}" for size, what in largest_blobs(net)]
    return "\n".join(lines)


PROFILE_FORMAT = "caffepar-profile/1"


def profile_dict(net, result, batch):
    """A compute profile for `caffepar plan`: each layer's forward and backward ms at `batch`
    images per rank on this machine."""
    import os
    import platform
    return {"format": PROFILE_FORMAT, "net": net.name, "batch": int(batch),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "iterations": result.iterations,
            "forward_ms": dict(zip(net._layer_names, map(float, result.forward_ms))),
            "backward_ms": dict(zip(net._layer_names, map(float, result.backward_ms)))}


def save_profile(path, profile):
    """Write a profile_dict to `path` (atomically: a crash leaves the old file or none)."""
    import json

    from caffepar.io.weights import atomic_write
    text = json.dumps(profile, indent=1) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def load_profile(path):
    import json

    from caffepar.errors import CaffeparError
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise CaffeparError(f"cannot read profile {path}: {e.strerror}") from None
    except ValueError as e:
        raise CaffeparError(f"{path}: not a profile (bad JSON: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT or \
            not isinstance(doc.get("forward_ms"), dict) or not doc.get("batch"):
        raise CaffeparError(f"{path}: not a caffepar profile (expected format "
                            f'"{PROFILE_FORMAT}" with batch, forward_ms, backward_ms)')
    return doc


def profile_compute_ms(profile, batch):
    """Forward + backward ms of the whole net at `batch` per rank, scaled linearly from the
    profile's batch."""
    total = sum(profile["forward_ms"].values()) + sum(profile["backward_ms"].values())
    return total * batch / profile["batch"]
