"""Checks on proto/caffe.proto and the generated caffepar/proto/caffe_pb2.py.

* the committed caffe_pb2.py matches proto/caffe.proto (not stale);
* the Caffe-compatible part of the schema has not drifted (pinned digest);
* every real Caffe file in the shared data directory parses with no unknown
  fields (binary files) or no parse errors (text files);
* the caffepar extension fields exist, round-trip, and are skipped as
  unknown fields by a schema that lacks them (as Caffe's does).
"""

from __future__ import annotations

import ast
import hashlib
import struct
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from caffepar.proto import caffe_pb2

REPO = Path(__file__).resolve().parents[1]
PROTO_DIR = REPO / "proto"
PROTO_FILE = PROTO_DIR / "caffe.proto"
PB2_FILE = REPO / "caffepar" / "proto" / "caffe_pb2.py"
SHARED = Path(__file__).resolve().parents[1].parent / "shared"

# caffepar-only fields: (message full name, field name) -> field number.
EXTENSIONS = {
    ("caffe.LayerParameter", "parallel_mode"): 1000,
    ("caffe.SolverState", "data_position"): 1000,
    ("caffe.SolverState", "rng_state"): 1001,
    ("caffe.SolverState", "gradient_residual"): 1002,
    ("caffe.SolverState", "gradient_threshold"): 1003,
    ("caffe.SolverState", "history_count"): 1004,
    ("caffe.SolverParameter", "comm_param"): 1000,
}
EXTENSION_ENUMS = {"caffe.LayerParameter.ParallelMode"}
EXTENSION_MESSAGES = {"caffe.CommParameter"}

# ---- Fork fields: SSD (weiliu89/caffe, branch ssd), numbers as the fork gives them. ----
SSD_FIELDS = {
    ("caffe.LayerParameter", "permute_param"): 202,
    ("caffe.LayerParameter", "prior_box_param"): 203,
    ("caffe.LayerParameter", "detection_output_param"): 204,
    ("caffe.LayerParameter", "norm_param"): 206,
    ("caffe.LayerParameter", "annotated_data_param"): 200,
    ("caffe.LayerParameter", "multibox_loss_param"): 201,
    ("caffe.LayerParameter", "detection_evaluate_param"): 205,
    ("caffe.TransformationParameter", "resize_param"): 8,
    ("caffe.TransformationParameter", "noise_param"): 9,
    ("caffe.TransformationParameter", "emit_constraint"): 10,
    ("caffe.TransformationParameter", "crop_h"): 11,
    ("caffe.TransformationParameter", "crop_w"): 12,
    ("caffe.TransformationParameter", "distort_param"): 13,
    ("caffe.TransformationParameter", "expand_param"): 14,
    ("caffe.SolverParameter", "show_per_class_result"): 44,
    # The fork's 41 and 42 are BVLC's layer_wise_reduce and weights (proto/README.md).
    ("caffe.SolverParameter", "eval_type"): 2041,
    ("caffe.SolverParameter", "ap_version"): 2042,
}
SSD_MESSAGES = {"caffe.PermuteParameter", "caffe.PriorBoxParameter", "caffe.NormalizeParameter",
                "caffe.NonMaximumSuppressionParameter", "caffe.SaveOutputParameter",
                "caffe.ResizeParameter", "caffe.DetectionOutputParameter",
                "caffe.LabelMapItem", "caffe.LabelMap", "caffe.Sampler", "caffe.SampleConstraint",
                "caffe.BatchSampler", "caffe.EmitConstraint", "caffe.NormalizedBBox",
                "caffe.Annotation", "caffe.AnnotationGroup", "caffe.AnnotatedDatum",
                "caffe.SaltPepperParameter", "caffe.NoiseParameter", "caffe.DistortionParameter",
                "caffe.ExpansionParameter", "caffe.AnnotatedDataParameter",
                "caffe.MultiBoxLossParameter", "caffe.DetectionEvaluateParameter"}
