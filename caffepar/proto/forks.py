"""What caffepar knows of Caffe's forks beyond the layers it implements: which fork a layer type
or a LayerParameter field it lacks comes from (so that a refusal names it), and how the forks'
fields of a binary file are read: by the layer's type, since forks give one number different
meanings, and never so that a file BVLC Caffe reads fails here."""
from google.protobuf.message import DecodeError

from caffepar.proto import caffe_pb2

SSD = "SSD (weiliu89/caffe, branch ssd)"
FAST_RCNN = "Fast/Faster R-CNN (rbgirshick/caffe-fast-rcnn)"
RFCN = "R-FCN (daijifeng001/caffe-rfcn)"
DEEPLAB = "DeepLab v2 (deeplab-public-ver2)"
SEGNET = "SegNet (alexgkendall/caffe-segnet)"
YOLO2 = "the YOLOv2 ports of Caffe"
MOBILE_YOLO = "MobileNet-YOLO (eric612/MobileNet-YOLO)"
DARKNET2CAFFE = "darknet2caffe's Caffe (ChenYingpeng/darknet2caffe)"
FLOWNET = "FlowNet 2 (lmb-freiburg/flownet2)"
GAL_DROPOUT = "Gal's Bayesian dropout (yaringal/DropoutUncertaintyCaffeModels)"

#: Layer types of Caffe's forks that caffepar does not implement -> the fork.
FORK_LAYER_TYPES = {
    "SmoothL1Loss": f"{FAST_RCNN} and {SSD}",
    "BoxAnnotatorOHEM": RFCN,
    **{t: DEEPLAB for t in ("DenseCRF", "SegAccuracy", "MatRead", "MatWrite", "UniqueLabel",
                            "BiasChannel", "AdaptiveBiasChannel", "DomainTransform")},
    "DenseImageData": SEGNET,
    "Reorg": YOLO2,
    "Region": YOLO2,
    "YoloDetectionOutput": MOBILE_YOLO,
    "Yolov3DetectionOutput": MOBILE_YOLO,
    "Mish": DARKNET2CAFFE,
    "Correlation": FLOWNET,
}

#: LayerParameter fields (`*_param`) of Caffe's forks that caffepar's schema lacks -> the fork.
FORK_LAYER_FIELDS = {
    "smooth_l1_loss_param": FAST_RCNN,
    "box_annotator_ohem_param": RFCN,
    **{f: DEEPLAB for f in ("dense_crf_param", "seg_accuracy_param", "mat_read_param",
                            "mat_write_param", "unique_label_param", "bias_channel_param",
                            "adaptive_bias_channel_param", "domain_transform_param")},
    "dense_image_data_param": SEGNET,
    "reorg_param": YOLO2,
    "yolo_detection_output_param": MOBILE_YOLO,
    "yolov3_detection_output_param": MOBILE_YOLO,
    "mish_param": DARKNET2CAFFE,
    "correlation_param": FLOWNET,
}


def fork_of_type(type_name):
    """A hint naming the fork a layer type comes from, or None."""
    fork = FORK_LAYER_TYPES.get(type_name)
    return f'"{type_name}" is a layer of {fork}, a Caffe fork; caffepar does not implement it' \
        if fork else None


#: Fields of other messages that forks added and caffepar's schema lacks: (message, field) ->
#: the fork. Gal's Dropout gives field 2 to sample_weights_test, which caffe-fast-rcnn (and
#: here) gives to scale_train.
FORK_MESSAGE_FIELDS = {
    ("DropoutParameter", "sample_weights_test"): GAL_DROPOUT,
}


def fork_of_field(field_name, message="LayerParameter"):
    """A hint naming the fork a field of `message` that caffepar lacks comes from, or None."""
    fork = FORK_LAYER_FIELDS.get(field_name) if message in ("LayerParameter", "V1LayerParameter") \
        else FORK_MESSAGE_FIELDS.get((message, field_name))
    return f"{field_name} is a field of {fork}, a Caffe fork; caffepar does not read it" \
        if fork else None


#: (layer type, field number in the fork, our field name, the fork's message or None when it is
#: ours): fork fields read by the layer's type from a .caffemodel. DeepLab's interp_param is
#: BVLC's input_param (143) and SegNet's upsample_param BVLC's embed_param (137); SegNet's
#: bn_param (45) numbers its fields unlike PSPNet's, whose number caffepar's schema holds.
COLLIDING_FIELDS = (("Interp", 143, "interp_param", None),
                    ("Upsample", 137, "upsample_param", None),
                    ("BN", 45, "bn_param", "SegNetBNParameter"))


