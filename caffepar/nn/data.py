"""Data-providing layers: Input and DummyData, and the dataset readers Data (LMDB/LevelDB),
ImageData, HDF5Data and MemoryData."""
import os
import threading

import h5py
import numpy as np

from caffepar import common
from caffepar.data.prefetch import PREFETCH_COUNT, Prefetcher, PrefetchError
from caffepar.data.sources import (backend_name, datum_array, open_db, parse_datum,
                                   read_hdf5_list, read_image, read_image_list, resolve_path,
                                   root_prefix)
from caffepar.data.transform import DataTransformer
from caffepar.errors import DataError
from caffepar.fillers import fill
from caffepar.nn.base import Layer, register
from caffepar.proto import caffe_pb2


def _shape_of(blob_shape):
    return tuple(int(d) for d in blob_shape.dim)


@register("Input")
class InputLayer(Layer):
    """Net inputs the caller fills; one shape given for all tops or one per top."""

    exact_bottoms = 0
    min_tops = 1

    def layer_setup(self, bottom, top):
        shapes = self.param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.error(f"input_param must give 0, 1 or {len(top)} shapes, got {len(shapes)}")
        for i, t in enumerate(top):
            if shapes:
                t.reshape(_shape_of(shapes[0] if len(shapes) == 1 else shapes[i]))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass


@register("DummyData")
class DummyDataLayer(Layer):
    """Tops filled by fillers: constant fillers once, others refilled every forward."""

    exact_bottoms = 0
    min_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.dummy_data_param
        n = len(top)
        if p.shape:
            shapes = [_shape_of(s) for s in p.shape]
        else:
            legacy = [p.num, p.channels, p.height, p.width]
            counts = {len(v) for v in legacy}
            if counts - {1, n}:
                raise self.error(f"num/channels/height/width must be given 1 or {n} times")
            shapes = [tuple(v[0] if len(v) == 1 else v[i] for v in legacy) for i in range(n)]
        if len(shapes) not in (1, n):
            raise self.error(f"dummy_data_param must give 1 or {n} shapes, got {len(shapes)}")
        fillers = list(p.data_filler)
        if len(fillers) not in (0, 1, n):
            raise self.error(f"dummy_data_param must give 0, 1 or {n} data_fillers")
        if not fillers:
            f = caffe_pb2.FillerParameter(type="constant", value=0)
            fillers = [f]
        self.fillers = [fillers[0] if len(fillers) == 1 else fillers[i] for i in range(n)]
        self.refill = [f.type != "constant" for f in self.fillers]
        for i, t in enumerate(top):
            t.reshape(shapes[0] if len(shapes) == 1 else shapes[i])
            t.data[...] = fill(self.fillers[i], t.shape, self.dtype)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        for f, again, t in zip(self.fillers, self.refill, top):
            if again:
                fill(f, t.shape, self.dtype, out=t.data)

    def backward(self, top, propagate_down, bottom):
        pass


# ==================================================================== dataset-reading layers
# Every batch is a pure function of its index: the rank's records come from one endless stream
# (record t of the stream is record t mod N of the source, epoch t // N), rank r of P takes stream
# positions r, r+P, r+2P, ... (Caffe's offset % size == rank rule), and every random choice is
# drawn from a generator seeded by (layer seed, epoch) or (layer seed, rank, batch). Prefetching,
# resuming and sharding then cannot change what a batch contains.


