"""ONNX converters for SSD's fork layers, in standard operators (registered into
onnx_export.CONVERTERS).

- Permute is a Transpose; Normalize is ReduceSum/Sqrt/Div/Mul.
- PriorBox depends only on shapes: it becomes a constant (a free height or width is refused).
- DetectionOutput decodes the boxes as the fork does (the width/height exponentials in double,
  as caffepar computes them), cuts each class to its top_k scores, runs ONNX
  NonMaxSuppression, keeps each image's keep_top_k best and writes Caffe's 1 x 1 x K x 7 rows
  (a row [image, -1, ...] per image when nothing is found). Where scores tie, the result may
  differ from Caffe's: at the top_k cut every box tying with the last one kept stays, and
  onnxruntime's NMS visits equal scores of a class in an order of its own (Caffe: lowest
  prior first). keep_top_k's ties are settled as caffepar's stable order settles them. Boxes with
  xmax < xmin (possible with code_type CORNER) count as empty in Caffe but not in ONNX's NMS.
  Adaptive NMS (eta < 1) has no ONNX form and is refused.
"""
import numpy as np

from caffepar.proto import caffe_pb2

CODE = caffe_pb2.PriorBoxParameter


def _scalar(g, base, value, dtype=np.int64):
    """A 0-d initializer (g.const keeps at least one axis)."""
    name = g.fresh(f"{g.layer_name}/{base}")
    g.initializers.append(g.numpy_helper.from_array(np.array(value, dtype), name))
    return name


def _permute(g, ctx):
    return [g.node("Transpose", [ctx.inputs[0]], ctx.outs[0], perm=list(ctx.layer.order))]


def _normalize(g, ctx):
    layer = ctx.layer
    x = ctx.inputs[0]
    ndim = len(ctx.bottom_shapes[0])
    axes = list(range(1, ndim)) if layer.across_spatial else [1]
    sq = g.node("Mul", [x, x])
    total = g.node("ReduceSum", [sq, g.ints("axes", axes)], keepdims=1)
    norm = g.node("Sqrt", [g.node("Add", [total, g.const("eps", np.float32(layer.eps))])])
    unit = g.node("Div", [x, norm])
    scale = np.asarray(layer.blobs[0].data, np.float32)
    if not layer.channel_shared:
        scale = scale.reshape((1, -1) + (1,) * (ndim - 2))
    return [g.node("Mul", [unit, g.const("scale", scale)], ctx.outs[0])]


def _prior_box(g, ctx):
    if tuple(ctx.top_shapes[0]) != tuple(ctx.probe_top_shapes[0]):
        raise ctx.error("PriorBox depends on the input's height and width; export with a "
                        "fixed size (without --dynamic-spatial)")
    layer = ctx.layer
    (_, _, fh, fw), image = ctx.bottom_shapes[0][:4], ctx.bottom_shapes[1]
    priors = layer.priors(fh, fw, image[2] if len(image) > 2 else 1,
                          image[3] if len(image) > 3 else 1)
    return [g.node("Identity", [g.const("priors", priors.reshape(ctx.top_shapes[0]))],
                   ctx.outs[0])]


def _coord(g, t, k):
    """Component k of the last axis (size 4) of t, that axis dropped."""
    return g.node("Gather", [t, _scalar(g, f"c{k}", k)], axis=-1)


def _decode(g, layer, loc, prior, var):
    """Decoded corners [N, P, Cl, 4] from loc [N, P, Cl, 4], prior and var [P, 1, 4]."""
    if layer.variance_in_target:
        offsets = loc
    else:
        offsets = g.node("Mul", [var, loc])
    if layer.code_type == CODE.CORNER:
        return g.node("Add", [prior, offsets])
    p = [_coord(g, prior, k) for k in range(4)]                      # [P, 1]
    pw, ph = g.node("Sub", [p[2], p[0]]), g.node("Sub", [p[3], p[1]])
    if layer.code_type == CODE.CORNER_SIZE:
        size = g.node("Concat", [g.node("Unsqueeze", [s, g.ints("axis", [-1])])
                                 for s in (pw, ph, pw, ph)], axis=-1)
        return g.node("Add", [prior, g.node("Mul", [offsets, size])])
    o = [_coord(g, offsets, k) for k in range(4)]                    # [N, P, Cl]
    two = g.const("two", np.float32(2))
    cx = g.node("Add", [g.node("Mul", [o[0], pw]), g.node("Div", [g.node("Add", [p[0], p[2]]),
                                                                  two])])
    cy = g.node("Add", [g.node("Mul", [o[1], ph]), g.node("Div", [g.node("Add", [p[1], p[3]]),
                                                                  two])])
    f64 = 11  # TensorProto.DOUBLE

    def scaled_exp(v, side):
        e = g.node("Exp", [g.node("Cast", [v], to=f64)])
        return g.node("Cast", [g.node("Mul", [e, g.node("Cast", [side], to=f64)])], to=1)

    hw = g.node("Div", [scaled_exp(o[2], pw), two])
    hh = g.node("Div", [scaled_exp(o[3], ph), two])
    corners = [g.node("Sub", [cx, hw]), g.node("Sub", [cy, hh]), g.node("Add", [cx, hw]),
               g.node("Add", [cy, hh])]
    return g.node("Concat", [g.node("Unsqueeze", [c, g.ints("axis", [-1])]) for c in corners],
                  axis=-1)


