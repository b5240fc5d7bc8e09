"""What caffepar knows of Caffe's forks beyond the layers it implements: which fork a layer type
or a LayerParameter field it lacks comes from (so that a refusal names it), and how a fork's
.caffemodel field whose number BVLC Caffe gave to another field is read back."""
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


def fork_of_field(field_name):
    fork = FORK_LAYER_FIELDS.get(field_name)
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
