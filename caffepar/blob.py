"""Blob: an N-D array of data and one of the same shape for its gradient (diff)."""
import numpy as np


class Blob:
    """Caffe's Blob. `data` and `diff` are NumPy arrays; a parameter blob's arrays are views into
    the net's flat parameter buffers, so a reshape that changes the count is refused for them."""

    __slots__ = ("data", "diff", "dtype", "is_param")

    def __init__(self, shape=(), dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.is_param = False
        shape = tuple(int(d) for d in shape)
        self.data = np.zeros(shape, self.dtype)
        self.diff = np.zeros(shape, self.dtype)

    @property
    def shape(self):
        return self.data.shape

    @property
    def count(self):
        return self.data.size

    @property
    def num_axes(self):
        return self.data.ndim

    def legacy_shape(self, index):
        """Caffe's LegacyShape: axes beyond the blob's count as 1 (num/channels/height/width)."""
        return self.data.shape[index] if index < self.data.ndim else 1

    num = property(lambda self: self.legacy_shape(0))
    channels = property(lambda self: self.legacy_shape(1))
    height = property(lambda self: self.legacy_shape(2))
    width = property(lambda self: self.legacy_shape(3))

    def reshape(self, *shape):
        """Give the blob a new shape; keep the memory when the count allows (as Caffe does)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
            if shape == self.data.shape:     # the net reshapes every layer before forward
                return
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"blob dimensions must be >= 0, got {shape}")
        if shape == self.data.shape:
            return
        count = int(np.prod(shape, dtype=np.int64))
        if self.is_param:
            if count != self.data.size:
                raise ValueError(f"cannot reshape a parameter blob from {self.data.shape} to {shape}")
            self.data = self.data.reshape(shape)
            self.diff = self.diff.reshape(shape)
            return
        if count == self.data.size:
            self.data = self.data.reshape(shape)
            self.diff = self.diff.reshape(shape)
        else:
            try:
                self.data = np.zeros(shape, self.dtype)
                self.diff = np.zeros(shape, self.dtype)
            except MemoryError:
                raise MemoryError(f"a blob of shape {shape} needs {_size_text(2 * count * np.dtype(self.dtype).itemsize)} "
                                  "(data and diff)") from None

    def share_data(self, other):
        self.data = other.data

    def shape_string(self):
        return " ".join(str(d) for d in self.shape) + f" ({self.count})"

    def __repr__(self):
        return f"Blob(shape={self.shape}, dtype={self.dtype.name})"


def _size_text(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024


class BlobVec(list):
    """A layer's parameter blobs, as pycaffe's `layer.blobs`: a list of Blobs to which a Python
    layer adds learnable blobs in its setup with `add_blob(*shape)`."""

    __slots__ = ("dtype",)      # one per layer: a huge net's layers each save a dict

    def __init__(self, blobs=(), dtype=np.float32):
        super().__init__(blobs)
        self.dtype = np.dtype(dtype)

    def add_blob(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        blob = Blob(shape, self.dtype)
        blob.is_param = True
        self.append(blob)


class _NoBlobs(BlobVec):
    """The blobs of a built layer that has none: one object for all of a net's such layers (a
    BlobVec each would cost a net of millions of layers 64 bytes a layer). Adding to it is an
    error: parameter blobs are made in a layer's setup."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("this layer has no parameter blobs: they are added in its setup")

    append = extend = insert = add_blob = __setitem__ = __iadd__ = _refuse


_NO_BLOBS = {}


def no_blobs(dtype):
    found = _NO_BLOBS.get(dtype)
    if found is None:
        found = _NO_BLOBS[dtype] = _NoBlobs(dtype=dtype)
    return found


def canonical_axis(axis, num_axes):
    """Caffe's CanonicalAxisIndex: negative axes count from the end."""
    if not -num_axes <= axis < max(num_axes, 1):
        raise ValueError(f"axis {axis} out of range for a {num_axes}-D blob")
    return axis % num_axes if num_axes else 0
