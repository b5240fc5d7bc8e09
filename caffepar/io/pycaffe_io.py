"""pycaffe's `caffe.io`: BlobProto/Datum conversions, image loading and the Transformer that
turns H x W x K images in [0, 1] into the net's N x C x H x W input."""
import numpy as np

from caffepar.errors import DataError, MissingFileError
from caffepar.proto import caffe_pb2


def blobproto_to_array(blob, return_diff=False):
    """A BlobProto's data (or diff) as an array shaped by its legacy num/channels/height/width
    when any of them is set, else by its shape; ValueError when the values do not fill it."""
    values = np.asarray(blob.diff if return_diff else blob.data, np.float32)
    if not values.size:
        values = np.asarray(blob.double_diff if return_diff else blob.double_data)
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        shape = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = tuple(blob.shape.dim)
    if values.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"BlobProto holds {values.size} values, its shape {shape} needs "
                         f"{int(np.prod(shape, dtype=np.int64))}")
    return values.reshape(shape)


def array_to_blobproto(arr, diff=None):
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(int(d) for d in arr.shape)
    blob.data.extend(np.asarray(arr, np.float32).ravel().tolist())
    if diff is not None:
        blob.diff.extend(np.asarray(diff, np.float32).ravel().tolist())
    return blob


def arraylist_to_blobprotovector_str(arraylist):
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(text):
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(text)
    return [blobproto_to_array(b) for b in vec.blobs]


def array_to_datum(arr, label=None):
    """A C x H x W array as a Datum: uint8 arrays as raw bytes, others as float_data."""
    if arr.ndim != 3:
        raise DataError(f"a Datum holds a 3-D C x H x W array, got shape {arr.shape}")
    datum = caffe_pb2.Datum(channels=arr.shape[0], height=arr.shape[1], width=arr.shape[2])
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(np.asarray(arr, np.float32).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def datum_to_array(datum):
    shape = (datum.channels, datum.height, datum.width)
    if datum.data:
        return np.frombuffer(datum.data, np.uint8).reshape(shape)
    return np.asarray(datum.float_data, np.float32).reshape(shape)


def load_image(filename, color=True):
    """An image as H x W x 3 (RGB) or H x W x 1 float32 array in [0, 1]."""
    from PIL import Image
    try:
        with Image.open(filename) as im:
            im = im.convert("RGB" if color else "L")
            arr = np.asarray(im, np.float32) / 255.0
    except FileNotFoundError:
        raise MissingFileError(filename, "image") from None
    return arr if color else arr[:, :, None]


def resize_image(im, new_dims, interp_order=1):
    """Resize H x W x K to new_dims (H', W') by spline interpolation of the given order."""
    from scipy import ndimage       # here: scipy.ndimage is a fifth of caffepar's import time
    factors = (new_dims[0] / im.shape[0], new_dims[1] / im.shape[1]) + (1,) * (im.ndim - 2)
    out = ndimage.zoom(np.asarray(im, np.float32), factors, order=interp_order)
    return out.astype(np.float32)


def oversample(images, crop_dims):
    """The 4 corner crops, the centre crop, and their mirrors, for each image."""
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    centre = im_shape[:2] / 2.0
    h_idx = (0, im_shape[0] - crop_dims[0])
    w_idx = (0, im_shape[1] - crop_dims[1])
    crops = [(i, j) for i in h_idx for j in w_idx]
    crops.append(tuple(np.round(centre - crop_dims / 2.0).astype(int)))
    out = []
    for im in images:
        patches = [im[i:i + crop_dims[0], j:j + crop_dims[1], :] for i, j in crops]
        out.extend(patches + [p[:, ::-1, :] for p in patches])
    return np.asarray(out, np.float32)


class Transformer:
    """pycaffe's Transformer: per-input transpose, channel swap, raw scale, mean, input scale."""

    def __init__(self, inputs):
        self.inputs = dict(inputs)
        self.transpose, self.channel_swap, self.raw_scale = {}, {}, {}
        self.mean, self.input_scale = {}, {}

    def _check(self, in_):
        if in_ not in self.inputs:
            raise DataError(f'"{in_}" is not one of the net inputs: {", ".join(self.inputs)}')

    def set_transpose(self, in_, order):
        self._check(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise DataError("transpose order needs one entry per input dimension")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order):
        self._check(in_)
        if len(order) != self.inputs[in_][1]:
            raise DataError("channel swap needs one entry per input channel")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale):
        self._check(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        self._check(in_)
        mean = np.asarray(mean, np.float32)
        in_shape = tuple(self.inputs[in_][1:])
        if mean.ndim == 1:
            if mean.shape[0] != in_shape[0]:
                raise DataError(f"mean has {mean.shape[0]} channels, the input {in_shape[0]}")
            mean = mean[:, None, None]
        else:
            if mean.ndim == 2:
                mean = mean[None]
            if mean.ndim != 3:
                raise DataError(f"mean must be 1-D (per channel) or C x H x W, got shape "
                                f"{mean.shape}")
            if mean.shape[0] != in_shape[0]:
                raise DataError(f"mean has {mean.shape[0]} channels, the input {in_shape[0]}")
            if mean.shape != in_shape:
                # An image mean of another size (256 x 256 for a 227 x 227 input) is resized.
                mean = resize_image(mean.transpose(1, 2, 0), in_shape[1:]).transpose(2, 0, 1)
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        self._check(in_)
        self.input_scale[in_] = scale

    def preprocess(self, in_, data):
        self._check(in_)
        x = np.asarray(data, np.float32)
        in_dims = self.inputs[in_][2:]
        if x.shape[:2] != tuple(in_dims):
            x = resize_image(x, in_dims)
        if in_ in self.transpose:
            x = x.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            x = x[self.channel_swap[in_], :, :]
        if in_ in self.raw_scale:
            x = x * self.raw_scale[in_]
        if in_ in self.mean:
            x = x - self.mean[in_]
        if in_ in self.input_scale:
            x = x * self.input_scale[in_]
        return np.ascontiguousarray(x, np.float32)

    def deprocess(self, in_, data):
        self._check(in_)
        x = np.asarray(data, np.float32).squeeze()
        if in_ in self.input_scale:
            x = x / self.input_scale[in_]
        if in_ in self.mean:
            x = x + self.mean[in_]
        if in_ in self.raw_scale:
            x = x / self.raw_scale[in_]
        if in_ in self.channel_swap:
            x = x[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            x = x.transpose(np.argsort(self.transpose[in_]))
        return x
