"""Loss layers (SoftmaxWithLoss, SigmoidCrossEntropyLoss, EuclideanLoss, HingeLoss, InfogainLoss,
MultinomialLogisticLoss, ContrastiveLoss) and Accuracy, with BVLC Caffe's normalisation rules.

Every loss top is a 0-axis blob; backward reads the loss weight from the top's diff, as Caffe does.
"""
import os

import numpy as np

from caffepar.blob import canonical_axis
from caffepar.nn.base import Layer, register, reshaped_by_shape
from caffepar.proto import caffe_pb2
from caffepar.proto.text import read_blob_proto

FLT_MIN = float(np.finfo(np.float32).tiny)
LOG_THRESHOLD = 1e-20
_Norm = caffe_pb2.LossParameter


def _legacy_shape(shape):
    """Caffe's num/channels/height/width view: missing trailing axes count as 1."""
    return tuple(shape) + (1,) * (4 - len(shape)) if len(shape) <= 4 else tuple(shape)


def softmax(x, axis, out=None):
    """Softmax over `axis`, max-subtracted as Caffe's Softmax layer does."""
    out = np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def split_label_axis(layer, bottom, axis_value, label_what="label"):
    """Set layer.axis and the (outer, channels, inner) split of bottom[0] around it; bottom[1]
    must hold one label per outer x inner position, as Caffe checks."""
    shape = bottom[0].shape
    try:
        layer.axis = canonical_axis(axis_value, len(shape))
    except ValueError as e:
        raise layer.error(str(e)) from None
    layer.outer = int(np.prod(shape[:layer.axis]))
    layer.channels = int(shape[layer.axis])
    layer.inner = int(np.prod(shape[layer.axis + 1:]))
    if layer.outer * layer.inner != bottom[1].count:
        raise layer.error(
            f"number of labels must match number of predictions; with axis {layer.axis} and "
            f"prediction shape {shape} the {label_what} count must be "
            f"{layer.outer * layer.inner}, got {bottom[1].count}")


class LossLayer(Layer):
    """Caffe's LossLayer: two bottoms with the same first axis, one 0-axis top, weight 1. Its
    top may be left out of the prototxt (Caffe's AutoTopBlobs)."""

    exact_bottoms = 2
    exact_tops = 1
    is_loss = True
    auto_top_blobs = True

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def reshape(self, bottom, top):
        if bottom[0].num_axes and bottom[1].num_axes and bottom[0].shape[0] != bottom[1].shape[0]:
            raise self.error(f"the data and label should have the same first dimension, got "
                             f"{bottom[0].shape} and {bottom[1].shape}")
        top[0].reshape(())

    def no_label_backward(self, propagate_down, index=1, what="label"):
        if len(propagate_down) > index and propagate_down[index]:
            raise self.error(f"cannot backpropagate to {what} inputs")

    def loss_weight(self, top):
        return float(top[0].diff.flat[0])


