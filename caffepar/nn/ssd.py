"""SSD's layers (the weiliu89/caffe fork, branch ssd): Permute, PriorBox, Normalize and
DetectionOutput, with that fork's parameters and arithmetic (float32 boxes, its sort orders)."""
from functools import partial

import numpy as np

from caffepar.nn import native
from caffepar.nn.base import Layer, register
from caffepar.proto import caffe_pb2

F32 = np.float32
CODE = caffe_pb2.PriorBoxParameter


@register("Permute")
class PermuteLayer(Layer):
    """Transposes the bottom's axes into `order`; axes not named follow in their own order."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        n = bottom[0].num_axes
        order = []
        for axis in self.param.permute_param.order:
            if axis >= n:
                raise self.error(f"order names axis {axis}, the bottom has {n} axes")
            if axis in order:
                raise self.error(f"order names axis {axis} twice")
            order.append(axis)
        self.order = tuple(order + [a for a in range(n) if a not in order])
        self.inverse = tuple(np.argsort(self.order))

    def reshape(self, bottom, top):
        if bottom[0].num_axes != len(self.order):
            raise self.error(f"bottom has {bottom[0].num_axes} axes, order needs "
                             f"{len(self.order)}")
        top[0].reshape(tuple(bottom[0].shape[a] for a in self.order))

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data.transpose(self.order)

    def prepare_forward(self, bottom, top):
        return partial(np.copyto, top[0].data, bottom[0].data.transpose(self.order))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff.transpose(self.inverse)


def prior_shapes(param):
    """The fork's prior boxes of one cell as (width, height) pairs, in its order: per min_size,
    the square, the sqrt(min*max) square, then the other aspect ratios. Sizes are taken as
    integers, as the fork does."""
    ratios = [1.0]
    for ar in param.aspect_ratio:
        if all(abs(ar - r) >= 1e-6 for r in ratios):
            ratios.append(ar)
            if param.flip:
                ratios.append(1.0 / ar)
    shapes = []
    for s, min_size in enumerate(param.min_size):
        m = int(min_size)
        shapes.append((m, m))
        if param.max_size:
            side = F32(np.sqrt(float(m * int(param.max_size[s]))))
            shapes.append((side, side))
        for ar in ratios:
            if abs(ar - 1.0) < 1e-6:
                continue
            root = np.sqrt(float(F32(ar)))
            shapes.append((F32(m * root), F32(m / root)))
    return shapes


@register("PriorBox")
class PriorBoxLayer(Layer):
    """SSD's default boxes for a feature map (bottom 0) over an image (bottom 1): 1 x 2 x 4P
    with the normalized corners in channel 0 and their variances in channel 1. Depends only on
    the shapes; no backward."""

    exact_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.prior_box_param
        if not p.min_size:
            raise self.error("prior_box_param needs min_size (none given)")
        for m in p.min_size:
            self.positive(m, "min_size")
        if p.max_size:
            if len(p.max_size) != len(p.min_size):
                raise self.error(f"gives {len(p.max_size)} max_size for {len(p.min_size)} "
                                 "min_size; give one per min_size")
            for lo, hi in zip(p.min_size, p.max_size):
                if hi <= lo:
                    raise self.error(f"max_size ({hi:g}) must be greater than min_size ({lo:g})")
        if len(p.variance) not in (0, 1, 4):
            raise self.error(f"variance takes 1 or 4 values, got {len(p.variance)}")
        for v in p.variance:
            self.positive(v, "variance")
        self.variance = list(p.variance) or [0.1]
        if p.HasField("img_h") or p.HasField("img_w"):
            if p.HasField("img_size"):
                raise self.error("give either img_size or img_h/img_w, not both")
            self.img = (self.positive(p.img_h, "img_h"), self.positive(p.img_w, "img_w"))
        elif p.HasField("img_size"):
            self.img = (self.positive(p.img_size, "img_size"),) * 2
        else:
            self.img = (0, 0)
        if p.HasField("step_h") or p.HasField("step_w"):
            if p.HasField("step"):
                raise self.error("give either step or step_h/step_w, not both")
            self.step = (self.positive(p.step_h, "step_h"), self.positive(p.step_w, "step_w"))
        elif p.HasField("step"):
            self.step = (self.positive(p.step, "step"),) * 2
        else:
            self.step = (0.0, 0.0)
        self.shapes = prior_shapes(p)
        self.offset = F32(p.offset)
        self.clip = p.clip

    @property
    def num_priors(self):
        return len(self.shapes)

    def reshape(self, bottom, top):
        for i, b in enumerate(bottom[:2]):
            if b.num_axes < 4 and not (i == 1 and self.img[0]):
                raise self.error(f"bottom {i} must be N x C x H x W, got shape {b.shape}")
        top[0].reshape((1, 2, bottom[0].height * bottom[0].width * self.num_priors * 4))

    def forward(self, bottom, top):
        top[0].data[...] = self.priors(bottom[0].height, bottom[0].width,
                                       bottom[1].height, bottom[1].width).reshape(top[0].shape)

    def prepare_forward(self, bottom, top):
        """The priors depend on the shapes alone: made once, copied at each call (a user may
        have written over the blob)."""
        priors = self.priors(bottom[0].height, bottom[0].width, bottom[1].height,
                             bottom[1].width).reshape(top[0].shape)
        return partial(np.copyto, top[0].data, priors)

    def priors(self, layer_h, layer_w, image_h, image_w):
        """The 2 x (layer_h * layer_w * P * 4) prior array for these sizes (no blobs needed)."""
        img_h, img_w = self.img if self.img[0] else (image_h, image_w)
        if self.step[0]:
            step_h, step_w = F32(self.step[0]), F32(self.step[1])
        else:
            step_h, step_w = F32(img_h) / F32(layer_h), F32(img_w) / F32(layer_w)
        cy = (np.arange(layer_h, dtype=F32) + self.offset) * step_h
        cx = (np.arange(layer_w, dtype=F32) + self.offset) * step_w
        sizes = np.array(self.shapes, np.float64)        # P x (w, h)
        cx = cx.astype(np.float64)[None, :, None]
        cy = cy.astype(np.float64)[:, None, None]
        half_w, half_h = sizes[:, 0] / 2, sizes[:, 1] / 2
        out = np.empty((layer_h, layer_w, len(sizes), 4), np.float64)
        out[..., 0] = (cx - half_w) / img_w
        out[..., 1] = (cy - half_h) / img_h
        out[..., 2] = (cx + half_w) / img_w
        out[..., 3] = (cy + half_h) / img_h
        boxes = out.astype(self.dtype).reshape(-1)
        if self.clip:
            np.clip(boxes, 0, 1, out=boxes)
        variances = np.resize(np.array(self.variance, self.dtype), boxes.size)
        return np.stack([boxes, variances])

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        """Priors depend on shapes only: the gradient is zero."""
        for down, b in zip(propagate_down, bottom):
            if down:
                b.diff[...] = 0


@register("Normalize")
class NormalizeLayer(Layer):
    """SSD's L2 normalization, x / sqrt(sum x^2 + eps), over each image (across_spatial) or
    over the channels of each position, times a learned scale (one value or one per channel)."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes, got shape {bottom[0].shape}")
        p = self.param.norm_param
        self.across_spatial = p.across_spatial
        self.channel_shared = p.channel_shared
        self.eps = float(F32(p.eps))
        channels = bottom[0].shape[1]
        if not self.blobs_already_set(1):
            filler = (p.scale_filler if p.HasField("scale_filler")
                      else caffe_pb2.FillerParameter(type="constant", value=1.0))
            self.add_param_blob(() if self.channel_shared else (channels,), filler)
        want = 1 if self.channel_shared else channels
        if self.blobs[0].count != want:
            raise self.error(f"scale blob has {self.blobs[0].count} values, the configuration "
                             f"needs {want}")

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes, got shape {bottom[0].shape}")
        top[0].reshape(bottom[0].shape)

    def _view(self, array):
        n, c = array.shape[:2]
        return array.reshape(n, c, -1)

    def _scale(self):
        s = self.blobs[0].data
        return s.reshape(()) if self.channel_shared else s.reshape(1, -1, 1)

    def forward(self, bottom, top):
        x = self._view(bottom[0].data)
        axes = (1, 2) if self.across_spatial else (1,)
        self.norm = np.sqrt(np.square(x).sum(axis=axes, keepdims=True) + self.dtype.type(self.eps))
        self.unit = x / self.norm
        self._view(top[0].data)[...] = self.unit * self._scale()

    def backward(self, top, propagate_down, bottom):
        dy = self._view(top[0].diff)
        if self.param_propagate_down and self.param_propagate_down[0]:
            g = dy * self.unit
            if self.channel_shared:
                self.blobs[0].diff += g.sum()
            else:
                self.blobs[0].diff += g.sum(axis=(0, 2))
        if propagate_down[0]:
            # The true gradient. The fork leaves the scale out of the dot product, which is
            # exact only for one shared scale (or equal ones).
            axes = (1, 2) if self.across_spatial else (1,)
            g = dy * self._scale()
            dot = (g * self.unit).sum(axis=axes, keepdims=True)
            self._view(bottom[0].diff)[...] = (g - self.unit * dot) / self.norm