class _StreamingDataLayer(Layer):
    """Shared machinery of Data, ImageData and HDF5Data: sharded, resumable, prefetched batches.
    Subclasses set `self.batch_size`, `self.num_records` and implement `make_batch(index)`."""

    exact_bottoms = 0
    min_tops = 1
    uses_prefetch = True

    def resolve(self, path, what):
        """A path as Caffe opens it (working directory), else beside the net's prototxt."""
        if not path:
            raise self.error(f"no {what} given")
        found = resolve_path(path, getattr(self, "net_dir", None))
        if found is None:
            raise DataError(f"{what} not found: {path}", path=path, layer=self.name,
                             layer_type=self.param.type)
        return found

    def start_stream(self, depth=None, rand_skip=0):
        """Called at the end of layer_setup once batch_size and num_records are known."""
        rank, size = getattr(self, "shard", (0, 1))
        self.rank, self.world = int(rank), int(size)
        if not 0 <= self.rank < self.world:
            raise self.error(f"shard rank {rank} out of range for {size} ranks")
        self.positive(self.batch_size, "batch_size")
        self.seed = common.seed_for(self.name)
        self.skip = 0
        if rand_skip:
            self.skip = int(np.random.default_rng([self.seed, 1 << 20]).integers(rand_skip))
        self.data_wait_seconds = 0.0
        self._batch = 0
        self._prefetcher = None
        self._depth = depth
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- stream arithmetic
    def positions(self, index):
        """Stream positions of the records in batch `index` for this rank."""
        j = np.arange(self.batch_size, dtype=np.int64)
        return (index * self.batch_size + j) * self.world + self.rank + self.skip

    def epoch_and_record(self, positions):
        return np.divmod(np.asarray(positions, np.int64), self.num_records)

    def batch_rng(self, index):
        return np.random.default_rng([self.seed, self.rank, int(index)])

    def epoch_rng(self, epoch):
        return np.random.default_rng([self.seed, 1 << 21, int(epoch)])

    # ---------------------------------------------------------------- running
    def _ensure_prefetcher(self):
        if self._prefetcher is None:
            depth = self._depth or PREFETCH_COUNT
            self._prefetcher = Prefetcher(self.make_batch, self._batch, depth,
                                          name=f"data:{self.name}")

    def next_batch(self):
        """The arrays for the next batch; waits for the prefetcher (time accumulated)."""
        if self.uses_prefetch:
            self._ensure_prefetcher()
            try:
                arrays, waited = self._prefetcher.next()
            except PrefetchError as e:
                self._prefetcher = None
                cause = e.error
                if isinstance(cause, DataError):
                    if cause.layer is None:
                        cause.layer, cause.layer_type = self.name, self.param.type
                    raise cause from None
                raise self.error(f"reading batch {e.index} failed: "
                                 f"{type(cause).__name__}: {cause}") from cause
            self.data_wait_seconds += waited
        else:
            arrays = self.make_batch(self._batch)
        self._batch += 1
        return arrays

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        arrays = self.next_batch()
        for t, a in zip(top, arrays):
            t.reshape(a.shape)
            t.data[...] = a

    def backward(self, top, propagate_down, bottom):
        pass

    # ---------------------------------------------------------------- state
    def get_state(self):
        """Where the NEXT forward() reads: JSON-able, for resuming a run exactly."""
        first = int(self.positions(self._batch)[0]) if self.batch_size else 0
        epoch, record = divmod(first, self.num_records)
        return {"batch": self._batch, "epoch": epoch, "record": record, "skip": self.skip,
                "rank": self.rank, "world": self.world, "batch_size": self.batch_size}

    def set_state(self, state):
        """Continue from a get_state() result; read-ahead batches are dropped."""
        self.skip = int(state.get("skip", self.skip))
        self._batch = int(state["batch"])
        if self._prefetcher is not None:
            self._prefetcher.restart(self._batch)

    def reset_data_wait(self):
        """Return the data-wait seconds accumulated since the last reset, and reset them."""
        waited, self.data_wait_seconds = self.data_wait_seconds, 0.0
        return waited

    def close(self):
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __del__(self):
        p = getattr(self, "_prefetcher", None)
        if p is not None and p._stop is not None:
            p._stop.set()


