"""SSD's annotated records and their augmentations (the weiliu89/caffe fork, branch ssd):
AnnotatedDatum decoding, the batch samplers, photometric distortion, expansion, crops,
resizing with OpenCV's interpolations, and the box arithmetic that follows each step.

Images are HxWxC uint8 BGR arrays (OpenCV's layout) until the last step; boxes are float32
[xmin, ymin, xmax, ymax] normalized to the image, computed in the fork's order of float
operations. Random choices come from the generator passed in, which the data layer seeds
from the record's position in its stream: a record is augmented the same way however the
batch is split across ranks.

Differences from the fork, on purpose: the fork re-encodes an encoded record as JPEG after
each of distortion, expansion and cropping (three lossy round trips); here the image is
decoded once and stays an array. The fork distorts and resizes encoded records only (a raw
record is passed through, or its shape check fails); here both kinds are treated alike.
"""
import numpy as np

from caffepar.data.sources import cv_resize, decode_image_bytes
from caffepar.errors import DataError
from caffepar.proto import caffe_pb2

F32 = np.float32
RESIZE = caffe_pb2.ResizeParameter
EMIT = caffe_pb2.EmitConstraint
INTERP = {RESIZE.LINEAR: "linear", RESIZE.AREA: "area", RESIZE.NEAREST: "nearest",
          RESIZE.CUBIC: "cubic", RESIZE.LANCZOS4: "lanczos4"}


# ==================================================================== records
class Record:
    """An AnnotatedDatum decoded: image (HxWxC uint8, or float for float_data), boxes (k, 4)
    float32 with their group labels, instance ids and difficult flags, and the Datum's label
    (for records without annotations)."""

    __slots__ = ("image", "boxes", "labels", "instances", "difficult", "label", "has_type")

    def __init__(self, image, boxes, labels, instances, difficult, label=0, has_type=True):
        self.image = image
        self.boxes = np.asarray(boxes, F32).reshape(-1, 4)
        self.labels = np.asarray(labels, np.int64).reshape(-1)
        self.instances = np.asarray(instances, np.int64).reshape(-1)
        self.difficult = np.asarray(difficult, bool).reshape(-1)
        self.label = label
        self.has_type = has_type

    def with_boxes(self, image, keep, boxes):
        """A record with another image and a subset `keep` of the boxes, moved to `boxes`."""
        return Record(image, boxes, self.labels[keep], self.instances[keep],
                      self.difficult[keep], self.label, self.has_type)


def parse_record(value, color=None):
    """An AnnotatedDatum's bytes -> Record (boxes in the order of its groups)."""
    anno = caffe_pb2.AnnotatedDatum()
    anno.ParseFromString(value)
    datum = anno.datum
    if datum.encoded:
        img = decode_image_bytes(datum.data, color)
        img = img[:, :, None] if img.ndim == 2 else img
    else:
        shape = (datum.channels, datum.height, datum.width)
        size = int(np.prod(shape))
        if datum.data:
            if len(datum.data) != size:
                raise DataError(f"AnnotatedDatum has {len(datum.data)} bytes of data for shape "
                                f"{shape}")
            img = np.frombuffer(datum.data, np.uint8).reshape(shape).transpose(1, 2, 0)
        elif len(datum.float_data) == size and size:
            img = np.asarray(datum.float_data, F32).reshape(shape).transpose(1, 2, 0)
        else:
            raise DataError(f"AnnotatedDatum holds no image (shape {shape})")
    boxes, labels, instances, difficult = [], [], [], []
    for group in anno.annotation_group:
        for a in group.annotation:
            b = a.bbox
            boxes.append((b.xmin, b.ymin, b.xmax, b.ymax))
            labels.append(group.group_label)
            instances.append(a.instance_id)
            difficult.append(b.difficult)
    return Record(np.ascontiguousarray(img), boxes, labels, instances, difficult, datum.label,
                  anno.HasField("type"))


def read_label_map(path):
    """A LabelMap prototxt -> caffe_pb2.LabelMap (one-line error naming the file)."""
    from google.protobuf import text_format
    label_map = caffe_pb2.LabelMap()
    try:
        with open(path) as f:
            text_format.Merge(f.read(), label_map)
    except OSError as e:
        raise DataError(f"cannot read label map: {e.strerror}", path=path) from None
    except text_format.ParseError as e:
        raise DataError(f"not a LabelMap prototxt: {e}", path=path) from None
    return label_map


# ==================================================================== box arithmetic
def box_size(b):
    """BBoxSize of one normalized box: width * height, 0 when inverted."""
    w, h = F32(b[2] - b[0]), F32(b[3] - b[1])
    return F32(0) if (w < 0 or h < 0) else F32(w * h)


def clip_box(b):
    return np.clip(np.asarray(b, F32), F32(0), F32(1))


def bbox_size(boxes, dtype=F32):
    """BBoxSize of normalized boxes (..., 4): width * height, 0 for an inverted box."""
    boxes = np.asarray(boxes, dtype)
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    return np.where((w < 0) | (h < 0), dtype(0), w * h)


