"""SSD's training layers (the weiliu89/caffe fork, branch ssd): MultiBoxLoss and
DetectionEvaluate, and the average precision the fork's solver computes from the latter's rows.

The arithmetic follows the fork's: boxes, overlaps and encodings in float32 in its order of
operations (so the matches it finds are the ones found here), its tie-breaks (the first of
equal overlaps by prior, then by ground truth), and its loss normalization. Where the fork's
backward is not the derivative of its loss (encode_variance_in_target divides the predictions
by the variances after the diff is taken), the fork's backward is the one computed, as the
docstrings say.
"""
import numpy as np

from caffepar.data.annotated import bbox_size, jaccard, project_box
from caffepar.nn.base import Layer, register
from caffepar.nn.ssd import decode_boxes
from caffepar.proto import caffe_pb2

F32 = np.float32
FLT_MIN = float(np.finfo(np.float32).tiny)
MB = caffe_pb2.MultiBoxLossParameter
CODE = caffe_pb2.PriorBoxParameter
NORM = caffe_pb2.LossParameter
RESIZE = caffe_pb2.ResizeParameter


# ==================================================================== matching and encoding
def match_boxes(gt, gt_size, boxes, boxes_size, match_type, threshold, ignore_cross_boundary):
    """MatchBBox: (index of the ground truth each box matches or -1, -2 for an ignored
    cross-boundary box; the overlap recorded for it). Bipartite first: the largest overlap
    left, pair by pair, until no ground truth is left; then (PER_PREDICTION) every box still
    free takes its best ground truth at `threshold` or more."""
    n = len(boxes)
    index = np.full(n, -1, np.int64)
    best = np.zeros(n, boxes.dtype)
    if not len(gt):
        return index, best
    ignored = np.zeros(n, bool)
    if ignore_cross_boundary:
        ignored = ((boxes < 0) | (boxes > 1)).any(axis=1)
        index[ignored] = -2
    ov = jaccard(boxes, boxes_size, gt, gt_size)
    stored = (ov > 1e-6) & ~ignored[:, None]
    best = np.where(stored, ov, 0).max(axis=1).astype(boxes.dtype)
    table = np.where(stored, ov, -np.inf)
    free_gt = np.ones(len(gt), bool)
    for _ in range(len(gt)):
        cand = np.where((index == -1)[:, None] & free_gt[None, :], table, -np.inf)
        k = int(np.argmax(cand))
        i, j = divmod(k, len(gt))
        if not np.isfinite(cand[i, j]):
            break
        index[i] = j
        best[i] = ov[i, j]
        free_gt[j] = False
    if match_type == MB.PER_PREDICTION:
        rest = np.flatnonzero((index == -1) & stored.any(axis=1))
        if len(rest):
            cand = np.where(table[rest] >= F32(threshold), table[rest], -np.inf)
            j = np.argmax(cand, axis=1)
            ok = np.isfinite(cand[np.arange(len(rest)), j])
            index[rest[ok]] = j[ok]
            best[rest[ok]] = ov[rest[ok], j[ok]]
    elif match_type != MB.BIPARTITE:
        raise ValueError(f"unknown match_type {match_type}")
    return index, best


def encode_boxes(prior, variance, code_type, variance_in_target, boxes):
    """EncodeBBox of boxes (n, 4) against their priors (n, 4) and variances (n, 4)."""
    dt = prior.dtype.type
    if code_type == CODE.CORNER:
        d = boxes - prior
        return d if variance_in_target else d / variance
    pw = prior[:, 2] - prior[:, 0]
    ph = prior[:, 3] - prior[:, 1]
    if code_type == CODE.CORNER_SIZE:
        size = np.stack([pw, ph, pw, ph], axis=1)
        d = (boxes - prior) / size
        return d if variance_in_target else d / variance
    if code_type != CODE.CENTER_SIZE:
        raise ValueError(f"unknown code_type {code_type}")
    half = dt(0.5)
    pcx = (prior[:, 0] + prior[:, 2]) * half
    pcy = (prior[:, 1] + prior[:, 3]) * half
    bw = boxes[:, 2] - boxes[:, 0]
    bh = boxes[:, 3] - boxes[:, 1]
    bcx = (boxes[:, 0] + boxes[:, 2]) * half
    bcy = (boxes[:, 1] + boxes[:, 3]) * half
    with np.errstate(divide="ignore", invalid="ignore"):
        lw = np.log((bw / pw).astype(np.float64))
        lh = np.log((bh / ph).astype(np.float64))
    if variance_in_target:
        return np.stack([(bcx - pcx) / pw, (bcy - pcy) / ph, lw.astype(dt), lh.astype(dt)],
                        axis=1)
    return np.stack([(bcx - pcx) / pw / variance[:, 0], (bcy - pcy) / ph / variance[:, 1],
                     (lw / variance[:, 2]).astype(dt), (lh / variance[:, 3]).astype(dt)],
                    axis=1)


