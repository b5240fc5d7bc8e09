"""SSD's training layers: MultiBoxLoss (gradient checks for its options, and the fork's loss and
bottom diffs on fixed inputs), DetectionEvaluate and the fork's average precision (its rows
and APs), one-line errors."""
from pathlib import Path

import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST
from caffepar.nn.ssd_train import average_precision, detection_map
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ssd"


def prior_array(grid=2, sizes=(0.35, 0.7), ratios=(1.0, 2.0), variance=(0.1, 0.1, 0.2, 0.2)):
    """1 x 2 x 4P priors on a grid (PriorBox's layout)."""
    boxes = []
    for y in range(grid):
        for x in range(grid):
            cx, cy = (x + 0.5) / grid, (y + 0.5) / grid
            for s in sizes:
                for r in ratios:
                    w, h = s * np.sqrt(r), s / np.sqrt(r)
                    boxes.append([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])
    p = np.array(boxes)
    var = np.tile(np.asarray(variance, np.float64), (len(p), 1))
    return np.stack([p.reshape(-1), var.reshape(-1)])[None]


GT = np.array([[0, 1, 0, 0.05, 0.1, 0.45, 0.55, 0],
               [0, 2, 0, 0.5, 0.45, 0.95, 0.9, 0],
               [1, 2, 0, 0.2, 0.3, 0.75, 0.65, 1],
               [1, 1, 1, 0.55, 0.05, 0.95, 0.45, 0]])


def net_text(num, priors, classes, gts, params, loc_classes=1, extra=""):
    return f"""force_backward: true
layer {{ name: "a" type: "Input" top: "loc"
  input_param {{ shape {{ dim: {num} dim: {priors * 4 * loc_classes} }} }} }}
layer {{ name: "b" type: "Input" top: "conf"
  input_param {{ shape {{ dim: {num} dim: {priors * classes} }} }} }}
layer {{ name: "c" type: "Input" top: "prior"
  input_param {{ shape {{ dim: 1 dim: 2 dim: {priors * 4} }} }} }}
layer {{ name: "d" type: "Input" top: "label"
  input_param {{ shape {{ dim: 1 dim: 1 dim: {gts} dim: 8 }} }} }}
layer {{ name: "mbox_loss" type: "MultiBoxLoss" bottom: "loc" bottom: "conf" bottom: "prior"
  bottom: "label" top: "loss"
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  {extra}
  multibox_loss_param {{ num_classes: {classes} {params} }} }}
"""


def build(text, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST, dtype=dtype)


def spaced_inputs(prior, classes, num, loc_classes, seed):
    """Confidences whose per-prior losses are 0.3 apart (so that the mining's choice stays put
    under the checker's 0.01 steps) and small location offsets."""
    rng = np.random.default_rng(seed)
    p = prior.shape[2] // 4
    conf = rng.uniform(-0.05, 0.05, (num, p, classes))
    conf[:, :, 1:] += 0.4 * np.stack([rng.permutation(p) for _ in range(num)])[..., None] - 1
    loc = rng.uniform(-0.3, 0.3, (num, p * loc_classes * 4))
    return loc, conf.reshape(num, -1)


# Every option at least once, several per case (each case costs a forward per input element).
OPTIONS = {
    "ssd": "code_type: CENTER_SIZE overlap_threshold: 0.5 neg_pos_ratio: 3 neg_overlap: 0.5",
    # NMS over the priors: over decoded predictions the picks jump with the locations.
    "hard_l2_logistic": "conf_loss_type: LOGISTIC mining_type: HARD_EXAMPLE sample_size: 6 "
                        "loc_loss_type: L2 match_type: BIPARTITE use_prior_for_nms: true "
                        "nms_param { nms_threshold: 0.5 top_k: 20 }",
    "unshared_no_mining": "share_location: false mining_type: NONE conf_loss_type: LOGISTIC "
                          "code_type: CORNER_SIZE",
    "agnostic": "map_object_to_agnostic: true use_difficult_gt: false loc_weight: 2.5",
    "variance_bp_inside": "encode_variance_in_target: true bp_inside: true code_type: CORNER",
}
NORMS = {"hard_l2_logistic": "loss_param { normalization: FULL }",
         "unshared_no_mining": "loss_param { normalization: BATCH_SIZE }",
         "agnostic": "loss_param { normalization: NONE }"}


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_multibox_loss_gradient(case):
    classes = 2 if case == "agnostic" else 3
    loc_classes = classes if "share_location: false" in OPTIONS[case] else 1
    # With the variances in the target the fork's diff is the derivative times the variance
    # (test_variance_in_target_diff_is_the_forks): checked here at variance 1.
    variance = (1, 1, 1, 1) if "variance" in case else (0.1, 0.1, 0.2, 0.2)
    prior = prior_array(variance=variance)
    gt = GT.copy()
    if classes == 2:
        gt[:, 1] = 1
    p = prior.shape[2] // 4
    text = net_text(2, p, classes, len(gt), OPTIONS[case], loc_classes, NORMS.get(case, ""))
    loc, conf = spaced_inputs(prior, classes, 2, loc_classes, seed=len(case))
    inputs = {"loc": loc, "conf": conf, "prior": prior, "label": gt.reshape(1, 1, -1, 8)}
    net = build(text)
    for k, v in inputs.items():
        net.blobs[k].data[...] = v
    net.forward()
    layer = net.layer_dict["mbox_loss"]
    assert layer.num_matches > 0
    # Keep every difference off the smooth L1 kink at +-1: predictions near their targets
    # (hard example mining picks its positives by their loss: until the picks settle).
    view = loc.reshape(2, p, loc_classes, 4)
    rng = np.random.default_rng(3)
    for _ in range(4):
        w = layer.loc_where
        view[w[:, 0], w[:, 1], w[:, 2]] = layer.loc_target + \
            rng.uniform(-0.5, 0.5, layer.loc_target.shape)
        net.blobs["loc"].data[...] = loc
        net.forward()
    check_net_gradients(text, inputs, skip_bottoms=("prior", "label"))


