"""Upgrade deprecated Caffe net and solver messages to the current schema.

Old model zoo files still use the V0 (``layers { layer { type: "conv" } }``) and V1
(``layers { type: CONVOLUTION blobs_lr: 1 }``) layouts, data-transformation fields inside the
data parameters, top-level ``input``/``input_dim`` fields and the ``solver_type`` enum. Caffe
rewrites all of these on load (``upgrade_proto.cpp``); doing exactly the same here means an old
file builds the same net, with the same weights, as it does in Caffe.

Every public function is pure: it returns a new message and a list of notes describing what was
changed, and never touches its argument. Problems Caffe treats as fatal raise ``PrototxtError``;
problems Caffe only logs ("continuing anyway") become notes starting with ``warning:``.
"""
from caffepar.errors import PrototxtError
from caffepar.proto import caffe_pb2

__all__ = [
    "V0_TYPE_NAMES",
    "V1_TYPE_NAMES",
    "SOLVER_TYPE_NAMES",
    "net_needs_upgrade",
    "upgrade_net",
    "solver_needs_upgrade",
    "upgrade_solver",
]

V1_TYPE_NAMES = {
    "ABSVAL": "AbsVal",
    "ACCURACY": "Accuracy",
    "ARGMAX": "ArgMax",
    "BNLL": "BNLL",
    "CONCAT": "Concat",
    "CONTRASTIVE_LOSS": "ContrastiveLoss",
    "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution",
    "DATA": "Data",
    "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss",
    "ELTWISE": "Eltwise",
    "EXP": "Exp",
    "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data",
    "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss",
    "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss",
    "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN",
    "MEMORY_DATA": "MemoryData",
    "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN",
    "POOLING": "Pooling",
    "POWER": "Power",
    "RELU": "ReLU",
    "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss",
    "SILENCE": "Silence",
    "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss",
    "SPLIT": "Split",
    "SLICE": "Slice",
    "TANH": "TanH",
    "WINDOW_DATA": "WindowData",
    "THRESHOLD": "Threshold",
}
"""V1 ``LayerType`` enum name -> V2 type string. ``NONE`` is left out: Caffe turns it into the
empty type string, which names no layer."""

V0_TYPE_NAMES = {
    "accuracy": "ACCURACY",
    "bnll": "BNLL",
    "concat": "CONCAT",
    "conv": "CONVOLUTION",
    "data": "DATA",
    "dropout": "DROPOUT",
    "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN",
    "hdf5_data": "HDF5_DATA",
    "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL",
    "images": "IMAGE_DATA",
    "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT",
    "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS",
    "pool": "POOLING",
    "relu": "RELU",
    "sigmoid": "SIGMOID",
    "softmax": "SOFTMAX",
    "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT",
    "tanh": "TANH",
    "window_data": "WINDOW_DATA",
}
"""V0 type string -> V1 ``LayerType`` enum name. V0 ``"padding"`` layers have no V1 form: they
are folded into the convolution or pooling layer they feed."""

SOLVER_TYPE_NAMES = {
    "SGD": "SGD",
    "NESTEROV": "Nesterov",
    "ADAGRAD": "AdaGrad",
    "RMSPROP": "RMSProp",
    "ADADELTA": "AdaDelta",
    "ADAM": "Adam",
}
"""``SolverParameter.SolverType`` enum name -> solver ``type`` string."""

_V1 = caffe_pb2.V1LayerParameter
_MIXED_MESSAGE = (
    "net mixes 'layer' (V2) and 'layers' (V1) fields; Caffe refuses to upgrade such a net. "
    "Write every layer as `layer { type: \"Convolution\" ... }`, or upgrade an all-V1 file "
    "with `caffepar convert upgrade`"
)