def nms_by_score(boxes, sizes, scores, threshold, top_k):
    """ApplyNMS (the one hard example mining uses): boxes by score (stable), cut to top_k
    (a top_k of 0, the field's default, keeps none), boxes smaller than 1e-5 dropped, each
    kept one removing those overlapping it by more than `threshold`."""
    order = list(np.argsort(-np.asarray(scores, np.float64), kind="stable"))
    if -1 < top_k < len(order):
        order = order[:top_k]
    kept = []
    while order:
        best = order.pop(0)
        if sizes[best] < 1e-5:
            continue
        kept.append(best)
        if -1 < top_k <= len(kept):
            break
        rest = np.array(order, np.int64)
        if not len(rest):
            break
        ov = jaccard(boxes[best:best + 1], sizes[best:best + 1], boxes[rest], sizes[rest])[0]
        order = [int(r) for r, o, s in zip(rest, ov, sizes[rest]) if s >= 1e-5 and o <= threshold]
    return kept


# ==================================================================== MultiBoxLoss
@register("MultiBoxLoss")
class MultiBoxLossLayer(Layer):
    """SSD's loss: bottoms loc predictions (N, P*Cl*4), confidences (N, P*C), priors (1, 2, 4P)
    and ground truth (1, 1, G, 8) rows [image, label, instance, xmin, ymin, xmax, ymax,
    difficult]. Priors (or decoded predictions) are matched to the ground truth, negatives
    mined, and the top is loc_weight * (smooth L1 or L2 of the encoded boxes) + (softmax or
    logistic loss of the classes), each divided by the normalizer (VALID: the matches).

    Backward is the fork's: the derivative of that loss, except that with
    encode_variance_in_target the location diff is taken after dividing predictions and
    targets by the variances, so it is the derivative times the variance. The fork's
    LOGISTIC loss without mining writes its targets at image offsets of P (not P*C), and
    fills the targets it does not set with background_label_id's value: both kept, as the
    loss the fork optimizes."""

    exact_bottoms = 4
    exact_tops = 1
    is_loss = True
    auto_top_blobs = True
    uses_replica_sum = True
    replica_sum = None

    def layer_setup(self, bottom, top):
        p = self.param.multibox_loss_param
        if not p.HasField("num_classes"):
            raise self.error("multibox_loss_param needs num_classes")
        self.num_classes = self.positive(p.num_classes, "num_classes")
        self.share_location = p.share_location
        self.loc_classes = 1 if p.share_location else self.num_classes
        self.background = int(p.background_label_id)
        self.use_difficult = p.use_difficult_gt
        self.mining = p.mining_type
        if p.HasField("do_neg_mining") and p.do_neg_mining != (self.mining != MB.NONE):
            raise self.error(f"do_neg_mining ({str(p.do_neg_mining).lower()}) contradicts "
                             f"mining_type {MB.MiningType.Name(self.mining)} (do_neg_mining is "
                             "deprecated: remove it)")
        if self.mining != MB.NONE and not self.share_location:
            raise self.error("negative mining needs share_location: true")
        lp = self.param.loss_param
        if not lp.HasField("normalization") and lp.HasField("normalize"):
            self.normalization = NORM.VALID if lp.normalize else NORM.BATCH_SIZE
        else:
            self.normalization = lp.normalization
        self.loc_weight = float(F32(p.loc_weight))
        self.loc_loss = p.loc_loss_type
        self.conf_loss = p.conf_loss_type
        if self.conf_loss == MB.SOFTMAX and not 0 <= self.background < self.num_classes:
            raise self.error(f"background_label_id ({self.background}) must be in [0, "
                             f"num_classes) for the SOFTMAX conf loss")
        if p.map_object_to_agnostic and self.num_classes != 2:
            raise self.error("map_object_to_agnostic needs num_classes: 2 (background and "
                             "object)")
        self.match_type = p.match_type
        self.overlap_threshold = float(F32(p.overlap_threshold))
        self.use_prior = p.use_prior_for_matching
        self.neg_pos_ratio = F32(p.neg_pos_ratio)
        self.neg_overlap = F32(p.neg_overlap)
        self.code_type = p.code_type
        self.variance_in_target = p.encode_variance_in_target
        self.agnostic = p.map_object_to_agnostic
        self.ignore_cross = p.ignore_cross_boundary_bbox
        self.bp_inside = p.bp_inside
        self.has_nms = p.HasField("nms_param")
        self.nms_threshold = float(F32(p.nms_param.nms_threshold)) if self.has_nms else 0.0
        self.nms_top_k = int(p.nms_param.top_k) if self.has_nms else -1
        self.sample_size = int(p.sample_size)
        if self.mining == MB.HARD_EXAMPLE and self.sample_size <= 0:
            raise self.error(f"sample_size must be > 0 for HARD_EXAMPLE, got {self.sample_size}")
        self.use_prior_for_nms = p.use_prior_for_nms
        # The loss terms the fork adds: those of the bottoms it back-propagates to.
        down = list(self.param.propagate_down) or [True, True, False, False]
        self.terms = (bool(down[0]), bool(down[1]))

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2

    def reshape(self, bottom, top):
        loc, conf, prior, gt = bottom
        if prior.num_axes < 3 or prior.shape[1] != 2:
            raise self.error(f"prior bottom must be 1 x 2 x 4P (a PriorBox top), got shape "
                             f"{prior.shape}")
        if gt.num_axes < 1 or gt.shape[-1] != 8:
            raise self.error(f"label bottom must have rows of 8 values [image, label, "
                             f"instance, xmin, ymin, xmax, ymax, difficult], got shape {gt.shape}")
        self.num = loc.num
        self.num_priors = prior.shape[2] // 4
        if conf.num != loc.num:
            raise self.error(f"location bottom has {loc.num} images, confidence bottom "
                             f"{conf.num}")
        per_loc = loc.count // max(loc.num, 1)
        if per_loc != self.num_priors * self.loc_classes * 4:
            raise self.error(f"the location bottom has {per_loc} values per image, "
                             f"{self.num_priors} priors x {self.loc_classes} x 4 = "
                             f"{self.num_priors * self.loc_classes * 4} expected")
        per_conf = conf.count // max(conf.num, 1)
        if per_conf != self.num_priors * self.num_classes:
            raise self.error(f"num_classes ({self.num_classes}) does not match the confidence "
                             f"bottom: {per_conf} values per image, {self.num_priors} priors x "
                             f"{self.num_classes} classes = "
                             f"{self.num_priors * self.num_classes} expected")
        top[0].reshape(())

    # ---------------------------------------------------------------- pieces
    def ground_truth(self, gt_rows):
        """{image: (boxes (g, 4), sizes, labels, difficult)}, GetGroundTruth's."""
        dt = self.dtype.type
        rows = gt_rows.reshape(-1, 8)
        out = {}
        for r in rows:
            item = int(r[0])
            if item == -1:
                continue
            label = int(r[1])
            if label == self.background:
                raise self.error(f"found the background label {label} in the ground truth")
            difficult = bool(r[7])
            if difficult and not self.use_difficult:
                continue
            out.setdefault(item, []).append((label, r[3:7].astype(self.dtype), difficult))
        result = {}
        for item, objs in out.items():
            boxes = np.stack([o[1] for o in objs]).astype(self.dtype)
            result[item] = (boxes, bbox_size(boxes, dt), np.array([o[0] for o in objs]),
                            np.array([o[2] for o in objs]))
        return result

    def find_matches(self, loc, priors, prior_size, variances, gts):
        """Per image {label: (match index (P,), overlap (P,))}, labels in ascending order
        (-1 for shared locations), as FindMatches leaves them."""
        matches = []
        for i in range(self.num):
            found = {}
            if i not in gts:
                matches.append(found)
                continue
            boxes, sizes, labels, _ = gts[i]
            if not self.use_prior:
                for c in range(self.loc_classes):
                    label = -1 if self.share_location else c
                    if not self.share_location and label == self.background:
                        continue
                    dec = decode_boxes(loc[i, :, c], priors, variances, self.code_type,
                                       self.variance_in_target).astype(self.dtype)
                    keep = np.arange(len(labels)) if label == -1 else np.flatnonzero(labels == label)
                    idx, ov = match_boxes(boxes[keep], sizes[keep], dec,
                                          bbox_size(dec, self.dtype.type), self.match_type,
                                          self.overlap_threshold, self.ignore_cross)
                    # The fork's indices are positions in the full list of ground truth.
                    if len(keep):
                        idx = np.where(idx >= 0, keep[np.maximum(idx, 0)], idx)
                    found[label] = (idx, ov)
            else:
                idx, ov = match_boxes(boxes, sizes, priors, prior_size, self.match_type,
                                      self.overlap_threshold, self.ignore_cross)
                if self.share_location:
                    found[-1] = (idx, ov)
                else:
                    for c in range(self.loc_classes):
                        if c == self.background:
                            continue
                        mine = np.where((idx > -1) & (labels[np.maximum(idx, 0)] == c), idx, -1)
                        found[c] = (mine, ov)
            matches.append(dict(sorted(found.items())))
        return matches

    def conf_losses(self, conf, matches, gts):
        """ComputeConfLoss: each prior's loss for its matched class (else the background)."""
        n, p, c = conf.shape
        labels = np.full((n, p), self.background, np.int64)
        for i in range(n):
            taken = np.zeros(p, bool)
            for idx, _ in matches[i].values():
                new = (idx > -1) & ~taken
                labels[i, new] = gts[i][2][idx[new]]
                taken |= idx > -1
        x = conf.astype(np.float64)
        if self.conf_loss == MB.SOFTMAX:
            m = x.max(axis=2, keepdims=True)
            e = np.exp(x - m)
            prob = np.take_along_axis(e, labels[..., None], axis=2)[..., 0] / e.sum(axis=2)
            return (-np.log(np.maximum(prob, FLT_MIN))).astype(F32)
        target = np.arange(c)[None, None, :] == labels[..., None]
        pos = (x >= 0).astype(np.float64)
        term = x * (target - pos) - np.log(1 + np.exp(x - 2 * x * pos))
        return (-term.sum(axis=2)).astype(F32)

    def loc_pairs(self, loc, priors, variances, matches, gts):
        """EncodeLocPrediction: (predictions, targets, (image, prior, loc class) of each), in
        the fork's order (image, label, prior)."""
        dt = self.dtype.type
        preds, targets, where = [], [], []
        for i in range(self.num):
            for label, (idx, _) in matches[i].items():
                js = np.flatnonzero(idx > -1)
                if not len(js):
                    continue
                lc = 0 if self.share_location else label
                gt_boxes = gts[i][0][idx[js]]
                enc = encode_boxes(priors[js], variances[js], self.code_type,
                                   self.variance_in_target, gt_boxes).astype(self.dtype)
                pred = loc[i, js, lc].astype(self.dtype)
                if self.bp_inside:
                    box = priors[js]
                    if not self.use_prior:
                        box = decode_boxes(pred, priors[js], variances[js], self.code_type,
                                           self.variance_in_target).astype(self.dtype)
                    outside = (box < 0) | (box > 1)
                    pred = np.where(outside, enc, pred)
                if self.variance_in_target:
                    pred = pred / variances[js]
                    enc = enc / variances[js]
                preds.append(pred)
                targets.append(enc)
                where.append(np.stack([np.full(len(js), i), js, np.full(len(js), lc)], axis=1))
        if not preds:
            return np.zeros((0, 4), self.dtype), np.zeros((0, 4), self.dtype), \
                np.zeros((0, 3), np.int64)
        return (np.concatenate(preds), np.concatenate(targets),
                np.concatenate(where).astype(np.int64))

    def loc_values(self, d):
        """Per-element loc loss and its derivative for differences d."""
        if self.loc_loss == MB.SMOOTH_L1:
            a = np.abs(d)
            small = a < 1
            return np.where(small, 0.5 * d * d, a - 0.5), np.where(small, d, np.sign(d))
        if self.loc_loss == MB.L2:
            return 0.5 * d * d, d
        raise self.error(f"unknown loc_loss_type {self.loc_loss}")

    def mine(self, conf, loc, priors, prior_size, variances, matches, gts):
        """MineHardExamples: per image the negatives picked (ascending prior index); matches
        that HARD_EXAMPLE leaves out are set to -1 in place."""
        negatives = [np.zeros(0, np.int64) for _ in range(self.num)]
        if self.mining == MB.NONE:
            return negatives
        losses = self.conf_losses(conf, matches, gts)
        if self.mining == MB.HARD_EXAMPLE:
            pred, target, where = self.loc_pairs(loc, priors, variances, matches, gts)
            per, _ = self.loc_values((pred - target).astype(np.float64))
            loc_loss = np.zeros_like(losses)
            loc_loss[where[:, 0], where[:, 1]] = per.sum(axis=1).astype(F32)
            losses = losses + loc_loss
        for i in range(self.num):
            picked = []
            for label, (idx, ov) in matches[i].items():
                if self.mining == MB.MAX_NEGATIVE:
                    eligible = np.flatnonzero((idx == -1) & (ov < self.neg_overlap))
                    num_pos = int((idx > -1).sum())
                    count = min(int(F32(num_pos) * self.neg_pos_ratio), len(eligible))
                else:
                    eligible = np.arange(len(idx))
                    count = min(self.sample_size, len(eligible))
                scores = losses[i, eligible]
                if self.has_nms and self.nms_threshold > 0:
                    if self.use_prior_for_nms:
                        boxes, sizes = priors[eligible], prior_size[eligible]
                    else:
                        lc = 0 if self.share_location else label
                        boxes = decode_boxes(loc[i, eligible, lc], priors[eligible],
                                             variances[eligible], self.code_type,
                                             self.variance_in_target).astype(self.dtype)
                        sizes = bbox_size(boxes, self.dtype.type)
                    kept = nms_by_score(boxes, sizes, scores, self.nms_threshold,
                                        self.nms_top_k)
                    chosen = eligible[np.asarray(kept[:count], np.int64)]
                else:
                    order = np.argsort(-scores.astype(np.float64), kind="stable")[:count]
                    chosen = eligible[order]
                selected = np.zeros(len(idx), bool)
                selected[chosen] = True
                if self.mining == MB.HARD_EXAMPLE:
                    idx[(idx > -1) & ~selected] = -1
                picked.append(np.flatnonzero((idx == -1) & selected))
            if picked:
                negatives[i] = np.concatenate(picked)
        return negatives

    def normalizer(self, num_matches):
        """GetNormalizer. In a P-rank run (replica_sum given) the counts are the whole
        batch's and each rank takes 1/P of the normalizer, so that the ranks' mean gradient
        is the one of one process at P times the batch."""
        num, world = self.num, 1
        if self.replica_sum is not None:
            num_matches, num = (int(v) for v in self.replica_sum([num_matches, self.num],
                                                                 "MultiBoxLoss counts"))
            world = self.replica_sum.world
        mode = self.normalization
        if mode == NORM.FULL:
            n = num * self.num_priors
        elif mode == NORM.VALID:
            n = num_matches
        elif mode == NORM.BATCH_SIZE:
            n = num
        elif mode == NORM.NONE:
            n = 1
        else:
            raise self.error(f"unknown normalization mode {mode}")
        return max(1.0, float(n)) / world

    # ---------------------------------------------------------------- passes
    def forward(self, bottom, top):
        dt = self.dtype
        loc = bottom[0].data.reshape(self.num, self.num_priors, self.loc_classes, 4)
        conf = bottom[1].data.reshape(self.num, self.num_priors, self.num_classes)
        prior = bottom[2].data.reshape(2, self.num_priors, 4).astype(dt)
        priors, variances = prior[0], prior[1]
        prior_size = bbox_size(priors, dt.type)
        gts = self.ground_truth(bottom[3].data)
        matches = self.find_matches(loc, priors, prior_size, variances, gts)
        negatives = self.mine(conf, loc, priors, prior_size, variances, matches, gts)
        self.num_matches = sum(int((idx > -1).sum()) for m in matches for idx, _ in m.values())
        self.norm = self.normalizer(self.num_matches)

        # Location: the matched priors' predictions against their encoded ground truth.
        pred, self.loc_target, self.loc_where = self.loc_pairs(loc, priors, variances, matches,
                                                               gts)
        d = (pred - self.loc_target).astype(dt)
        per, self.loc_grad = self.loc_values(d)
        loc_loss = float(per.astype(dt).sum(dtype=np.float64))
        if self.loc_loss == MB.L2:
            self.loc_grad = d
        # Confidence: the rows the fork's conf loss layer sees, and their targets.
        self.conf_rows, rows_gt = self.conf_targets(conf, matches, negatives, gts)
        x = conf.reshape(-1, self.num_classes)[self.conf_rows] if self.mining != MB.NONE \
            else conf.reshape(-1, self.num_classes)
        if self.conf_loss == MB.SOFTMAX:
            xs = x.astype(dt)
            prob = np.exp(xs - xs.max(axis=1, keepdims=True))
            prob /= prob.sum(axis=1, keepdims=True)
            picked = prob[np.arange(len(xs)), rows_gt]
            conf_loss = float(-np.log(np.maximum(picked, FLT_MIN)).sum(dtype=np.float64))
            grad = prob
            grad[np.arange(len(xs)), rows_gt] -= 1
        else:
            xs = x.astype(dt)
            t = rows_gt.astype(dt)
            pos = (xs >= 0).astype(dt)
            term = xs * (t - pos) - np.log1p(np.exp(xs - 2 * xs * pos))
            conf_loss = float(-term.sum(dtype=np.float64))
            grad = 1 / (1 + np.exp(-xs)) - t
        self.conf_grad = grad
        loss = 0.0
        if self.terms[0]:
            loss += self.loc_weight * loc_loss / self.norm
        if self.terms[1]:
            loss += conf_loss / self.norm
        top[0].data[...] = loss

    def conf_targets(self, conf, matches, negatives, gts):
        """EncodeConfPrediction: the rows of the flattened (N*P, C) confidences the loss sees
        and their targets (SOFTMAX: a label per row; LOGISTIC: a (rows, C) array)."""
        n, p, c = conf.shape
        agnostic = self.background + 1
        if self.mining != MB.NONE:
            rows, labels = [], []
            for i in range(n):
                if i not in gts:
                    continue
                for idx, _ in matches[i].values():
                    js = np.flatnonzero(idx > -1)
                    rows.append(i * p + js)
                    labels.append(np.full(len(js), agnostic) if self.agnostic
                                  else gts[i][2][idx[js]])
                rows.append(i * p + negatives[i])
                labels.append(np.full(len(negatives[i]), -1))
            rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
            labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
            if self.conf_loss == MB.SOFTMAX:
                return rows, np.where(labels == -1, self.background, labels)
            t = np.full((len(rows), c), self.background, self.dtype)
            pos = labels >= 0
            t[np.flatnonzero(pos), labels[pos]] = 1
            if 0 <= self.background < c:
                t[np.flatnonzero(~pos), self.background] = 1
            return rows, t
        # No mining: every prior, the matched ones with their class.
        if self.conf_loss == MB.SOFTMAX:
            target = np.full(n * p, self.background, np.int64)
        else:
            target = np.full(n * p * c, self.background, self.dtype)
        for i in range(n):
            if i not in gts:
                continue
            for idx, _ in matches[i].values():
                js = np.flatnonzero(idx > -1)
                lab = np.full(len(js), agnostic) if self.agnostic else gts[i][2][idx[js]]
                if self.conf_loss == MB.SOFTMAX:
                    target[i * p + js] = lab
                else:
                    target[i * p + js * c + lab] = 1
        if self.conf_loss == MB.SOFTMAX:
            return None, target
        return None, target.reshape(n * p, c)

    def backward(self, top, propagate_down, bottom):
        if len(propagate_down) > 3 and propagate_down[3]:
            raise self.error("cannot backpropagate to label inputs")
        if propagate_down[2]:
            bottom[2].diff[...] = 0        # priors depend on shapes only
        scale = float(top[0].diff.flat[0]) / self.norm
        if propagate_down[0]:
            diff = bottom[0].diff.reshape(self.num, self.num_priors, self.loc_classes, 4)
            diff[...] = 0
            if len(self.loc_where):
                w = self.loc_where
                diff[w[:, 0], w[:, 1], w[:, 2]] = self.loc_grad * (self.loc_weight * scale)
        if propagate_down[1]:
            diff = bottom[1].diff.reshape(-1, self.num_classes)
            if self.conf_rows is None:
                np.multiply(self.conf_grad, scale, out=diff)
            else:
                diff[...] = 0
                diff[self.conf_rows] = self.conf_grad * scale


