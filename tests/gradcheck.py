"""Caffe's gradient checker semantics in float64: central differences with step 1e-2, an error
threshold of 1e-3 scaled by max(|analytic|, |numeric|, 1), kinks skipped."""
import numpy as np

from caffepar.graph.net import Net, TEST


def check_net_gradients(net_text, inputs, step=1e-2, threshold=1e-3, kink=None, kink_range=-1,
                        seed=7, check_params=True, skip_bottoms=(), phase=TEST, prepare=None):
    """Build the net in float64, then compare backward against numeric derivatives of the
    objective sum(w_top * top) (random fixed w_top per output; loss outputs use their weight)."""
    net = _build(net_text, phase)
    if prepare:
        prepare(net)
    rng = np.random.default_rng(seed)
    for name, value in inputs.items():
        net.blobs[name].reshape(value.shape)
        net.blobs[name].data[...] = value
    net.reshape()
    net.forward_from_to()
    weights = {}
    for name in net.outputs:
        blob = net.blobs[name]
        lw = net.blob_loss_weights.get(name, 0.0)
        weights[name] = np.full(blob.shape, lw) if lw else rng.standard_normal(blob.shape)

    stored = {name: net.blobs[name].data.copy() for name in net.inputs}

    def objective():
        for name, value in stored.items():
            net.blobs[name].data[...] = value
        net.forward_from_to()
        return sum(float(np.sum(net.blobs[n].data * w)) for n, w in weights.items())

    def analytic():
        for blob in net.blobs.values():
            blob.diff[...] = 0
        net.clear_param_diffs()
        objective()
        for n, w in weights.items():
            net.blobs[n].diff[...] = w
        net.backward_from_to()

    analytic()
    targets = []
    for name in net.inputs:
        if name not in skip_bottoms:
            targets.append((f"bottom {name}", stored[name], net.blobs[name].diff.copy()))
    if check_params:
        for lname, blobs in net.params.items():
            for i, b in enumerate(blobs):
                targets.append((f"param {lname}/{i}", b.data, b.diff.copy()))
    failures = []
    for label, values, grad in targets:
        flat = values.reshape(-1)
        g = grad.reshape(-1)
        for k in range(flat.size):
            x0 = flat[k]
            if kink is not None and abs(x0 - kink) < kink_range:
                continue
            flat[k] = x0 + step
            fp = objective()
            flat[k] = x0 - step
            fm = objective()
            flat[k] = x0
            numeric = (fp - fm) / (2 * step)
            scale = max(abs(numeric), abs(g[k]), 1.0)
            if abs(numeric - g[k]) > threshold * scale:
                failures.append(f"{label}[{k}]: analytic {g[k]:.6g} numeric {numeric:.6g}")
    objective()
    assert not failures, f"{len(failures)} gradient mismatches, first: " + "; ".join(failures[:5])
    return net


def _build(net_text, phase):
    """A float64 Net from prototxt text."""
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import parse_text
    return Net(parse_text(net_text, caffe_pb2.NetParameter()), phase=phase, dtype=np.float64)