def _detection_output(g, ctx):
    layer = ctx.layer
    if layer.eta < 1:
        raise ctx.error(f"adaptive NMS (eta {layer.eta:g} < 1) has no ONNX form")
    p, c, cl = layer.num_priors, layer.num_classes, layer.num_loc_classes
    neg_inf = _scalar(g, "neg_inf", -np.inf, np.float32)
    loc = g.node("Reshape", [ctx.inputs[0], g.ints("loc_shape", [-1, p, cl, 4])])
    pri = g.node("Reshape", [ctx.inputs[2], g.ints("prior_shape", [2, p, 1, 4])])
    prior = g.node("Gather", [pri, _scalar(g, "i0", 0)], axis=0)
    var = g.node("Gather", [pri, _scalar(g, "i1", 1)], axis=0)
    boxes = _decode(g, layer, loc, prior, var)                              # [N, P, Cl, 4]
    if layer.clip:
        boxes = g.node("Clip", [boxes, _scalar(g, "zero_f", 0, np.float32),
                                _scalar(g, "one_f", 1, np.float32)])
    conf = g.node("Reshape", [ctx.inputs[1], g.ints("conf_shape", [-1, p, c])])
    scores = g.node("Transpose", [conf], perm=[0, 2, 1])                    # [N, C, P]
    masked = scores
    if 0 <= layer.background < c:
        keep = np.ones((1, c, 1), bool)
        keep[0, layer.background] = False
        masked = g.node("Where", [g.const("not_background", keep, bool), masked, neg_inf])
    if -1 < layer.top_k < p:
        # Caffe takes each class's top_k scores before NMS: lower ones are out.
        kth = g.node("TopK", [masked, g.ints("k", [max(layer.top_k, 1)])], axis=2)
        g.nodes[-1].output.append(g.fresh(f"{layer.name}/topk_index"))
        last = g.node("Slice", [kth, g.ints("s", [max(layer.top_k, 1) - 1]),
                                g.ints("e", [max(layer.top_k, 1)]), g.ints("a", [2])])
        out = g.node("Less", [masked, last])
        if layer.top_k == 0:
            out = g.const("none", np.ones((1, 1, 1), bool), bool)
        masked = g.node("Where", [out, neg_inf, masked])
    threshold = g.const("score_threshold", np.array([layer.confidence_threshold], np.float32))
    iou = g.const("iou_threshold", np.array([layer.nms_threshold], np.float32))
    most = g.ints("max_boxes", [p])
    if layer.share_location:
        nms_boxes = g.node("Reshape", [boxes, g.ints("boxes_shape", [-1, p, 4])])
        sel = g.node("NonMaxSuppression", [nms_boxes, masked, most, iou, threshold])
        image = g.node("Gather", [sel, _scalar(g, "col0", 0)], axis=1)
        label = g.node("Gather", [sel, _scalar(g, "col1", 1)], axis=1)
        index = g.node("Gather", [sel, _scalar(g, "col2", 2)], axis=1)
        box_at = g.node("Concat", [g.node("Unsqueeze", [t, g.ints("ax1", [1])])
                                   for t in (image, index)], axis=1)
        picked = g.node("GatherND", [nms_boxes, box_at])                  # [M, 4]
    else:
        per_class = g.node("Reshape", [g.node("Transpose", [boxes], perm=[0, 2, 1, 3]),
                                       g.ints("boxes_shape", [-1, p, 4])])   # [N*C, P, 4]
        flat_scores = g.node("Reshape", [masked, g.ints("scores_shape", [-1, 1, p])])
        sel = g.node("NonMaxSuppression", [per_class, flat_scores, most, iou, threshold])
        batch = g.node("Gather", [sel, _scalar(g, "col0", 0)], axis=1)
        classes = g.ints("classes", [c])
        image = g.node("Div", [batch, classes])
        label = g.node("Mod", [batch, classes])
        index = g.node("Gather", [sel, _scalar(g, "col2", 2)], axis=1)
        box_at = g.node("Concat", [g.node("Unsqueeze", [t, g.ints("ax1", [1])])
                                   for t in (batch, index)], axis=1)
        picked = g.node("GatherND", [per_class, box_at])
    score_at = g.node("Concat", [g.node("Unsqueeze", [t, g.ints("ax1", [1])])
                                 for t in (image, label, index)], axis=1)
    score = g.node("GatherND", [scores, score_at])                          # [M]
    rows = g.node("Concat", [g.node("Cast", [g.node("Unsqueeze", [t, g.ints("ax1", [1])])],
                                    to=1) for t in (image, label)]
                  + [g.node("Unsqueeze", [score, g.ints("ax1", [1])]), picked], axis=1)
    num = g.node("Slice", [g.node("Shape", [conf]), g.ints("s0", [0]), g.ints("e1", [1])])
    if layer.keep_top_k > -1:
        rows = _keep_top_k(g, layer.keep_top_k, rows, image, score, num, neg_inf)
    # Nothing kept at all: one row [image, -1, ...] per image, as Caffe writes.
    kept = g.node("Slice", [g.node("Shape", [rows]), g.ints("s0", [0]), g.ints("e1", [1])])
    ids = g.node("Cast", [g.node("Range", [_scalar(g, "zero", 0),
                                           g.node("Squeeze", [num]),
                                           _scalar(g, "one", 1)])], to=1)
    filler = g.node("Expand", [_scalar(g, "minus_one", -1, np.float32),
                               g.node("Concat", [num, g.ints("six", [6])], axis=0)])
    fallback = g.node("Concat", [g.node("Unsqueeze", [ids, g.ints("ax1", [1])]), filler], axis=1)
    both = g.node("Concat", [rows, fallback], axis=0)
    empty = g.node("Equal", [kept, g.ints("zero1", [0])])
    start = g.node("Where", [empty, kept, g.ints("zero2", [0])])
    end = g.node("Where", [empty, g.node("Add", [kept, num]), kept])
    out = g.node("Slice", [both, start, end, g.ints("a0", [0])])
    return [g.node("Reshape", [out, g.ints("top_shape", [1, 1, -1, 7])], ctx.outs[0])]