class NormalizedLoss(LossLayer):
    """Losses with Caffe's LossParameter normalisation and ignore_label over (outer, C, inner)."""

    default_norm = _Norm.VALID
    allow_normalize = True

    def read_loss_param(self):
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        if lp.HasField("normalization"):
            self.normalization = lp.normalization
        elif lp.HasField("normalize"):
            if not self.allow_normalize:
                raise self.error('normalize is deprecated, use "normalization"')
            self.normalization = _Norm.VALID if lp.normalize else _Norm.BATCH_SIZE
        else:
            self.normalization = self.default_norm

    def summed_loss(self, per, valid):
        """(-sum of the per-position log terms over the positions that count, their number)."""
        if valid is None:
            return -per.sum(dtype=np.float64), per.size
        return -per[valid].sum(dtype=np.float64), int(valid.sum())

    def normalizer(self, valid_count):
        mode = self.normalization
        if mode == _Norm.FULL:
            n = self.outer * self.inner
        elif mode == _Norm.VALID:
            n = valid_count if valid_count >= 0 else self.outer * self.inner
        elif mode == _Norm.BATCH_SIZE:
            n = self.outer
        elif mode == _Norm.NONE:
            n = 1
        else:
            raise self.error(f"unknown normalization mode {mode}")
        return max(1.0, float(n))

    def split_axis(self, bottom, axis_value, label_what="label"):
        split_label_axis(self, bottom, axis_value, label_what)

    def labels(self, bottom):
        """Integer labels (outer, inner), the valid mask, and labels safe for indexing."""
        lab = bottom[1].data.reshape(self.outer, self.inner).astype(np.int64)
        if self.ignore_label is not None:
            valid = lab != self.ignore_label
            safe = np.where(valid, lab, 0)
        else:
            valid = None
            safe = lab
        if safe.size and (safe.min() < 0 or safe.max() >= self.channels):
            bad = lab[(lab < 0) | (lab >= self.channels)]
            if valid is not None:
                bad = lab[valid & ((lab < 0) | (lab >= self.channels))]
            raise self.error(f"label value {int(bad.flat[0])} out of range [0, {self.channels})")
        return lab, valid, safe


@register("SoftmaxWithLoss")
class SoftmaxWithLossLayer(NormalizedLoss):
    """Softmax over `softmax_param.axis` then multinomial logistic loss; optional top 1 = prob."""

    exact_tops = None
    min_tops = 1
    max_tops = 2

    def layer_setup(self, bottom, top):
        self.read_loss_param()

    @reshaped_by_shape
    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.split_axis(bottom, self.param.softmax_param.axis)
        # (outer, 1) and (1, inner) indices: with the labels, where each position's
        # probability sits (take_along_axis built these at every call).
        self.at = np.indices((self.outer, self.inner), sparse=True)
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)
            self.prob = top[1].data
        else:
            self.prob = np.zeros(bottom[0].shape, self.dtype)

    def forward(self, bottom, top):
        if len(top) >= 2:
            self.prob = top[1].data
        softmax(bottom[0].data, self.axis, out=self.prob)
        _, valid, safe = self.labels(bottom)
        p = self.prob.reshape(self.outer, self.channels, self.inner)
        picked = p[self.at[0], safe, self.at[1]]
        logs = np.log(np.maximum(picked, FLT_MIN))
        loss, count = self.summed_loss(logs, valid)
        top[0].data[...] = loss / self.normalizer(count)

    def backward(self, top, propagate_down, bottom):
        self.no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        _, valid, safe = self.labels(bottom)
        dx = bottom[0].diff.reshape(self.outer, self.channels, self.inner)
        np.copyto(dx, self.prob.reshape(dx.shape))
        o, i = self.at
        if valid is None:
            dx[o, safe, i] -= 1
            count = safe.size
        else:
            dx[o, safe, i] -= valid
            dx *= valid[:, None, :]
            count = int(valid.sum())
        dx *= self.loss_weight(top) / self.normalizer(count)


@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLossLayer(NormalizedLoss):
    """Cross-entropy of sigmoid(x) against targets; default normalisation BATCH_SIZE."""

    default_norm = _Norm.BATCH_SIZE

    def layer_setup(self, bottom, top):
        self.read_loss_param()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.outer = int(bottom[0].shape[0])
        self.inner = int(np.prod(bottom[0].shape[1:]))
        if bottom[0].count != bottom[1].count:
            raise self.error(f"inputs must have the same count, got {bottom[0].count} and "
                             f"{bottom[1].count}")

    def _valid(self, bottom):
        if self.ignore_label is None:
            return None
        return bottom[1].data.reshape(-1).astype(np.int64) != self.ignore_label

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(-1)
        t = bottom[1].data.reshape(-1)
        pos = (x >= 0).astype(x.dtype)
        term = x * (t - pos) - np.log(1 + np.exp(x - 2 * x * pos))
        valid = self._valid(bottom)
        loss, count = self.summed_loss(term, valid)
        self.norm = self.normalizer(count)
        top[0].data[...] = loss / self.norm

    def backward(self, top, propagate_down, bottom):
        self.no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        x = bottom[0].data
        dx = bottom[0].diff
        np.multiply(x, 0.5, out=dx)
        np.tanh(dx, out=dx)
        dx *= 0.5
        dx += 0.5
        dx -= bottom[1].data.reshape(dx.shape)
        valid = self._valid(bottom)
        if valid is not None:
            dx *= valid.reshape(dx.shape)
        dx *= self.loss_weight(top) / self.norm