# ==================================================================== DetectionEvaluate
def output_box(box, size, height, width, resize):
    """OutputBBox: a normalized box (with its stored size) in pixels of an image of
    height x width, through the resize policy the test images went through. Returns the
    box and its size."""
    dt = F32
    box = np.asarray(box, dt)

    def clip(b):
        b = np.clip(b, dt(0), dt(1))
        return b, bbox_size(b)

    def scale(b):
        s = np.array([width, height, width, height], dt)
        out = (b * s).astype(dt)
        w, h = out[2] - out[0], out[3] - out[1]
        if width > 1 or height > 1:
            sz = dt(0) if (w < 0 or h < 0) else dt((w + dt(1)) * (h + dt(1)))
        else:
            sz = dt(0) if (w < 0 or h < 0) else dt(w * h)
        return out, sz

    if resize is not None and resize.resize_mode:
        rh, rw = dt(resize.height), dt(resize.width)
        aspect = dt(width) / dt(height)
        mode = resize.resize_mode
        if mode == RESIZE.WARP:
            return scale(clip(box)[0])
        if mode == RESIZE.FIT_LARGE_SIZE_AND_PAD:
            if aspect > rw / rh:
                pad = (rh - rw / aspect) / dt(2)
                src = np.array([0, pad / rh, 1, dt(1) - pad / rh], dt)
            else:
                pad = (rw - rh * aspect) / dt(2)
                src = np.array([pad / rw, 0, dt(1) - pad / rw, 1], dt)
            b, _ = project_box(src, box)
            return scale(clip(box if b is None else b)[0])
        if mode == RESIZE.FIT_SMALL_SIZE:
            if not resize.height_scale or not resize.width_scale:
                return scale(clip(box)[0])
            s = np.array([resize.width_scale, resize.height_scale] * 2, dt)
            out = (box * s).astype(dt)
            out = np.minimum(np.maximum(out, dt(0)), np.array([width, height] * 2, dt))
            w, h = out[2] - out[0], out[3] - out[1]
            return out, (dt(0) if (w < 0 or h < 0) else dt(w * h))
        raise ValueError(f"unknown resize_mode {mode}")
    return scale(clip(box)[0])