def jaccard(a, a_size, b, b_size, normalized=True):
    """JaccardOverlap of every box of `a` (n, 4) with every box of `b` (m, 4): (n, m), with the
    sizes the fork stores in its boxes (a box's own size field, as BBoxSize returns it)."""
    dt = a.dtype.type
    a = a[:, None, :]
    b = b[None, :, :]
    apart = (b[..., 0] > a[..., 2]) | (b[..., 2] < a[..., 0]) | \
            (b[..., 1] > a[..., 3]) | (b[..., 3] < a[..., 1])
    w = np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0])
    h = np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1])
    if not normalized:
        w = w + dt(1)
        h = h + dt(1)
    hit = ~apart & (w > 0) & (h > 0)
    inter = np.where(hit, w * h, dt(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = inter / ((a_size[:, None] + b_size[None, :]) - inter)
    return np.where(hit, out, dt(0))


def coverage(a, b):
    """BBoxCoverage: the part of box a that box b covers."""
    return _coverage_matrix(np.asarray(a, F32)[None], np.asarray(b, F32)[None])[0, 0]


def project_box(src, b):
    """ProjectBBox: box b in the frame of src, clipped. Returns (box, kept): box is None when
    b misses src altogether; kept is whether the projected box has an area."""
    src = np.asarray(src, F32)
    b = np.asarray(b, F32)
    if b[0] >= src[2] or b[2] <= src[0] or b[1] >= src[3] or b[3] <= src[1]:
        return None, False
    w, h = F32(src[2] - src[0]), F32(src[3] - src[1])
    out = clip_box(np.array([(b[0] - src[0]) / w, (b[1] - src[1]) / h, (b[2] - src[0]) / w,
                             (b[3] - src[1]) / h], F32))
    return out, bool(box_size(out) > 0)


def meets_emit(src, b, emit):
    """MeetEmitConstraint: keep box b of a crop src when its centre is inside (CENTER) or src
    covers more than emit_overlap of it (MIN_OVERLAP)."""
    if emit.emit_type == EMIT.CENTER:
        cx = F32(F32(b[0] + b[2]) / F32(2))
        cy = F32(F32(b[1] + b[3]) / F32(2))
        return bool(src[0] <= cx <= src[2] and src[1] <= cy <= src[3])
    if emit.emit_type == EMIT.MIN_OVERLAP:
        return bool(coverage(b, src) > F32(emit.emit_overlap))
    raise DataError(f"unknown emit_type {emit.emit_type}")


def transform_boxes(record, crop, emit=None, mirror=False, resize=None, size=None):
    """TransformAnnotation: the record's boxes (first moved by the resize policy, given the
    image size (height, width) they refer to) that meet the emit constraint in `crop` and
    overlap it, projected into it, mirrored when asked. Returns (indices kept, boxes)."""
    keep, out = [], []
    for k, b in enumerate(record.boxes):
        if resize is not None:
            b = resize_box(resize, size[1], size[0], b)
        if emit is not None and not meets_emit(crop, b, emit):
            continue
        proj, ok = project_box(crop, b)
        if not ok:
            continue
        if mirror:
            proj = np.array([F32(1) - proj[2], proj[1], F32(1) - proj[0], proj[3]], F32)
        if resize is not None:
            proj = extrapolate_box(resize, size[0], size[1], crop, proj)
        keep.append(k)
        out.append(proj)
    return np.asarray(keep, np.int64), np.asarray(out, F32).reshape(-1, 4)


def resize_box(param, old_width, old_height, b):
    """UpdateBBoxByResizePolicy: a normalized box of an old_width x old_height image in the
    resized (and, for FIT_LARGE_SIZE_AND_PAD, padded) image."""
    nh, nw = F32(param.height), F32(param.width)
    ow, oh = F32(old_width), F32(old_height)
    orig_aspect = F32(ow / oh)
    new_aspect = F32(nw / nh)
    x0, y0, x1, y1 = (F32(b[0] * ow), F32(b[1] * oh), F32(b[2] * ow), F32(b[3] * oh))
    zero = F32(0)
    mode = param.resize_mode
    if mode == RESIZE.WARP:
        x0 = max(zero, F32(F32(x0 * nw) / ow))
        x1 = min(nw, F32(F32(x1 * nw) / ow))
        y0 = max(zero, F32(F32(y0 * nh) / oh))
        y1 = min(nh, F32(F32(y1 * nh) / oh))
    elif mode == RESIZE.FIT_LARGE_SIZE_AND_PAD:
        if orig_aspect > new_aspect:
            pad = F32(F32(nh - F32(nw / orig_aspect)) / F32(2))
            x0 = max(zero, F32(F32(x0 * nw) / ow))
            x1 = min(nw, F32(F32(x1 * nw) / ow))
            inner = F32(nh - F32(2) * pad)
            y0 = F32(pad + max(zero, F32(F32(y0 * inner) / oh)))
            y1 = F32(pad + min(nh, F32(F32(y1 * inner) / oh)))
        else:
            pad = F32(F32(nw - F32(orig_aspect * nh)) / F32(2))
            inner = F32(nw - F32(2) * pad)
            x0 = F32(pad + max(zero, F32(F32(x0 * inner) / ow)))
            x1 = F32(pad + min(nw, F32(F32(x1 * inner) / ow)))
            y0 = max(zero, F32(F32(y0 * nh) / oh))
            y1 = min(nh, F32(F32(y1 * nh) / oh))
    elif mode == RESIZE.FIT_SMALL_SIZE:
        if orig_aspect < new_aspect:
            nh = F32(nw / orig_aspect)
        else:
            nw = F32(orig_aspect * nh)
        x0 = max(zero, F32(F32(x0 * nw) / ow))
        x1 = min(nw, F32(F32(x1 * nw) / ow))
        y0 = max(zero, F32(F32(y0 * nh) / oh))
        y1 = min(nh, F32(F32(y1 * nh) / oh))
    else:
        raise DataError(f"unknown resize_mode {mode}")
    return np.array([x0 / nw, y0 / nh, x1 / nw, y1 / nh], F32)


def extrapolate_box(param, height, width, crop, b):
    """ExtrapolateBBox: FIT_SMALL_SIZE with height_scale/width_scale rescales the boxes."""
    hs, ws = F32(param.height_scale), F32(param.width_scale)
    if not (hs > 0 and ws > 0 and param.resize_mode == RESIZE.FIT_SMALL_SIZE):
        return b
    orig_aspect = F32(F32(width) / F32(height))
    rh, rw = F32(param.height), F32(param.width)
    if orig_aspect < F32(rw / rh):
        rh = F32(rw / orig_aspect)
    else:
        rw = F32(rh * orig_aspect)
    ch = F32(rh * F32(crop[3] - crop[1]))
    cw = F32(rw * F32(crop[2] - crop[0]))
    return np.array([b[0] * cw / ws, b[1] * ch / hs, b[2] * cw / ws, b[3] * ch / hs], F32)


# ==================================================================== samplers
def uniform(rng, low, high):
    """caffe_rng_uniform of one float in [low, high] (low when high is not above it)."""
    low, high = float(F32(low)), float(F32(high))
    return F32(low if high <= low else rng.uniform(low, high))


def _check_sampler(sampler):
    if not (0 < sampler.min_scale <= sampler.max_scale <= 1):
        raise DataError(f"sampler needs 0 < min_scale <= max_scale <= 1, got "
                        f"{sampler.min_scale:g} and {sampler.max_scale:g}")
    if not (0 < sampler.min_aspect_ratio <= sampler.max_aspect_ratio):
        raise DataError(f"sampler needs 0 < min_aspect_ratio <= max_aspect_ratio, got "
                        f"{sampler.min_aspect_ratio:g} and {sampler.max_aspect_ratio:g}")


def _draw_boxes(limits, rng):
    """SampleBBox for each row of limits (min_scale, max_scale, min_ratio, max_ratio): boxes
    of random scale and aspect ratio at random places in [0, 1]^2, (n, 4) float32."""
    lo = limits[:, [0, 2]]
    hi = np.maximum(limits[:, [1, 3]], lo)
    u = rng.random((len(limits), 4))
    scale, ratio = (lo + (hi - lo) * u[:, :2]).astype(F32).T
    sq = (scale.astype(np.float64) ** 2).astype(F32)
    ratio = np.minimum(np.maximum(ratio, sq), (1 / sq.astype(np.float64)).astype(F32))
    root = np.sqrt(ratio.astype(np.float64))
    w = (scale * root).astype(F32)
    h = (scale / root).astype(F32)
    # Where rounding makes a box a hair wider than the image the fork aborts (its known
    # "Check failed: a <= b (0 vs. -1.19209e-07)" in SampleBBox); the offset is 0 here.
    room = np.maximum(np.stack([F32(1) - w, F32(1) - h], axis=1).astype(np.float64), 0)
    x, y = (room * u[:, 2:]).astype(F32).T
    return np.stack([x, y, (x + w).astype(F32), (y + h).astype(F32)], axis=1)


def sample_boxes(sampler, rng, n):
    """SampleBBox n times for one sampler: (n, 4)."""
    _check_sampler(sampler)
    limits = np.array([[sampler.min_scale, sampler.max_scale, sampler.min_aspect_ratio,
                        sampler.max_aspect_ratio]], F32).astype(np.float64)
    return _draw_boxes(np.repeat(limits, n, axis=0), rng)


def _coverage_matrix(a, b):
    """BBoxCoverage of each box of a by each box of b: (len(a), len(b))."""
    a = a[:, None, :]
    b = b[None, :, :]
    apart = (b[..., 0] > a[..., 2]) | (b[..., 2] < a[..., 0]) | \
            (b[..., 1] > a[..., 3]) | (b[..., 3] < a[..., 1])
    iw = np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0])
    ih = np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1])
    inter = np.where(apart | (iw < 0) | (ih < 0), F32(0), iw * ih)
    size = np.where((a[..., 2] < a[..., 0]) | (a[..., 3] < a[..., 1]), F32(0),
                    (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1]))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, inter / size, F32(0)).astype(F32)