# The fork's facts for its messages: "field number label type default".
SSD_FACTS = {
    "PermuteParameter": ["order 1 repeated uint32 -"],
    "PriorBoxParameter": [
        "min_size 1 repeated float -", "max_size 2 repeated float -",
        "aspect_ratio 3 repeated float -", "flip 4 optional bool true",
        "clip 5 optional bool false", "variance 6 repeated float -",
        "img_size 7 optional uint32 -", "img_h 8 optional uint32 -", "img_w 9 optional uint32 -",
        "step 10 optional float -", "step_h 11 optional float -", "step_w 12 optional float -",
        "offset 13 optional float 0.5"],
    "NormalizeParameter": [
        "across_spatial 1 optional bool true", "scale_filler 2 optional message -",
        "channel_shared 3 optional bool true", "eps 4 optional float 1e-10"],
    "NonMaximumSuppressionParameter": [
        "nms_threshold 1 optional float 0.3", "top_k 2 optional int32 -",
        "eta 3 optional float 1.0"],
    "SaveOutputParameter": [
        "output_directory 1 optional string -", "output_name_prefix 2 optional string -",
        "output_format 3 optional string -", "label_map_file 4 optional string -",
        "name_size_file 5 optional string -", "num_test_image 6 optional uint32 -",
        "resize_param 7 optional message -"],
    "ResizeParameter": [
        "prob 1 optional float 1", "resize_mode 2 optional enum WARP",
        "height 3 optional uint32 0", "width 4 optional uint32 0",
        "pad_mode 5 optional enum CONSTANT", "pad_value 6 repeated float -",
        "interp_mode 7 repeated enum -", "height_scale 8 optional uint32 0",
        "width_scale 9 optional uint32 0"],
    "DetectionOutputParameter": [
        "num_classes 1 optional uint32 -", "share_location 2 optional bool true",
        "background_label_id 3 optional int32 0", "nms_param 4 optional message -",
        "save_output_param 5 optional message -", "code_type 6 optional enum CORNER",
        "keep_top_k 7 optional int32 -1", "variance_encoded_in_target 8 optional bool false",
        "confidence_threshold 9 optional float -", "visualize 10 optional bool false",
        "visualize_threshold 11 optional float -", "save_file 12 optional string -",
        "clip 1000 optional bool false"],
    "LabelMapItem": ["name 1 optional string -", "label 2 optional int32 -",
                     "display_name 3 optional string -"],
    "LabelMap": ["item 1 repeated message -"],
    "Sampler": ["min_scale 1 optional float 1.0", "max_scale 2 optional float 1.0",
                "min_aspect_ratio 3 optional float 1.0", "max_aspect_ratio 4 optional float 1.0"],
    "SampleConstraint": [
        "min_jaccard_overlap 1 optional float -", "max_jaccard_overlap 2 optional float -",
        "min_sample_coverage 3 optional float -", "max_sample_coverage 4 optional float -",
        "min_object_coverage 5 optional float -", "max_object_coverage 6 optional float -"],
    "BatchSampler": [
        "use_original_image 1 optional bool true", "sampler 2 optional message -",
        "sample_constraint 3 optional message -", "max_sample 4 optional uint32 -",
        "max_trials 5 optional uint32 100"],
    "EmitConstraint": ["emit_type 1 optional enum CENTER", "emit_overlap 2 optional float -"],
    "NormalizedBBox": [
        "xmin 1 optional float -", "ymin 2 optional float -", "xmax 3 optional float -",
        "ymax 4 optional float -", "label 5 optional int32 -", "difficult 6 optional bool -",
        "score 7 optional float -", "size 8 optional float -"],
    "Annotation": ["instance_id 1 optional int32 0", "bbox 2 optional message -"],
    "AnnotationGroup": ["group_label 1 optional int32 -", "annotation 2 repeated message -"],
    "AnnotatedDatum": ["datum 1 optional message -", "type 2 optional enum -",
                       "annotation_group 3 repeated message -"],
    "SaltPepperParameter": ["fraction 1 optional float 0", "value 2 repeated float -"],
    "NoiseParameter": [
        "prob 1 optional float 0", "hist_eq 2 optional bool false",
        "inverse 3 optional bool false", "decolorize 4 optional bool false",
        "gauss_blur 5 optional bool false", "jpeg 6 optional float -1",
        "posterize 7 optional bool false", "erode 8 optional bool false",
        "saltpepper 9 optional bool false", "saltpepper_param 10 optional message -",
        "clahe 11 optional bool false", "convert_to_hsv 12 optional bool false",
        "convert_to_lab 13 optional bool false"],
    "DistortionParameter": [
        "brightness_prob 1 optional float 0.0", "brightness_delta 2 optional float 0.0",
        "contrast_prob 3 optional float 0.0", "contrast_lower 4 optional float 0.0",
        "contrast_upper 5 optional float 0.0", "hue_prob 6 optional float 0.0",
        "hue_delta 7 optional float 0.0", "saturation_prob 8 optional float 0.0",
        "saturation_lower 9 optional float 0.0", "saturation_upper 10 optional float 0.0",
        "random_order_prob 11 optional float 0.0"],
    "ExpansionParameter": ["prob 1 optional float 1", "max_expand_ratio 2 optional float 1.0"],
    "AnnotatedDataParameter": ["batch_sampler 1 repeated message -",
                               "label_map_file 2 optional string -",
                               "anno_type 3 optional enum -"],
    "MultiBoxLossParameter": [
        "loc_loss_type 1 optional enum SMOOTH_L1", "conf_loss_type 2 optional enum SOFTMAX",
        "loc_weight 3 optional float 1.0", "num_classes 4 optional uint32 -",
        "share_location 5 optional bool true", "match_type 6 optional enum PER_PREDICTION",
        "overlap_threshold 7 optional float 0.5", "use_prior_for_matching 8 optional bool true",
        "background_label_id 9 optional uint32 0", "use_difficult_gt 10 optional bool true",
        "do_neg_mining 11 optional bool -", "neg_pos_ratio 12 optional float 3.0",
        "neg_overlap 13 optional float 0.5", "code_type 14 optional enum CORNER",
        "encode_variance_in_target 16 optional bool false",
        "map_object_to_agnostic 17 optional bool false",
        "ignore_cross_boundary_bbox 18 optional bool false", "bp_inside 19 optional bool false",
        "mining_type 20 optional enum MAX_NEGATIVE", "nms_param 21 optional message -",
        "sample_size 22 optional int32 64", "use_prior_for_nms 23 optional bool false"],
    "DetectionEvaluateParameter": [
        "num_classes 1 optional uint32 -", "background_label_id 2 optional uint32 0",
        "overlap_threshold 3 optional float 0.5", "evaluate_difficult_gt 4 optional bool true",
        "name_size_file 5 optional string -", "resize_param 6 optional message -"],
}
EXTENSIONS.update(SSD_FIELDS)
EXTENSION_MESSAGES |= SSD_MESSAGES
# ---- end of SSD fork fields ----
# Fields of Caffe's forks: mobile, segmentation and detection layers (proto/README.md).
FORK_FIELDS_MOBILE_SEGMENTATION_DETECTION = {
    ("caffe.LayerParameter", "upsample_param"): 149,
    ("caffe.LayerParameter", "shuffle_channel_param"): 164,
    ("caffe.LayerParameter", "interp_param"): 2143,
    ("caffe.LayerParameter", "psroi_pooling_param"): 10001,
    ("caffe.LayerParameter", "roi_pooling_param"): 8266711,
    ("caffe.PoolingParameter", "ceil_mode"): 1013,
    ("caffe.LayerParameter", "bn_param"): 152,
    ("caffe.DropoutParameter", "scale_train"): 2,
}
EXTENSIONS.update(FORK_FIELDS_MOBILE_SEGMENTATION_DETECTION)
EXTENSION_MESSAGES |= {"caffe.ShuffleChannelParameter", "caffe.InterpParameter",
                       "caffe.UpsampleParameter", "caffe.ROIPoolingParameter",
                       "caffe.PSROIPoolingParameter", "caffe.BNParameter",
                       "caffe.SegNetBNParameter"}
