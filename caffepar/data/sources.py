"""Record readers behind the data layers: LMDB / LevelDB databases of Datums, image list files
and HDF5 list files, plus Datum decoding as Caffe does it (encoded images come out BGR)."""
import io
import os
import threading
import weakref

import numpy as np

from caffepar.errors import DataError
from caffepar.proto import caffe_pb2


def resolve_path(path, base_dir=None):
    """Caffe opens paths relative to the working directory; fall back to the prototxt's folder.
    Returns None when neither exists."""
    path = os.fspath(path)
    if os.path.exists(path):
        return path
    if base_dir and not os.path.isabs(path):
        alt = os.path.join(base_dir, path)
        if os.path.exists(alt):
            return alt
    return None


# ---------------------------------------------------------------- Datum decoding
def decode_image_bytes(data, color=True):
    """Decode JPEG/PNG bytes as OpenCV's imdecode does: HxWx3 BGR for color, HxW for gray;
    color=None keeps the stored channels (gray stays gray, alpha gives BGRA)."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        if color is None:
            if im.mode in ("1", "L", "I", "I;16", "F"):
                color = False
            elif im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
                arr = np.asarray(im.convert("RGBA"))
                return np.ascontiguousarray(arr[:, :, [2, 1, 0, 3]])
            else:
                color = True
        if color:
            return np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1])
        return np.asarray(im.convert("L"))


def datum_array(datum, color=None):
    """A Datum's image as a CxHxW array: uint8 for raw bytes and encoded images, float32 for
    float_data. Encoded images decode as stored unless color is True (BGR) or False (gray)."""
    if datum.encoded:
        img = decode_image_bytes(datum.data, color)
        return img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
    shape = (datum.channels, datum.height, datum.width)
    size = int(np.prod(shape))
    if datum.data:
        if len(datum.data) != size:
            raise DataError(f"Datum has {len(datum.data)} bytes of data for shape {shape}")
        return np.frombuffer(datum.data, np.uint8).reshape(shape)
    if len(datum.float_data) != size:
        raise DataError(f"Datum has {len(datum.float_data)} float_data values for shape {shape}")
    return np.asarray(datum.float_data, np.float32).reshape(shape)


def parse_datum(value):
    datum = caffe_pb2.Datum()
    datum.ParseFromString(value)
    return datum


# ---------------------------------------------------------------- key-value databases
_INDEX_STRIDE = 256


class _DB:
    """Random access by record number over a sorted key-value store: a sparse index of every
    256th key, then a cursor stepped forward, so sequential reads stay sequential."""

    def __init__(self, path):
        self.path = path
        self._local = threading.local()
        self._anchors = []
        n = 0
        for key in self._iter_keys():
            if n % _INDEX_STRIDE == 0:
                self._anchors.append(key)
            n += 1
        self.count = n
        if n == 0:
            raise DataError("database is empty", path=path)

    def __len__(self):
        return self.count

    def get(self, i):
        """The value of record i (0-based, in key order)."""
        st = self._local.__dict__
        pos = st.get("pos")
        if pos is None or not (pos <= i < pos + _INDEX_STRIDE) or st.get("gen") is not self:
            self._seek(self._anchors[i // _INDEX_STRIDE])
            pos = i - i % _INDEX_STRIDE
            st["gen"] = self
        for _ in range(i - pos):
            self._step()
        st["pos"] = i
        return self._value()


class _Env:
    """One open LMDB environment or LevelDB per path and process (both refuse a second one),
    released when the last reader lets go of it. Never closed explicitly: cursors and iterators
    of other threads may still point into it, and the bindings free them in a safe order."""

    def __init__(self, env):
        self.env = env


_ENVS = weakref.WeakValueDictionary()
_ENVS_LOCK = threading.Lock()


def _lmdb_env(path):
    try:
        import lmdb
    except ImportError:
        raise DataError("reading LMDB needs the python package lmdb (pip install lmdb)",
                        path=path) from None
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        holder = _ENVS.get(key)
        if holder is None:
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False,
                                max_readers=512, subdir=os.path.isdir(path))
            except lmdb.Error as e:
                raise DataError(f"cannot open LMDB: {e}", path=path) from None
            holder = _ENVS[key] = _Env(env)
    return holder


class LMDBSource(_DB):
    def __init__(self, path):
        self._holder = _lmdb_env(path)
        self.env = self._holder.env
        super().__init__(path)

    def _iter_keys(self):
        with self.env.begin(buffers=False) as txn:
            yield from txn.cursor().iternext(keys=True, values=False)

    def _cursor(self):
        st = self._local.__dict__
        if st.get("cursor") is None:
            st["txn"] = self.env.begin(buffers=False)
            st["cursor"] = st["txn"].cursor()
        return st["cursor"]

    def _seek(self, key):
        self._cursor().set_key(key)

    def _step(self):
        self._cursor().next()

    def _value(self):
        return self._cursor().value()

    def items(self):
        with self.env.begin(buffers=False) as txn:
            yield from txn.cursor().iternext()

    def close(self):
        self._local = threading.local()
        self.env = self._holder = None


def _plyvel():
    try:
        import plyvel
    except ImportError:
        raise DataError("reading or writing LevelDB needs the python package plyvel "
                        "(pip install plyvel), or convert the data to LMDB") from None
    return plyvel


class LevelDBSource(_DB):
    def __init__(self, path):
        plyvel = _plyvel()
        key = "leveldb:" + os.path.realpath(path)
        with _ENVS_LOCK:
            holder = _ENVS.get(key)
            if holder is None:
                try:
                    db = plyvel.DB(path, create_if_missing=False)
                except Exception as e:
                    raise DataError(f"cannot open LevelDB: {e}", path=path) from None
                holder = _ENVS[key] = _Env(db)
        self._holder = holder
        self.db = holder.env
        super().__init__(path)

    def _iter_keys(self):
        with self.db.iterator(include_value=False) as it:
            yield from it

    def _seek(self, key):
        st = self._local.__dict__
        st["it"] = self.db.iterator()
        st["it"].seek(key)
        st["item"] = next(st["it"])

    def _step(self):
        st = self._local.__dict__
        st["item"] = next(st["it"])

    def _value(self):
        return self._local.__dict__["item"][1]

    def items(self):
        with self.db.iterator() as it:
            yield from it

    def close(self):
        self._local = threading.local()
        self.db = self._holder = None


def open_db(path, backend="lmdb"):
    backend = str(backend).lower()
    if backend == "lmdb":
        return LMDBSource(path)
    if backend == "leveldb":
        return LevelDBSource(path)
    raise DataError(f"unknown database backend {backend!r} (lmdb or leveldb)", path=path)


def backend_name(value):
    """DataParameter.backend (enum) or a string to 'lmdb' / 'leveldb'."""
    if isinstance(value, str):
        return value.lower()
    return "lmdb" if value == caffe_pb2.DataParameter.LMDB else "leveldb"


# ---------------------------------------------------------------- list files
def root_prefix(root):
    """Caffe prepends root_folder to each listed path as a plain string; a folder given without
    its trailing slash gets one, so `images` and `images/` both work."""
    root = os.fspath(root or "")
    if root and not root.endswith(("/", os.sep)) and os.path.isdir(root):
        root += "/"
    return root


def read_image_list(path):
    """Caffe's ImageData list: each line "path label"; the label is after the last space, so
    paths may contain spaces."""
    entries = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            pos = line.rfind(" ")
            if pos < 0:
                raise DataError(f"line {n}: expected \"<path> <label>\", got {line!r}", path=path)
            try:
                label = int(line[pos + 1:])
            except ValueError:
                raise DataError(f"line {n}: label {line[pos + 1:]!r} is not an integer",
                                path=path) from None
            entries.append((line[:pos], label))
    return entries


def read_window_file(path):
    """Caffe's WindowData source: records of "# <image index>", the image path, its channels,
    height and width, a window count, then one "<label> <overlap> <x1> <y1> <x2> <y2>" per
    window (inclusive pixel corners), all whitespace-separated. Returns a list of
    (image path, (channels, height, width), windows as an N x 6 float64 array)."""
    tokens = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            tokens.extend((t, n) for t in line.split())
    pos = 0

    def take(what, kind=str):
        nonlocal pos
        if pos >= len(tokens):
            last = tokens[-1][1] if tokens else 1
            raise DataError(f"line {last}: file ends where {what} was expected", path=path)
        text, line = tokens[pos]
        pos += 1
        try:
            return kind(text)
        except ValueError:
            raise DataError(f"line {line}: {what} must be {kind.__name__}, got {text!r}",
                            path=path) from None

    images = []
    while pos < len(tokens):
        line = tokens[pos][1]
        if take("'#'") != "#":
            raise DataError(f"line {line}: expected '# <image index>' to start an image record",
                            path=path)
        take("image index", int)
        image = take("image path")
        size = tuple(take(what, int) for what in ("channels", "height", "width"))
        count = take("number of windows", int)
        windows = np.array([[take(what, kind) for what, kind in
                             (("label", int), ("overlap", float), ("x1", int), ("y1", int),
                              ("x2", int), ("y2", int))] for _ in range(count)],
                           np.float64).reshape(count, 6)
        images.append((image, size, windows))
    if not images:
        raise DataError("window file is empty", path=path)
    return images


def read_hdf5_list(path):
    """Caffe reads whitespace-separated file names from an HDF5Data source."""
    with open(path) as f:
        return f.read().split()


def _linear_taps(src, dst, clamp_weights):
    """OpenCV INTER_LINEAR source indices and 11-bit fixed-point weights along one axis. OpenCV
    zeroes the weight of an out-of-range tap along x, but along y only clips the row index."""
    f = ((np.arange(dst) + 0.5) * (src / dst) - 0.5).astype(np.float32)
    i0 = np.floor(f).astype(np.int64)
    f = f - i0
    if clamp_weights:
        low = i0 < 0
        f[low], i0[low] = 0, 0
        high = i0 >= src - 1
        f[high], i0[high] = 0, src - 1
    w1 = np.rint(f * 2048).astype(np.int64)
    return np.clip(i0, 0, src - 1), np.clip(i0 + 1, 0, src - 1), 2048 - w1, w1


def cv_resize(img, height, width):
    """cv::resize(INTER_LINEAR) of an HxWxC uint8 image in OpenCV's fixed-point arithmetic (as
    its SIMD code rounds); an exact 2x reduction is a 2x2 average, as OpenCV switches to
    INTER_AREA there."""
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    shape = (height, width) + img.shape[2:]
    if h == 2 * height and w == 2 * width:
        s = img.reshape(height, 2, width, 2, -1).astype(np.int32).sum(axis=(1, 3))
        return ((s + 2) >> 2).astype(np.uint8).reshape(shape)
    y0, y1, a0, a1 = _linear_taps(h, height, False)
    x0, x1, b0, b1 = _linear_taps(w, width, True)
    src = img.reshape(h, w, -1).astype(np.int64)
    rows = (src[:, x0] * b0[None, :, None] + src[:, x1] * b1[None, :, None]) >> 4
    out = ((rows[y0] * a0[:, None, None]) >> 16) + ((rows[y1] * a1[:, None, None]) >> 16)
    return np.clip((out + 2) >> 2, 0, 255).astype(np.uint8).reshape(shape)


def read_image(path, height=0, width=0, color=True):
    """Caffe's ReadImageToCVMat: HxWx3 BGR (or HxWx1 gray) uint8, resized when both height and
    width are given. Returns None when the file cannot be read as an image, as OpenCV does."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB" if color else "L"))
    except (OSError, UnidentifiedImageError):
        return None
    arr = np.ascontiguousarray(arr[:, :, ::-1]) if color else arr[:, :, None]
    if height > 0 and width > 0:
        arr = cv_resize(arr, height, width)
    return arr
