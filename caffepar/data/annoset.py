"""SSD's data tools (the weiliu89/caffe fork, branch ssd): an AnnotatedDatum database from a
folder of images with VOC XML (or COCO-style JSON, or plain text) box files and a list file,
as its create_annoset.py / convert_annoset write it; the label map prototxt; the
"name height width" file its get_image_size writes for DetectionEvaluate."""
import json
import os
import sys
import xml.etree.ElementTree as ElementTree

import numpy as np

from caffepar.data.annotated import read_label_map
from caffepar.data.sources import cv_resize, read_image, root_prefix
from caffepar.data.tools import Progress, _Writer, _encode, _match_ext
from caffepar.errors import DataError, MissingFileError
from caffepar.proto import caffe_pb2

BACKGROUND = ("none_of_the_above", "background")


def read_pairs(list_file):
    """A list file's "image annotation" lines (any whitespace, as the fork's >> reads)."""
    if not os.path.exists(list_file):
        raise MissingFileError(list_file, "list file")
    with open(list_file) as f:
        words = f.read().split()
    if len(words) % 2:
        raise DataError(f"expected pairs of image and annotation (or label) per line, "
                        f"found {len(words)} words", path=list_file)
    return [(words[k], words[k + 1]) for k in range(0, len(words), 2)]


def name_to_label(label_map, check=False, path=None):
    """MapNameToLabel: name -> label; with `check`, a name given twice is an error."""
    names = {}
    for item in label_map.item:
        if check and item.name in names:
            raise DataError(f'the label map gives the name "{item.name}" twice', path=path)
        names[item.name] = item.label
    return names


def object_names(root, pairs, label_type):
    """The class names the annotation files use (for a label map written from them)."""
    names = set()
    for _, anno in pairs:
        path = root + anno
        if not os.path.exists(path):
            continue
        if label_type == "xml":
            tree = _parse_xml(path)
            names.update((o.findtext("name") or "").strip() for o in tree.iter("object"))
        elif label_type == "json":
            with open(path) as f:
                names.update(str(a["category_id"]) for a in json.load(f).get("annotation", []))
        else:
            raise DataError("a label map can be derived from xml or json annotations only; "
                            "give --label-map-file")
    names.discard("")
    return sorted(names)


def write_label_map(path, names):
    """A LabelMap prototxt: label 0 the background (as the fork's VOC and COCO maps), then
    the names in the order given, labels 1..K."""
    label_map = caffe_pb2.LabelMap()
    item = label_map.item.add()
    item.name, item.label, item.display_name = BACKGROUND[0], 0, BACKGROUND[1]
    for k, name in enumerate(names, 1):
        item = label_map.item.add()
        item.name, item.label, item.display_name = name, k, name
    from google.protobuf import text_format
    with open(path, "w") as f:
        f.write(text_format.MessageToString(label_map))
    return label_map


def _parse_xml(path):
    try:
        return ElementTree.parse(path)
    except ElementTree.ParseError as e:
        raise DataError(f"not an XML file: {e}", path=path) from None


def _group(anno, label):
    """The annotation group of `label` (created at the end when new) and the next instance id,
    as the fork numbers them."""
    for g in anno.annotation_group:
        if g.group_label == label:
            nxt = g.annotation[-1].instance_id + 1 if len(g.annotation) else 0
            return g, nxt
    g = anno.annotation_group.add()
    g.group_label = label
    return g, 0


def _add_box(anno, label, box, size, difficult):
    g, instance = _group(anno, label)
    a = g.annotation.add()
    a.instance_id = instance
    h, w = size
    b = a.bbox
    b.xmin, b.ymin = np.float32(box[0]) / np.float32(w), np.float32(box[1]) / np.float32(h)
    b.xmax, b.ymax = np.float32(box[2]) / np.float32(w), np.float32(box[3]) / np.float32(h)
    b.difficult = bool(difficult)


def _number(text, what, path):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise DataError(f"{what} is not a number: {text!r}", path=path) from None
    return int(value)