@register("EuclideanLoss")
class EuclideanLossLayer(LossLayer):
    """sum((a - b)^2) / (2 N); both bottoms receive a gradient."""

    def allow_force_backward(self, bottom_index):
        return True

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if int(np.prod(bottom[0].shape[1:])) != int(np.prod(bottom[1].shape[1:])):
            raise self.error(f"inputs must have the same dimension, got {bottom[0].shape} and "
                             f"{bottom[1].shape}")

    def forward(self, bottom, top):
        self.diff = np.subtract(bottom[0].data.reshape(-1), bottom[1].data.reshape(-1))
        top[0].data[...] = np.dot(self.diff, self.diff) / bottom[0].shape[0] / 2

    def backward(self, top, propagate_down, bottom):
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                alpha = sign * self.loss_weight(top) / bottom[i].shape[0]
                np.multiply(self.diff.reshape(bottom[i].shape), alpha, out=bottom[i].diff)


@register("HingeLoss")
class HingeLossLayer(LossLayer):
    """One-vs-all hinge loss (L1 or L2). As in Caffe, forward leaves max(0, 1 -+ x) in
    bottom[0]'s diff and backward builds the gradient from what it finds there."""

    def layer_setup(self, bottom, top):
        self.norm = self.param.hinge_loss_param.norm
        if self.norm not in (caffe_pb2.HingeLossParameter.L1, caffe_pb2.HingeLossParameter.L2):
            raise self.error(f"unknown norm {self.norm}")

    def _flip_label_entries(self, bottom, d):
        lab = bottom[1].data.reshape(-1).astype(np.int64)
        if lab.size and (lab.min() < 0 or lab.max() >= d.shape[1]):
            raise self.error(f"label out of range [0, {d.shape[1]})")
        rows = np.arange(d.shape[0])
        d[rows, lab[:d.shape[0]]] *= -1

    def forward(self, bottom, top):
        num = bottom[0].shape[0]
        d = bottom[0].diff.reshape(num, -1)
        np.copyto(d, bottom[0].data.reshape(num, -1))
        self._flip_label_entries(bottom, d)
        d += 1
        np.maximum(d, 0, out=d)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            loss = np.abs(d).sum(dtype=np.float64)
        else:
            loss = np.dot(d.reshape(-1), d.reshape(-1))
        top[0].data[...] = loss / num

    def backward(self, top, propagate_down, bottom):
        self.no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        num = bottom[0].shape[0]
        d = bottom[0].diff.reshape(num, -1)
        self._flip_label_entries(bottom, d)
        lw = self.loss_weight(top)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            np.sign(d, out=d)
            d *= lw / num
        else:
            d *= lw * 2 / num