# V0 field -> {V0 type: (V1 parameter message, field in it)}; None names the V1 layer itself.
_V0_TYPED_FIELDS = (
    ("num_output", {"conv": ("convolution_param", "num_output"),
                    "innerproduct": ("inner_product_param", "num_output")}),
    ("biasterm", {"conv": ("convolution_param", "bias_term"),
                  "innerproduct": ("inner_product_param", "bias_term")}),
    ("weight_filler", {"conv": ("convolution_param", "weight_filler"),
                       "innerproduct": ("inner_product_param", "weight_filler")}),
    ("bias_filler", {"conv": ("convolution_param", "bias_filler"),
                     "innerproduct": ("inner_product_param", "bias_filler")}),
    ("pad", {"conv": ("convolution_param", "pad"), "pool": ("pooling_param", "pad")}),
    ("kernelsize", {"conv": ("convolution_param", "kernel_size"),
                    "pool": ("pooling_param", "kernel_size")}),
    ("group", {"conv": ("convolution_param", "group")}),
    ("stride", {"conv": ("convolution_param", "stride"), "pool": ("pooling_param", "stride")}),
    ("pool", {"pool": ("pooling_param", "pool")}),
    ("dropout_ratio", {"dropout": ("dropout_param", "dropout_ratio")}),
    ("local_size", {"lrn": ("lrn_param", "local_size")}),
    ("alpha", {"lrn": ("lrn_param", "alpha")}),
    ("beta", {"lrn": ("lrn_param", "beta")}),
    ("k", {"lrn": ("lrn_param", "k")}),
    ("source", {"data": ("data_param", "source"),
                "hdf5_data": ("hdf5_data_param", "source"),
                "images": ("image_data_param", "source"),
                "window_data": ("window_data_param", "source"),
                "infogain_loss": ("infogain_loss_param", "source")}),
    ("batchsize", {"data": ("data_param", "batch_size"),
                   "hdf5_data": ("hdf5_data_param", "batch_size"),
                   "images": ("image_data_param", "batch_size"),
                   "window_data": ("window_data_param", "batch_size")}),
    ("rand_skip", {"data": ("data_param", "rand_skip"),
                   "images": ("image_data_param", "rand_skip")}),
    ("shuffle_images", {"images": ("image_data_param", "shuffle")}),
    ("new_height", {"images": ("image_data_param", "new_height")}),
    ("new_width", {"images": ("image_data_param", "new_width")}),
    ("concat_dim", {"concat": ("concat_param", "concat_dim")}),
    ("det_fg_threshold", {"window_data": ("window_data_param", "fg_threshold")}),
    ("det_bg_threshold", {"window_data": ("window_data_param", "bg_threshold")}),
    ("det_fg_fraction", {"window_data": ("window_data_param", "fg_fraction")}),
    ("det_context_pad", {"window_data": ("window_data_param", "context_pad")}),
    ("det_crop_mode", {"window_data": ("window_data_param", "crop_mode")}),
    ("hdf5_output_param", {"hdf5_output": (None, "hdf5_output_param")}),
)

# V0 transformation fields go to transform_param whatever the layer type.
_V0_TRANSFORM_FIELDS = (
    ("scale", "scale"),
    ("meanfile", "mean_file"),
    ("cropsize", "crop_size"),
    ("mirror", "mirror"),
)

_DATA_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")
_DATA_LAYER_PARAMS = {
    _V1.DATA: "data_param",
    _V1.IMAGE_DATA: "image_data_param",
    _V1.WINDOW_DATA: "window_data_param",
}

# The per-type parameter messages Caffe carries from a V1 layer to a V2 layer; any other
# V1 field is dropped, as in Caffe.
_V1_COPIED_PARAMS = (
    "accuracy_param", "argmax_param", "concat_param", "contrastive_loss_param",
    "convolution_param", "data_param", "dropout_param", "dummy_data_param", "eltwise_param",
    "exp_param", "hdf5_data_param", "hdf5_output_param", "hinge_loss_param",
    "image_data_param", "infogain_loss_param", "inner_product_param", "lrn_param",
    "memory_data_param", "mvn_param", "pooling_param", "power_param", "relu_param",
    "sigmoid_param", "softmax_param", "slice_param", "tanh_param", "threshold_param",
    "window_data_param", "transform_param", "loss_param",
)


def _where(source):
    return source if source else "net"


def _copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


# ---------------------------------------------------------------------------- detection


def _needs_v0_to_v1(net):
    return any(layer.HasField("layer") for layer in net.layers)


