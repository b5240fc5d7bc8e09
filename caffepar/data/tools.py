"""Caffe's data tools: convert_cifar_data, convert_mnist_data, convert_imageset and
compute_image_mean, writing the same keys and Datum bytes as Caffe's tools.

Each returns the number of records written (or read) and shows a progress bar when stderr is a
terminal.
"""
import glob
import gzip
import io
import lzma
import os
import sys
import time

import numpy as np

from caffepar.data.sources import (open_db, parse_datum, read_image, read_image_list,
                                   root_prefix)
from caffepar.errors import DataError, MissingFileError
from caffepar.proto import caffe_pb2

CIFAR_SIZE = 32
CIFAR_IMAGE_BYTES = 3 * CIFAR_SIZE * CIFAR_SIZE
CIFAR_BATCH = 10000
COMMIT_EVERY = 1000


class Progress:
    """A one-line progress bar on stderr, drawn only on a terminal and at most ~10 times/s."""

    def __init__(self, total, label, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total = max(int(total), 0)
        self.label = label
        self.done = 0
        self._last = 0.0

    def update(self, n=1):
        self.done += n
        if self.enabled and (time.monotonic() - self._last > 0.1 or self.done >= self.total):
            self._last = time.monotonic()
            self._draw()

    def _draw(self):
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            text = f"\r{self.label} [{bar:<30}] {self.done}/{self.total}"
        else:
            text = f"\r{self.label} {self.done}"
        self.stream.write(text)
        self.stream.flush()

    def close(self):
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- writing databases
class _Writer:
    """Puts key/value pairs into a new LMDB or LevelDB, committing every 1000 records as
    Caffe's tools do. Refuses an existing destination (Caffe's db::NEW)."""

    def __init__(self, path, backend="lmdb"):
        self.path = os.fspath(path)
        self.backend = backend.lower()
        if os.path.exists(self.path):
            raise DataError("destination already exists; remove it first", path=self.path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise MissingFileError(parent, "output folder")
        if self.backend == "lmdb":
            import lmdb
            self.db = lmdb.open(self.path, map_size=1 << 40, subdir=True, meminit=False,
                                map_async=True)
            self.txn = self.db.begin(write=True)
        elif self.backend == "leveldb":
            from caffepar.data.sources import _plyvel
            self.db = _plyvel().DB(self.path, create_if_missing=True, error_if_exists=True)
            self.txn = self.db.write_batch()
        else:
            raise DataError(f"unknown database backend {backend!r} (lmdb or leveldb)")
        self.count = 0

    def put(self, key, value):
        if isinstance(key, str):
            key = key.encode()
        self.txn.put(key, value)
        self.count += 1
        if self.count % COMMIT_EVERY == 0:
            self._commit(reopen=True)

    def _commit(self, reopen):
        if self.backend == "lmdb":
            self.txn.commit()
            self.txn = self.db.begin(write=True) if reopen else None
        else:
            self.txn.write()
            self.txn = self.db.write_batch() if reopen else None

    def close(self):
        self._commit(reopen=False)
        if self.backend == "lmdb":
            self.db.sync(True)
        self.db.close()


def _raw_datum(pixels, label, channels, height, width):
    d = caffe_pb2.Datum()
    d.channels, d.height, d.width = channels, height, width
    d.data = pixels
    d.label = label
    return d


# ---------------------------------------------------------------- CIFAR-10
def _read_maybe_compressed(path):
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(os.path.splitext(path)[1], open)
    with opener(path, "rb") as f:
        return f.read()


def _find_batch(src_dir, stem):
    """data_batch_1.bin, or a compressed / partial variant such as data_batch_1.first1102.bin.xz."""
    for pattern in (f"{stem}.bin", f"{stem}.bin.xz", f"{stem}.bin.gz", f"{stem}.*bin",
                    f"{stem}.*bin.xz", f"{stem}.*bin.gz"):
        found = sorted(glob.glob(os.path.join(glob.escape(os.fspath(src_dir)), pattern)))
        if found:
            return found[0]
    raise MissingFileError(os.path.join(os.fspath(src_dir), f"{stem}.bin"), "CIFAR-10 batch")


def _cifar_records(path):
    raw = _read_maybe_compressed(path)
    rec = CIFAR_IMAGE_BYTES + 1
    if len(raw) % rec:
        raise DataError(f"size {len(raw)} is not a multiple of {rec}-byte CIFAR records",
                        path=path)
    return np.frombuffer(raw, np.uint8).reshape(-1, rec)


def convert_cifar10(src_dir, dst_dir, backend="lmdb"):
    """convert_cifar_data: data_batch_1..5 -> cifar10_train_<backend>, test_batch ->
    cifar10_test_<backend>; raw 3x32x32 Datums keyed %05d of batch*10000 + item."""
    if not os.path.isdir(src_dir):
        raise MissingFileError(src_dir, "CIFAR-10 folder")
    train = [_cifar_records(_find_batch(src_dir, f"data_batch_{i}")) for i in range(1, 6)]
    test = _cifar_records(_find_batch(src_dir, "test_batch"))
    stride = max([CIFAR_BATCH] + [len(r) for r in train])
    total = 0
    for name, batches in ((f"cifar10_train_{backend}", train), (f"cifar10_test_{backend}", [test])):
        out = _Writer(os.path.join(dst_dir, name), backend)
        with Progress(sum(len(b) for b in batches), name) as bar:
            for fileid, recs in enumerate(batches):
                for item, row in enumerate(recs):
                    datum = _raw_datum(row[1:].tobytes(), int(row[0].view(np.int8)), 3,
                                       CIFAR_SIZE, CIFAR_SIZE)
                    out.put("%05d" % (fileid * stride + item), datum.SerializeToString())
                    bar.update()
        total += out.count
        out.close()
    return total


# ---------------------------------------------------------------- MNIST
def _idx(path, magic):
    if not os.path.exists(path):
        raise MissingFileError(path, "MNIST file")
    raw = _read_maybe_compressed(path)
    head = np.frombuffer(raw[:4], ">u4")[0]
    if head != magic:
        raise DataError(f"incorrect magic {head}, expected {magic}", path=path)
    ndim = 3 if magic == 2051 else 1
    dims = [int(d) for d in np.frombuffer(raw[4:4 + 4 * ndim], ">u4")]
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size < int(np.prod(dims)):
        raise DataError(f"file is truncated: {data.size} bytes for shape {dims}", path=path)
    return data[:int(np.prod(dims))].reshape(dims)


def convert_mnist(images, labels, db, backend="lmdb"):
    """convert_mnist_data: idx image and label files (.gz accepted) -> raw 1xRxC Datums
    keyed %08d."""
    imgs = _idx(images, 2051)
    labs = _idx(labels, 2049)
    if len(imgs) != len(labs):
        raise DataError(f"{len(imgs)} images but {len(labs)} labels", path=labels)
    _, rows, cols = imgs.shape
    out = _Writer(db, backend)
    with Progress(len(imgs), os.path.basename(os.fspath(db))) as bar:
        for i in range(len(imgs)):
            datum = _raw_datum(imgs[i].tobytes(), int(labs[i:i + 1].view(np.int8)[0]), 1, rows,
                               cols)
            out.put("%08d" % i, datum.SerializeToString())
            bar.update()
    out.close()
    return out.count


# ---------------------------------------------------------------- image sets
def _match_ext(name, enc):
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else name.lower()
    enc = enc.lower()
    return ext == enc or (enc == "jpg" and ext == "jpeg")


def _encode(img, enc):
    """cv::imencode of a BGR / gray HxWxC uint8 image (JPEG quality 95 as OpenCV's default)."""
    from PIL import Image
    arr = img[:, :, 0] if img.shape[2] == 1 else img[:, :, ::-1]
    fmt = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "bmp": "BMP", "tif": "TIFF",
           "tiff": "TIFF", "ppm": "PPM", "pgm": "PPM"}.get(enc.lower())
    if fmt is None:
        raise DataError(f"cannot encode images as {enc!r}")
    buf = io.BytesIO()
    kwargs = {"quality": 95} if fmt == "JPEG" else {}
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def image_datum(path, label, height=0, width=0, color=True, encoding=""):
    """Caffe's ReadImageToDatum; None when the image cannot be read."""
    img = read_image(path, height, width, color)
    if img is None:
        return None
    datum = caffe_pb2.Datum()
    if encoding:
        if not height and not width and _match_ext(path, encoding):
            with open(path, "rb") as f:
                datum.data = f.read()
        else:
            datum.data = _encode(img, encoding)
        datum.label = label
        datum.encoded = True
        return datum
    h, w, c = img.shape
    datum.channels, datum.height, datum.width = c, h, w
    datum.encoded = False
    datum.data = np.ascontiguousarray(img.transpose(2, 0, 1)).tobytes()
    datum.label = label
    return datum


def convert_imageset(root, list_file, db, resize_height=0, resize_width=0, shuffle=False,
                     encoded=False, gray=False, encode_type="", backend="lmdb", check_size=False,
                     seed=None):
    """convert_imageset: images named in a "path label" list (relative to `root`, which is
    prepended as a string, as Caffe does) -> Datums keyed %08d_<path>. Unreadable images are
    skipped with a warning, as Caffe does."""
    if not os.path.exists(list_file):
        raise MissingFileError(list_file, "image list")
    lines = read_image_list(list_file)
    if shuffle:
        from caffepar import common
        rng = np.random.default_rng(common.seed_for("convert_imageset") if seed is None else seed)
        lines = [lines[i] for i in rng.permutation(len(lines))]
    encoded = encoded or bool(encode_type)
    resize_height, resize_width = max(0, resize_height), max(0, resize_width)
    root = root_prefix(root)
    out = _Writer(db, backend)
    size = None
    with Progress(len(lines), os.path.basename(os.fspath(db))) as bar:
        for line_id, (name, label) in enumerate(lines):
            enc = encode_type
            if encoded and not enc:
                enc = name.rsplit(".", 1)[-1].lower() if "." in name else ""
            datum = image_datum(root + name, label, resize_height, resize_width, not gray, enc)
            bar.update()
            if datum is None:
                print(f"warning: could not read image {root + name}; skipped", file=sys.stderr)
                continue
            if check_size:
                n = datum.channels * datum.height * datum.width
                size = n if size is None else size
                if len(datum.data) != size:
                    out.close()
                    raise DataError(f"incorrect data field size {len(datum.data)} "
                                    f"(expected {size})", path=root + name)
            out.put("%08d_%s" % (line_id, name), datum.SerializeToString())
    out.close()
    return out.count


# ---------------------------------------------------------------- mean image
def _datum_values(datum):
    if datum.encoded:
        from caffepar.data.sources import decode_image_bytes
        img = decode_image_bytes(datum.data, None)
        img = img[:, :, None] if img.ndim == 2 else img
        return img.transpose(2, 0, 1), img.shape[2], img.shape[0], img.shape[1]
    if datum.data:
        return np.frombuffer(datum.data, np.uint8), datum.channels, datum.height, datum.width
    return np.asarray(datum.float_data, np.float32), datum.channels, datum.height, datum.width


def image_mean(db, backend="lmdb"):
    """The CxHxW float32 mean of every record of a database and the record count, accumulated
    one record at a time in float32 as Caffe's compute_image_mean does (so it matches Caffe's
    to the bit)."""
    db = os.fspath(db)
    if not os.path.exists(db):
        raise MissingFileError(db, "database")
    src = open_db(db, backend)
    acc, shape, count = None, None, 0
    try:
        with Progress(len(src), os.path.basename(db)) as bar:
            for _key, value in src.items():
                values, c, h, w = _datum_values(parse_datum(value))
                values = values.reshape(-1)
                if acc is None:
                    acc, shape = np.zeros(values.size, np.float32), (c, h, w)
                if values.size != acc.size:
                    raise DataError(f"record {count} has {values.size} values, the first has "
                                    f"{acc.size}", path=db)
                acc += values.astype(np.float32)
                count += 1
                bar.update()
    finally:
        src.close()
    return (acc / np.float32(count)).reshape(shape), count


def write_mean(mean, path):
    """A CxHxW mean as Caffe writes it: BlobProto with legacy num/channels/height/width."""
    blob = caffe_pb2.BlobProto()
    blob.num, (blob.channels, blob.height, blob.width) = 1, mean.shape
    blob.data.extend(np.asarray(mean, np.float32).reshape(-1).tolist())
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob.SerializeToString())
    os.replace(tmp, path)


def compute_image_mean(db, out_binaryproto=None, backend="lmdb"):
    """compute_image_mean: writes the mean image to `out_binaryproto` (when given); returns
    the number of records."""
    mean, count = image_mean(db, backend)
    if out_binaryproto is not None:
        write_mean(mean, out_binaryproto)
    return count