# Each fork's facts for its message ("name number type default"; PSROIPooling's fields are
# `required` in R-FCN, optional here with the same bytes; UpsampleParameter.scale has SegNet's
# default 2 and the YOLO ports' 1 there, none here: the layer takes the one of its form).
FORK_MESSAGE_FACTS_MOBILE_SEGMENTATION_DETECTION = {
    "ShuffleChannelParameter": ["group 1 uint32 1"],
    "InterpParameter": ["height 1 int32 0", "width 2 int32 0", "zoom_factor 3 int32 1",
                        "shrink_factor 4 int32 1", "pad_beg 5 int32 0", "pad_end 6 int32 0"],
    "UpsampleParameter": ["scale 1 uint32 -", "scale_h 2 uint32 -", "scale_w 3 uint32 -",
                          "pad_out_h 4 bool false", "pad_out_w 5 bool false",
                          "upsample_h 6 uint32 -", "upsample_w 7 uint32 -"],
    "ROIPoolingParameter": ["pooled_h 1 uint32 0", "pooled_w 2 uint32 0",
                            "spatial_scale 3 float 1.0"],
    "PSROIPoolingParameter": ["spatial_scale 1 float -", "output_dim 2 int32 -",
                              "group_size 3 int32 -"],
    # PSPNet's fields, then SegNet's under 1001-1003 (its own numbers in SegNetBNParameter).
    "BNParameter": ["slope_filler 1 message -", "bias_filler 2 message -", "momentum 3 float 0.9",
                    "eps 4 float 1e-05", "frozen 5 bool false", "engine 6 enum 0",
                    "scale_filler 1001 message -", "shift_filler 1002 message -",
                    "bn_mode 1003 enum 0"],
    "SegNetBNParameter": ["scale_filler 1 message -", "shift_filler 2 message -",
                          "bn_mode 3 enum 0"],
}