CONSTRAINTS = (("jaccard", "min_jaccard_overlap", "max_jaccard_overlap"),
               ("sample", "min_sample_coverage", "max_sample_coverage"),
               ("object", "min_object_coverage", "max_object_coverage"))


def satisfies_all(boxes, objects, constraint, measures=None):
    """SatisfySampleConstraint for each of `boxes`: no bounds given, or some object within the
    bounds of the first kind given (jaccard overlap, sample coverage, object coverage): the
    fork's loop returns true once an object passed that first check. `measures` may hold the
    (boxes x objects) matrices already computed, by kind."""
    c = constraint
    given = [k for k in CONSTRAINTS if c.HasField(k[1]) or c.HasField(k[2])]
    if not given:
        return np.ones(len(boxes), bool)
    objects = np.asarray(objects, F32).reshape(-1, 4)
    if not len(objects):
        return np.zeros(len(boxes), bool)
    kind, low, high = given[0]
    v = (measures or {}).get(kind)
    if v is None:
        v = _measure(kind, boxes, objects)
    ok = np.ones(v.shape, bool)
    if c.HasField(low):
        ok &= ~(v < F32(getattr(c, low)))
    if c.HasField(high):
        ok &= ~(v > F32(getattr(c, high)))
    return ok.any(axis=1)