def _needs_data_upgrade(net):
    for layer in net.layers:
        param_name = _DATA_LAYER_PARAMS.get(layer.type)
        if param_name is None:
            continue
        param = getattr(layer, param_name)
        if any(param.HasField(f) for f in _DATA_TRANSFORM_FIELDS):
            return True
    return False


def _needs_v1_to_v2(net):
    return len(net.layers) > 0


def _needs_input_upgrade(net):
    return len(net.input) > 0


def _needs_batchnorm_upgrade(net):
    return any(layer.type == "BatchNorm" and len(layer.param) == 3 for layer in net.layer)


def net_needs_upgrade(net):
    """True when Caffe would rewrite this NetParameter on load.

    Like Caffe, a BatchNorm layer with exactly three ``param`` specs always counts, even after
    its multipliers have been zeroed, because that is all Caffe checks.
    """
    return (_needs_v0_to_v1(net) or _needs_v1_to_v2(net) or _needs_data_upgrade(net)
            or _needs_input_upgrade(net) or _needs_batchnorm_upgrade(net))


# ---------------------------------------------------------------------------- V0 -> V1


def _fold_padding_layers(net, source):
    """Drop V0 "padding" layers, moving their pad into the conv/pool layer that reads them."""
    out = _copy(net)
    del out.layers[:]
    last_producer = {name: -1 for name in net.input}
    for i, connection in enumerate(net.layers):
        v0_type = connection.layer.type
        if v0_type != "padding":
            out.layers.add().CopyFrom(connection)
        for j, blob in enumerate(connection.bottom):
            if blob not in last_producer:
                raise PrototxtError(
                    f'V0 layer {i} ("{connection.layer.name}") reads unknown blob "{blob}"',
                    path=source)
            producer_idx = last_producer[blob]
            if producer_idx == -1:
                continue
            producer = net.layers[producer_idx]
            if producer.layer.type != "padding":
                continue
            if v0_type not in ("conv", "pool"):
                raise PrototxtError(
                    f'V0 padding layer "{producer.layer.name}" feeds layer '
                    f'"{connection.layer.name}" of type "{v0_type}"; only "conv" and "pool" '
                    "layers can absorb padding", path=source)
            if len(connection.bottom) != 1:
                raise PrototxtError(
                    f'V0 layer "{connection.layer.name}" reads a padding layer, so it must '
                    "have exactly one bottom", path=source)
            if len(producer.bottom) != 1 or len(producer.top) != 1:
                raise PrototxtError(
                    f'V0 padding layer "{producer.layer.name}" must have exactly one bottom '
                    "and one top", path=source)
            folded = out.layers[len(out.layers) - 1]
            folded.layer.pad = producer.layer.pad
            folded.bottom[j] = producer.bottom[0]
        for blob in connection.top:
            last_producer[blob] = i
    return out


def _assign(target, field_name, source_message, source_field):
    """Copy one field value across messages, matching enums by name and appending to repeats."""
    value = getattr(source_message, source_field)
    src_fd = source_message.DESCRIPTOR.fields_by_name[source_field]
    dst_fd = target.DESCRIPTOR.fields_by_name[field_name]
    if dst_fd.message_type is not None:
        getattr(target, field_name).CopyFrom(value)
        return
    if dst_fd.enum_type is not None and src_fd.enum_type is not None:
        name = src_fd.enum_type.values_by_number[value].name
        value = dst_fd.enum_type.values_by_name[name].number
    if dst_fd.is_repeated:
        getattr(target, field_name).append(value)
    else:
        setattr(target, field_name, value)