def read_colliding_fields(layer, raw_fields):
    """Set a layer's fork field from the raw bytes of the fork's field number (which protobuf
    parsed as BVLC's field, or kept as unknown). `raw_fields` maps field number -> payload
    bytes of the layer as written in the file."""
    by_number = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_number
    for type_name, number, name, fork_message in COLLIDING_FIELDS:
        if layer.type != type_name or number not in raw_fields:
            continue
        if number in by_number:
            layer.ClearField(by_number[number].name)
        target = getattr(layer, name)
        if fork_message is None:
            target.MergeFromString(raw_fields[number])
            continue
        fork = getattr(caffe_pb2, fork_message).FromString(raw_fields[number])
        for field, value in fork.ListFields():
            if field.message_type is not None:
                getattr(target, field.name).CopyFrom(value)
            else:
                setattr(target, field.name, value)


#: LayerParameter's field numbers in BVLC Caffe (1-11, 100-148). Every other number of a layer in
#: a binary file is read as BVLC Caffe reads it, an unknown field, unless the layer's type is
#: one that reads our field of that number (FIELD_LAYER_TYPES) and the bytes parse as it.
BVLC_LAYER_NUMBERS = frozenset(range(1, 12)) | frozenset(range(100, 149))

#: The layer types that read each LayerParameter field outside BVLC's numbers. The forks'
#: numbers collide (R-FCN's psroi_pooling_param is 10001, a number open_nsfw's Caffe gave a
#: string): a layer of any other type keeps such a field unread. A field not listed is read
#: on every layer (parallel_mode, caffepar's own, applies to any).
FIELD_LAYER_TYPES = {
    "permute_param": ("Permute",),
    "prior_box_param": ("PriorBox",),
    "detection_output_param": ("DetectionOutput",),
    "norm_param": ("Normalize",),
    "annotated_data_param": ("AnnotatedData",),
    "multibox_loss_param": ("MultiBoxLoss",),
    "detection_evaluate_param": ("DetectionEvaluate",),
    "upsample_param": ("Upsample",),
    "shuffle_channel_param": ("ShuffleChannel",),
    "interp_param": ("Interp",),
    "psroi_pooling_param": ("PSROIPooling",),
    "roi_pooling_param": ("ROIPooling",),
    "bn_param": ("BN",),
}


def read_fork_fields(message, extras):
    """Merge into `message` (parsed from the fields BVLC Caffe numbers) those of `extras` --
    [(number, the whole field's bytes)], its other fields as the file has them -- that parse as
    our field of that number and, in a LayerParameter, that its type reads. Returns (the bytes
    of the rest, which stay unknown fields as in BVLC Caffe, for a writer to keep; the first of
    the rest that holds something else than our field of its number, as (number, field name),
    or None)."""
    kept, odd = [], None
    by_number = message.DESCRIPTOR.fields_by_number
    layer_type = message.type if isinstance(message, caffe_pb2.LayerParameter) else None
    for number, raw in extras:
        fd = by_number.get(number)
        if fd is None:
            kept.append(raw)
            continue
        types = FIELD_LAYER_TYPES.get(fd.name) if layer_type is not None else None
        if types is None or layer_type in types:
            scratch = type(message)()
            try:
                scratch.MergeFromString(raw)
            except DecodeError:
                scratch.Clear()
            if scratch.ListFields():     # empty when protobuf kept it unknown (wrong wire type)
                message.MergeFrom(scratch)
                continue
        kept.append(raw)
        if odd is None:
            odd = (number, fd.name)
    return b"".join(kept), odd


def fork_field_note(layer, odd, count):
    """The one note a file gets about fields kept unread (`odd` from read_fork_fields, for the
    first such layer; `count` of them in the file)."""
    number, name = odd
    types = FIELD_LAYER_TYPES.get(name)
    if types is None or layer.type in types:
        what = f"does not hold {name}, as it does here"
    else:
        what = f"is read here as {name} of {' and '.join(types)} layers only"
    more = f" ({count} such fields in the file)" if count > 1 else ""
    return (f'layer "{layer.name}" ({layer.type}): field {number} {what}; kept as an unknown '
            f"field, as BVLC Caffe does{more}")