def _keep_top_k(g, keep_top_k, rows, image, score, num, neg_inf):
    """The rows among their image's keep_top_k best scores. ONNX's TopK breaks ties by the
    lower index, and the rows come in Caffe's order (image, label, NMS order), so ties at the
    cut are settled as caffepar's stable sort settles them."""
    m = g.node("Slice", [g.node("Shape", [score]), g.ints("s0", [0]), g.ints("e1", [1])])
    if keep_top_k == 0:
        return g.node("Slice", [rows, g.ints("s0", [0]), g.ints("e0", [0]), g.ints("a0", [0])])
    # Scores laid out per image: [N, M + 1], -inf where a row belongs to another image (the
    # extra column keeps k >= 1 when nothing was selected).
    width = g.node("Add", [m, g.ints("one1", [1])])
    grid = g.node("Expand", [neg_inf, g.node("Concat", [num, width], axis=0)])
    pad = g.node("Concat", [score, neg_inf_1d(g, neg_inf)], axis=0)
    at = g.node("Concat", [image, g.ints("zero_i", [0])], axis=0)
    grid = g.node("ScatterElements", [grid, g.node("Unsqueeze", [at, g.ints("ax0", [0])]),
                                      g.node("Unsqueeze", [pad, g.ints("ax0", [0])])], axis=0)
    k = g.node("Min", [width, g.ints("keep", [keep_top_k])])
    best = g.node("TopK", [grid, k], axis=1)
    columns = g.fresh("keep_top_k_index")
    g.nodes[-1].output.append(columns)
    # A pick is real where its value is finite (a -inf pick is another image's row or the
    # pad). Real picks are distinct columns; the others all write 0 into the pad column M.
    real = g.node("Not", [g.node("IsInf", [best], detect_positive=0)])
    picked = g.node("ScatterElements", [
        g.node("Expand", [_scalar(g, "zero_f", 0, np.float32), width]),
        g.node("Reshape", [g.node("Where", [real, columns, m]), g.ints("flat", [-1])]),
        g.node("Reshape", [g.node("Cast", [real], to=1), g.ints("flat", [-1])])], axis=0)
    keep = g.node("Greater", [g.node("Slice", [picked, g.ints("s0", [0]), m, g.ints("a0", [0])]),
                              _scalar(g, "half", 0.5, np.float32)])
    return g.node("Compress", [rows, keep], axis=0)


def neg_inf_1d(g, neg_inf):
    return g.node("Reshape", [neg_inf, g.ints("one_d", [1])])


SSD_CONVERTERS = {
    "Permute": _permute,
    "Normalize": _normalize,
    "PriorBox": _prior_box,
    "DetectionOutput": _detection_output,
}