# sha256 of the canonical listing (see _caffe_fingerprint) of everything in
# the schema except EXTENSIONS / EXTENSION_ENUMS. It was taken when the schema
# was verified field by field against BVLC Caffe's caffe.proto; a change here
# means a Caffe-visible fact (name, number, type, label, default, packed, enum
# value) was edited. Add new caffepar-only fields to EXTENSIONS instead.
CAFFE_FINGERPRINT = "3728f992a815bc63b3bae1a4511a80de0da0d6210f4d5e6f7cd376bb211ea7b0"


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def _file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(caffe_pb2.DESCRIPTOR.serialized_pb)


def _caffe_fingerprint(fdp: descriptor_pb2.FileDescriptorProto) -> tuple[str, list[str]]:
    lines: list[str] = [f"package {fdp.package}"]
    labels = descriptor_pb2.FieldDescriptorProto.Label
    types = descriptor_pb2.FieldDescriptorProto.Type

    def enum_lines(full: str, enum) -> None:
        if full in EXTENSION_ENUMS:
            return
        values = sorted((v.number, v.name) for v in enum.value)
        lines.append(f"enum {full} first={enum.value[0].name} "
                     + " ".join(f"{name}={num}" for num, name in values))

    def message_lines(full: str, msg) -> None:
        lines.append(f"message {full}")
        for field in sorted(msg.field, key=lambda f: f.number):
            if (full, field.name) in EXTENSIONS:
                continue
            default = field.default_value if field.HasField("default_value") else "-"
            if default != "-" and field.type == field.TYPE_FLOAT:
                # Spelling of float defaults differs between descriptor dumps
                # ("0.999" vs "0.999000013"); compare the float32 value.
                default = repr(struct.unpack("<f", struct.pack("<f", float(default)))[0])
            elif default != "-" and field.type == field.TYPE_DOUBLE:
                default = repr(float(default))
            packed = field.options.packed if field.options.HasField("packed") else "-"
            lines.append(f"{full} {field.number} {field.name} {labels.Name(field.label)} "
                         f"{types.Name(field.type)} {field.type_name or '-'} "
                         f"default={default} packed={packed}")
        for enum in msg.enum_type:
            enum_lines(f"{full}.{enum.name}", enum)
        for nested in msg.nested_type:
            message_lines(f"{full}.{nested.name}", nested)

    for enum in fdp.enum_type:
        enum_lines(f"{fdp.package}.{enum.name}", enum)
    for msg in fdp.message_type:
        if f"{fdp.package}.{msg.name}" not in EXTENSION_MESSAGES:
            message_lines(f"{fdp.package}.{msg.name}", msg)
    lines.sort()
    return hashlib.sha256("\n".join(lines).encode()).hexdigest(), lines