def read_xml_boxes(path, names, image_size, anno):
    """ReadXMLToAnnotatedDatum: VOC XML objects (name, difficult, bndbox in pixels) into the
    record's groups, normalized by the XML's size (the image's when it has none)."""
    tree = _parse_xml(path).getroot()
    size = tree.find("size")
    h = w = 0
    if size is not None and size.findtext("height") and size.findtext("width"):
        h = _number(size.findtext("height"), "size/height", path)
        w = _number(size.findtext("width"), "size/width", path)
    if not (h and w):
        h, w = image_size
    if (h, w) != tuple(image_size):
        print(f"warning: {path}: size {w}x{h} differs from the image's {image_size[1]}x"
              f"{image_size[0]}", file=sys.stderr)
    if not (h and w):
        raise DataError("no valid image width/height", path=path)
    for obj in tree.iter("object"):
        name = (obj.findtext("name") or "").strip()
        if name not in names:
            raise DataError(f'unknown class name "{name}" (not in the label map)', path=path)
        difficult = (obj.findtext("difficult") or "0").strip() == "1"
        box = obj.find("bndbox")
        if box is None:
            raise DataError(f'object "{name}" has no bndbox', path=path)
        coords = [_number(box.findtext(k, "0"), f"bndbox/{k}", path)
                  for k in ("xmin", "ymin", "xmax", "ymax")]
        _add_box(anno, names[name], coords, (h, w), difficult)


def read_json_boxes(path, names, image_size, anno):
    """ReadJSONToAnnotatedDatum: {"image": {height, width}, "annotation": [{category_id,
    bbox [x, y, w, h], iscrowd}]}; iscrowd marks a box difficult."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except ValueError as e:
        raise DataError(f"not a JSON file: {e}", path=path) from None
    image = doc.get("image", {})
    h, w = int(image.get("height", 0)), int(image.get("width", 0))
    if not (h and w):
        h, w = image_size
    for a in doc.get("annotation", []):
        name = str(a["category_id"])
        if name not in names:
            raise DataError(f'unknown category "{name}" (not in the label map)', path=path)
        x, y, bw, bh = (float(v) for v in a["bbox"])
        _add_box(anno, names[name], (x, y, x + bw, y + bh), (h, w), a.get("iscrowd", 0))


def read_txt_boxes(path, image_size, anno):
    """ReadTxtToAnnotatedDatum: "label xmin ymin xmax ymax" lines, in pixels."""
    with open(path) as f:
        words = f.read().split()
    for k in range(0, len(words) - 4, 5):
        label = int(words[k])
        _add_box(anno, label, [float(v) for v in words[k + 1:k + 5]], image_size, False)


def read_image_dims(path, height=0, width=0, min_dim=0, max_dim=0, color=True):
    """ReadImageToCVMat with the fork's min_dim / max_dim (aspect kept)."""
    img = read_image(path, 0, 0, color)
    if img is None:
        return None
    if min_dim > 0 or max_dim > 0:
        rows, cols = img.shape[:2]
        scale = np.float32(1)
        if min_dim > 0 and min(rows, cols) < min_dim:
            scale = np.float32(min_dim) / np.float32(min(rows, cols))
        if max_dim > 0 and int(scale * max(rows, cols)) > max_dim:
            scale = np.float32(max_dim) / np.float32(max(rows, cols))
        if scale != 1:
            img = cv_resize(img, int(round(rows * float(scale))), int(round(cols * float(scale))))
    elif height > 0 and width > 0:
        img = cv_resize(img, height, width)
    return img


def annotated_datum(image_path, anno_path, names, label_type, height=0, width=0, min_dim=0,
                    max_dim=0, color=True, encoding=""):
    """ReadRichImageToAnnotatedDatum: the image (encoded as stored when it needs no change)
    and its boxes; None when the image cannot be read. A missing annotation file gives a
    record without boxes, as the fork's."""
    img = read_image_dims(image_path, height, width, min_dim, max_dim, color)
    if img is None:
        return None
    anno = caffe_pb2.AnnotatedDatum()
    datum = anno.datum
    if encoding:
        unchanged = not (height or width or min_dim or max_dim)
        if unchanged and _match_ext(image_path, encoding):
            with open(image_path, "rb") as f:
                datum.data = f.read()
        else:
            datum.data = _encode(img, encoding)
        datum.encoded = True
        # The fork records the size of encoded images too (its TransformAnnotation reads it).
        datum.height, datum.width, datum.channels = img.shape
    else:
        h, w, c = img.shape
        datum.channels, datum.height, datum.width = c, h, w
        datum.data = np.ascontiguousarray(img.transpose(2, 0, 1)).tobytes()
    datum.label = -1
    anno.type = caffe_pb2.AnnotatedDatum.BBOX
    if os.path.exists(anno_path):
        original = read_image(image_path, 0, 0, True)
        size = original.shape[:2]
        if label_type == "xml":
            read_xml_boxes(anno_path, names, size, anno)
        elif label_type == "json":
            read_json_boxes(anno_path, names, size, anno)
        elif label_type == "txt":
            read_txt_boxes(anno_path, size, anno)
        else:
            raise DataError(f"unknown label type {label_type!r} (xml, json or txt)")
    return anno