@register("InfogainLoss")
class InfogainLossLayer(NormalizedLoss):
    """-sum_l H[label, l] log softmax(x)_l; H from `infogain_loss_param.source` (resolved
    against the working directory, as Caffe does) or from a third bottom."""

    exact_bottoms = None
    min_bottoms = 2
    max_bottoms = 3
    exact_tops = None
    min_tops = 1
    max_tops = 2
    allow_normalize = False

    def layer_setup(self, bottom, top):
        self.read_loss_param()
        self.H = None
        if len(bottom) < 3:
            source = self.param.infogain_loss_param.source
            if not source:
                raise self.error("infogain matrix source must be specified (infogain_loss_param "
                                 "{ source: ... }) or given as a third bottom")
            if not os.path.exists(source):
                raise self.error(f'cannot open infogain matrix "{source}" (relative paths are '
                                 f"resolved against the working directory {os.getcwd()})")
            bp = read_blob_proto(source)
            self.H = np.asarray(bp.data if len(bp.data) else bp.double_data, dtype=self.dtype)

    def reshape(self, bottom, top):
        LossLayer.reshape(self, bottom, top)
        self.split_axis(bottom, self.param.infogain_loss_param.axis)
        h_count = self.H.size if self.H is not None else bottom[2].count
        if h_count != self.channels * self.channels:
            raise self.error(f"H must be {self.channels}x{self.channels}, it has {h_count} values")
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)
            self.prob = top[1].data
        else:
            self.prob = np.zeros(bottom[0].shape, self.dtype)

    def _h(self, bottom):
        h = self.H if self.H is not None else bottom[2].data
        return h.reshape(self.channels, self.channels)

    def forward(self, bottom, top):
        if len(top) >= 2:
            self.prob = top[1].data
        softmax(bottom[0].data, self.axis, out=self.prob)
        _, valid, safe = self.labels(bottom)
        h = self._h(bottom)
        logp = np.log(np.maximum(self.prob.reshape(self.outer, self.channels, self.inner),
                                 LOG_THRESHOLD))
        rows = h[safe]  # (outer, inner, C)
        per = np.einsum("oic,oci->oi", rows, logp)
        loss, count = self.summed_loss(per, valid)
        top[0].data[...] = loss / self.normalizer(count)

    def backward(self, top, propagate_down, bottom):
        self.no_label_backward(propagate_down)
        self.no_label_backward(propagate_down, 2, "infogain")
        if not propagate_down[0]:
            return
        _, valid, safe = self.labels(bottom)
        h = self._h(bottom)
        row_sums = h.sum(axis=1)
        p = self.prob.reshape(self.outer, self.channels, self.inner)
        dx = bottom[0].diff.reshape(p.shape)
        np.multiply(p, row_sums[safe][:, None, :], out=dx)
        dx -= h[safe].transpose(0, 2, 1)
        if valid is None:
            count = safe.size
        else:
            dx *= valid[:, None, :]
            count = int(valid.sum())
        dx *= self.loss_weight(top) / self.normalizer(count)


@register("MultinomialLogisticLoss")
class MultinomialLogisticLossLayer(LossLayer):
    """-log p[label] averaged over the batch; bottom[0] holds probabilities."""

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if _legacy_shape(bottom[1].shape)[1:4] != (1, 1, 1):
            raise self.error(f"label blob must have channels, height and width 1, got "
                             f"{bottom[1].shape}")

    def _picked(self, bottom):
        num = bottom[0].shape[0]
        x = bottom[0].data.reshape(num, -1)
        lab = bottom[1].data.reshape(-1).astype(np.int64)
        if lab.size and (lab.min() < 0 or lab.max() >= x.shape[1]):
            raise self.error(f"label out of range [0, {x.shape[1]})")
        return num, lab, np.maximum(x[np.arange(num), lab], LOG_THRESHOLD)

    def forward(self, bottom, top):
        num, _, prob = self._picked(bottom)
        top[0].data[...] = -np.log(prob).sum(dtype=np.float64) / num

    def backward(self, top, propagate_down, bottom):
        self.no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        num, lab, prob = self._picked(bottom)
        dx = bottom[0].diff.reshape(num, -1)
        dx[...] = 0
        dx[np.arange(num), lab] = (-self.loss_weight(top) / num) / prob


