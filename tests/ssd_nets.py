"""A small SSD (written for these tests): AnnotatedData with the MobileNet-SSD augmentations,
four convolutions with a BatchNorm, two PriorBox heads, MultiBoxLoss (TRAIN) or
DetectionOutput + DetectionEvaluate (TEST); and a VOC folder converted with annoset."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_ssd(phase, source, batch, classes=6, size=64, label_map="labelmap.prototxt"):
    """The net's prototxt text for `phase` (TRAIN or TEST)."""
    train = phase == "TRAIN"
    aug = """
    emit_constraint { emit_type: CENTER }
    distort_param { brightness_prob: 0.5 brightness_delta: 32 contrast_prob: 0.5 contrast_lower: 0.5
      contrast_upper: 1.5 hue_prob: 0.5 hue_delta: 18 saturation_prob: 0.5 saturation_lower: 0.5
      saturation_upper: 1.5 }
    expand_param { prob: 0.5 max_expand_ratio: 2.0 }""" if train else ""
    samplers = """
    batch_sampler { max_sample: 1 max_trials: 1 }
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }
      sample_constraint { min_jaccard_overlap: 0.3 } max_sample: 1 max_trials: 20 }""" if train else "batch_sampler { }"
    interp = "interp_mode: LINEAR interp_mode: AREA interp_mode: NEAREST interp_mode: CUBIC interp_mode: LANCZOS4" if train else "interp_mode: LINEAR"
    s = f'''name: "tiny_ssd"
layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label"
  transform_param {{ scale: 0.007843 {"mirror: true" if train else ""} mean_value: 127.5 mean_value: 127.5 mean_value: 127.5
    resize_param {{ prob: 1 resize_mode: WARP height: {size} width: {size} {interp} }}{aug} }}
  data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }}
  annotated_data_param {{ {samplers} label_map_file: "{label_map}" }} }}
'''
    def conv(name, bottom, n, k=3, stride=1, relu=True, pad=None):
        pad = k // 2 if pad is None else pad
        out = f'''layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"
  convolution_param {{ num_output: {n} kernel_size: {k} pad: {pad} stride: {stride}
    weight_filler {{ type: "xavier" }} bias_filler {{ type: "constant" value: 0 }} }} }}
'''
        if relu:
            out += f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'
        return out
    s += conv("conv1", "data", 8, stride=2)
    s += conv("conv2", "conv1", 16, stride=2)
    s += f'''layer {{ name: "conv2_bn" type: "BatchNorm" bottom: "conv2" top: "conv2" }}
layer {{ name: "conv2_scale" type: "Scale" bottom: "conv2" top: "conv2" scale_param {{ bias_term: true }} }}
'''
    s += conv("conv3", "conv2", 16, stride=2)
    s += conv("conv4", "conv3", 16, stride=2)
    heads = [("conv3", 0.2, 0.45), ("conv4", 0.45, 0.8)]
    locs, confs, priors = [], [], []
    for feat, lo, hi in heads:
        n = 4  # priors per cell: min, sqrt(min*max), ar 2, 1/2
        s += conv(f"{feat}_loc", feat, n * 4, relu=False)
        s += conv(f"{feat}_conf", feat, n * classes, relu=False)
        for kind in ("loc", "conf"):
            s += f'''layer {{ name: "{feat}_{kind}_perm" type: "Permute" bottom: "{feat}_{kind}" top: "{feat}_{kind}_perm" permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "{feat}_{kind}_flat" type: "Flatten" bottom: "{feat}_{kind}_perm" top: "{feat}_{kind}_flat" flatten_param {{ axis: 1 }} }}
'''
        s += f'''layer {{ name: "{feat}_prior" type: "PriorBox" bottom: "{feat}" bottom: "data" top: "{feat}_prior"
  prior_box_param {{ min_size: {int(lo*size)} max_size: {int(hi*size)} aspect_ratio: 2 flip: true clip: false
    variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 offset: 0.5 }} }}
'''
        locs.append(f"{feat}_loc_flat"); confs.append(f"{feat}_conf_flat"); priors.append(f"{feat}_prior")
    for name, parts, axis in (("mbox_loc", locs, 1), ("mbox_conf", confs, 1), ("mbox_priorbox", priors, 2)):
        s += f'layer {{ name: "{name}" type: "Concat" ' + " ".join(f'bottom: "{p}"' for p in parts) + f' top: "{name}" concat_param {{ axis: {axis} }} }}\n'
    if train:
        s += f'''layer {{ name: "mbox_loss" type: "MultiBoxLoss" bottom: "mbox_loc" bottom: "mbox_conf" bottom: "mbox_priorbox" bottom: "label" top: "mbox_loss"
  propagate_down: true propagate_down: true propagate_down: false propagate_down: false
  loss_param {{ normalization: VALID }}
  multibox_loss_param {{ loc_loss_type: SMOOTH_L1 conf_loss_type: SOFTMAX loc_weight: 1.0 num_classes: {classes}
    share_location: true match_type: PER_PREDICTION overlap_threshold: 0.5 use_prior_for_matching: true
    background_label_id: 0 use_difficult_gt: true neg_pos_ratio: 3.0 neg_overlap: 0.5 code_type: CENTER_SIZE
    ignore_cross_boundary_bbox: false mining_type: MAX_NEGATIVE }} }}
'''
    else:
        s += f'''layer {{ name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf" top: "mbox_conf_reshape" reshape_param {{ shape {{ dim: 0 dim: -1 dim: {classes} }} }} }}
layer {{ name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape" top: "mbox_conf_softmax" softmax_param {{ axis: 2 }} }}
layer {{ name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax" top: "mbox_conf_flatten" flatten_param {{ axis: 1 }} }}
layer {{ name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc" bottom: "mbox_conf_flatten" bottom: "mbox_priorbox" top: "detection_out"
  detection_output_param {{ num_classes: {classes} share_location: true background_label_id: 0
    nms_param {{ nms_threshold: 0.45 top_k: 100 }} code_type: CENTER_SIZE keep_top_k: 50 confidence_threshold: 0.01 }} }}
layer {{ name: "detection_eval" type: "DetectionEvaluate" bottom: "detection_out" bottom: "label" top: "detection_eval"
  detection_evaluate_param {{ num_classes: {classes} background_label_id: 0 overlap_threshold: 0.5 evaluate_difficult_gt: false }} }}
'''
    return s