def _embedded_descriptor(pb2_path: Path) -> bytes:
    """The serialized FileDescriptorProto a generated *_pb2.py registers."""
    tree = ast.parse(pb2_path.read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "AddSerializedFile"):
            return ast.literal_eval(node.args[0])
    raise AssertionError(f"no AddSerializedFile(...) call in {pb2_path.name}")


def _unknown_field_numbers(msg) -> list[int]:
    try:  # protobuf >= 4.22 (required with the upb backend)
        from google.protobuf import unknown_fields
        return [f.field_number for f in unknown_fields.UnknownFieldSet(msg)]
    except ImportError:  # older protobuf
        return [f.field_number for f in msg.UnknownFields()]


def _unknown_fields_anywhere(msg, path: str = "") -> list[str]:
    """Paths of all unknown fields in `msg` and its sub-messages."""
    name = path or msg.DESCRIPTOR.name
    found = [f"{name}: field {n}" for n in _unknown_field_numbers(msg)]
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        if field.is_repeated:
            for i, item in enumerate(value):
                found += _unknown_fields_anywhere(item, f"{name}.{field.name}[{i}]")
        else:
            found += _unknown_fields_anywhere(value, f"{name}.{field.name}")
    return found


_NO_SHARED = f"shared data directory not found (expected next to the repo: {SHARED.name}/)"


def _shared_files(*patterns: str) -> list:
    if not SHARED.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason=_NO_SHARED), id="no-shared-data")]
    files = sorted({p for pattern in patterns for p in SHARED.rglob(pattern) if p.is_file()})
    if not files:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no {patterns} files under shared/"),
                             id="none")]
    return [pytest.param(p, id=str(p.relative_to(SHARED))) for p in files]


# --------------------------------------------------------------------------
# (1) the generated module is in sync with proto/caffe.proto
# --------------------------------------------------------------------------

def test_generated_module_is_not_stale(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpc_tools (grpcio-tools) is not installed, cannot run protoc")
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
         f"--python_out={tmp_path}", str(PROTO_FILE)],
        capture_output=True, text=True)
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    stale = ("caffepar/proto/caffe_pb2.py is stale: regenerate it with\n"
             "  python -m grpc_tools.protoc -Iproto --python_out=caffepar/proto proto/caffe.proto")
    regenerated = _embedded_descriptor(tmp_path / "caffe_pb2.py")
    assert Path(caffe_pb2.__file__).resolve() == PB2_FILE
    assert regenerated == _embedded_descriptor(PB2_FILE), stale
    # The runtime's DESCRIPTOR.serialized_pb is re-serialized from the loaded
    # descriptor (upb spells float defaults differently from protoc), so load
    # the regenerated bytes into a fresh pool and compare like with like.
    fresh = descriptor_pool.DescriptorPool().AddSerializedFile(regenerated)
    assert fresh.serialized_pb == caffe_pb2.DESCRIPTOR.serialized_pb, stale


def test_caffe_part_of_schema_unchanged():
    fdp = _file_descriptor_proto()
    assert fdp.package == "caffe"
    assert fdp.syntax in ("", "proto2")
    digest, lines = _caffe_fingerprint(fdp)
    assert digest == CAFFE_FINGERPRINT, (
        "a Caffe-visible fact of proto/caffe.proto changed; it must stay identical to "
        "BVLC Caffe's schema (new caffepar-only fields go into EXTENSIONS).\n"
        + "\n".join(lines[:5]) + "\n...")