def read_name_size(path):
    """A name_size_file's (height, width) per line ("name height width")."""
    sizes = []
    with open(path) as f:
        words = f.read().split()
    for k in range(0, len(words) - 2, 3):
        sizes.append((int(words[k + 1]), int(words[k + 2])))
    return sizes


@register("DetectionEvaluate")
class DetectionEvaluateLayer(Layer):
    """Marks each detection (bottom 0: DetectionOutput's rows) true or false positive against
    the ground truth (bottom 1: AnnotatedData's rows). Top: 1 x 1 x R x 5 rows; first one per
    foreground class [-1, class, number of positives, -1, -1], then per detection [image,
    class, score, tp, fp], images and classes in ascending order, detections by score. With
    name_size_file, boxes are compared in pixels of the original images (the file's lines in
    record order; in a P-rank run rank r's k-th image is record k*P + r)."""

    exact_bottoms = 2
    exact_tops = 1
    data_dependent_axes = (2,)

    def layer_setup(self, bottom, top):
        p = self.param.detection_evaluate_param
        if not p.HasField("num_classes"):
            raise self.error("detection_evaluate_param needs num_classes")
        self.num_classes = self.positive(p.num_classes, "num_classes")
        self.background = int(p.background_label_id)
        self.threshold = F32(p.overlap_threshold)
        if not self.threshold > 0:
            raise self.error(f"overlap_threshold must be > 0, got {p.overlap_threshold:g}")
        self.evaluate_difficult = p.evaluate_difficult_gt
        self.sizes = []
        if p.HasField("name_size_file"):
            from caffepar.data.sources import resolve_path
            path = resolve_path(p.name_size_file, getattr(self, "net_dir", None))
            if path is None:
                raise self.error(f"name_size_file not found: {p.name_size_file}")
            self.sizes = read_name_size(path)
        self.resize = p.resize_param if p.HasField("resize_param") else None
        self.count = 0
        self.rank, self.world = (int(v) for v in getattr(self, "shard", (0, 1)))

    def reshape(self, bottom, top):
        det, gt = bottom
        if det.shape[-1] != 7 or det.count // 7 * 7 != det.count:
            raise self.error(f"bottom 0 must hold detection rows of 7 values (a "
                             f"DetectionOutput top), got shape {det.shape}")
        if gt.shape[-1] != 8:
            raise self.error(f"bottom 1 must hold ground-truth rows of 8 values (an "
                             f"AnnotatedData label top), got shape {gt.shape}")
        top[0].reshape((1, 1, 1, 5))

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        pass

    def forward(self, bottom, top):
        rows = self.evaluate(bottom[0].data.reshape(-1, 7), bottom[1].data.reshape(-1, 8))
        top[0].reshape((1, 1, len(rows), 5))
        top[0].data[...] = np.asarray(rows, self.dtype).reshape(top[0].shape)

    def evaluate(self, det, gt_rows):
        dt = F32
        gts = {}                                       # image -> label -> [(box, difficult)]
        for r in gt_rows:
            item = int(r[0])
            if item == -1:
                break
            label = int(r[1])
            if label == self.background:
                raise self.error(f"found the background label {label} in the ground truth")
            gts.setdefault(item, {}).setdefault(label, []).append(
                (np.asarray(r[3:7], dt), bool(r[7])))
        dets = {}
        for r in det:
            item = int(r[0])
            if item == -1:
                continue
            label = int(r[1])
            if label == self.background:
                raise self.error(f"found the background label {label} in the detections")
            dets.setdefault(item, {}).setdefault(label, []).append(
                (dt(r[2]), np.asarray(r[3:7], dt)))
        num_pos = {}
        for item in sorted(gts):
            for label, objs in gts[item].items():
                n = len(objs) if self.evaluate_difficult else sum(not d for _, d in objs)
                num_pos[label] = num_pos.get(label, 0) + n
        rows = [[-1, c, num_pos.get(c, 0), -1, -1] for c in range(self.num_classes)
                if c != self.background]
        for item in sorted(dets):
            by_label = dets[item]
            size = None
            if self.sizes:
                index = (self.count * self.world + self.rank) % len(self.sizes)
                size = self.sizes[index]
            for label in sorted(by_label):
                if label == -1:
                    continue
                found = by_label[label]
                truth = gts.get(item, {}).get(label)
                if truth is None:
                    rows += [[item, label, s, 0, 1] for s, _ in found]
                    continue
                boxes = [b for b, _ in truth]
                sizes = [bbox_size(b) for b in boxes]
                if size is not None:
                    scaled = [output_box(b, s, size[0], size[1], self.resize)
                              for b, s in zip(boxes, sizes)]
                    boxes, sizes = [b for b, _ in scaled], [s for _, s in scaled]
                visited = np.zeros(len(boxes), bool)
                order = sorted(range(len(found)), key=lambda k: -float(found[k][0]))
                gt_boxes = np.stack(boxes).astype(dt)
                gt_sizes = np.asarray(sizes, dt)
                for k in order:
                    score, box = found[k]
                    bsize = bbox_size(box)
                    if size is not None:
                        box, bsize = output_box(box, bsize, size[0], size[1], self.resize)
                    ov = jaccard(np.asarray(box, dt)[None], np.asarray([bsize], dt), gt_boxes,
                                 gt_sizes, normalized=size is None)[0]
                    jmax = int(np.argmax(ov))
                    if ov[jmax] >= self.threshold:
                        if self.evaluate_difficult or not truth[jmax][1]:
                            if not visited[jmax]:
                                rows.append([item, label, score, 1, 0])
                                visited[jmax] = True
                            else:
                                rows.append([item, label, score, 0, 1])
                        else:
                            rows.append([item, label, score, 0, 0])
                    else:
                        rows.append([item, label, score, 0, 1])
            if self.sizes:
                self.count = (self.count + 1) % len(self.sizes)
        return rows