def _measure(kind, boxes, objects):
    if kind == "jaccard":
        return jaccard(boxes, bbox_size(boxes), objects, bbox_size(objects))
    if kind == "sample":
        return _coverage_matrix(boxes, objects)
    return _coverage_matrix(objects, boxes).T


def generate_samples(objects, batch_samplers, rng):
    """GenerateBatchSamples: for each sampler, max_trials draws keeping up to max_sample that
    meet its constraint (the draws are independent: all samplers' are made at once, and the
    first that qualify kept)."""
    samplers = [s for s in batch_samplers if s.use_original_image and s.max_trials]
    if not samplers:
        return []
    for s in samplers:
        _check_sampler(s.sampler)
    counts = [s.max_trials for s in samplers]
    limits = np.repeat(np.array([[s.sampler.min_scale, s.sampler.max_scale,
                                  s.sampler.min_aspect_ratio, s.sampler.max_aspect_ratio]
                                 for s in samplers], F32).astype(np.float64), counts, axis=0)
    boxes = _draw_boxes(limits, rng)
    objects = np.asarray(objects, F32).reshape(-1, 4)
    kinds = {k[0] for s in samplers for k in CONSTRAINTS
             if s.sample_constraint.HasField(k[1]) or s.sample_constraint.HasField(k[2])}
    measures = {k: _measure(k, boxes, objects) for k in kinds} if len(objects) else {}
    out, start = [], 0
    for s, n in zip(samplers, counts):
        part = slice(start, start + n)
        start += n
        keep = np.flatnonzero(satisfies_all(
            boxes[part], objects, s.sample_constraint,
            {k: v[part] for k, v in measures.items()}))
        if s.HasField("max_sample"):
            keep = keep[:s.max_sample]
        out.extend(boxes[part][keep])
    return out


# ==================================================================== image operations
def crop_pixels(shape, box):
    """CropImage's pixel window (y, x, height, width) of a normalized box."""
    h, w = shape[:2]
    c = clip_box(box)
    x0, y0 = F32(c[0] * F32(w)), F32(c[1] * F32(h))
    x1, y1 = F32(c[2] * F32(w)), F32(c[3] * F32(h))
    return int(y0), int(x0), int(F32(y1 - y0)), int(F32(x1 - x0))


def crop_record(record, box, emit):
    """CropImage of a record to a sampled box: the pixels of its window, and the boxes that
    meet the emit constraint, projected into the (unrounded) box."""
    y, x, h, w = crop_pixels(record.image.shape, box)
    image = np.ascontiguousarray(record.image[y:y + h, x:x + w])
    keep, boxes = transform_boxes(record, clip_box(box), emit)
    return record.with_boxes(image, keep, boxes)


def expand_record(record, param, fill, emit, rng):
    """ExpandImage: with probability prob, the image at a random place of a canvas up to
    max_expand_ratio times as large, filled with `fill` (one value per channel)."""
    if uniform(rng, 0, 1) > F32(param.prob):
        return record
    if abs(float(F32(param.max_expand_ratio)) - 1.0) < 1e-2:
        return record
    ratio = uniform(rng, 1, param.max_expand_ratio)
    h, w, c = record.image.shape
    eh, ew = int(F32(F32(h) * ratio)), int(F32(F32(w) * ratio))
    y = F32(np.floor(uniform(rng, 0, F32(eh - h))))
    x = F32(np.floor(uniform(rng, 0, F32(ew - w))))
    canvas = np.empty((eh, ew, c), record.image.dtype)
    canvas[...] = fill
    canvas[int(y):int(y) + h, int(x):int(x) + w] = record.image
    frame = np.array([-x / F32(w), -y / F32(h), F32(F32(ew) - x) / F32(w),
                      F32(F32(eh) - y) / F32(h)], F32)
    keep, boxes = transform_boxes(record, frame, emit)
    return record.with_boxes(canvas, keep, boxes)


def convert_scale(img, alpha, beta):
    """Mat::convertTo to uint8: saturate(round(x * alpha + beta)), in float."""
    v = img.astype(F32) * F32(alpha) + F32(beta)
    return np.clip(np.rint(v), 0, 255).astype(np.uint8)


_SDIV = np.zeros(256, np.int64)
_HDIV = np.zeros(256, np.int64)
for _i in range(1, 256):
    _SDIV[_i] = int(np.rint((255 << 12) / (1.0 * _i)))
    _HDIV[_i] = int(np.rint((180 << 12) / (6.0 * _i)))


def bgr_to_hsv(img):
    """cvtColor(BGR2HSV) of uint8 images, OpenCV's integer arithmetic (H in 0..179)."""
    b, g, r = (img[..., k].astype(np.int64) for k in range(3))
    v = np.maximum(np.maximum(b, g), r)
    vmin = np.minimum(np.minimum(b, g), r)
    diff = v - vmin
    vr = v == r
    vg = v == g
    s = (diff * _SDIV[v] + (1 << 11)) >> 12
    h = np.where(vr, g - b, np.where(vg, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * _HDIV[diff] + (1 << 11)) >> 12
    h = np.where(h < 0, h + 180, h)
    return np.stack([np.clip(h, 0, 255), s, v], axis=-1).astype(np.uint8)


_SECTORS = np.array([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]])