def test_schema_has_all_caffe_messages():
    names = set(caffe_pb2.DESCRIPTOR.message_types_by_name) - \
        {name.split(".", 1)[1] for name in EXTENSION_MESSAGES}
    expected = {
        "BlobShape", "BlobProto", "BlobProtoVector", "Datum", "FillerParameter",
        "NetParameter", "SolverParameter", "SolverState", "NetState", "NetStateRule",
        "ParamSpec", "LayerParameter", "TransformationParameter", "LossParameter",
        "AccuracyParameter", "ArgMaxParameter", "BatchNormParameter", "BiasParameter",
        "ClipParameter", "ConcatParameter", "ContrastiveLossParameter",
        "ConvolutionParameter", "CropParameter", "DataParameter", "DropoutParameter",
        "DummyDataParameter", "EltwiseParameter", "ELUParameter", "EmbedParameter",
        "ExpParameter", "FlattenParameter", "HDF5DataParameter", "HDF5OutputParameter",
        "HingeLossParameter", "ImageDataParameter", "InfogainLossParameter",
        "InnerProductParameter", "InputParameter", "LogParameter", "LRNParameter",
        "MemoryDataParameter", "MVNParameter", "ParameterParameter", "PoolingParameter",
        "PowerParameter", "PReLUParameter", "PythonParameter", "RecurrentParameter",
        "ReductionParameter", "ReLUParameter", "ReshapeParameter", "ScaleParameter",
        "SigmoidParameter", "SliceParameter", "SoftmaxParameter", "SPPParameter",
        "SwishParameter", "TanHParameter", "ThresholdParameter", "TileParameter",
        "WindowDataParameter", "V1LayerParameter", "V0LayerParameter",
    }
    assert names == expected
    assert set(caffe_pb2.DESCRIPTOR.enum_types_by_name) == {"Phase"}
    layer = caffe_pb2.LayerParameter.DESCRIPTOR
    standard = [f.number for f in layer.fields if (layer.full_name, f.name) not in EXTENSIONS]
    assert max(standard) == 148


# --------------------------------------------------------------------------
# (2) real Caffe files parse cleanly
# --------------------------------------------------------------------------

def _check_binary(path: Path, message_class) -> None:
    data = path.read_bytes()
    msg = message_class()
    msg.ParseFromString(data)
    assert _unknown_fields_anywhere(msg) == [], f"{path.name} has fields the schema lacks"
    # Nothing was dropped or re-encoded differently in size.
    assert msg.ByteSize() == len(data)


@pytest.mark.parametrize("path", _shared_files("*.caffemodel"))
def test_caffemodel_parses_without_unknown_fields(path):
    _check_binary(path, caffe_pb2.NetParameter)
    net = caffe_pb2.NetParameter.FromString(path.read_bytes())
    assert len(net.layer) + len(net.layers) > 0


@pytest.mark.parametrize("path", _shared_files("*.solverstate"))
def test_solverstate_parses_without_unknown_fields(path):
    _check_binary(path, caffe_pb2.SolverState)
    state = caffe_pb2.SolverState.FromString(path.read_bytes())
    assert state.HasField("iter")


@pytest.mark.parametrize("path", _shared_files("*.binaryproto"))
def test_binaryproto_parses_without_unknown_fields(path):
    _check_binary(path, caffe_pb2.BlobProto)


@pytest.mark.parametrize("path", _shared_files("*.prototxt"))
def test_prototxt_parses(path):
    # text_format raises ParseError on any field the schema does not know.
    if "solver" in path.name:
        msg = caffe_pb2.SolverParameter()
    else:
        msg = caffe_pb2.NetParameter()
    text_format.Merge(path.read_text(), msg)
    if isinstance(msg, caffe_pb2.NetParameter):
        assert len(msg.layer) + len(msg.layers) > 0


# --------------------------------------------------------------------------
# (3) caffepar extensions
# --------------------------------------------------------------------------

