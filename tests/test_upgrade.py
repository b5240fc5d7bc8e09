"""Upgrading deprecated Caffe nets and solvers must give exactly what BVLC Caffe gives."""
from pathlib import Path

import pytest
from google.protobuf import text_format

from caffepar.errors import PrototxtError
from caffepar.proto import caffe_pb2
from caffepar.proto.upgrade import (
    SOLVER_TYPE_NAMES,
    V0_TYPE_NAMES,
    V1_TYPE_NAMES,
    net_needs_upgrade,
    solver_needs_upgrade,
    upgrade_net,
    upgrade_solver,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GOLDEN = SHARED / "caffe_ref" / "upgrade"

needs_golden = pytest.mark.skipif(
    not GOLDEN.is_dir(),
    reason="Caffe reference upgrades (shared/caffe_ref/upgrade) are not available",
)


def net_text(text):
    return text_format.Merge(text, caffe_pb2.NetParameter())


def solver_text(text):
    return text_format.Merge(text, caffe_pb2.SolverParameter())


def read_net(name):
    return net_text((GOLDEN / name).read_text())


def read_model(name):
    return caffe_pb2.NetParameter.FromString((GOLDEN / name).read_bytes())


def assert_pure_and_stable(original, upgraded):
    """The input is left alone and a second upgrade changes nothing."""
    before = original.SerializeToString()
    again, notes = upgrade_net(upgraded)
    assert again == upgraded
    assert notes == []
    assert not net_needs_upgrade(upgraded)
    assert original.SerializeToString() == before


# ---------------------------------------------------------------- Caffe golden files


@needs_golden
@pytest.mark.parametrize("stem", ["v1_small", "v1_train"])
def test_text_net_matches_caffe(stem):
    old = read_net(f"{stem}.prototxt")
    snapshot = caffe_pb2.NetParameter()
    snapshot.CopyFrom(old)
    assert net_needs_upgrade(old)
    upgraded, notes = upgrade_net(old, source=f"{stem}.prototxt")
    assert upgraded == read_net(f"{stem}_upgraded.prototxt")
    assert notes and all(f"{stem}.prototxt" in n for n in notes)
    assert old == snapshot
    assert_pure_and_stable(old, upgraded)


@needs_golden
def test_v1_small_notes_follow_caffe_log_order():
    _, notes = upgrade_net(read_net("v1_small.prototxt"))
    assert len(notes) == 2
    assert "V1LayerParameter" in notes[0]
    assert "input" in notes[1]


@needs_golden
def test_v1_train_data_upgrade_runs_before_v1():
    _, notes = upgrade_net(read_net("v1_train.prototxt"))
    assert "transform_param" in notes[0]
    assert "V1LayerParameter" in notes[1]


@needs_golden
def test_binary_v1_caffemodel_matches_caffe_and_keeps_blobs():
    old = read_model("v1_small.caffemodel")
    upgraded, _ = upgrade_net(old)
    golden = read_model("v1_small_upgraded.caffemodel")
    assert upgraded == golden
    conv = upgraded.layer[0]
    assert conv.type == "Convolution"
    assert [(b.num, b.channels, b.height, b.width) for b in conv.blobs] == \
        [(4, 3, 3, 3), (1, 1, 1, 4)]
    assert list(conv.blobs[0].data) == list(old.layers[0].blobs[0].data)
    assert_pure_and_stable(old, upgraded)


@needs_golden
def test_solver_matches_caffe():
    old = solver_text((GOLDEN / "old_solver.prototxt").read_text())
    assert solver_needs_upgrade(old)
    upgraded, notes = upgrade_solver(old)
    golden = solver_text((GOLDEN / "old_solver_upgraded.prototxt").read_text())
    assert upgraded == golden
    assert not upgraded.HasField("solver_type")
    assert old.HasField("solver_type")
    assert len(notes) == 1 and "AdaGrad" in notes[0]


# ---------------------------------------------------------------- V0 nets

V0_NET = """
name: "v0_tiny"
input: "data"
input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
layers {
  layer { name: "pad1" type: "padding" pad: 2 }
  bottom: "data" top: "pad1"
}
layers {
  layer {
    name: "conv1" type: "conv" num_output: 4 kernelsize: 5 stride: 1 group: 1
    biasterm: false
    weight_filler { type: "gaussian" std: 0.01 }
    blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  }
  bottom: "pad1" top: "conv1"
}
layers { layer { name: "relu1" type: "relu" } bottom: "conv1" top: "conv1" }
layers {
  layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 }
  bottom: "conv1" top: "pool1"
}
layers {
  layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.0001 beta: 0.75 k: 2 }
  bottom: "pool1" top: "norm1"
}
layers {
  layer {
    name: "fc" type: "innerproduct" num_output: 10
    bias_filler { type: "constant" value: 0.5 }
  }
  bottom: "norm1" top: "fc"
}
layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.3 } bottom: "fc" top: "fc" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc" top: "prob" }
"""

V0_NET_UPGRADED = """
name: "v0_tiny"
layer {
  name: "input" type: "Input" top: "data"
  input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } }
}
layer {
  name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 decay_mult: 1 }
  param { lr_mult: 2 decay_mult: 0 }
  convolution_param {
    num_output: 4 bias_term: false pad: 2 kernel_size: 5 group: 1 stride: 1
    weight_filler { type: "gaussian" std: 0.01 }
  }
}
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer {
  name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 }
}
layer {
  name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
  lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 k: 2 }
}
layer {
  name: "fc" type: "InnerProduct" bottom: "norm1" top: "fc"
  inner_product_param { num_output: 10 bias_filler { type: "constant" value: 0.5 } }
}
layer {
  name: "drop" type: "Dropout" bottom: "fc" top: "fc"
  dropout_param { dropout_ratio: 0.3 }
}
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_v0_net_with_padding_layer_upgrades_to_v2():
    old = net_text(V0_NET)
    assert net_needs_upgrade(old)
    upgraded, notes = upgrade_net(old, source="v0_tiny.prototxt")
    assert upgraded == net_text(V0_NET_UPGRADED)
    assert [("V0LayerParameter" in n, "V1LayerParameter" in n, "Input" in n) for n in notes] == \
        [(True, False, False), (False, True, False), (False, False, True)]
    assert_pure_and_stable(old, upgraded)


def test_v0_padding_before_pool_sets_pooling_pad():
    old = net_text("""
      input: "data" input_dim: 1 input_dim: 1 input_dim: 4 input_dim: 4
      layers { layer { name: "p" type: "padding" pad: 1 } bottom: "data" top: "padded" }
      layers {
        layer { name: "pool" type: "pool" pool: MAX kernelsize: 3 }
        bottom: "padded" top: "out"
      }
    """)
    upgraded, _ = upgrade_net(old)
    assert [layer.name for layer in upgraded.layer] == ["input", "pool"]
    pool = upgraded.layer[1]
    assert list(pool.bottom) == ["data"]
    assert pool.pooling_param.pad == 1 and pool.pooling_param.kernel_size == 3


def test_v0_data_layer_fields():
    old = net_text("""
      name: "v0_data"
      force_backward: true
      layers {
        layer {
          name: "mnist" type: "data" source: "train_db" batchsize: 64 rand_skip: 7
          scale: 0.00390625 meanfile: "mean.binaryproto" cropsize: 24 mirror: true
        }
        top: "data" top: "label"
      }
      layers {
        layer {
          name: "win" type: "window_data" source: "windows.txt" batchsize: 8
          det_fg_threshold: 0.6 det_bg_threshold: 0.4 det_fg_fraction: 0.3
          det_context_pad: 16 det_crop_mode: "square"
        }
        top: "wdata" top: "wlabel"
      }
      layers {
        layer { name: "img" type: "images" source: "list.txt" shuffle_images: true
                new_height: 32 new_width: 30 }
        top: "idata" top: "ilabel"
      }
      layers {
        layer { name: "cat" type: "concat" concat_dim: 1 }
        bottom: "data" bottom: "idata" top: "cat"
      }
      layers {
        layer { name: "loss" type: "softmax_loss" }
        bottom: "cat" bottom: "label"
      }
    """)
    expected = net_text("""
      name: "v0_data"
      force_backward: true
      layer {
        name: "mnist" type: "Data" top: "data" top: "label"
        transform_param {
          scale: 0.00390625 mean_file: "mean.binaryproto" crop_size: 24 mirror: true
        }
        data_param { source: "train_db" batch_size: 64 rand_skip: 7 }
      }
      layer {
        name: "win" type: "WindowData" top: "wdata" top: "wlabel"
        window_data_param {
          source: "windows.txt" batch_size: 8 fg_threshold: 0.6 bg_threshold: 0.4
          fg_fraction: 0.3 context_pad: 16 crop_mode: "square"
        }
      }
      layer {
        name: "img" type: "ImageData" top: "idata" top: "ilabel"
        image_data_param { source: "list.txt" shuffle: true new_height: 32 new_width: 30 }
      }
      layer {
        name: "cat" type: "Concat" bottom: "data" bottom: "idata" top: "cat"
        concat_param { concat_dim: 1 }
      }
      layer { name: "loss" type: "SoftmaxWithLoss" bottom: "cat" bottom: "label" }
    """)
    upgraded, notes = upgrade_net(old)
    assert upgraded == expected
    assert not any(n.startswith("warning") for n in notes)


def test_v0_field_for_wrong_type_is_dropped_with_warning():
    old = net_text("""
      input: "data" input_dim: 1 input_dim: 1 input_dim: 2 input_dim: 2
      layers { layer { name: "r" type: "relu" num_output: 3 } bottom: "data" top: "r" }
    """)
    upgraded, notes = upgrade_net(old, source="bad.prototxt")
    relu = upgraded.layer[1]
    assert relu.type == "ReLU"
    assert not relu.HasField("convolution_param")
    assert any(n.startswith("warning:") and "num_output" in n for n in notes)


def test_v0_padding_into_non_conv_is_refused():
    old = net_text("""
      input: "data" input_dim: 1 input_dim: 1 input_dim: 4 input_dim: 4
      layers { layer { name: "p" type: "padding" pad: 1 } bottom: "data" top: "padded" }
      layers { layer { name: "r" type: "relu" } bottom: "padded" top: "out" }
    """)
    with pytest.raises(PrototxtError, match="padding"):
        upgrade_net(old, source="pad.prototxt")


def test_v0_unknown_type_and_unknown_blob_are_refused():
    with pytest.raises(PrototxtError, match="unknown type"):
        upgrade_net(net_text('layers { layer { name: "x" type: "warp" } top: "x" }'))
    with pytest.raises(PrototxtError, match="unknown blob"):
        upgrade_net(net_text('layers { layer { name: "x" type: "relu" } bottom: "nope" top: "x" }'))


def test_v0_type_names_all_map_to_v1_enum():
    for v1_name in V0_TYPE_NAMES.values():
        assert v1_name in V1_TYPE_NAMES
    assert V0_TYPE_NAMES["conv"] == "CONVOLUTION"
    assert V0_TYPE_NAMES["images"] == "IMAGE_DATA"


# ---------------------------------------------------------------- V1 nets


def test_v1_type_names_cover_every_enum_value():
    enum_names = {v.name for v in caffe_pb2.V1LayerParameter.LayerType.DESCRIPTOR.values}
    assert set(V1_TYPE_NAMES) == enum_names - {"NONE"}
    assert V1_TYPE_NAMES["CONVOLUTION"] == "Convolution"
    assert V1_TYPE_NAMES["INNER_PRODUCT"] == "InnerProduct"
    assert V1_TYPE_NAMES["RELU"] == "ReLU"
    assert V1_TYPE_NAMES["SOFTMAX_LOSS"] == "SoftmaxWithLoss"
    assert V1_TYPE_NAMES["TANH"] == "TanH"
    assert V1_TYPE_NAMES["IM2COL"] == "Im2col"


def test_v1_param_specs_sharing_loss_weight_and_rules():
    old = net_text("""
      state { phase: TRAIN }
      layers {
        name: "ip" type: INNER_PRODUCT bottom: "x" top: "y"
        param: "w" param: "b"
        blob_share_mode: PERMISSIVE
        blobs_lr: 1 blobs_lr: 2 blobs_lr: 3
        weight_decay: 0
        loss_weight: 0.5
        include { phase: TRAIN }
        exclude { stage: "deploy" }
        inner_product_param { num_output: 2 }
      }
      layers { name: "eu" type: EUCLIDEAN_LOSS bottom: "y" bottom: "t" top: "l"
               loss_param { normalize: false } }
      layers { name: "none" type: NONE }
    """)
    expected = net_text("""
      state { phase: TRAIN }
      layer {
        name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        param { name: "w" share_mode: PERMISSIVE lr_mult: 1 decay_mult: 0 }
        param { name: "b" lr_mult: 2 }
        param { lr_mult: 3 }
        loss_weight: 0.5
        include { phase: TRAIN }
        exclude { stage: "deploy" }
        inner_product_param { num_output: 2 }
      }
      layer { name: "eu" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "l"
              loss_param { normalize: false } }
      layer { name: "none" type: "" }
    """)
    upgraded, _ = upgrade_net(old)
    assert upgraded == expected
    assert upgraded.layer[2].HasField("type")


def test_data_upgrade_on_image_data_creates_transform_param():
    old = net_text("""
      layers { name: "d" type: IMAGE_DATA top: "d" top: "l"
               image_data_param { source: "list" mean_file: "m.binaryproto" mirror: false } }
      layers { name: "plain" type: DATA top: "p" }
    """)
    upgraded, _ = upgrade_net(old)
    expected = net_text("""
      layer { name: "d" type: "ImageData" top: "d" top: "l"
              transform_param { mean_file: "m.binaryproto" mirror: false }
              image_data_param { source: "list" } }
      layer { name: "plain" type: "Data" top: "p" transform_param {} data_param {} }
    """)
    assert upgraded == expected


def test_mixed_layer_and_layers_is_refused():
    mixed = net_text("""
      layer { name: "a" type: "ReLU" bottom: "x" top: "x" }
      layers { name: "b" type: RELU bottom: "x" top: "x" }
    """)
    assert net_needs_upgrade(mixed)
    with pytest.raises(PrototxtError, match="mixes 'layer'") as info:
        upgrade_net(mixed, source="mixed.prototxt")
    assert info.value.path == "mixed.prototxt"


# ---------------------------------------------------------------- V2 nets


CURRENT_NET = """
name: "current"
layer { name: "input" type: "Input" top: "data"
        input_param { shape { dim: 1 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        param { lr_mult: 1 } inner_product_param { num_output: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "ip"
        param { lr_mult: 0 } param { lr_mult: 0 } }
"""


def test_current_net_is_unchanged():
    net = net_text(CURRENT_NET)
    assert not net_needs_upgrade(net)
    upgraded, notes = upgrade_net(net)
    assert upgraded == net
    assert upgraded is not net
    assert notes == []


def test_input_shape_fields_become_input_layer():
    old = net_text("""
      input: "a" input_shape { dim: 2 dim: 5 }
      input: "b" input_shape { dim: 2 }
      layer { name: "c" type: "Concat" bottom: "a" bottom: "b" top: "c" }
    """)
    expected = net_text("""
      layer { name: "input" type: "Input" top: "a" top: "b"
              input_param { shape { dim: 2 dim: 5 } shape { dim: 2 } } }
      layer { name: "c" type: "Concat" bottom: "a" bottom: "b" top: "c" }
    """)
    upgraded, notes = upgrade_net(old)
    assert upgraded == expected
    assert len(notes) == 1
    assert_pure_and_stable(old, upgraded)


def test_bare_input_without_shape_is_dropped():
    old = net_text('input: "data" layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')
    upgraded, _ = upgrade_net(old)
    assert upgraded == net_text('layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')


def test_too_few_input_dims_are_refused():
    with pytest.raises(PrototxtError, match="input_dim"):
        upgrade_net(net_text('input: "a" input: "b" input_dim: 1 input_dim: 2 '
                             "input_dim: 3 input_dim: 4 input_dim: 5"))


def test_old_batchnorm_params_get_zero_multipliers():
    old = net_text("""
      layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
              param { name: "m" lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 } param {} }
      layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 1 } }
    """)
    assert net_needs_upgrade(old)
    upgraded, notes = upgrade_net(old)
    expected = net_text("""
      layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
              param { name: "m" lr_mult: 0 decay_mult: 0 }
              param { lr_mult: 0 decay_mult: 0 }
              param { lr_mult: 0 decay_mult: 0 } }
      layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 1 } }
    """)
    assert upgraded == expected
    assert len(notes) == 1 and "BatchNorm" in notes[0]
    again, _ = upgrade_net(upgraded)
    assert again == upgraded


# ---------------------------------------------------------------- solvers


def test_nesterov_solver_type():
    old = solver_text('base_lr: 0.1 solver_type: NESTEROV')
    upgraded, notes = upgrade_solver(old, source="s.prototxt")
    assert upgraded == solver_text('base_lr: 0.1 type: "Nesterov"')
    assert notes and "s.prototxt" in notes[0]
    assert old.solver_type == caffe_pb2.SolverParameter.NESTEROV


@pytest.mark.parametrize("enum_name, type_name", sorted(SOLVER_TYPE_NAMES.items()))
def test_every_solver_type(enum_name, type_name):
    upgraded, _ = upgrade_solver(solver_text(f"solver_type: {enum_name}"))
    assert upgraded.type == type_name
    assert not solver_needs_upgrade(upgraded)


def test_solver_type_covers_enum():
    names = {v.name for v in caffe_pb2.SolverParameter.SolverType.DESCRIPTOR.values}
    assert set(SOLVER_TYPE_NAMES) == names


def test_current_solver_is_unchanged():
    solver = solver_text('type: "Adam" base_lr: 0.001')
    assert not solver_needs_upgrade(solver)
    upgraded, notes = upgrade_solver(solver)
    assert upgraded == solver and notes == []


def test_solver_with_both_type_fields_is_refused():
    with pytest.raises(PrototxtError, match="solver_type"):
        upgrade_solver(solver_text('solver_type: ADAM type: "SGD"'), source="s.prototxt")
    with pytest.raises(PrototxtError):
        upgrade_solver(solver_text('solver_type: SGD type: "SGD"'))