def decode_boxes(loc, prior, variance, code_type, variance_in_target):
    """Caffe's DecodeBBox for arrays: loc (..., P, 4) offsets, prior and variance (P, 4);
    float32 corners as the fork computes them."""
    loc = loc.astype(F32)
    prior = prior.astype(F32)
    var = np.ones_like(prior) if variance_in_target else variance.astype(F32)
    if code_type == CODE.CORNER:
        return prior + var * loc
    pw = prior[:, 2] - prior[:, 0]
    ph = prior[:, 3] - prior[:, 1]
    if code_type == CODE.CORNER_SIZE:
        size = np.stack([pw, ph, pw, ph], axis=-1)
        return prior + var * loc * size
    if code_type != CODE.CENTER_SIZE:
        raise ValueError(f"unknown code_type {code_type}")
    pcx = (prior[:, 0] + prior[:, 2]) / F32(2)
    pcy = (prior[:, 1] + prior[:, 3]) / F32(2)
    cx = var[:, 0] * loc[..., 0] * pw + pcx
    cy = var[:, 1] * loc[..., 1] * ph + pcy
    w = (np.exp((var[:, 2] * loc[..., 2]).astype(np.float64)) * pw).astype(F32)
    h = (np.exp((var[:, 3] * loc[..., 3]).astype(np.float64)) * ph).astype(F32)
    return np.stack([cx - w / F32(2), cy - h / F32(2), cx + w / F32(2), cy + h / F32(2)], axis=-1)