HSV_BLOCK = 32
"""Pixels of a row OpenCV 4.6's vector HSV2BGR takes at a time; the rest go through its
scalar code."""


def hsv_to_bgr(img):
    """cvtColor(HSV2BGR) of uint8 images (H on the 0..180 scale) as the fork's OpenCV (4.6)
    computes it on a CPU with FMA: in float, 1 - s*h fused; the vector code (whole blocks of 32
    pixels of a row) truncates the result, its scalar code (the rest of the row) rounds it.
    (OpenCV 4.10 and later round throughout.)"""
    h = img[..., 0].astype(F32) * F32(6 / 180)
    s = img[..., 1].astype(F32) * F32(1 / 255)
    v = img[..., 2].astype(F32) * F32(1 / 255)
    h = np.where(h >= 6, h - F32(6), h)
    h = np.where(h >= 6, h - F32(6), h)
    sector = np.floor(h).astype(np.int64)
    h = (h - sector).astype(F32)
    one = F32(1)
    fused = (lambda a, b: (1.0 - a.astype(np.float64) * b.astype(np.float64)).astype(F32))
    tab = np.stack([v, v * (one - s), v * fused(s, h), v * fused(s, (one - h).astype(F32))],
                   axis=-1)
    out = np.take_along_axis(tab, _SECTORS[sector][..., :], axis=-1)
    out = np.where((s == 0)[..., None], v[..., None], out) * F32(255)
    vector = img.shape[1] - img.shape[1] % HSV_BLOCK
    out[:, :vector] = np.floor(out[:, :vector])
    out[:, vector:] = np.rint(out[:, vector:])
    return np.clip(out, 0, 255).astype(np.uint8)


def distort_image(img, p, rng):
    """ApplyDistort: brightness, then contrast, saturation, hue (or saturation, hue, then
    contrast, at even odds), then a random order of the channels, each with its own
    probability."""
    if img.dtype != np.uint8 or img.shape[2] != 3:
        raise DataError("distort_param needs 3-channel 8-bit images")

    def brightness(x):
        if uniform(rng, 0, 1) < F32(p.brightness_prob):
            delta = uniform(rng, -p.brightness_delta, p.brightness_delta)
            if abs(delta) > 0:
                return convert_scale(x, 1, delta)
        return x

    def contrast(x):
        if uniform(rng, 0, 1) < F32(p.contrast_prob):
            delta = uniform(rng, p.contrast_lower, p.contrast_upper)
            if abs(float(delta) - 1) > 1e-3:
                return convert_scale(x, delta, 0)
        return x

    def saturation(x):
        if uniform(rng, 0, 1) < F32(p.saturation_prob):
            delta = uniform(rng, p.saturation_lower, p.saturation_upper)
            hsv = bgr_to_hsv(x)
            hsv[..., 1] = convert_scale(hsv[..., 1], delta, 0)
            return hsv_to_bgr(hsv)
        return x

    def hue(x):
        if uniform(rng, 0, 1) < F32(p.hue_prob):
            delta = uniform(rng, -p.hue_delta, p.hue_delta)
            if abs(delta) > 0:
                hsv = bgr_to_hsv(x)
                hsv[..., 0] = convert_scale(hsv[..., 0], 1, delta)
                return hsv_to_bgr(hsv)
        return x

    def order(x):
        if uniform(rng, 0, 1) < F32(p.random_order_prob):
            return np.ascontiguousarray(x[..., rng.permutation(3)])
        return x

    steps = (brightness, contrast, saturation, hue) if uniform(rng, 0, 1) > F32(0.5) \
        else (brightness, saturation, hue, contrast)
    for step in steps:
        img = step(img)
    return order(img)