def test_extension_field_numbers_and_types():
    for (message, field_name), number in EXTENSIONS.items():
        desc = caffe_pb2.DESCRIPTOR.pool.FindMessageTypeByName(message)
        assert desc.fields_by_name[field_name].number == number
    layer = caffe_pb2.LayerParameter.DESCRIPTOR
    mode = layer.fields_by_name["parallel_mode"]
    assert mode.type == mode.TYPE_ENUM and not mode.is_repeated and mode.has_presence
    assert not mode.has_default_value
    assert mode.enum_type.full_name == "caffe.LayerParameter.ParallelMode"
    assert {v.name: v.number for v in mode.enum_type.values} == {"DATA": 0, "MODEL": 1, "AUTO": 2}
    assert caffe_pb2.LayerParameter.DATA == 0
    assert caffe_pb2.LayerParameter.MODEL == 1
    assert caffe_pb2.LayerParameter.AUTO == 2

    state = caffe_pb2.SolverState.DESCRIPTOR
    pos = state.fields_by_name["data_position"]
    assert pos.type == pos.TYPE_INT64 and pos.is_repeated
    rng = state.fields_by_name["rng_state"]
    assert rng.type == rng.TYPE_BYTES and not rng.is_repeated and rng.has_presence
    for name in ("gradient_residual", "gradient_threshold"):
        blobs = state.fields_by_name[name]
        assert blobs.is_repeated and blobs.message_type.full_name == "caffe.BlobProto"

    solver = caffe_pb2.SolverParameter.DESCRIPTOR
    comm = solver.fields_by_name["comm_param"]
    assert comm.message_type.full_name == "caffe.CommParameter" and comm.has_presence
    standard = [f.number for f in solver.fields if (solver.full_name, f.name) not in EXTENSIONS]
    assert max(standard) == 42


def test_ssd_fork_fields_are_the_forks():
    names = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool",
             9: "string", 11: "message", 13: "uint32", 14: "enum"}
    for message, facts in SSD_FACTS.items():
        desc = caffe_pb2.DESCRIPTOR.message_types_by_name[message]
        got = []
        for f in sorted(desc.fields, key=lambda f: f.number):
            default = "-"
            if f.has_default_value:
                default = (f.enum_type.values_by_number[f.default_value].name
                           if f.type == f.TYPE_ENUM else str(f.default_value).lower())
                if f.type == f.TYPE_FLOAT:
                    default = repr(float(struct.unpack("<f", struct.pack("<f", f.default_value))[0]))
            got.append(f"{f.name} {f.number} {'repeated' if f.is_repeated else 'optional'} {names[f.type]} {default}")
        want = []
        for fact in facts:
            name, number, label, kind, default = fact.split()
            if kind == "float" and default != "-":
                default = repr(float(struct.unpack("<f", struct.pack("<f", float(default)))[0]))
            want.append(f"{name} {number} {label} {kind} {default}")
        assert got == want, message
    codes = caffe_pb2.PriorBoxParameter.CodeType
    assert (codes.Value("CORNER"), codes.Value("CENTER_SIZE"), codes.Value("CORNER_SIZE")) == (1, 2, 3)


def test_parallel_mode_round_trips():
    layer = caffe_pb2.LayerParameter(name="fc1", type="InnerProduct",
                                     parallel_mode=caffe_pb2.LayerParameter.MODEL)
    back = caffe_pb2.LayerParameter.FromString(layer.SerializeToString())
    assert back.HasField("parallel_mode")
    assert back.parallel_mode == caffe_pb2.LayerParameter.MODEL
    assert back == layer

    text = text_format.MessageToString(layer)
    assert "parallel_mode: MODEL" in text
    assert text_format.Parse(text, caffe_pb2.LayerParameter()) == layer

    # Explicitly setting the zero value still counts as set.
    data = caffe_pb2.LayerParameter(parallel_mode=caffe_pb2.LayerParameter.DATA)
    assert caffe_pb2.LayerParameter.FromString(data.SerializeToString()).HasField("parallel_mode")


