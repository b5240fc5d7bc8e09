"""SSD's AnnotatedData layer (the weiliu89/caffe fork, branch ssd): AnnotatedDatum records
from an LMDB or LevelDB, augmented for detection (caffepar/data/annotated.py), with the
boxes that survive as a second top."""
import logging

import numpy as np

from caffepar.data.annotated import AnnotatedTransformer, parse_record, read_label_map
from caffepar.data.sources import resolve_path
from caffepar.data.transform import blob_proto_array
from caffepar.errors import DataError
from caffepar.nn.base import register
from caffepar.nn.data import _StreamingDataLayer, open_data_source
from caffepar.proto import caffe_pb2

log = logging.getLogger("caffepar")
FIT_SMALL = caffe_pb2.ResizeParameter.FIT_SMALL_SIZE
RECORD_STREAM = 1 << 23


@register("AnnotatedData")
class AnnotatedDataLayer(_StreamingDataLayer):
    """Tops: data (N x C x H x W) and, with a second top, the ground truth: 1 x 1 x G x 8 rows
    [item, label, instance, xmin, ymin, xmax, ymax, difficult] over the batch's boxes (one row
    of -1 when none survive), or the Datums' labels (N) for records without annotations.

    Each record's random choices (distortion, expansion, sampled crop, interpolation, mirror)
    come from a generator seeded by the layer's seed and the record's position in the stream,
    so one process at batch P*B and P ranks at batch B make the same batches, and a resumed
    run continues them exactly."""

    max_tops = 2

    def layer_setup(self, bottom, top):
        p = self.param.data_param
        ap = self.param.annotated_data_param
        tp = self.param.transform_param
        self.db = open_data_source(self, p)
        if tp.force_color and tp.force_gray:
            raise self.error("cannot set both force_color and force_gray")
        self.color = True if tp.force_color else (False if tp.force_gray else None)
        mean = None
        if tp.HasField("mean_file"):
            from caffepar.proto.text import read_blob_proto
            mean = blob_proto_array(read_blob_proto(self.resolve(tp.mean_file, "mean_file")))
            mean = mean.reshape(mean.shape[-3:]).astype(np.float32)
        try:
            self.transformer = AnnotatedTransformer(tp, ap.batch_sampler, self.phase, mean,
                                                    self.dtype)
        except DataError as e:
            raise self.error(e.message) from None
        for s in ap.batch_sampler:
            sm = s.sampler
            if not (0 < sm.min_scale <= sm.max_scale <= 1 and
                    0 < sm.min_aspect_ratio <= sm.max_aspect_ratio):
                raise self.error("batch_sampler needs 0 < min_scale <= max_scale <= 1 and "
                                 "0 < min_aspect_ratio <= max_aspect_ratio, got scale "
                                 f"[{sm.min_scale:g}, {sm.max_scale:g}], aspect ratio "
                                 f"[{sm.min_aspect_ratio:g}, {sm.max_aspect_ratio:g}]")
        self.label_map = None
        if ap.label_map_file:
            found = resolve_path(ap.label_map_file, getattr(self, "net_dir", None))
            if found is None:
                log.warning('AnnotatedData "%s": label_map_file %s not found (it only names '
                            "the classes)", self.name, ap.label_map_file)
            else:
                self.label_map = read_label_map(found)
        self.num_records = len(self.db)
        self.batch_size = p.batch_size
        if self.transformer.resize is not None and \
                self.transformer.resize.resize_mode == FIT_SMALL and self.batch_size != 1:
            raise self.error("resize_mode FIT_SMALL_SIZE needs batch_size 1 (its images "
                             "differ in size)")
        self.output_labels = len(top) > 1
        self.start_stream(depth=p.prefetch, rand_skip=p.rand_skip)
        first = self.record(int(self.positions(0)[0]) % self.num_records)
        self.has_type = first.has_type or ap.HasField("anno_type")
        if ap.HasField("anno_type") and ap.anno_type != caffe_pb2.AnnotatedDatum.BBOX:
            raise self.error(f"unknown anno_type {ap.anno_type}")
        h, w, c = first.image.shape
        try:
            shape = self.transformer.output_shape(h, w, c)
        except DataError as e:
            raise self.error(e.message) from None
        top[0].reshape((self.batch_size,) + shape)
        if self.output_labels:
            if self.has_type:
                top[1].reshape((1, 1, max(len(first.boxes), 1), 8))
            else:
                top[1].reshape((self.batch_size,))

    def record(self, i):
        try:
            return parse_record(self.db.get(int(i)), self.color)
        except DataError as e:
            raise DataError(f"record {i}: {e.message}", layer=self.name,
                            layer_type=self.param.type) from None

    def make_batch(self, index):
        positions = self.positions(index)
        _, records = self.epoch_and_record(positions)
        images, rows, labels = [], [], []
        for item, (pos, r) in enumerate(zip(positions, records)):
            rng = np.random.default_rng([self.seed, RECORD_STREAM, int(pos)])
            rec = self.record(r)
            try:
                data, lab, inst, diff, boxes = self.transformer(rec, rng)
            except DataError as e:
                raise DataError(f"record {int(r)}: {e.message}", layer=self.name,
                                layer_type=self.param.type) from None
            images.append(data)
            labels.append(rec.label)
            for k in range(len(boxes)):
                rows.append([item, lab[k], inst[k], *boxes[k], diff[k]])
        shapes = {a.shape for a in images}
        if len(shapes) > 1:
            raise self.error(f"images of one batch differ in shape "
                             f"({', '.join(sorted(map(str, shapes)))}): give resize_param or "
                             "crop_size, or use batch_size 1")
        data = np.stack(images)
        if not self.output_labels:
            return [data]
        if not self.has_type:
            return [data, np.asarray(labels, self.dtype)]
        if not rows:
            return [data, np.full((1, 1, 1, 8), -1, self.dtype)]
        return [data, np.asarray(rows, self.dtype).reshape(1, 1, -1, 8)]