def box_sizes(boxes):
    """Caffe's BBoxSize (normalized): width * height, 0 for an inverted box."""
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    return np.where((w < 0) | (h < 0), F32(0), w * h)


def overlaps(box, size, boxes, sizes):
    """Caffe's JaccardOverlap of one box (or a column of boxes, shape (n, 1, 4)) with
    several, in float32."""
    w = np.minimum(box[..., 2], boxes[..., 2]) - np.maximum(box[..., 0], boxes[..., 0])
    h = np.minimum(box[..., 3], boxes[..., 3]) - np.maximum(box[..., 1], boxes[..., 1])
    hit = (w > 0) & (h > 0)
    inter = np.where(hit, w * h, F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(hit, inter / (size + sizes - inter), F32(0))


PAIRWISE_MAX = 2048
"""Candidates up to which NMS computes all their overlaps at once (16 MiB)."""


def nms(boxes, sizes, scores, score_threshold, nms_threshold, eta, top_k):
    """Caffe's ApplyNMSFast: the candidates above the threshold, best first (ties by index),
    cut to top_k, each kept when it overlaps no kept box by more than the (adaptive)
    threshold. Returns the kept indices in that order. The compiled kernel compares each
    candidate with the kept boxes only, in the same float32 roundings; the NumPy code computes
    all their overlaps at once (a Python loop of small overlaps would cost more)."""
    candidates = np.flatnonzero(scores > score_threshold)
    best = scores[candidates]
    if top_k == 0:
        return []
    if -1 < top_k < len(candidates):
        # The top_k best without sorting them all: those above the top_k-th score, then those
        # at it in index order (the stable sort's ties).
        kth = np.partition(best, len(best) - top_k)[len(best) - top_k]
        above = np.flatnonzero(best > kth)
        at = np.flatnonzero(best == kth)[:top_k - len(above)]
        pick = np.sort(np.concatenate([above, at]))
        candidates, best = candidates[pick], best[pick]
    candidates = candidates[np.argsort(-best, kind="stable")]
    b, s = boxes[candidates], sizes[candidates]
    k = native.kernels(np.float32)
    if k is not None and not np.isnan(b).any():
        kept = np.empty(len(candidates), np.int64)
        count = k.nms_sorted(native.ptr(b), native.ptr(s), len(candidates), nms_threshold, eta,
                             native.ptr(kept))
        return candidates[kept[:count]].tolist()
    table = (overlaps(b[:, None], s[:, None], b[None], s[None])
             if len(candidates) <= PAIRWISE_MAX else None)
    # A candidate is kept when its largest overlap with the kept ones is within the threshold.
    largest = np.zeros(len(candidates), F32)
    kept = []
    threshold = F32(nms_threshold)
    for i in range(len(candidates)):
        if largest[i] > threshold:
            continue
        kept.append(candidates[i])
        np.maximum(largest, table[i] if table is not None else overlaps(b[i], s[i], b, s),
                   out=largest)
        if eta < 1 and threshold > 0.5:
            threshold = F32(threshold * F32(eta))
    return kept


@register("DetectionOutput")
class DetectionOutputLayer(Layer):
    """SSD's detections from location offsets (bottom 0), class confidences (bottom 1) and
    priors (bottom 2): decode, per-class NMS, keep_top_k per image. The top is 1 x 1 x N x 7
    rows [image, label, score, xmin, ymin, xmax, ymax] ordered by image, label, then score;
    an image with no detection at all gives one row [image, -1, ...]. No files are written:
    save_output_param is read and ignored. `clip` (OpenCV's field) clips the decoded boxes to
    [0, 1] before NMS."""

    exact_bottoms = 3
    exact_tops = 1
    data_dependent_axes = (2,)

    def layer_setup(self, bottom, top):
        p = self.param.detection_output_param
        if not p.HasField("num_classes"):
            raise self.error("detection_output_param needs num_classes")
        self.num_classes = self.positive(p.num_classes, "num_classes")
        self.share_location = p.share_location
        self.num_loc_classes = 1 if p.share_location else self.num_classes
        self.background = p.background_label_id
        self.code_type = p.code_type
        self.clip = p.clip
        self.variance_in_target = p.variance_encoded_in_target
        self.keep_top_k = p.keep_top_k
        self.confidence_threshold = (F32(p.confidence_threshold) if p.HasField("confidence_threshold")
                                     else -np.finfo(F32).max)
        nms_param = p.nms_param
        self.nms_threshold = float(F32(nms_param.nms_threshold))
        if self.nms_threshold < 0:
            raise self.error(f"nms_threshold must be >= 0, got {nms_param.nms_threshold:g}")
        self.eta = float(F32(nms_param.eta))
        if not 0 < self.eta <= 1:
            raise self.error(f"eta must be in (0, 1], got {nms_param.eta:g}")
        self.top_k = nms_param.top_k if nms_param.HasField("top_k") else -1

    def reshape(self, bottom, top):
        loc, conf, prior = bottom
        if loc.num != conf.num:
            raise self.error(f"location bottom has {loc.num} images, confidence bottom "
                             f"{conf.num}")
        if prior.num_axes < 3 or prior.shape[1] != 2:
            raise self.error(f"prior bottom must be 1 x 2 x 4P (a PriorBox top), got shape "
                             f"{prior.shape}")
        self.num_priors = prior.height // 4
        per_image = conf.count // max(conf.num, 1)
        if per_image != self.num_priors * self.num_classes:
            raise self.error(
                f"num_classes ({self.num_classes}) does not match the bottoms: the confidence "
                f'bottom "{self.param.bottom[1]}" has {per_image} values per image, '
                f"{self.num_priors} priors x {self.num_classes} classes = "
                f"{self.num_priors * self.num_classes} expected")
        if loc.count // max(loc.num, 1) != self.num_priors * self.num_loc_classes * 4:
            raise self.error(
                f'the location bottom "{self.param.bottom[0]}" has '
                f"{loc.count // max(loc.num, 1)} values per image, {self.num_priors} priors x "
                f"{self.num_loc_classes} x 4 = {self.num_priors * self.num_loc_classes * 4} "
                "expected")
        top[0].reshape((1, 1, 1, 7))

    def detect(self, loc, conf, prior):
        """The N_kept x 7 rows for arrays loc (N, P*Cl*4), conf (N, P*C), prior (2, P*4)."""
        num, priors = loc.shape[0], self.num_priors
        loc = loc.reshape(num, priors, self.num_loc_classes, 4).transpose(0, 2, 1, 3)
        conf = conf.reshape(num, priors, self.num_classes).astype(F32)
        prior_boxes = prior[0].reshape(priors, 4)
        variances = prior[1].reshape(priors, 4)
        boxes = decode_boxes(loc, prior_boxes, variances, self.code_type, self.variance_in_target)
        if self.clip:
            boxes = np.clip(boxes, F32(0), F32(1))
        sizes = box_sizes(boxes)
        rows = []
        for i in range(num):
            labels, kept = [], []                          # in output order
            for c in range(self.num_classes):
                if c == self.background:
                    continue
                lc = 0 if self.share_location else c
                found = nms(boxes[i, lc], sizes[i, lc], conf[i, :, c], self.confidence_threshold,
                            self.nms_threshold, self.eta, self.top_k)
                labels += [c] * len(found)
                kept += found
            labels, kept = np.array(labels, np.int64), np.array(kept, np.int64)
            scores = conf[i, kept, labels]
            if -1 < self.keep_top_k < len(kept):
                best = np.sort(np.argsort(-scores, kind="stable")[:self.keep_top_k])
                labels, kept, scores = labels[best], kept[best], scores[best]
            lc = 0 if self.share_location else labels
            rows.append(np.column_stack([np.full(len(kept), i), labels, scores,
                                         boxes[i, lc, kept]]).astype(self.dtype))
        if not sum(map(len, rows)):
            return np.array([[i] + [-1] * 6 for i in range(num)], self.dtype).reshape(-1, 7)
        return np.concatenate(rows)

    def forward(self, bottom, top):
        loc, conf, prior = bottom
        rows = self.detect(loc.data.reshape(loc.num, -1), conf.data.reshape(conf.num, -1),
                           prior.data.reshape(2, -1))
        top[0].reshape((1, 1, rows.shape[0], 7))
        top[0].data[...] = rows.reshape(top[0].shape)

    def allow_force_backward(self, bottom_index):
        return False