def test_parallel_mode_unset_means_run_default():
    layer = caffe_pb2.LayerParameter(name="conv1", type="Convolution")
    back = caffe_pb2.LayerParameter.FromString(layer.SerializeToString())
    assert not back.HasField("parallel_mode")
    assert "parallel_mode" not in text_format.MessageToString(back)


def test_solverstate_extensions_round_trip():
    state = caffe_pb2.SolverState(iter=50, current_step=1, rng_state=b"\x00\x01rng")
    state.data_position.extend([1234, 0, 2**40])
    back = caffe_pb2.SolverState.FromString(state.SerializeToString())
    assert list(back.data_position) == [1234, 0, 2**40]
    assert back.rng_state == b"\x00\x01rng"
    assert back.iter == 50
    assert not caffe_pb2.SolverState().HasField("rng_state")


def _schema_without_extensions():
    """Message classes for the schema with the caffepar-only fields removed,
    i.e. what Caffe itself sees."""
    fdp = _file_descriptor_proto()
    by_name = {f"caffe.{m.name}": m for m in fdp.message_type}
    for (message, field_name), _ in EXTENSIONS.items():
        fields = by_name[message].field
        index = next(i for i, f in enumerate(fields) if f.name == field_name)
        del fields[index]
    layer = by_name["caffe.LayerParameter"]
    index = next(i for i, e in enumerate(layer.enum_type) if e.name == "ParallelMode")
    del layer.enum_type[index]
    for name in EXTENSION_MESSAGES:
        index = next(i for i, m in enumerate(fdp.message_type) if f"caffe.{m.name}" == name)
        del fdp.message_type[index]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def test_extensions_are_skipped_by_plain_caffe_schema():
    plain = _schema_without_extensions()

    net = caffe_pb2.NetParameter(name="n")
    net.layer.add(name="ip", type="InnerProduct", parallel_mode=caffe_pb2.LayerParameter.AUTO,
                  bottom=["data"], top=["ip"]).inner_product_param.num_output = 10
    old_net = plain("caffe.NetParameter").FromString(net.SerializeToString())
    assert old_net.layer[0].name == "ip"
    assert old_net.layer[0].inner_product_param.num_output == 10
    assert _unknown_field_numbers(old_net.layer[0]) == [1000]
    assert "parallel_mode" not in old_net.layer[0].DESCRIPTOR.fields_by_name

    state = caffe_pb2.SolverState(iter=7, rng_state=b"abc", data_position=[3, 4])
    old_state = plain("caffe.SolverState").FromString(state.SerializeToString())
    assert old_state.iter == 7
    assert sorted(set(_unknown_field_numbers(old_state))) == [1000, 1001]

    solver = caffe_pb2.SolverParameter(base_lr=0.1)
    solver.comm_param.overlap = True
    solver.comm_param.topk_ratio = 0.01
    old_solver = plain("caffe.SolverParameter").FromString(solver.SerializeToString())
    assert old_solver.base_lr == pytest.approx(0.1)
    assert _unknown_field_numbers(old_solver) == [1000]


def test_mobile_segmentation_detection_fork_messages_are_the_forks():
    kinds = {2: "float", 5: "int32", 8: "bool", 11: "message", 13: "uint32", 14: "enum"}
    for message, facts in FORK_MESSAGE_FACTS_MOBILE_SEGMENTATION_DETECTION.items():
        descriptor = getattr(caffe_pb2, message).DESCRIPTOR
        got = []
        for f in sorted(descriptor.fields, key=lambda f: f.number):
            assert not (f.is_repeated or f.is_required), f"{message}.{f.name}"
            default = "-" if not f.has_default_value else \
                repr(round(f.default_value, 7)) if f.type == 2 else str(f.default_value).lower()
            got.append(f"{f.name} {f.number} {kinds[f.type]} {default}")
        assert got == facts, message
    ceil_mode = caffe_pb2.PoolingParameter.DESCRIPTOR.fields_by_name["ceil_mode"]
    assert (ceil_mode.number, ceil_mode.type, ceil_mode.default_value) == (1013, 8, True)