def convert_annoset(root, list_file, db, label_map_file="", anno_type="detection",
                    label_type="xml", check_label=False, min_dim=0, max_dim=0, resize_height=0,
                    resize_width=0, backend="lmdb", shuffle=False, check_size=False,
                    encode_type="", encoded=False, gray=False, name_size_file=None, seed=None):
    """create_annoset.py + convert_annoset: the images and annotation files of LIST (relative
    to ROOT) -> AnnotatedDatums keyed %08d_<image> in DB. A detection set needs a label map:
    `label_map_file` is read, or written from the class names of the annotations (background
    0, then the names sorted) when it does not exist. `name_size_file` gets "name height
    width" per image in list order (get_image_size). Returns the number of records."""
    if not os.path.isdir(root):
        raise MissingFileError(root, "root folder")
    pairs = read_pairs(list_file)
    root = root_prefix(root)
    if anno_type not in ("detection", "classification"):
        raise DataError(f"unknown anno_type {anno_type!r} (detection or classification)")
    names = {}
    if anno_type == "detection":
        if not label_map_file:
            raise DataError("a detection set needs --label-map-file (read, or written from the "
                            "annotations when the file does not exist)")
        if os.path.exists(label_map_file):
            label_map = read_label_map(label_map_file)
        else:
            label_map = write_label_map(label_map_file, object_names(root, pairs, label_type))
            print(f"wrote label map {label_map_file} ({len(label_map.item) - 1} classes)",
                  file=sys.stderr)
        names = name_to_label(label_map, check_label, label_map_file)
    if shuffle:
        from caffepar import common
        rng = np.random.default_rng(common.seed_for("convert_annoset") if seed is None else seed)
        pairs = [pairs[i] for i in rng.permutation(len(pairs))]
    encoded = encoded or bool(encode_type)
    parent = os.path.dirname(os.path.abspath(os.fspath(db)))
    os.makedirs(parent, exist_ok=True)           # as create_annoset.py makes it
    out = _Writer(db, backend)
    sizes = []
    size = None
    try:
        with Progress(len(pairs), os.path.basename(os.fspath(db))) as bar:
            for line_id, (image, second) in enumerate(pairs):
                enc = encode_type
                if encoded and not enc:
                    enc = image.rsplit(".", 1)[-1].lower() if "." in image else ""
                path = root + image
                if anno_type == "detection":
                    anno = annotated_datum(path, root + second, names, label_type,
                                           resize_height, resize_width, min_dim, max_dim,
                                           not gray, enc)
                else:
                    anno = annotated_datum(path, "", {}, label_type, resize_height,
                                           resize_width, min_dim, max_dim, not gray, enc)
                    if anno is not None:
                        anno.ClearField("type")
                        anno.datum.label = _number(second, "label", list_file)
                bar.update()
                if anno is None:
                    print(f"warning: could not read image {path}; skipped", file=sys.stderr)
                    continue
                if check_size:
                    d = anno.datum
                    n = d.channels * d.height * d.width
                    size = n if size is None else size
                    if len(d.data) != size:
                        raise DataError(f"incorrect data field size {len(d.data)} (expected "
                                        f"{size})", path=path)
                if name_size_file:
                    original = read_image(path, 0, 0, True)
                    stem = os.path.splitext(os.path.basename(image))[0]
                    sizes.append(f"{stem} {original.shape[0]} {original.shape[1]}")
                out.put("%08d_%s" % (line_id, image), anno.SerializeToString())
    finally:
        out.close()
    if name_size_file:
        with open(name_size_file, "w") as f:
            f.write("".join(line + "\n" for line in sizes))
    return out.count