def noise_image(img, p, rng):
    """ApplyNoise, for the effects written here (decolorize, posterize, inverse, salt and
    pepper, conversion to HSV); like the fork, prob is not looked at."""
    missing = [name for name in ("hist_eq", "clahe", "gauss_blur", "erode", "convert_to_lab")
               if getattr(p, name)] + (["jpeg"] if p.jpeg > 0 else [])
    if missing:
        raise DataError(f"noise_param: {', '.join(missing)} not supported (supported: "
                        "decolorize, posterize, inverse, saltpepper, convert_to_hsv)")
    if p.decolorize:
        b, g, r = (img[..., k].astype(np.int64) for k in range(3))
        y = ((r * 4899 + g * 9617 + b * 1868 + (1 << 13)) >> 14).astype(np.uint8)
        img = np.repeat(y[..., None], 3, axis=2)
    if p.posterize:
        table = (np.arange(256) // 64 * 64 + 32).astype(np.uint8)
        img = table[img]
    if p.inverse:
        img = 255 - img
    if p.saltpepper:
        img = img.copy()
        values = list(p.saltpepper_param.value) or [0]
        if len(values) == 1:
            values = values * img.shape[2]
        n = int(np.floor(float(F32(p.saltpepper_param.fraction)) * img.shape[0] * img.shape[1]))
        xs = rng.integers(0, img.shape[1], n)
        ys = rng.integers(0, img.shape[0], n)
        img[ys, xs] = np.asarray(values, np.uint8)[:img.shape[2]]
    if p.convert_to_hsv:
        img = bgr_to_hsv(img)
    return img


# ---------------------------------------------------------------- resizing (OpenCV's)
def _cubic(x):
    a = F32(-0.75)
    x = np.asarray(x, F32)
    one = F32(1)
    c0 = ((a * (x + one) - F32(5) * a) * (x + one) + F32(8) * a) * (x + one) - F32(4) * a
    c1 = ((a + F32(2)) * x - (a + F32(3))) * x * x + one
    c2 = ((a + F32(2)) * (one - x) - (a + F32(3))) * (one - x) * (one - x) + one
    c3 = one - c0 - c1 - c2
    return np.stack([c0, c1, c2, c3], axis=-1)


def _lanczos4(x):
    s45 = 0.70710678118654752440084436210485
    cs = [(1, 0), (-s45, -s45), (0, 1), (s45, -s45), (-1, 0), (s45, s45), (0, -1), (-s45, s45)]
    out = np.empty(np.shape(x) + (8,), F32)
    for n, xv in enumerate(np.asarray(x, F32).reshape(-1)):
        y0 = -(float(xv) + 3) * np.pi * 0.25
        s0, c0 = np.sin(y0), np.cos(y0)
        coeffs = np.empty(8, F32)
        total = F32(0)
        for i in range(8):
            y_ = F32(xv + F32(3) - F32(i))
            if abs(y_) >= F32(1e-6):
                y = -float(y_) * np.pi * 0.25
                coeffs[i] = F32((cs[i][0] * s0 + cs[i][1] * c0) / (y * y))
            else:
                coeffs[i] = F32(1e30)
            total = F32(total + coeffs[i])
        out.reshape(-1, 8)[n] = coeffs * F32(1 / total)
    return out


def _taps(src, dst, kind):
    """Source indices (dst, k) and 11-bit weights of one axis for cubic / Lanczos-4 and for
    linear-like area upscaling."""
    inv = dst / src
    scale = 1.0 / inv                # as OpenCV derives it (src / dst can differ in the last bit)
    d = np.arange(dst)
    if kind == "area":
        sx = np.floor(d * scale).astype(np.int64)
        f = ((d + 1) - (sx + 1) * inv).astype(F32)
        f = np.where(f <= 0, F32(0), f - np.floor(f)).astype(F32)
        low = sx < 0
        f[low], sx[low] = 0, 0
        high = sx >= src - 1
        f[high], sx[high] = 0, src - 1
        w = np.stack([F32(1) - f, f], axis=-1)
        ksize = 2
    else:
        f = ((d + 0.5) * scale - 0.5).astype(F32)
        sx = np.floor(f).astype(np.int64)
        f = (f - sx).astype(F32)
        w = _cubic(f) if kind == "cubic" else _lanczos4(f)
        ksize = 4 if kind == "cubic" else 8
    idx = sx[:, None] - ksize // 2 + 1 + np.arange(ksize)[None, :]
    iw = np.clip(np.rint(w * F32(2048)), -32768, 32767).astype(np.int64)
    return np.clip(idx, 0, src - 1), iw


def _separable(img, height, width, kind):
    h, w = img.shape[:2]
    ys, wy = _taps(h, height, kind)
    xs, wx = _taps(w, width, kind)
    src = img.reshape(h, w, -1).astype(np.int64)
    rows = np.einsum("hwkc,wk->hwc", src[:, xs], wx)         # (h, width, C), * 2048
    if kind == "area":
        r = rows >> 4
        out = ((r[ys[:, 0]] * wy[:, 0, None, None]) >> 16) + \
              ((r[ys[:, 1]] * wy[:, 1, None, None]) >> 16)
        out = (out + 2) >> 2
    else:
        out = np.einsum("hkwc,hk->hwc", rows[ys], wy)
        out = (out + (1 << 21)) >> 22
    return np.clip(out, 0, 255).astype(np.uint8)


def _area_down(img, height, width):
    """INTER_AREA shrinking: each output pixel the area-weighted mean of the pixels it
    covers (an integer factor: the block mean)."""
    h, w = img.shape[:2]
    sy, sx = 1.0 / (height / h), 1.0 / (width / w)
    if abs(sx - round(sx)) < 2.3e-16 and abs(sy - round(sy)) < 2.3e-16:
        ix, iy = int(round(sx)), int(round(sy))
        blocks = img[:height * iy, :width * ix].reshape(height, iy, width, ix, -1)
        total = blocks.astype(np.int64).sum(axis=(1, 3))
        if ix == 2 and iy == 2:
            return ((total + 2) >> 2).astype(np.uint8)
        return np.clip(np.rint(total.astype(F32) * F32(1 / (ix * iy))), 0, 255).astype(np.uint8)

    def table(src, dst, scale):
        """computeResizeAreaTab: per output pixel its source pixels and weights, in order
        (padded with weight 0, which leaves the float sums as they are)."""
        rows = []
        for d in range(dst):
            f1 = d * scale
            f2 = f1 + scale
            cell = min(scale, src - f1)
            s1, s2 = int(np.ceil(f1)), int(np.floor(f2))
            s2 = min(s2, src - 1)
            s1 = min(s1, s2)
            taps = []
            if s1 - f1 > 1e-3:
                taps.append((s1 - 1, F32((s1 - f1) / cell)))
            taps += [(k, F32(1.0 / cell)) for k in range(s1, s2)]
            if f2 - s2 > 1e-3:
                taps.append((s2, F32(min(min(f2 - s2, 1.0), cell) / cell)))
            rows.append(taps)
        n = max(len(t) for t in rows)
        idx = np.zeros((dst, n), np.int64)
        weight = np.zeros((dst, n), F32)
        for d, taps in enumerate(rows):
            for k, (i, w) in enumerate(taps):
                idx[d, k], weight[d, k] = i, w
        return idx, weight

    # ResizeArea_Invoker's float sums, in its order: along each source row, then down.
    xi, xw = table(w, width, 1.0 / (width / w))
    yi, yw = table(h, height, 1.0 / (height / h))
    x = img.reshape(h, w, -1).astype(F32)
    rows = np.zeros((h, width, x.shape[2]), F32)
    for k in range(xi.shape[1]):
        rows += x[:, xi[:, k]] * xw[None, :, k, None]
    out = np.zeros((height, width, x.shape[2]), F32)
    for k in range(yi.shape[1]):
        out += rows[yi[:, k]] * yw[:, k, None, None]
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def resize(img, height, width, interp="linear"):
    """cv::resize of an HxWxC uint8 image to height x width with one of OpenCV's
    interpolations: nearest, linear, area, cubic, lanczos4."""
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    if img.dtype != np.uint8:
        raise DataError("resizing needs 8-bit images")
    channels = img.shape[2:]
    if interp == "nearest":
        ys = np.minimum(np.floor(np.arange(height) * (1.0 / (height / h))).astype(np.int64), h - 1)
        xs = np.minimum(np.floor(np.arange(width) * (1.0 / (width / w))).astype(np.int64), w - 1)
        return np.ascontiguousarray(img[ys][:, xs])
    if interp == "linear":
        return cv_resize(img, height, width)
    if interp == "area":
        if h >= height and w >= width:
            out = _area_down(img, height, width)
        else:
            out = _separable(img, height, width, "area")
        return out.reshape((height, width) + channels)
    if interp in ("cubic", "lanczos4"):
        return _separable(img, height, width, interp).reshape((height, width) + channels)
    raise DataError(f"unknown interpolation {interp}")


def pad_image(img, top, bottom, left, right, mode, values):
    """copyMakeBorder with the ResizeParameter's pad_mode."""
    widths = ((top, bottom), (left, right), (0, 0))
    if mode == RESIZE.CONSTANT:
        out = np.empty((img.shape[0] + top + bottom, img.shape[1] + left + right,
                        img.shape[2]), img.dtype)
        out[...] = values
        out[top:top + img.shape[0], left:left + img.shape[1]] = img
        return out
    if mode == RESIZE.MIRRORED:
        return np.pad(img, widths, mode="reflect")
    if mode == RESIZE.REPEAT_NEAREST:
        return np.pad(img, widths, mode="edge")
    raise DataError(f"unknown pad_mode {mode}")


def new_size(param, width, height):
    """InferNewSize: the (height, width) an image of width x height is resized to."""
    h, w = int(param.height), int(param.width)
    if param.resize_mode == RESIZE.FIT_SMALL_SIZE:
        orig = F32(F32(width) / F32(height))
        if orig < F32(F32(w) / F32(h)):
            h = int(F32(F32(w) / orig))
        else:
            w = int(F32(orig * F32(h)))
    return h, w


def apply_resize(img, param, rng):
    """ApplyResize: one of interp_mode at random (LINEAR when none), then WARP, or
    FIT_LARGE_SIZE_AND_PAD (aspect kept, padded), or FIT_SMALL_SIZE (aspect kept)."""
    modes = list(param.interp_mode)
    interp = "linear"
    if modes:
        cumulative = np.cumsum(np.full(len(modes), F32(1) / F32(len(modes)), F32), dtype=F32)
        val = uniform(rng, 0, cumulative[-1])
        interp = INTERP[modes[min(int(np.searchsorted(cumulative, val, "left")), len(modes) - 1)]]
    nh, nw = int(param.height), int(param.width)
    h, w = img.shape[:2]
    orig = F32(F32(w) / F32(h))
    target = F32(F32(nw) / F32(nh))
    mode = param.resize_mode
    if mode == RESIZE.WARP:
        return resize(img, nh, nw, interp)
    if mode == RESIZE.FIT_LARGE_SIZE_AND_PAD:
        values = list(param.pad_value) or [0]
        if len(values) not in (1, img.shape[2]):
            raise DataError(f"give 1 pad_value or as many as channels ({img.shape[2]}), got "
                            f"{len(values)}")
        values = np.clip(np.rint(np.resize(np.asarray(values, F32), img.shape[2])), 0, 255)
        if orig > target:
            rh = int(np.floor(F32(F32(nw) / orig)))
            out = resize(img, rh, nw, interp)
            top = int(np.floor((nh - rh) / 2.0))
            return pad_image(out, top, nh - rh - top, 0, 0, param.pad_mode, values)
        rw = int(np.floor(F32(orig * F32(nh))))
        out = resize(img, nh, rw, interp)
        left = int(np.floor((nw - rw) / 2.0))
        return pad_image(out, 0, 0, left, nw - rw - left, param.pad_mode, values)
    if mode == RESIZE.FIT_SMALL_SIZE:
        if orig < target:
            return resize(img, int(np.floor(F32(F32(nw) / orig))), nw, interp)
        return resize(img, nh, int(np.floor(F32(orig * F32(nh)))), interp)
    raise DataError(f"unknown resize_mode {mode}")


# ==================================================================== the whole transform
class AnnotatedTransformer:
    """The fork's per-record path through AnnotatedData: distort, expand, sample and crop,
    then its DataTransformer (resize, noise, crop_size, mirror, mean and scale) on image and
    boxes alike."""

    def __init__(self, param, batch_samplers, phase, mean=None, dtype=np.float32):
        self.p = param
        self.samplers = list(batch_samplers)
        self.train = phase == caffe_pb2.TRAIN
        self.dtype = np.dtype(dtype)
        self.scale = F32(param.scale)
        self.mean_values = np.asarray(param.mean_value, F32) if param.mean_value else None
        self.mean = mean
        if self.mean_values is not None and mean is not None:
            raise DataError("cannot specify mean_file and mean_value at the same time")
        if param.HasField("resize_param") and (param.resize_param.height <= 0
                                               or param.resize_param.width <= 0):
            raise DataError("resize_param needs height and width > 0")
        if param.HasField("expand_param"):
            if not param.expand_param.max_expand_ratio > 1:
                raise DataError(f"expand_param needs max_expand_ratio > 1, got "
                                f"{param.expand_param.max_expand_ratio:g}")
            if mean is not None:
                raise DataError("expand_param fills the canvas with mean_value; a mean_file "
                                "cannot fill a canvas of random size (use mean_value)")
        crop = param.crop_size
        self.crop = (crop, crop) if crop else (param.crop_h, param.crop_w)
        self.emit = param.emit_constraint if param.HasField("emit_constraint") else None
        self.resize = param.resize_param if param.HasField("resize_param") else None

    def channel_values(self, channels):
        mv = self.mean_values
        if mv is None:
            return np.zeros(channels, F32)
        if len(mv) == 1:
            return np.repeat(mv, channels)
        if len(mv) != channels:
            raise DataError(f"specify either 1 mean_value or as many as channels ({channels}), "
                            f"got {len(mv)}")
        return mv

    def output_shape(self, height, width, channels):
        """InferBlobShape: (C, H, W) of a record of this size."""
        if self.resize is not None:
            height, width = new_size(self.resize, width, height)
        ch, cw = self.crop
        if height < ch or width < cw:
            raise DataError(f"crop {ch}x{cw} is larger than the image ({height}x{width})")
        return channels, ch or height, cw or width

    def augment(self, record, rng):
        """Distortion, expansion and the sampled crop (training-time changes to a record)."""
        p = self.p
        if p.HasField("distort_param"):
            record = Record(distort_image(record.image, p.distort_param, rng), record.boxes,
                            record.labels, record.instances, record.difficult, record.label,
                            record.has_type)
        if p.HasField("expand_param"):
            fill = np.clip(np.rint(self.channel_values(record.image.shape[2])), 0, 255)
            record = expand_record(record, p.expand_param, fill, self.emit, rng)
        if self.samplers:
            samples = generate_samples(record.boxes, self.samplers, rng)
            if samples:
                box = samples[int(rng.integers(len(samples)))]
                record = crop_record(record, box, self.emit)
        return record

    def __call__(self, record, rng):
        """(C x H x W array in the blob's type, kept box indices, their boxes)."""
        record = self.augment(record, rng)
        p = self.p
        mirror = bool(p.mirror) and bool(rng.integers(2))
        img = record.image
        size = img.shape[:2]
        if self.resize is not None:
            img = apply_resize(img, self.resize, rng)
        if p.HasField("noise_param"):
            img = noise_image(img, p.noise_param, rng)
        h, w = img.shape[:2]
        ch, cw = self.crop
        y = x = 0
        out_h, out_w = h, w
        if ch and cw:
            if h < ch or w < cw:
                raise DataError(f"crop {ch}x{cw} is larger than the image ({h}x{w})")
            if self.train:
                y = int(rng.integers(h - ch + 1))
                x = int(rng.integers(w - cw + 1))
            else:
                y, x = (h - ch) // 2, (w - cw) // 2
            img = img[y:y + ch, x:x + cw]
            out_h, out_w = ch, cw
        crop = np.array([F32(x) / F32(w), F32(y) / F32(h), F32(x + out_w) / F32(w),
                         F32(y + out_h) / F32(h)], F32)
        keep, boxes = transform_boxes(record, crop, self.emit, mirror, self.resize, size)
        if mirror:
            img = img[:, ::-1]
        data = img.astype(F32)
        if self.mean is not None:
            m = self.mean[:, y:y + out_h, x:x + out_w].transpose(1, 2, 0)
            if m.shape != data.shape:
                raise DataError(f"mean has shape {self.mean.shape}, the images are "
                                f"{data.shape[2]}x{h}x{w}")
            data = data - m        # the fork subtracts the mean at the output's position
        elif self.mean_values is not None:
            data = data - self.channel_values(data.shape[2])
        if self.scale != 1:
            data = data * self.scale
        return (np.ascontiguousarray(data.transpose(2, 0, 1), dtype=self.dtype),
                record.labels[keep], record.instances[keep], record.difficult[keep], boxes)