@register("ContrastiveLoss")
class ContrastiveLossLayer(LossLayer):
    """Siamese contrastive loss over pairs (a, b) with similarity y; both a and b get diffs."""

    exact_bottoms = 3

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def layer_setup(self, bottom, top):
        a, b, y = (_legacy_shape(x.shape) for x in bottom)
        if a[1] != b[1] or a[2:] != (1, 1) or b[2:] != (1, 1) or y[1:] != (1, 1, 1):
            raise self.error(f"bottoms must be (N, C, 1, 1), (N, C, 1, 1) and (N, 1, 1, 1), got "
                             f"{bottom[0].shape}, {bottom[1].shape} and {bottom[2].shape}")
        p = self.param.contrastive_loss_param
        self.margin = p.margin
        self.legacy = p.legacy_version

    def forward(self, bottom, top):
        num = bottom[0].shape[0]
        self.diff = np.subtract(bottom[0].data.reshape(num, -1), bottom[1].data.reshape(num, -1))
        self.dist_sq = np.einsum("ij,ij->i", self.diff, self.diff)
        self.similar = bottom[2].data.reshape(-1).astype(np.int64) != 0
        if self.legacy:
            dissim = np.maximum(self.margin - self.dist_sq, 0)
        else:
            dissim = np.maximum(self.margin - np.sqrt(self.dist_sq), 0) ** 2
        loss = np.where(self.similar, self.dist_sq, dissim).sum(dtype=np.float64)
        top[0].data[...] = loss / num / 2

    def backward(self, top, propagate_down, bottom):
        for i, sign in ((0, 1.0), (1, -1.0)):
            if not propagate_down[i]:
                continue
            num = bottom[i].shape[0]
            alpha = sign * self.loss_weight(top) / num
            if self.legacy:
                mdist = self.margin - self.dist_sq
                beta = np.full_like(mdist, -alpha)
            else:
                dist = np.sqrt(self.dist_sq)
                mdist = self.margin - dist
                beta = -alpha * mdist / (dist + 1e-4)
            coef = np.where(self.similar, alpha, np.where(mdist > 0, beta, 0))
            np.multiply(self.diff, coef[:, None].astype(self.dtype),
                        out=bottom[i].diff.reshape(num, -1))
        if len(propagate_down) > 2 and propagate_down[2]:
            raise self.error("cannot backpropagate to the similarity input")


@register("Accuracy")
class AccuracyLayer(Layer):
    """Top-k accuracy over `axis`; optional second top with per-class accuracy. No backward."""

    exact_bottoms = 2
    min_tops = 1
    max_tops = 2

    def layer_setup(self, bottom, top):
        p = self.param.accuracy_param
        self.top_k = p.top_k
        self.ignore_label = p.ignore_label if p.HasField("ignore_label") else None

    def reshape(self, bottom, top):
        if bottom[1].count == 0 or self.top_k > bottom[0].count // bottom[1].count:
            raise self.error("top_k must be less than or equal to the number of classes, got "
                             f"top_k {self.top_k}")
        split_label_axis(self, bottom, self.param.accuracy_param.axis)
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.channels,))

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.outer, self.channels, self.inner)
        lab = bottom[1].data.reshape(self.outer, self.inner).astype(np.int64)
        valid = np.ones(lab.shape, bool) if self.ignore_label is None \
            else lab != self.ignore_label
        lab_v = lab[valid]
        if lab_v.size and (lab_v.min() < 0 or lab_v.max() >= self.channels):
            raise self.error(f"label out of range [0, {self.channels})")
        safe = np.where(valid, lab, 0)
        true_score = np.take_along_axis(x, safe[:, None, :], axis=1)
        better = (x >= true_score).sum(axis=1)
        correct = (better <= self.top_k) & valid
        count = int(valid.sum())
        top[0].data[...] = correct.sum() / count if count else 0
        if len(top) > 1:
            nums = np.bincount(lab_v, minlength=self.channels)
            hits = np.bincount(lab[correct], minlength=self.channels)
            top[1].data[...] = np.where(nums == 0, 0, hits / np.maximum(nums, 1))