def _upgrade_v0_layer(connection, notes, source):
    """One V0 ``layers`` entry as a V1 layer; returns (layer, fully_compatible)."""
    out = caffe_pb2.V1LayerParameter()
    out.bottom.extend(connection.bottom)
    out.top.extend(connection.top)
    if not connection.HasField("layer"):
        return out, True
    v0 = connection.layer
    ok = True
    if v0.HasField("name"):
        out.name = v0.name
    v0_type = v0.type
    if v0.HasField("type"):
        if v0_type not in V0_TYPE_NAMES:
            raise PrototxtError(f'V0 layer "{v0.name}" has unknown type "{v0_type}"', path=source)
        out.type = _V1.LayerType.Value(V0_TYPE_NAMES[v0_type])
    for blob in v0.blobs:
        out.blobs.add().CopyFrom(blob)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for v0_field, targets in _V0_TYPED_FIELDS:
        if not v0.HasField(v0_field):
            continue
        target = targets.get(v0_type)
        if target is None:
            notes.append(f'warning: {_where(source)}: V0 layer "{v0.name}": parameter '
                         f'{v0_field} does not apply to layer type "{v0_type}"; dropped')
            ok = False
            continue
        param_name, field_name = target
        holder = out if param_name is None else getattr(out, param_name)
        _assign(holder, field_name, v0, v0_field)
    for v0_field, field_name in _V0_TRANSFORM_FIELDS:
        if v0.HasField(v0_field):
            _assign(out.transform_param, field_name, v0, v0_field)
    return out, ok


def _upgrade_v0_net(net, notes, source):
    padded = _fold_padding_layers(net, source)
    out = caffe_pb2.NetParameter()
    if padded.HasField("name"):
        out.name = padded.name
    ok = True
    for connection in padded.layers:
        layer, layer_ok = _upgrade_v0_layer(connection, notes, source)
        out.layers.add().CopyFrom(layer)
        ok &= layer_ok
    out.input.extend(padded.input)
    out.input_dim.extend(padded.input_dim)
    if padded.HasField("force_backward"):
        out.force_backward = padded.force_backward
    return out, ok


# ---------------------------------------------------------------------------- data transform


def _upgrade_data_transformation(net):
    """Move scale/mean_file/crop_size/mirror out of V1 data parameters into transform_param."""
    for layer in net.layers:
        param_name = _DATA_LAYER_PARAMS.get(layer.type)
        if param_name is None:
            continue
        param = getattr(layer, param_name)
        param.SetInParent()
        layer.transform_param.SetInParent()
        for field in _DATA_TRANSFORM_FIELDS:
            if param.HasField(field):
                setattr(layer.transform_param, field, getattr(param, field))
                param.ClearField(field)


# ---------------------------------------------------------------------------- V1 -> V2


def _upgrade_v1_layer(v1, index, notes, source):
    """One V1 layer as a V2 LayerParameter; returns (layer, fully_compatible)."""
    out = caffe_pb2.LayerParameter()
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    if v1.HasField("name"):
        out.name = v1.name
    for rule in v1.include:
        out.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        out.exclude.add().CopyFrom(rule)
    if v1.HasField("type"):
        enum_name = _V1.LayerType.Name(v1.type)
        out.type = "" if enum_name == "NONE" else V1_TYPE_NAMES[enum_name]
    for blob in v1.blobs:
        out.blobs.add().CopyFrom(blob)

    def spec(i):
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        spec(i).share_mode = caffe_pb2.ParamSpec.DimCheckMode.Value(
            _V1.DimCheckMode.Name(mode))
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for param_name in _V1_COPIED_PARAMS:
        if v1.HasField(param_name):
            getattr(out, param_name).CopyFrom(getattr(v1, param_name))
    if v1.HasField("layer"):
        notes.append(f"warning: {_where(source)}: V1 layer {index} "
                     f'("{v1.name}") still holds a V0 layer definition; ignored')
        return out, False
    return out, True


def _upgrade_v1_net(net, notes, source):
    out = _copy(net)
    out.ClearField("layers")
    out.ClearField("layer")
    ok = True
    for i, v1 in enumerate(net.layers):
        layer, layer_ok = _upgrade_v1_layer(v1, i, notes, source)
        out.layer.add().CopyFrom(layer)
        ok &= layer_ok
    return out, ok


# ---------------------------------------------------------------------------- input fields


