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
    """Per output blob: the largest absolute difference and the largest |caffepar value|.
    `untested`: why the comparison, however close, tested nothing (None when it did)."""

    max_abs: dict
    scale: dict
    tolerance: float
    untested: str = None

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
                input_shapes=None, informative=False):
    """Compare onnxruntime on `result.model` (an ExportResult) with result.net's forward.

    The tolerance is absolute for outputs up to 1 in magnitude and relative above that, since
    raw class scores of a deep net can be large where probabilities are not. `input_shapes`
    (or the shapes of `inputs`) other than the net's: both run at that size (a graph with a
    free batch or spatial size), and the net is put back to its own afterwards. Random inputs
    are standard normal, but for the regions of a ROIPooling layer (valid_regions). The
    result's `untested` says why the comparison tested nothing: most of caffepar's blobs not
    finite, or (`informative`: one more forward pass of caffepar's) outputs that another
    random input leaves unchanged.
    """
    if not have_onnxruntime():
        raise CaffeparError("--verify needs onnxruntime: pip install 'caffepar[onnx]'")
    net = result.net
    if inputs is not None:
        input_shapes = {n: tuple(v.shape) for n, v in inputs.items()}
    own = {n: tuple(net.blobs[n].shape) for n in net.inputs}
    if not input_shapes or all(own[n] == tuple(s) for n, s in input_shapes.items()):
        return _verify(result, seed, tolerance, inputs, all_blobs, informative)
    try:
        for name, shape in input_shapes.items():
            net.blobs[name].reshape(tuple(shape))
        net.reshape()
        return _verify(result, seed, tolerance, inputs, all_blobs, informative)
    finally:
        for name, shape in own.items():
            net.blobs[name].reshape(shape)
        net.reshape()


def _batchnorm_without_statistics(net):
    """Names of BatchNorm layers whose stored statistics were never set (factor 0)."""
    return [layer.name for layer in net.layers
            if layer.type == "BatchNorm" and len(layer.blobs) == 3
            and not np.asarray(layer.blobs[2].data).any()]


#: Layers whose second bottom holds regions: rows of (batch index, x1, y1, x2, y2).
REGION_LAYERS = ("ROIPooling", "PSROIPooling")
_PASS_THROUGH = ("Split", "Reshape", "Flatten")


def _source_input(net, layer_index, blob):
    """The net input `blob` comes from through Split/Reshape/Flatten layers, or None."""
    i = layer_index
    while blob not in net.input_ids:
        i = next((j for j in range(i - 1, -1, -1) if blob in net.top_ids[j]), None)
        if i is None or net.layers[i].type not in _PASS_THROUGH or len(net.bottom_ids[i]) != 1:
            return None
        blob = net.bottom_ids[i][0]
    return blob


def region_inputs(net):
    """{input name: (the features' blob id, the region layer)} for the net's inputs that hold
    a region pooling layer's regions."""
    out = {}
    for i, layer in enumerate(net.layers):
        if layer.type in REGION_LAYERS and len(net.bottom_ids[i]) == 2:
            source = _source_input(net, i, net.bottom_ids[i][1])
            if source is not None:
                out.setdefault(net.blob_names[source], (net.bottom_ids[i][0], layer))
    return out


def valid_regions(rng, shape, images, height, width):
    """Regions of `shape` (rows of 5) as a detector feeds them: batch index in 0..images-1,
    x1 <= x2 and y1 <= y2, inside a height x width image."""
    rows = int(np.prod(shape)) // 5
    x = np.sort(rng.uniform(0, max(width - 1, 0), (rows, 2)), axis=1)
    y = np.sort(rng.uniform(0, max(height - 1, 0), (rows, 2)), axis=1)
    batch = rng.randint(0, max(images, 1), rows)
    regions = np.stack([batch, x[:, 0], y[:, 0], x[:, 1], y[:, 1]], axis=1)
    return regions.astype(np.float32).reshape(shape)