def test_variance_in_target_diff_is_the_forks():
    """With encode_variance_in_target the fork takes the location diff after dividing by the
    variances: the derivative times the variance."""
    prior = prior_array()
    p = prior.shape[2] // 4
    text = net_text(2, p, 3, len(GT), "encode_variance_in_target: true code_type: CENTER_SIZE")
    loc, conf = spaced_inputs(prior, 3, 2, 1, seed=4)
    net = build(text)
    for k, v in {"loc": loc, "conf": conf, "prior": prior,
                 "label": GT.reshape(1, 1, -1, 8)}.items():
        net.blobs[k].data[...] = v
    net.forward()
    net.backward()
    got = net.blobs["loc"].diff.reshape(2, p, 4).copy()
    eps = 1e-6
    numeric = np.zeros_like(got)
    layer = net.layer_dict["mbox_loss"]
    for i, j in layer.loc_where[:, :2]:
        for k in range(4):
            for sign in (1, -1):
                net.blobs["loc"].data.reshape(2, p, 4)[i, j, k] += sign * eps
                net.forward()
                numeric[i, j, k] += sign * float(net.blobs["loss"].data) / (2 * eps)
                net.blobs["loc"].data.reshape(2, p, 4)[i, j, k] -= sign * eps
    variance = prior[0, 1].reshape(p, 4)
    np.testing.assert_allclose(got, numeric * variance[None], rtol=1e-4, atol=1e-7)


def test_multibox_loss_errors_name_the_layer():
    prior = prior_array()
    p = prior.shape[2] // 4
    with pytest.raises(CaffeparError, match=r'layer "mbox_loss".*num_classes \(4\) does not '
                                            r"match the confidence bottom"):
        build(net_text(2, p, 3, 4, "").replace("num_classes: 3", "num_classes: 4"))
    with pytest.raises(CaffeparError, match=r"negative mining needs share_location"):
        build(net_text(2, p, 3, 4, "share_location: false", 3))
    with pytest.raises(CaffeparError, match=r"needs num_classes"):
        build(net_text(2, p, 3, 4, "").replace("num_classes: 3", ""))
    net = build(net_text(2, p, 3, 4, ""))
    net.blobs["prior"].data[...] = prior
    net.blobs["label"].data[...] = np.array([[0, 0, 0, .1, .1, .5, .5, 0]] * 4).reshape(1, 1, 4, 8)
    with pytest.raises(CaffeparError, match="background label 0 in the ground truth"):
        net.forward()


# ------------------------------------------------------------------ average precision
def test_average_precision_by_hand():
    """Five detections of one class, three positives: ranked tp fp tp tp fp. Precision
    1, 1/2, 2/3, 3/4, 3/5 at recall 1/3, 1/3, 2/3, 1, 1."""
    scores = [0.9, 0.8, 0.7, 0.6, 0.5]
    tp = list(zip(scores, [1, 0, 1, 1, 0]))
    fp = list(zip(scores, [0, 1, 0, 0, 1]))
    integral = 1 / 3 * 1 + 1 / 3 * (2 / 3) + 1 / 3 * (3 / 4)
    max_integral = 1 / 3 * 1 + 2 / 3 * (3 / 4)
    eleven = (4 * 1 + 3 * 0.75 + 4 * 0.75) / 11
    assert average_precision(tp, fp, 3, "Integral") == pytest.approx(integral, rel=1e-6)
    assert average_precision(tp, fp, 3, "MaxIntegral") == pytest.approx(max_integral, rel=1e-6)
    assert average_precision(tp, fp, 3, "11point") == pytest.approx(eleven, rel=1e-6)
    rows = [[-1, 1, 3, -1, -1], [-1, 2, 2, -1, -1]] + \
        [[0, 1, s, t, f] for (s, t), (_, f) in zip(tp, fp)]
    mean, aps = detection_map(rows, "Integral")
    assert aps == {1: pytest.approx(integral, rel=1e-6)}
    assert mean == pytest.approx(integral / 2, rel=1e-6)      # class 2: positives, no detection