def _upgrade_input(net, source):
    """Turn top-level input/input_shape/input_dim into a leading Input layer named "input".

    A bare ``input`` without shapes (as in old caffemodels) is simply dropped.
    """
    has_shape = len(net.input_shape) > 0
    has_dim = len(net.input_dim) > 0
    if has_shape or has_dim:
        count = len(net.input)
        if has_shape and len(net.input_shape) < count:
            raise PrototxtError(
                f"net declares {count} input(s) but only {len(net.input_shape)} input_shape",
                path=source)
        if not has_shape and len(net.input_dim) < 4 * count:
            raise PrototxtError(
                f"net declares {count} input(s), which need {4 * count} input_dim values, "
                f"but has {len(net.input_dim)}", path=source)
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, blob in enumerate(net.input):
            layer.top.append(blob)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i:4 * i + 4])
        existing = [_copy(layer) for layer in net.layer]
        del net.layer[:]
        net.layer.add().CopyFrom(layer)
        net.layer.extend(existing)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")


def _upgrade_batchnorm(net):
    """Zero lr_mult/decay_mult of the three params old BatchNorm definitions declared.

    Caffe's BatchNorm statistics are not learned; older nets said so with three ``param``
    specs, and Caffe keeps them (and their names) but forces both multipliers to 0.
    """
    for layer in net.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for spec in layer.param:
                spec.lr_mult = 0.0
                spec.decay_mult = 0.0


# ---------------------------------------------------------------------------- public


def upgrade_net(net, source=None, copy=True):
    """Return ``(upgraded NetParameter, notes)`` with every deprecated form rewritten.

    Steps run in Caffe's order: V0 -> V1, data-transformation fields, V1 -> V2, input fields,
    BatchNorm params. ``source`` (a file name) is only used in notes and errors. With
    ``copy=False`` a net that needs no upgrade comes back as it is (a caller that owns it, a
    net of millions of layers: no copy); else always a new message.
    """
    if len(net.layer) > 0 and len(net.layers) > 0:
        raise PrototxtError(_MIXED_MESSAGE, path=source)
    if not copy and not net_needs_upgrade(net):
        return net, []
    where = _where(source)
    out = _copy(net)
    notes = []
    if _needs_v0_to_v1(out):
        out, ok = _upgrade_v0_net(out, notes, source)
        if ok:
            notes.append(f"{where}: upgraded deprecated V0LayerParameter layers to V1")
        else:
            notes.append(f"warning: {where}: V0LayerParameter upgrade had problems "
                         "(see above); continuing anyway")
    if _needs_data_upgrade(out):
        _upgrade_data_transformation(out)
        notes.append(f"{where}: moved deprecated data transformation fields "
                     "(scale, mean_file, crop_size, mirror) into transform_param")
    if _needs_v1_to_v2(out):
        out, ok = _upgrade_v1_net(out, notes, source)
        if ok:
            notes.append(f"{where}: upgraded deprecated V1LayerParameter 'layers' to 'layer'")
        else:
            notes.append(f"warning: {where}: V1LayerParameter upgrade had problems "
                         "(see above); continuing anyway")
    if _needs_input_upgrade(out):
        _upgrade_input(out, source)
        notes.append(f"{where}: replaced deprecated input fields with an Input layer")
    if _needs_batchnorm_upgrade(out):
        _upgrade_batchnorm(out)
        notes.append(f"{where}: set lr_mult and decay_mult to 0 in the params of "
                     "BatchNorm layers using the deprecated three-param definition")
    return out, notes


def solver_needs_upgrade(solver):
    """True when the solver still names its type with the deprecated ``solver_type`` enum."""
    return solver.HasField("solver_type")


def upgrade_solver(solver, source=None):
    """Return ``(upgraded SolverParameter, notes)``: ``solver_type`` enum -> ``type`` string.

    Like Caffe, a solver that sets both fields is refused, even if they agree.
    """
    out = _copy(solver)
    if not solver_needs_upgrade(out):
        return out, []
    enum_name = caffe_pb2.SolverParameter.SolverType.Name(out.solver_type)
    if out.HasField("type"):
        raise PrototxtError(
            f"solver sets both the deprecated solver_type ({enum_name}) and type "
            f'("{out.type}"); keep only type', path=source)
    out.type = SOLVER_TYPE_NAMES[enum_name]
    out.ClearField("solver_type")
    return out, [f'{_where(source)}: replaced deprecated solver_type: {enum_name} '
                 f'with type: "{out.type}"']
