"""pycaffe's net drawing: a NetParameter as a Graphviz graph of layer and blob nodes.

Needs pydot (`pip install 'caffepar[draw]'`); images need Graphviz's `dot` program as well,
while a `.raw` file is the graph's dot source and needs only pydot. This module imports without
either and says what is missing when asked to draw. Layers are boxes (coloured by type, green
when in place), blobs octagons; edges out of Convolution, Deconvolution and InnerProduct layers
carry num_output, out of Data layers the batch size. Old V0/V1 nets are upgraded first.
"""
import shutil

from caffepar.errors import CaffeparError
from caffepar.proto import caffe_pb2
from caffepar.proto.upgrade import upgrade_net

__all__ = ["get_pydot_graph", "draw_net", "draw_net_to_file", "get_layer_label",
           "get_edge_label", "get_layer_lr_mult", "choose_color_by_layertype"]

LAYER_STYLE = {"shape": "record", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
_LAYER_COLORS = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
                 "InnerProduct": "#CC33FF"}
_LEARNING_TYPES = ("Convolution", "Deconvolution", "InnerProduct")


class DrawError(CaffeparError, ImportError):
    """pydot or Graphviz is missing."""


def _pydot():
    try:
        import pydot
    except ImportError:
        raise DrawError("drawing a net needs pydot: pip install 'caffepar[draw]' "
                        "(or pip install pydot)") from None
    return pydot


def choose_color_by_layertype(layer_type):
    return _LAYER_COLORS.get(layer_type, "#6495ED")


def get_edge_label(layer):
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return ""


def get_layer_lr_mult(layer):
    """(weights, bias) learning-rate multipliers of a Convolution, Deconvolution or
    InnerProduct layer; 1.0 where its param specs say nothing."""
    if layer.type not in _LEARNING_TYPES:
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    if len(layer.param) > 2:
        raise ValueError(f'layer "{layer.name}" has {len(layer.param)} param specs, expected '
                         "at most 2")
    mults = [p.lr_mult for p in layer.param]
    return tuple(mults + [1.0] * (2 - len(mults)))


def _spatial(layer):
    """(kernel size, stride, pad) along the first spatial axis."""
    if layer.type == "Pooling":
        p = layer.pooling_param
        return p.kernel_size, p.stride, p.pad
    p = layer.convolution_param
    return (p.kernel_size[0] if p.kernel_size else 1, p.stride[0] if p.stride else 1,
            p.pad[0] if p.pad else 0)


def get_layer_label(layer, rankdir, display_lrm=False):
    """The text of a layer's node: name, type, kernel/stride/pad, optionally lr multipliers;
    one item a line when the graph runs left to right, spaces when it runs top to bottom."""
    separator = " " if rankdir in ("TB", "BT") else "\n"
    parts = [layer.name]
    if layer.type == "Pooling":
        method = caffe_pb2.PoolingParameter.PoolMethod.Name(layer.pooling_param.pool)
        parts.append(f"({layer.type} {method})")
    else:
        parts.append(f"({layer.type})")
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        kernel, stride, pad = _spatial(layer)
        parts.append(separator.join([f"kernel size: {kernel}", f"stride: {stride}",
                                     f"pad: {pad}"]))
    if display_lrm and layer.type in _LEARNING_TYPES:
        weights, bias = get_layer_lr_mult(layer)
        if weights or bias:
            parts.append(f"lr mult: {weights:.1f}, {bias:.1f}")
    return separator.join(parts)


def _in_phase(layer, phase):
    """pycaffe's phase filter: include/exclude rules judged on their phase alone (a rule with
    no phase matches every phase)."""
    if phase is None:
        return True
    if layer.include and layer.exclude:
        raise ValueError(f"layer {layer.name} has both include and exclude specified.")

    def matches(rule):
        return not rule.HasField("phase") or rule.phase == phase

    if layer.include:
        return any(matches(r) for r in layer.include)
    return not any(matches(r) for r in layer.exclude)


def _quoted(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False):
    """A pydot.Dot of the net (a caffe_pb2.NetParameter); `phase` keeps only that phase's
    layers (None: all)."""
    pydot = _pydot()
    if len(caffe_net.layers):
        caffe_net, _ = upgrade_net(caffe_net)
    graph = pydot.Dot(_quoted(caffe_net.name or "Net"), graph_type="digraph", rankdir=rankdir)
    nodes, edges = {}, []

    def blob(name):
        key = _quoted(name + "_blob")
        nodes.setdefault(key, pydot.Node(key, label=_quoted(name), **BLOB_STYLE))
        return key

    for layer in caffe_net.layer:
        if not _in_phase(layer, phase):
            continue
        key = _quoted(f"{layer.name}_{layer.type}")
        label = _quoted(get_layer_label(layer, rankdir, display_lrm))
        in_place = len(layer.bottom) == 1 and list(layer.bottom) == list(layer.top)
        style = NEURON_LAYER_STYLE if in_place else \
            dict(LAYER_STYLE, fillcolor=choose_color_by_layertype(layer.type))
        nodes[key] = pydot.Node(key, label=label, **style)
        for name in layer.bottom:
            edges.append((blob(name), key, ""))
        edge_label = get_edge_label(layer) if label_edges else ""
        for name in layer.top:
            edges.append((key, blob(name), edge_label))
    for node in nodes.values():
        graph.add_node(node)
    for src, dst, label in edges:
        graph.add_edge(pydot.Edge(src, dst, label=_quoted(label)))
    return graph


def draw_net(caffe_net, rankdir, ext="png", phase=None, display_lrm=False):
    """The drawing as bytes in Graphviz output format `ext`; "raw" gives the dot source."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    if ext == "raw":
        return graph.to_string().encode()
    if shutil.which("dot") is None:
        raise DrawError(f"drawing a .{ext} file needs Graphviz's dot program (e.g. apt-get "
                        "install graphviz); a .raw file needs only pydot")
    return graph.create(format=ext)


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False):
    """Draw the net into `filename`, in the format its extension names (.png, .svg, .pdf, ...;
    .raw for the dot source)."""
    ext = filename[filename.rfind(".") + 1:]
    image = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as f:
        f.write(image)