def random_inputs(net, seed=0):
    """Standard normal values for the net's inputs at their current shapes, but valid regions
    for an input that feeds a region pooling layer (an image the features' size over the
    layer's spatial_scale)."""
    rng = np.random.RandomState(seed)
    regions = region_inputs(net)
    out = {}
    for name in net.inputs:
        shape = net.blobs[name].shape
        if name in regions:
            features, layer = regions[name]
            n, _c, h, w = net.blob_list[features].shape
            scale = float(layer.scale) or 1.0
            out[name] = valid_regions(rng, shape, n, h / scale, w / scale)
        else:
            out[name] = rng.randn(*shape).astype(np.float32)
    return out


def _ort_message(error):
    """onnxruntime's error text as one line, without its source file paths."""
    import re
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"\S*onnxruntime\S*\.(?:cc|h|cpp):\d+ (?:\S+ )?", "", text)
    text = re.sub(r"[\w:<>~]+::[\w~<>]+\([^()]*\)(?: const)? (?:\[with [^]]*\] )?", "",
                  text)                                                 # C++ signatures
    return text[:400]


def _session(ort, source, options):
    try:
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own classes of error
        raise CaffeparError(f"onnxruntime cannot load the exported model: {_ort_message(e)}") \
            from None


def _untested(net, outputs):
    """Why a comparison of these outputs tests nothing: most blobs not finite, or None."""
    ids = [i for i, name in enumerate(net.blob_names)
           if i not in net.input_ids and name != "(automatic)"]
    bad = [net.blob_names[i] for i in ids if not np.isfinite(net.blob_list[i].data).all()]
    if 2 * len(bad) > len(ids):
        return (f"{len(bad)} of the {len(ids)} blobs of caffepar's forward pass on random input "
                f"hold NaN or infinite values (the first: '{bad[0]}'), so outputs "
                f"{', '.join(repr(o) for o in outputs)} hold no computed values to compare")
    return None


def _verify(result, seed, tolerance, inputs, all_blobs, informative):
    import onnxruntime as ort
    net = result.net
    if inputs is None:
        inputs = random_inputs(net, seed)
    options = ort.SessionOptions()
    options.log_severity_level = 4      # its errors come back as one line of ours
    rename = {}
    if all_blobs:
        model, rename = _with_blob_outputs(result)
        session = _session(ort, model.SerializeToString(), options)
    elif result.path is not None:
        session = _session(ort, result.path, options)
    else:
        session = _session(ort, result.model.SerializeToString(), options)
    names = [o.name for o in session.get_outputs()]
    # Graph outputs come in the order of the net's outputs (names may differ when an output
    # is an input changed in place); extra outputs map back through `rename`.
    blobs = list(result.outputs) + [rename[n] for n in names[len(result.outputs):]]
    try:
        values = session.run(names, inputs)
    except Exception as e:  # onnxruntime raises its own classes of error
        raise CaffeparError(f"onnxruntime cannot run the exported model on the inputs "
                            f"{', '.join(f'{k} {v.shape}' for k, v in inputs.items())}: "
                            f"{_ort_message(e)}") from None
    got = dict(zip(blobs, values))
    names = blobs
    _forward(net, inputs)
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
    untested = _untested(net, result.outputs)
    if untested is None and informative:
        untested = _constant(net, result.outputs, seed)
    return VerifyResult(max_abs, scale, tolerance, untested)


def _forward(net, inputs):
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    with np.errstate(all="ignore"):     # a non-finite output is reported below, in one line
        net.forward_from_to()


def _constant(net, outputs, seed):
    """Why the outputs test nothing when another random input leaves them as they are (the
    weights of a net with no filler are all zeros), or None."""
    first = {n: net.blobs[n].data.copy() for n in outputs}
    _forward(net, random_inputs(net, seed + 1))
    if all(np.array_equal(first[n], net.blobs[n].data) for n in outputs):
        shown = ", ".join(repr(n) for n in outputs)
        return (f"another random input gives the same {shown}: the outputs do not depend on "
                "the input (are the weights placeholders, all zeros?)")
    return None
