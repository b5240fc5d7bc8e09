"""Caffe's DataTransformer, applied to a whole batch at once.

Per item: crop (random offsets in TRAIN, centred in TEST), mirror (a coin flip whenever
`mirror: true` — Caffe flips in every phase), then (pixel - mean) * scale in the blob's float
type, where a mean_file is indexed at the same source pixel as the data (so it is cropped and
mirrored with it) and mean_value gives one value or one per channel.
"""
import numpy as np

from caffepar.errors import DataError
from caffepar.proto import caffe_pb2

TRAIN = caffe_pb2.TRAIN


def blob_proto_array(proto):
    """A BlobProto's data as an array, from its shape or its legacy num/channels/height/width."""
    if proto.HasField("shape"):
        shape = tuple(int(d) for d in proto.shape.dim)
    else:
        shape = (proto.num, proto.channels, proto.height, proto.width)
    values = proto.double_data if len(proto.double_data) else proto.data
    arr = np.asarray(values, np.float64 if len(proto.double_data) else np.float32)
    if arr.size != int(np.prod(shape)):
        raise DataError(f"mean blob has {arr.size} values for shape {shape}")
    return arr.reshape(shape)


class DataTransformer:
    """TransformationParameter for one phase. `mean_file` must already be resolved to a path
    (or a CxHxW array passed as `mean`)."""

    def __init__(self, param=None, phase=TRAIN, mean_file=None, mean=None, dtype=np.float32):
        param = param if param is not None else caffe_pb2.TransformationParameter()
        self.dtype = np.dtype(dtype)
        self.phase = phase
        self.crop = int(param.crop_size)
        self.mirror = bool(param.mirror)
        self.scale = self.dtype.type(param.scale)
        self.force_color = bool(param.force_color)
        self.force_gray = bool(param.force_gray)
        if self.force_color and self.force_gray:
            raise DataError("cannot set both force_color and force_gray")
        if param.mean_value and (param.HasField("mean_file") or mean is not None):
            raise DataError("cannot specify mean_file and mean_value at the same time")
        self.mean = None
        if mean is None and mean_file is not None:
            from caffepar.proto.text import read_blob_proto
            mean = blob_proto_array(read_blob_proto(mean_file))
        if mean is not None:
            mean = np.asarray(mean, self.dtype)
            if mean.ndim == 4:
                if mean.shape[0] != 1:
                    raise DataError(f"mean blob must hold one image, has shape {mean.shape}")
                mean = mean[0]
            self.mean = mean
        self.mean_values = np.asarray(param.mean_value, self.dtype) if param.mean_value else None

    @property
    def decode_color(self):
        """How encoded images decode: True color, False gray, None as stored."""
        if self.force_color:
            return True
        if self.force_gray:
            return False
        return None

    def output_shape(self, channels, height, width):
        if channels <= 0:
            raise DataError("image has no channels")
        if height < self.crop or width < self.crop:
            raise DataError(f"crop_size {self.crop} is larger than the image ({height}x{width})")
        if self.crop:
            return channels, self.crop, self.crop
        return channels, height, width

    def draw(self, n, height, width, rng):
        """Per-item mirror flags and crop offsets, drawn from `rng` (None: no randomness)."""
        mirror = np.zeros(n, bool)
        h_off = np.zeros(n, np.int64)
        w_off = np.zeros(n, np.int64)
        if self.mirror:
            mirror = rng.integers(0, 2, n).astype(bool)
        if self.crop:
            if self.phase == TRAIN:
                h_off = rng.integers(0, height - self.crop + 1, n)
                w_off = rng.integers(0, width - self.crop + 1, n)
            else:
                h_off[:] = (height - self.crop) // 2
                w_off[:] = (width - self.crop) // 2
        return mirror, h_off, w_off

    def __call__(self, images, rng=None, out=None):
        """Transform an NxCxHxW batch (uint8 or float) into the blob dtype."""
        images = np.asarray(images)
        n, c, h, w = images.shape
        oc, oh, ow = self.output_shape(c, h, w)
        mirror, h_off, w_off = self.draw(n, h, w, rng)
        self._check_mean(c, h, w)
        if out is None:
            out = np.empty((n, oc, oh, ow), self.dtype)
        sub = self._channel_means(c)[:, None, None] if self.mean_values is not None else None
        if not self.crop and not mirror.any():
            if self.mean is not None:
                sub = self.mean
            np.subtract(images, sub, out=out, dtype=self.dtype) if sub is not None \
                else np.copyto(out, images, casting="unsafe")
        else:
            # One strided view per item: cheaper than a fancy-index gather over the batch.
            for i in range(n):
                rows = slice(h_off[i], h_off[i] + oh)
                cols = slice(w_off[i], w_off[i] + ow)
                src = images[i, :, rows, cols]
                m = self.mean[:, rows, cols] if self.mean is not None else sub
                if mirror[i]:
                    src = src[:, :, ::-1]
                    m = m[:, :, ::-1] if self.mean is not None else m
                if m is None:
                    np.copyto(out[i], src, casting="unsafe")
                else:
                    np.subtract(src, m, out=out[i], dtype=self.dtype)
        if self.scale != 1:
            out *= self.scale
        return out

    def transform_one(self, image, rng=None):
        """One CxHxW image (images of differing sizes go one by one)."""
        return self(np.asarray(image)[None], rng)[0]

    def _channel_means(self, c):
        mv = self.mean_values
        if len(mv) == 1:
            return np.repeat(mv, c)
        if len(mv) != c:
            raise DataError(f"specify either 1 mean_value or as many as channels ({c}), "
                            f"got {len(mv)}")
        return mv

    def _check_mean(self, c, h, w):
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise DataError(f"mean has shape {'x'.join(map(str, self.mean.shape))}, "
                            f"the images are {c}x{h}x{w}")
        if self.mean_values is not None:
            self._channel_means(c)