SOLVER = """train_net: "train.prototxt"
test_net: "test.prototxt"
test_iter: {test_iter}
test_interval: {test_interval}
base_lr: 0.001
display: 5
max_iter: {max_iter}
lr_policy: "fixed"
weight_decay: 0.0005
snapshot: 0
snapshot_prefix: "snap/tiny"
average_loss: 10
type: "RMSProp"
eval_type: "detection"
ap_version: "11point"
test_initialization: true
random_seed: 1
"""


def voc_folder(folder, train=12, test=6, seed=5):
    """make_shapes_voc's dataset (small) converted with annoset: (root, labelmap path)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_shapes_voc import make_dataset
    from caffepar.data.annoset import convert_annoset
    voc = folder / "voc"
    make_dataset(str(voc), train, test, seed)
    for split in ("trainval", "test"):
        convert_annoset(str(voc), str(voc / f"{split}.txt"), str(folder / f"{split}_lmdb"),
                        label_map_file=str(voc / "labelmap.prototxt"), encode_type="jpg",
                        name_size_file=str(folder / f"{split}_name_size.txt"))
    return voc, voc / "labelmap.prototxt"


def ssd_solver_param(folder, batch, iterations, prefix, size=32):
    """The small SSD's training run on `folder`'s trainval_lmdb as a SolverParameter: SGD with
    momentum (RMSProp's first steps are lr * sign(gradient), which turns the last bit of a
    near-zero gradient into a whole step), no test net, a snapshot at the end."""
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import parse_text
    text = tiny_ssd("TRAIN", str(folder / "trainval_lmdb"), batch, size=size,
                    label_map=str(folder / "voc" / "labelmap.prototxt"))
    param = caffe_pb2.SolverParameter()
    param.net_param.CopyFrom(parse_text(text, caffe_pb2.NetParameter()))
    param.type = "SGD"
    param.base_lr = 0.01
    param.momentum = 0.9
    param.weight_decay = 0.0005
    param.lr_policy = "fixed"
    param.max_iter = iterations
    param.display = 0
    param.snapshot_after_train = True
    param.snapshot_prefix = str(prefix)
    param.random_seed = 5
    return param
