"""Run an exported ONNX model in onnxruntime beside caffepar's own forward pass and compare.

onnxruntime is an optional extra (`pip install 'caffepar[onnx]'`); the comparison feeds both
the same seeded random input, so a failure is reproducible.
"""
from dataclasses import dataclass

import numpy as np

from caffepar.errors import CaffeparError

__all__ = ["VerifyResult", "verify_onnx", "have_onnxruntime"]


def have_onnxruntime():
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class VerifyResult:
    """Per output blob: the largest absolute difference and the largest |caffepar value|."""

    max_abs: dict
    scale: dict
    tolerance: float

    @property
    def ok(self):
        return all(d <= self.tolerance * max(1.0, self.scale[k]) for k, d in self.max_abs.items())

    def lines(self):
        return [f"{name}: max |onnxruntime - caffepar| = {d:.3g} (max |value| {self.scale[name]:.3g})"
                for name, d in self.max_abs.items()]


def _with_blob_outputs(result):
    """A copy of the model that also outputs every intermediate Caffe blob's final value, so a
    mismatch is caught where it starts, not after a softmax has flattened it."""
    from onnx import TensorProto, helper
    model = type(result.model)()
    model.CopyFrom(result.model)
    have = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    extra = {}
    for blob, tensor in result.blob_tensors.items():
        if tensor in have or blob in result.net.inputs:
            continue
        have.add(tensor)
        extra[tensor] = blob
        model.graph.output.append(helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None))
    return model, extra


def verify_onnx(result, seed=0, tolerance=1e-4, inputs=None, all_blobs=False,
                input_shapes=None):
    """Compare onnxruntime on `result.model` (an ExportResult) with result.net's forward.

    The tolerance is absolute for outputs up to 1 in magnitude and relative above that, since
    raw class scores of a deep net can be large where probabilities are not. `input_shapes`
    (or the shapes of `inputs`) other than the net's: both run at that size (a graph with a
    free batch or spatial size), and the net is put back to its own afterwards.
    """
    if not have_onnxruntime():
        raise CaffeparError("--verify needs onnxruntime: pip install 'caffepar[onnx]'")
    net = result.net
    if inputs is not None:
        input_shapes = {n: tuple(v.shape) for n, v in inputs.items()}
    own = {n: tuple(net.blobs[n].shape) for n in net.inputs}
    if not input_shapes or all(own[n] == tuple(s) for n, s in input_shapes.items()):
        return _verify(result, seed, tolerance, inputs, all_blobs)
    try:
        for name, shape in input_shapes.items():
            net.blobs[name].reshape(tuple(shape))
        net.reshape()
        return _verify(result, seed, tolerance, inputs, all_blobs)
    finally:
        for name, shape in own.items():
            net.blobs[name].reshape(shape)
        net.reshape()


def _batchnorm_without_statistics(net):
    """Names of BatchNorm layers whose stored statistics were never set (factor 0)."""
    return [layer.name for layer in net.layers
            if layer.type == "BatchNorm" and len(layer.blobs) == 3
            and not np.asarray(layer.blobs[2].data).any()]


def _verify(result, seed, tolerance, inputs, all_blobs):
    import onnxruntime as ort
    net = result.net
    rng = np.random.RandomState(seed)
    if inputs is None:
        inputs = {n: rng.randn(*net.blobs[n].shape).astype(np.float32) for n in net.inputs}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    rename = {}
    if all_blobs:
        model, rename = _with_blob_outputs(result)
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
    elif result.path is not None:
        session = ort.InferenceSession(result.path, options, providers=["CPUExecutionProvider"])
    else:
        session = ort.InferenceSession(result.model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    # Graph outputs come in the order of the net's outputs (names may differ when an output
    # is an input changed in place); extra outputs map back through `rename`.
    blobs = list(result.outputs) + [rename[n] for n in names[len(result.outputs):]]
    got = dict(zip(blobs, session.run(names, inputs)))
    names = blobs
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    with np.errstate(all="ignore"):     # a non-finite output is reported below, in one line
        net.forward_from_to()
    bad = [n for n in names if not np.isfinite(net.blobs[n].data).all()]
    if bad:
        what = f"caffepar's own output {', '.join(repr(n) for n in bad)} is not finite (NaN " \
            "or infinite) on random input, so there is nothing to compare onnxruntime with"
        empty = _batchnorm_without_statistics(net)
        if empty:
            raise CaffeparError(
                f"{what}: BatchNorm layer(s) {', '.join(empty)} have no statistics (mean and "
                "variance 0 with a moving-average factor of 0: the weights file has none for "
                "them and --allow-missing kept the defaults); give weights that hold them")
        raise CaffeparError(f"{what}: check the weights (a diverged snapshot?)")
    max_abs, scale = {}, {}
    for name in names:
        ref = net.blobs[name].data
        if got[name].shape != ref.shape:
            raise CaffeparError(f'output "{name}": onnxruntime gives shape {got[name].shape}, '
                                f"caffepar {ref.shape}")
        max_abs[name] = float(np.max(np.abs(got[name] - ref))) if ref.size else 0.0
        scale[name] = float(np.max(np.abs(ref))) if ref.size else 0.0
    return VerifyResult(max_abs, scale, tolerance)