@register("HDF5Data")
class HDF5DataLayer(_StreamingDataLayer):
    """Rows of the datasets named by the tops, across the files of a list file, as floats."""

    def layer_setup(self, bottom, top):
        p = self.param.hdf5_data_param
        if self.param.HasField("transform_param"):
            raise self.error("HDF5Data does not transform data; remove transform_param")
        source = self.resolve(p.source, "HDF5 source list")
        names = read_hdf5_list(source)
        if not names:
            raise DataError(f"no HDF5 file names listed in {p.source}", path=source,
                             layer=self.name, layer_type=self.param.type)
        base = os.path.dirname(os.path.abspath(source))
        self.files = []
        for n in names:
            found = self.resolve_listed(n, base)
            self.files.append(found)
        self.datasets = list(self.param.top)
        rows, shapes = [], None
        for f in self.files:
            r, s = self._inspect(f)
            if shapes is not None and s != shapes:
                raise DataError(f"datasets have shapes {s}, other files have {shapes}", path=f,
                                 layer=self.name, layer_type=self.param.type)
            shapes = s
            rows.append(r)
        self.rows = np.asarray(rows, np.int64)
        self.num_records = int(self.rows.sum())
        if self.num_records == 0:
            raise DataError("HDF5 files hold no rows", path=source, layer=self.name,
                             layer_type=self.param.type)
        self.shuffle = p.shuffle
        self.batch_size = p.batch_size
        self.start_stream()
        self._cache = {}
        for t, s in zip(top, shapes):
            t.reshape((self.batch_size,) + s)

    def resolve_listed(self, name, list_dir):
        found = resolve_path(name, getattr(self, "net_dir", None)) or \
            resolve_path(name, list_dir)
        if found is None:
            raise DataError(f"HDF5 file not found: {name}", path=name, layer=self.name,
                             layer_type=self.param.type)
        return found

    def _inspect(self, path):
        try:
            with h5py.File(path, "r") as f:
                shapes, rows = [], None
                for name in self.datasets:
                    if name not in f:
                        raise DataError(f'no dataset "{name}" (the file has: '
                                         f'{", ".join(sorted(f.keys()))})', path=path,
                                         layer=self.name, layer_type=self.param.type)
                    ds = f[name]
                    if ds.ndim < 1 or ds.dtype.kind not in "fiub":
                        raise DataError(f'dataset "{name}" must be numeric with >= 1 axis',
                                         path=path, layer=self.name, layer_type=self.param.type)
                    if rows is not None and ds.shape[0] != rows:
                        raise DataError(f'dataset "{name}" has {ds.shape[0]} rows, '
                                         f'"{self.datasets[0]}" has {rows}', path=path,
                                         layer=self.name, layer_type=self.param.type)
                    rows = ds.shape[0]
                    shapes.append(tuple(ds.shape[1:]))
        except OSError as e:
            raise DataError(f"cannot read HDF5 file: {e}", path=path, layer=self.name,
                             layer_type=self.param.type) from None
        return rows, tuple(shapes)

    def _load(self, k):
        with self._lock:
            arrays = self._cache.get(k)
            if arrays is None:
                with h5py.File(self.files[k], "r") as f:
                    arrays = [np.asarray(f[n], dtype=self.dtype) for n in self.datasets]
                if len(self._cache) >= 2:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[k] = arrays
            return arrays

    def _file_order(self, epoch):
        n = len(self.files)
        return self.epoch_rng(epoch).permutation(n) if self.shuffle and n > 1 else np.arange(n)

    def make_batch(self, index):
        epochs, records = self.epoch_and_record(self.positions(index))
        out = [np.empty((self.batch_size,) + a.shape[1:], self.dtype)
               for a in self._load(0)] if len(self.files) == 1 else None
        files = np.empty(self.batch_size, np.int64)
        rows = np.empty(self.batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            order = self._file_order(e)
            ends = np.cumsum(self.rows[order])
            slot = np.searchsorted(ends, records[sel], side="right")
            f = order[slot]
            r = records[sel] - (ends[slot] - self.rows[f])
            if self.shuffle:
                for k in np.unique(f):
                    perm = np.random.default_rng([self.seed, 1 << 22, int(e), int(k)]) \
                        .permutation(int(self.rows[k]))
                    r[f == k] = perm[r[f == k]]
            files[sel], rows[sel] = f, r
        for k in np.unique(files):
            arrays = self._load(int(k))
            if out is None:
                out = [np.empty((self.batch_size,) + a.shape[1:], self.dtype) for a in arrays]
            sel = files == k
            for o, a in zip(out, arrays):
                o[sel] = a[rows[sel]]
        return out


def _transformer(layer):
    """The layer's DataTransformer, its mean_file found as Caffe would (or beside the net)."""
    tp = layer.param.transform_param
    mean_file = layer.resolve(tp.mean_file, "mean_file") if tp.HasField("mean_file") else None
    try:
        return DataTransformer(tp, layer.phase, mean_file=mean_file, dtype=layer.dtype)
    except DataError as e:
        raise layer.error(e.message) from None


def _stack(layer, images, what):
    shapes = {a.shape for a in images}
    if len(shapes) > 1:
        raise layer.error(f"{what} of one batch differ in shape ({', '.join(sorted(map(str, shapes)))});"
                          " use batch_size 1 or images of one size")
    return np.stack(images)


def open_data_source(layer, p):
    """The database of data_param `p`'s source for `layer`, or a DataError naming the layer
    (with a hint where an LMDB is read as LevelDB)."""
    source = layer.resolve(p.source, "data source")
    try:
        return open_db(source, backend_name(p.backend))
    except DataError as e:
        hint = None
        if backend_name(p.backend) == "leveldb" and \
                os.path.exists(os.path.join(source, "data.mdb")):
            hint = "the source looks like an LMDB: set data_param { backend: LMDB }"
        raise DataError(e.message, path=source, layer=layer.name,
                        layer_type=layer.param.type, hint=hint) from None


@register("Data")
class DataLayer(_StreamingDataLayer):
    """Datums from an LMDB or LevelDB, transformed; tops: data and optionally label."""

    max_tops = 2

    def layer_setup(self, bottom, top):
        p = self.param.data_param
        self.transformer = _transformer(self)
        self.db = open_data_source(self, p)
        self.num_records = len(self.db)
        self.batch_size = p.batch_size
        self.output_labels = len(top) > 1
        self.start_stream(depth=p.prefetch, rand_skip=p.rand_skip)
        first = datum_array(parse_datum(self.db.get(int(self.positions(0)[0]) % self.num_records)),
                            self.transformer.decode_color)
        try:
            shape = self.transformer.output_shape(*first.shape)
        except DataError as e:
            raise self.error(e.message) from None
        top[0].reshape((self.batch_size,) + shape)
        if self.output_labels:
            top[1].reshape((self.batch_size,))

    def make_batch(self, index):
        _, records = self.epoch_and_record(self.positions(index))
        color = self.transformer.decode_color
        datums = [parse_datum(self.db.get(int(r))) for r in records]
        images = _stack(self, [datum_array(d, color) for d in datums], "records")
        data = self.transformer(images, self.batch_rng(index))
        if not self.output_labels:
            return [data]
        return [data, np.fromiter((d.label for d in datums), self.dtype, len(datums))]


@register("ImageData")
class ImageDataLayer(_StreamingDataLayer):
    """Images named in a list file ("path label" lines), read as BGR (or gray), resized when
    new_height/new_width are set, transformed; tops: data and label."""

    exact_tops = 2

    def layer_setup(self, bottom, top):
        p = self.param.image_data_param
        if (p.new_height > 0) != (p.new_width > 0):
            raise self.error("new_height and new_width must be set together")
        source = self.resolve(p.source, "image list")
        self.lines = read_image_list(source)
        if not self.lines:
            raise DataError("image list is empty", path=source, layer=self.name,
                             layer_type=self.param.type)
        self.root = root_prefix(p.root_folder)
        self.labels = np.asarray([lab for _, lab in self.lines], self.dtype)
        self.num_records = len(self.lines)
        self.batch_size = p.batch_size
        self.shuffle = p.shuffle
        self.size = (p.new_height, p.new_width)
        self.color = p.is_color
        self.transformer = _transformer(self)
        self.start_stream(depth=self.param.data_param.prefetch, rand_skip=p.rand_skip)
        first = self.read(self.records(self.positions(0)[:1])[0])
        try:
            shape = self.transformer.output_shape(*first.shape)
        except DataError as e:
            raise self.error(e.message) from None
        top[0].reshape((self.batch_size,) + shape)
        top[1].reshape((self.batch_size,))

    def records(self, positions):
        epochs, idx = self.epoch_and_record(positions)
        if not self.shuffle:
            return idx
        out = np.empty_like(idx)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.epoch_rng(e).permutation(self.num_records)[idx[sel]]
        return out

    def read(self, i):
        path = self.root + self.lines[i][0]
        found = resolve_path(path, getattr(self, "net_dir", None))
        img = read_image(found, *self.size, color=self.color) if found else None
        if img is None:
            raise DataError(f"could not load image {path}", path=path, layer=self.name,
                             layer_type=self.param.type)
        return img.transpose(2, 0, 1)

    def make_batch(self, index):
        recs = self.records(self.positions(index))
        images = _stack(self, [self.read(int(r)) for r in recs], "images")
        return [self.transformer(images, self.batch_rng(index)), self.labels[recs]]


@register("HDF5Output")
class HDF5OutputLayer(Layer):
    """Saves its two bottoms into an HDF5 file as the datasets "data" and "label", each as 4-D
    (Caffe's num, channels, height, width): features or predictions written out by a forward
    pass. The file is created empty at setup, as Caffe creates it; every forward replaces both
    datasets with its batch (Caffe's layer fails at a second forward, the names being taken). In
    a P-rank run rank r writes its share of the batch to NAME.rank<r>.EXT."""

    exact_bottoms = 2
    exact_tops = 0

    def layer_setup(self, bottom, top):
        name = self.param.hdf5_output_param.file_name
        if not name:
            raise self.error("hdf5_output_param { file_name } is required")
        rank, size = getattr(self, "shard", (0, 1))
        if size > 1:
            stem, ext = os.path.splitext(name)
            name = f"{stem}.rank{rank}{ext}"
        self.path = name
        self._write({})

    def reshape(self, bottom, top):
        if bottom[0].num != bottom[1].num:
            raise self.error(f"data and label must have the same num: bottoms have "
                             f"{bottom[0].shape} and {bottom[1].shape}")

    def _write(self, datasets):
        try:
            with h5py.File(self.path, "w") as f:
                for key, array in datasets.items():
                    f.create_dataset(key, data=array)
        except OSError as e:
            raise DataError(f"cannot write HDF5 output: {e}", path=self.path, layer=self.name,
                            layer_type=self.param.type) from None

    def forward(self, bottom, top):
        self._write({key: b.data.reshape([b.legacy_shape(i) for i in range(4)])
                     for key, b in zip(("data", "label"), bottom)})

    def backward(self, top, propagate_down, bottom):
        pass


@register("MemoryData")
class MemoryDataLayer(Layer):
    """Batches from arrays given with reset(data, labels, n), as pycaffe's set_input_arrays;
    no transformation is applied to them (as in Caffe)."""

    exact_bottoms = 0
    exact_tops = 2
    data_wait_seconds = 0.0

    def layer_setup(self, bottom, top):
        p = self.param.memory_data_param
        self.batch_size, self.channels = int(p.batch_size), int(p.channels)
        self.height, self.width = int(p.height), int(p.width)
        if min(self.batch_size, self.channels, self.height, self.width) <= 0:
            raise self.error("batch_size, channels, height and width must be specified and "
                             "positive in memory_data_param")
        top[0].reshape(self.batch_size, self.channels, self.height, self.width)
        top[1].reshape(self.batch_size)
        self.data = None
        self.labels = None
        self.n = 0
        self.pos = 0

    def reset(self, data, labels, n):
        """Serve `n` items of `data` (n x C x H x W) and `labels` batch by batch, cyclically."""
        n = int(n)
        if data is None or labels is None:
            raise self.error("reset needs data and labels")
        if n <= 0 or n % self.batch_size:
            raise self.error(f"n ({n}) must be a positive multiple of batch_size "
                             f"({self.batch_size})")
        self.data = np.asarray(data).reshape(-1, self.channels, self.height, self.width)
        self.labels = np.asarray(labels).reshape(-1)
        if len(self.data) < n or len(self.labels) < n:
            raise self.error(f"reset with n={n} but only {len(self.data)} data and "
                             f"{len(self.labels)} labels")
        self.n = n
        self.pos = 0

    def set_batch_size(self, new_size):
        self.batch_size = self.positive(int(new_size), "batch_size")

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        if self.data is None:
            raise self.error("needs data: call reset() (pycaffe: net.set_input_arrays) first")
        b, s = self.batch_size, self.pos
        top[0].reshape(b, self.channels, self.height, self.width)
        top[1].reshape(b, 1, 1, 1)
        top[0].data[...] = self.data[s:s + b]
        top[1].data[...] = self.labels[s:s + b].reshape(b, 1, 1, 1)
        self.pos = (s + b) % self.n

    def backward(self, top, propagate_down, bottom):
        pass

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = int(state["pos"])

    def reset_data_wait(self):
        return 0.0

    def close(self):
        pass