# ==================================================================== average precision
def average_precision(tp, fp, num_pos, version):
    """ComputeAP for one class: tp and fp are (score, 0/1) pairs of its detections (in the
    order met); detections are ranked by score (stable), precision and recall taken along
    the ranking, and AP computed as `version` says: "11point" (VOC2007: the mean of the
    best precision at recall >= 0, 0.1, ..., 1), "MaxIntegral" (VOC2012: the area under the
    precision made non-increasing) or "Integral" (the area under the raw curve)."""
    if version not in ("11point", "MaxIntegral", "Integral"):
        raise ValueError(f'unknown ap_version "{version}" (11point, MaxIntegral or Integral)')
    if not len(tp) or num_pos == 0:
        return 0.0
    scores = np.asarray([s for s, _ in tp], F32)
    order = np.argsort(-scores, kind="stable")
    tp_sum = np.cumsum(np.asarray([t for _, t in tp], np.int64)[order])
    fp_scores = np.asarray([s for s, _ in fp], F32)
    fp_sum = np.cumsum(np.asarray([f for _, f in fp], np.int64)[
        np.argsort(-fp_scores, kind="stable")])
    prec = (tp_sum.astype(F32) / (tp_sum + fp_sum).astype(F32)).astype(F32)
    rec = (tp_sum.astype(F32) / F32(num_pos)).astype(F32)
    eps = F32(1e-6)
    n = len(tp)
    ap = F32(0)
    if version == "11point":
        best = [F32(0)] * 11
        start = n - 1
        for j in range(10, -1, -1):
            for i in range(start, -1, -1):
                if float(rec[i]) < j / 10.0:
                    start = i
                    if j > 0:
                        best[j - 1] = best[j]
                    break
                if best[j] < prec[i]:
                    best[j] = prec[i]
        for j in range(10, -1, -1):
            ap = F32(ap + F32(best[j] / F32(11)))
    elif version == "MaxIntegral":
        cur_rec, cur_prec = rec[-1], prec[-1]
        for i in range(n - 2, -1, -1):
            cur_prec = max(prec[i], cur_prec)
            step = abs(F32(cur_rec - rec[i]))
            if step > eps:
                ap = F32(ap + F32(cur_prec * step))
            cur_rec = rec[i]
        ap = F32(ap + F32(cur_rec * cur_prec))
    else:
        prev = F32(0)
        for i in range(n):
            step = abs(F32(rec[i] - prev))
            if step > eps:
                ap = F32(ap + F32(prec[i] * step))
            prev = rec[i]
    return float(ap)


def detection_map(rows, version):
    """The fork's TestDetection for one output: rows (k, 5) gathered over the test
    iterations -> (mAP, {label: AP}). Classes with positives but no detection count as 0
    in the mean, as the fork's does."""
    num_pos, tp, fp = {}, {}, {}
    for item, label, score, t, f in np.asarray(rows, np.float64).reshape(-1, 5):
        label = int(label)
        if int(item) == -1:
            num_pos[label] = num_pos.get(label, 0) + int(score)
            continue
        t, f = int(t), int(f)
        if t == 0 and f == 0:
            continue
        tp.setdefault(label, []).append((F32(score), t))
        fp.setdefault(label, []).append((F32(score), f))
    aps = {}
    total = F32(0)
    for label in sorted(num_pos):
        if label not in tp:
            continue
        aps[label] = average_precision(tp[label], fp[label], num_pos[label], version)
        total = F32(total + F32(aps[label]))
    mean = float(F32(total / F32(len(num_pos)))) if num_pos else 0.0
    return mean, aps
