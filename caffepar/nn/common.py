"""Layers that move, combine or reduce blobs rather than transform single values: Softmax,
Concat, Slice, Split, Eltwise, Flatten, Reshape, Crop, Tile, Reduction, Silence, ArgMax,
BatchReindex, Filter, Parameter, Embed, Bias and Scale."""
from functools import partial

import numpy as np

from caffepar.blob import canonical_axis
from caffepar.nn import native
from caffepar.nn.base import Layer, register
from caffepar.nn.blas import channel_parts, run_parts
from caffepar.nn.neuron import relu_forward
from caffepar.nn.prepared import sequence, view_as
from caffepar.proto import caffe_pb2


def _count(shape, start=0, end=None):
    return int(np.prod(shape[start:end], dtype=np.int64))


def _axis(layer, axis, num_axes, what="axis"):
    try:
        return canonical_axis(axis, num_axes)
    except ValueError:
        raise layer.error(f"{what} {axis} out of range for a {num_axes}-D bottom blob") from None


@register("Softmax")
class SoftmaxLayer(Layer):
    """exp(x - max) / sum over `axis`."""

    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        self.axis = _axis(self, self.param.softmax_param.axis, bottom[0].num_axes)
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        np.subtract(x, x.max(axis=self.axis, keepdims=True), out=y)
        np.exp(y, out=y)
        y /= y.sum(axis=self.axis, keepdims=True)

    def prepare_forward(self, bottom, top):
        x, y, axis = bottom[0].data, top[0].data, self.axis
        m = np.empty(x.shape[:axis] + (1,) + x.shape[axis + 1:], x.dtype)

        def run():
            np.maximum.reduce(x, axis=axis, keepdims=True, out=m)
            np.subtract(x, m, out=y)
            np.exp(y, out=y)
            np.add.reduce(y, axis=axis, keepdims=True, out=m)
            np.divide(y, m, out=y)
        return run

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y, dy = top[0].data, top[0].diff
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        dx = bottom[0].diff
        np.subtract(dy, dot, out=dx)
        dx *= y


def _blob_slices(ndim, axis, start, stop):
    index = [slice(None)] * ndim
    index[axis] = slice(start, stop)
    return tuple(index)


@register("Concat")
class ConcatLayer(Layer):
    """Joins bottoms along `axis` (legacy `concat_dim`)."""

    min_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.concat_param
        if p.HasField("axis") and p.HasField("concat_dim"):
            raise self.error("give either axis or concat_dim, not both")

    def reshape(self, bottom, top):
        p = self.param.concat_param
        n = bottom[0].num_axes
        if p.HasField("concat_dim"):
            if p.concat_dim >= n:
                raise self.error(f"concat_dim {p.concat_dim} out of range for a {n}-D blob")
            self.axis = int(p.concat_dim)
        else:
            self.axis = _axis(self, p.axis, n)
        shape = list(bottom[0].shape)
        for i, b in enumerate(bottom[1:], 1):
            if b.num_axes != n:
                raise self.error(f"all bottoms must have the same number of axes: bottom 0 is "
                                 f"{bottom[0].shape}, bottom {i} is {b.shape}")
            for j in range(n):
                if j != self.axis and b.shape[j] != shape[j]:
                    raise self.error(f"bottoms must match except on the concat axis {self.axis}: "
                                     f"bottom 0 is {bottom[0].shape}, bottom {i} is {b.shape}")
            shape[self.axis] += b.shape[self.axis]
        top[0].reshape(shape)

    def forward(self, bottom, top):
        if len(bottom) == 1:
            top[0].data[...] = bottom[0].data
            return
        np.concatenate([b.data for b in bottom], axis=self.axis, out=top[0].data)

    def parts(self, bottom, top):
        """The views of top[0]'s data that hold each bottom."""
        y, offset, views = top[0].data, 0, []
        for b in bottom:
            size = b.shape[self.axis]
            views.append(y[_blob_slices(y.ndim, self.axis, offset, offset + size)])
            offset += size
        return views

    def prepare_forward(self, bottom, top, copied=None):
        """The forward copying the bottoms whose positions are in `copied` (default: all)."""
        views = self.parts(bottom, top)
        pairs = [(v, b.data) for j, (v, b) in enumerate(zip(views, bottom))
                 if copied is None or j in copied]
        if copied is None and len(bottom) > 1:
            return partial(np.concatenate, [b.data for b in bottom], axis=self.axis,
                           out=top[0].data)
        return sequence([partial(np.copyto, v, x) for v, x in pairs])

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        offset = 0
        for b, down in zip(bottom, propagate_down):
            size = b.shape[self.axis]
            if down:
                b.diff[...] = dy[_blob_slices(dy.ndim, self.axis, offset, offset + size)]
            offset += size


@register("Slice")
class SliceLayer(Layer):
    """Cuts the bottom along `axis` (legacy `slice_dim`) at `slice_point`s, or into equal
    parts when none are given."""

    exact_bottoms = 1
    min_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.slice_param
        if p.HasField("axis") and p.HasField("slice_dim"):
            raise self.error("give either axis or slice_dim, not both")

    def reshape(self, bottom, top):
        p = self.param.slice_param
        n = bottom[0].num_axes
        if p.HasField("slice_dim"):
            if p.slice_dim >= n:
                raise self.error(f"slice_dim {p.slice_dim} out of range for a {n}-D blob")
            self.axis = int(p.slice_dim)
        else:
            self.axis = _axis(self, p.axis, n)
        total = bottom[0].shape[self.axis]
        points = list(p.slice_point)
        if points:
            if len(points) != len(top) - 1:
                raise self.error(f"{len(top)} tops need {len(top) - 1} slice_point values, got "
                                 f"{len(points)}")
            prev = 0
            sizes = []
            for sp in points:
                if sp <= prev:
                    raise self.error(f"slice_point values must increase and be > 0, got {points}")
                sizes.append(sp - prev)
                prev = sp
            if prev >= total:
                raise self.error(f"slice_point {prev} is beyond the slice axis size {total}")
            sizes.append(total - prev)
        else:
            if total % len(top):
                raise self.error(f"{len(top)} tops do not evenly divide the slice axis size "
                                 f"{total} (bottom shape {bottom[0].shape})")
            sizes = [total // len(top)] * len(top)
        self.sizes = sizes
        shape = list(bottom[0].shape)
        for t, size in zip(top, sizes):
            shape[self.axis] = size
            t.reshape(shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        offset = 0
        for t, size in zip(top, self.sizes):
            t.data[...] = x[_blob_slices(x.ndim, self.axis, offset, offset + size)]
            offset += size

    def prepare_forward(self, bottom, top):
        x, offset, calls = bottom[0].data, 0, []
        for t, size in zip(top, self.sizes):
            calls.append(partial(np.copyto, t.data,
                                 x[_blob_slices(x.ndim, self.axis, offset, offset + size)]))
            offset += size
        return sequence(calls)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        offset = 0
        for t, size in zip(top, self.sizes):
            dx[_blob_slices(dx.ndim, self.axis, offset, offset + size)] = t.diff
            offset += size


@register("Split")
class SplitLayer(Layer):
    """Every top shares the bottom's data; the bottom's diff is the sum of the top diffs."""

    exact_bottoms = 1
    min_tops = 1

    def reshape(self, bottom, top):
        for i, t in enumerate(top):
            if t is bottom[0]:
                raise self.error(f"does not allow in-place computation (top {i} is the bottom)")
            t.reshape(bottom[0].shape)

    def forward(self, bottom, top):
        for t in top:
            t.data = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        if len(top) == 1:
            dx[...] = top[0].diff
            return
        np.add(top[0].diff, top[1].diff, out=dx)
        for t in top[2:]:
            dx += t.diff


@register("Eltwise")
class EltwiseLayer(Layer):
    """Element-wise PROD, SUM (with per-bottom coefficients) or MAX of equally shaped bottoms."""

    min_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.eltwise_param
        E = caffe_pb2.EltwiseParameter
        self.op = p.operation
        if p.coeff and len(p.coeff) != len(bottom):
            raise self.error(f"takes one coeff per bottom blob: {len(bottom)} bottoms, "
                             f"{len(p.coeff)} coeff values")
        if p.coeff and self.op != E.SUM:
            raise self.error("coeff is only allowed with operation SUM")
        self.coeffs = [float(c) for c in p.coeff] if p.coeff else [1.0] * len(bottom)
        self.stable_prod_grad = p.stable_prod_grad
        self.max_idx = None

    def reshape(self, bottom, top):
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != bottom[0].shape:
                raise self.error(f"bottoms must have the same shape: bottom 0 is "
                                 f"{bottom[0].shape}, bottom {i} is {b.shape}")
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        E = caffe_pb2.EltwiseParameter
        y = top[0].data
        if self.op == E.PROD:
            np.multiply(bottom[0].data, bottom[1].data, out=y)
            for b in bottom[2:]:
                y *= b.data
        elif self.op == E.SUM:
            aliased = any(b is top[0] for b in bottom)
            acc = np.empty_like(y) if aliased else y
            np.multiply(bottom[0].data, self.dtype.type(self.coeffs[0]), out=acc)
            for b, c in zip(bottom[1:], self.coeffs[1:]):
                if c == 1:
                    acc += b.data
                else:
                    acc += b.data * self.dtype.type(c)
            if aliased:
                y[...] = acc
        elif self.op == E.MAX:
            a, b = bottom[0].data, bottom[1].data
            idx = np.where(a > b, 0, 1).astype(np.int32)
            best = np.where(a > b, a, b)
            for i, blob in enumerate(bottom[2:], 2):
                better = blob.data > best
                idx[better] = i
                np.copyto(best, blob.data, where=better)
            self.max_idx = idx
            y[...] = best
        else:
            raise self.error(f"unknown eltwise operation {self.op}")

    def prepare_forward(self, bottom, top):
        """SUM and PROD (MAX keeps its winners for backward: it runs as itself)."""
        E = caffe_pb2.EltwiseParameter
        xs, y = [b.data for b in bottom], top[0].data
        if self.op not in (E.SUM, E.PROD) or any(np.may_share_memory(x, y) for x in xs):
            return None
        if self.op == E.PROD:
            return sequence([partial(np.multiply, xs[0], xs[1], out=y)] +
                            [partial(np.multiply, y, x, out=y) for x in xs[2:]])
        c = [self.dtype.type(v) for v in self.coeffs]
        if all(v == 1 for v in c):
            return sequence([partial(np.add, xs[0], xs[1], out=y)] +
                            [partial(np.add, y, x, out=y) for x in xs[2:]])
        t = np.empty(y.shape, y.dtype)
        calls = [partial(np.multiply, xs[0], c[0], out=y)]
        for x, v in zip(xs[1:], c[1:]):
            if v == 1:
                calls.append(partial(np.add, y, x, out=y))
            else:
                calls += [partial(np.multiply, x, v, out=t), partial(np.add, y, t, out=y)]
        return sequence(calls)

    def backward(self, top, propagate_down, bottom):
        E = caffe_pb2.EltwiseParameter
        y, dy = top[0].data, top[0].diff
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                continue
            if self.op == E.PROD:
                if self.stable_prod_grad:
                    others = [o.data for j, o in enumerate(bottom) if j != i]
                    g = others[0].copy()
                    for o in others[1:]:
                        g *= o
                else:
                    g = y / b.data
                np.multiply(g, dy, out=b.diff)
            elif self.op == E.SUM:
                if self.coeffs[i] == 1:
                    b.diff[...] = dy
                else:
                    np.multiply(dy, self.dtype.type(self.coeffs[i]), out=b.diff)
            else:
                np.multiply(dy, self.max_idx == i, out=b.diff)


class _ViewLayer(Layer):
    """A top that is the bottom under another shape: the data is shared, the diff copied back."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        if top[0] is bottom[0]:
            raise self.error("does not allow in-place computation")

    def top_shape(self, bottom):
        raise NotImplementedError

    def reshape(self, bottom, top):
        shape = self.top_shape(bottom)
        if _count(shape) != bottom[0].count:
            raise self.error(f"output count {_count(shape)} (shape {tuple(shape)}) must match "
                             f"input count {bottom[0].count} (shape {bottom[0].shape})")
        top[0].reshape(shape)
        top[0].data = bottom[0].data.reshape(shape)

    def forward(self, bottom, top):
        top[0].data = bottom[0].data.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0] and not np.shares_memory(bottom[0].diff, top[0].diff):
            bottom[0].diff[...] = top[0].diff.reshape(bottom[0].shape)


@register("Flatten")
class FlattenLayer(_ViewLayer):
    """Merges axes `axis`..`end_axis` into one."""

    def top_shape(self, bottom):
        p = self.param.flatten_param
        shape = bottom[0].shape
        start = _axis(self, p.axis, len(shape))
        end = _axis(self, p.end_axis, len(shape), "end_axis")
        return shape[:start] + (_count(shape, start, end + 1),) + shape[end + 1:]


@register("Reshape")
class ReshapeLayer(_ViewLayer):
    """Replaces axes [axis, axis + num_axes) by `shape`; 0 copies the bottom's dimension and
    a single -1 is inferred from the count."""

    def layer_setup(self, bottom, top):
        super().layer_setup(bottom, top)
        dims = list(self.param.reshape_param.shape.dim)
        self.copy_axes = [i for i, d in enumerate(dims) if d == 0]
        inferred = [i for i, d in enumerate(dims) if d == -1]
        if len(inferred) > 1:
            raise self.error(f"new shape contains more than one -1: {dims}")
        bad = [d for d in dims if d < -1]
        if bad:
            raise self.error(f"shape dimensions must be >= -1, got {dims}")
        self.inferred_axis = inferred[0] if inferred else -1
        self.dims = dims

    def top_shape(self, bottom):
        p = self.param.reshape_param
        shape = bottom[0].shape
        n = len(shape)
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if not 0 <= start <= n:
            raise self.error(f"axis {p.axis} out of range for a {n}-D bottom blob")
        if p.num_axes < -1:
            raise self.error(f"num_axes must be >= 0, or -1 for all, got {p.num_axes}")
        end = n if p.num_axes == -1 else start + p.num_axes
        if end > n:
            raise self.error(f"axis + num_axes = {end} is beyond the {n} bottom axes")
        out = list(shape[:start]) + list(self.dims) + list(shape[end:])
        for i in self.copy_axes:
            if start + i >= n:
                raise self.error(f"new shape has a 0 at position {i} but the bottom "
                                 f"{shape} has no axis {start + i} to copy")
            out[start + i] = shape[start + i]
        if self.inferred_axis >= 0:
            at = start + self.inferred_axis
            known = _count(out[:at]) * _count(out[at + 1:])
            total = bottom[0].count
            if known == 0 or total % known:
                raise self.error(f"bottom count {total} (shape {shape}) is not divisible by the "
                                 f"product of the given dimensions {known}")
            out[start + self.inferred_axis] = total // known
        return tuple(out)


@register("Crop")
class CropLayer(Layer):
    """Crops bottom[0] from `axis` on to the shape of bottom[1] at `offset`s; bottom[1] gives
    only the shape and gets no diff."""

    exact_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.crop_param
        n = bottom[0].num_axes
        start = _axis(self, p.axis, n)
        if len(p.offset) > 1 and start + len(p.offset) != n:
            raise self.error(f"{len(p.offset)} offsets given, but axes {start}..{n - 1} "
                             f"need {n - start}")

    def reshape(self, bottom, top):
        p = self.param.crop_param
        a, b = bottom[0].shape, bottom[1].shape
        n = len(a)
        if len(b) != n:
            raise self.error(f"bottoms must have the same number of axes, got {a} and {b}")
        start = _axis(self, p.axis, n)
        index, shape = [], []
        for i in range(n):
            if i < start:
                index.append(slice(None))
                shape.append(a[i])
                continue
            off = p.offset[0] if len(p.offset) == 1 else (p.offset[i - start] if p.offset else 0)
            if a[i] - off < b[i]:
                raise self.error(f"crop of axis {i} is out of bounds: size {b[i]} at offset "
                                 f"{off} in {a[i]}")
            index.append(slice(off, off + b[i]))
            shape.append(b[i])
        self.index = tuple(index)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self.index]

    def prepare_forward(self, bottom, top):
        return partial(np.copyto, top[0].data, bottom[0].data[self.index])

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dx = bottom[0].diff
            dx[...] = 0
            dx[self.index] = top[0].diff


@register("Tile")
class TileLayer(Layer):
    """Repeats the bottom `tiles` times along `axis` (whole blocks from `axis` on)."""

    exact_bottoms = 1
    exact_tops = 1

    def reshape(self, bottom, top):
        p = self.param.tile_param
        if not p.HasField("tiles"):
            raise self.error("tile_param.tiles must be given")
        if p.tiles <= 0:
            raise self.error(f"tiles must be > 0, got {p.tiles}")
        self.tiles = int(p.tiles)
        shape = bottom[0].shape
        axis = _axis(self, p.axis, len(shape))
        self.outer = _count(shape, 0, axis)
        self.inner = _count(shape, axis)
        top[0].reshape(shape[:axis] + (shape[axis] * self.tiles,) + shape[axis + 1:])

    def forward(self, bottom, top):
        src = bottom[0].data.reshape(self.outer, 1, self.inner)
        top[0].data.reshape(self.outer, self.tiles, self.inner)[...] = src

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dy = top[0].diff.reshape(self.outer, self.tiles, self.inner)
            np.sum(dy, axis=1, out=bottom[0].diff.reshape(self.outer, self.inner))


@register("Reduction")
class ReductionLayer(Layer):
    """SUM, ASUM, SUMSQ or MEAN over all axes from `axis` on, times `coeff`."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        self.op = self.param.reduction_param.operation

    def reshape(self, bottom, top):
        p = self.param.reduction_param
        shape = bottom[0].shape
        axis = _axis(self, p.axis, len(shape))
        self.num = _count(shape, 0, axis)
        self.dim = _count(shape, axis)
        top[0].reshape(shape[:axis])
        self.coeff = float(p.coeff)
        if self.op == caffe_pb2.ReductionParameter.MEAN:
            self.coeff /= self.dim

    def forward(self, bottom, top):
        R = caffe_pb2.ReductionParameter
        x = bottom[0].data.reshape(self.num, self.dim)
        y = top[0].data.reshape(self.num)
        if self.op in (R.SUM, R.MEAN):
            np.sum(x, axis=1, out=y)
        elif self.op == R.ASUM:
            np.sum(np.abs(x), axis=1, out=y)
        elif self.op == R.SUMSQ:
            np.einsum("ij,ij->i", x, x, out=y)
        else:
            raise self.error(f"unknown reduction operation {self.op}")
        if self.coeff != 1:
            y *= self.dtype.type(self.coeff)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        R = caffe_pb2.ReductionParameter
        c = top[0].diff.reshape(self.num, 1) * self.dtype.type(self.coeff)
        dx = bottom[0].diff.reshape(self.num, self.dim)
        if self.op in (R.SUM, R.MEAN):
            dx[...] = c
        elif self.op == R.ASUM:
            np.multiply(np.sign(bottom[0].data.reshape(self.num, self.dim)), c, out=dx)
        else:
            np.multiply(bottom[0].data.reshape(self.num, self.dim), 2 * c, out=dx)


@register("Silence")
class SilenceLayer(Layer):
    """Consumes blobs so they are not net outputs; backward gives them zero diffs."""

    min_bottoms = 1
    exact_tops = 0

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff[...] = 0


@register("ArgMax")
class ArgMaxLayer(Layer):
    """Indices (or values with out_max_val) of the top_k largest entries, per instance over all
    of axes 1.. (output N x 1|2 x top_k) or along `axis`. Ties go to the larger index, as with
    Caffe's sort of (value, index) pairs."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.argmax_param
        self.out_max_val = p.out_max_val
        self.top_k = int(p.top_k)
        self.has_axis = p.HasField("axis")
        if self.top_k < 1:
            raise self.error(f"top_k must be >= 1, got {self.top_k}")
        if self.has_axis:
            self.axis = _axis(self, p.axis, bottom[0].num_axes)
            if self.top_k > bottom[0].shape[self.axis]:
                raise self.error(f"top_k {self.top_k} is larger than axis {self.axis} "
                                 f"(size {bottom[0].shape[self.axis]})")
        elif self.top_k > _count(bottom[0].shape, 1):
            raise self.error(f"top_k {self.top_k} is larger than the {_count(bottom[0].shape, 1)} "
                             "values per instance")

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if self.has_axis:
            out = list(shape)
            out[self.axis] = self.top_k
        else:
            out = [1] * max(len(shape), 3)
            out[0] = shape[0]
            out[2] = self.top_k
            if self.out_max_val:
                out[1] = 2
        top[0].reshape(out)

    def forward(self, bottom, top):
        x = bottom[0].data
        if self.has_axis:
            v = np.moveaxis(x, self.axis, -1)
        else:
            v = x.reshape(x.shape[0], -1)
        k = self.top_k
        dim = v.shape[-1]
        flipped = v[..., ::-1]
        order = np.argsort(-flipped, axis=-1, kind="stable")[..., :k]
        idx = dim - 1 - order
        vals = np.take_along_axis(v, idx, axis=-1)
        y = top[0].data
        if self.has_axis:
            res = vals if self.out_max_val else idx
            y[...] = np.moveaxis(res, -1, self.axis)
        elif self.out_max_val:
            y2 = y.reshape(x.shape[0], 2, k)
            y2[:, 0, :] = idx
            y2[:, 1, :] = vals
        else:
            y.reshape(x.shape[0], k)[...] = idx


@register("BatchReindex")
class BatchReindexLayer(Layer):
    """top[i] = bottom[0][index[i]]; the backward sums diffs of repeated indices."""

    exact_bottoms = 2
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        if bottom[1].num_axes != 1:
            raise self.error(f"the index bottom must be 1-D, got shape {bottom[1].shape}")
        top[0].reshape((bottom[1].shape[0],) + bottom[0].shape[1:])

    def _indices(self, bottom):
        idx = bottom[1].data
        n = bottom[0].shape[0]
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise self.error(f"indices must be in [0, {n}), got values from {idx.min()} to "
                             f"{idx.max()}")
        return idx.astype(np.int64)

    def forward(self, bottom, top):
        np.take(bottom[0].data, self._indices(bottom), axis=0, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if len(propagate_down) > 1 and propagate_down[1]:
            raise self.error("cannot backpropagate to the index bottom")
        if propagate_down[0]:
            dx = bottom[0].diff
            dx[...] = 0
            np.add.at(dx, self._indices(bottom), top[0].diff)


@register("Filter")
class FilterLayer(Layer):
    """Passes on the items (along axis 0) of each bottom whose selector (last bottom) is
    non-zero. The top size depends on the selector's values, so forward reshapes the tops."""

    min_bottoms = 2
    min_tops = 1

    def layer_setup(self, bottom, top):
        if len(top) != len(bottom) - 1:
            raise self.error(f"needs one top per filtered bottom: {len(bottom) - 1} bottoms "
                             f"before the selector, {len(top)} tops")
        self.first_reshape = True
        self.indices = np.zeros(0, np.int64)

    def allow_force_backward(self, bottom_index):
        return bottom_index != len(self.param.bottom) - 1

    def reshape(self, bottom, top):
        sel = bottom[-1]
        if any(d != 1 for d in sel.shape[1:]):
            raise self.error(f"selector dimensions must be 1 except the first, got {sel.shape}")
        for i, b in enumerate(bottom[:-1]):
            if b.shape[:1] != sel.shape[:1]:
                raise self.error(f"bottom {i} {b.shape} and the selector {sel.shape} must have "
                                 "the same first dimension")
        self.indices = np.flatnonzero(sel.data.reshape(sel.shape[0]))
        n = len(self.indices)
        if self.first_reshape:
            n = bottom[0].shape[0]
            self.first_reshape = False
        for t, b in zip(top, bottom):
            t.reshape((n,) + b.shape[1:])

    def forward(self, bottom, top):
        self.reshape(bottom, top)
        for t, b in zip(top, bottom):
            np.take(b.data, self.indices, axis=0, out=t.data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[-1]:
            raise self.error("cannot backpropagate to the selector bottom")
        for t, b, down in zip(top, bottom, propagate_down):
            if down:
                b.diff[...] = 0
                b.diff[self.indices] = t.diff


@register("Parameter")
class ParameterLayer(Layer):
    """Outputs its parameter blob: the top shares the blob's data and diff, so whatever the
    consumer writes to the top diff is the parameter's gradient."""

    exact_bottoms = 0
    exact_tops = 1

    def layer_setup(self, bottom, top):
        shape = tuple(int(d) for d in self.param.parameter_param.shape.dim)
        if not self.blobs_already_set(1):
            self.add_param_blob(shape)
        top[0].reshape(shape)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        top[0].data = self.blobs[0].data
        top[0].diff = self.blobs[0].diff

    def backward(self, top, propagate_down, bottom):
        if top[0].diff is not self.blobs[0].diff:
            self.blobs[0].diff[...] = top[0].diff


@register("Embed")
class EmbedLayer(Layer):
    """A lookup table: top[..., :] = W[index] (+ b); W is (input_dim, num_output)."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.embed_param
        self.num_output = self.positive(p.num_output, "num_output")
        self.input_dim = self.positive(p.input_dim, "input_dim")
        self.bias_term = p.bias_term
        if self.blobs_already_set(1 + self.bias_term):
            return
        self.add_param_blob((self.input_dim, self.num_output), p.weight_filler)
        if self.bias_term:
            self.add_param_blob((self.num_output,), p.bias_filler)

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def _indices(self, bottom):
        x = bottom[0].data.reshape(-1)
        idx = x.astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.input_dim):
            raise self.error(f"indices must be in [0, {self.input_dim}), got values from "
                             f"{x.min()} to {x.max()}")
        return idx

    def forward(self, bottom, top):
        y = top[0].data.reshape(-1, self.num_output)
        np.take(self.blobs[0].data, self._indices(bottom), axis=0, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error("cannot backpropagate to the index input")
        dy = top[0].diff.reshape(-1, self.num_output)
        if self.param_propagate_down[0]:
            np.add.at(self.blobs[0].diff, self._indices(bottom), dy)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)


def _operand_shape(layer, bottom, p, blob):
    """(outer, dim, inner) for applying `blob` to bottom[0] from p.axis on (axis 0 when the
    operand is a scalar, as in Caffe)."""
    shape = bottom[0].shape
    axis = 0 if blob.num_axes == 0 else _axis(layer, p.axis, len(shape))
    n = blob.num_axes
    if axis + n > len(shape) or shape[axis:axis + n] != blob.shape:
        raise layer.error(f"operand shape {blob.shape} does not match bottom[0] {shape} "
                          f"starting at axis {axis}")
    return _count(shape, 0, axis), blob.count, _count(shape, axis + n)


def _param_shape(layer, bottom, axis, num_axes):
    shape = bottom[0].shape
    axis = _axis(layer, axis, len(shape))
    if num_axes < -1:
        raise layer.error(f"num_axes must be >= 0, or -1 for all axes from axis on, got {num_axes}")
    if num_axes >= 0 and axis + num_axes > len(shape):
        raise layer.error(f"axis {axis} + num_axes {num_axes} extends past the bottom shape "
                          f"{shape}")
    return shape[axis:] if num_axes == -1 else shape[axis:axis + num_axes]


@register("Bias")
class BiasLayer(Layer):
    """top = bottom[0] + b, b broadcast from `axis`; b is bottom[1] or a learned blob."""

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.bias_param
        if len(bottom) == 1 and not self.blobs_already_set(1):
            self.add_param_blob(_param_shape(self, bottom, p.axis, p.num_axes), p.filler)

    def reshape(self, bottom, top):
        operand = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self.dims = _operand_shape(self, bottom, self.param.bias_param, operand)
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        b = (bottom[1].data if len(bottom) > 1 else self.blobs[0].data).reshape(1, -1, 1)
        outer, dim, inner = self.dims
        y = top[0].data.reshape(outer, dim, inner)
        np.add(bottom[0].data.reshape(outer, dim, inner), b, out=y)

    def prepare_forward(self, bottom, top):
        outer, dim, inner = self.dims
        b = view_as(bottom[1].data if len(bottom) > 1 else self.blobs[0].data, (1, dim, 1))
        x = view_as(bottom[0].data, (outer, dim, inner))
        y = view_as(top[0].data, (outer, dim, inner))
        if b is None or x is None or y is None:
            return None
        return partial(np.add, x, b, out=y)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0] and top[0] is not bottom[0]:
            bottom[0].diff[...] = top[0].diff
        outer, dim, inner = self.dims
        g = top[0].diff.reshape(outer, dim, inner).sum(axis=(0, 2))
        if len(bottom) > 1:
            if propagate_down[1]:
                bottom[1].diff[...] = g.reshape(bottom[1].shape)
        elif self.param_propagate_down[0]:
            self.blobs[0].diff += g.reshape(self.blobs[0].shape)


@register("Scale")
class ScaleLayer(Layer):
    """top = bottom[0] * s (+ bias), s broadcast from `axis`; s is bottom[1] or a learned blob
    (default filler constant 1). The bias, when bias_term, is the last parameter blob.

    As in Caffe, a learned scale with as many values as bottom[0] gets its gradient written,
    not accumulated."""

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    # In training's in-place BatchNorm -> Scale chain (Net.scale_of_norm): the input kept for
    # backward is the BatchNorm's normalized copy when it applied this layer's map
    # (borrow_input), and this backward may leave the diff to that BatchNorm (defer_to).
    borrowed = None
    defer_to = None

    def layer_setup(self, bottom, top):
        p = self.param.scale_param
        self.bias_term = p.bias_term
        self.saved_input = None
        n_blobs = (len(bottom) == 1) + bool(self.bias_term)
        if self.blobs and len(self.blobs) != n_blobs:
            raise self.error(f"expected {n_blobs} parameter blobs, found {len(self.blobs)}")
        if self.blobs:
            return
        if len(bottom) == 1:
            shape = _param_shape(self, bottom, p.axis, p.num_axes)
            filler = p.filler if p.HasField("filler") else \
                caffe_pb2.FillerParameter(type="constant", value=1)
            self.add_param_blob(shape, filler)
        if self.bias_term:
            num_axes = bottom[1].num_axes if len(bottom) > 1 else p.num_axes
            self.add_param_blob(_param_shape(self, bottom, p.axis, num_axes), p.bias_filler)

    def reshape(self, bottom, top):
        scale = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self.dims = _operand_shape(self, bottom, self.param.scale_param, scale)
        if self.bias_term:
            self.bias_dims = _operand_shape(self, bottom, self.param.scale_param, self.blobs[-1])
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def _scale(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def _kernels(self, bottom, top, *more):
        """The compiled kernels where the blobs' arrays are C-contiguous of one dtype and any
        bias runs along the scale's axes, else None."""
        arrays = [bottom[0].data, top[0].data, self._scale(bottom).data, *more]
        if self.bias_term:
            if self.bias_dims != self.dims:
                return None
            arrays.append(self.blobs[-1].data)
        return native.kernels_for(*arrays)

    def forward(self, bottom, top):
        x = bottom[0].data
        k = self._kernels(bottom, top)
        if k is not None:
            saved = None
            if top[0] is bottom[0]:
                saved = self.saved_input
                if saved is None or saved.shape != x.shape or saved.dtype != x.dtype or \
                        saved is self.borrowed:
                    saved = self.saved_input = np.empty_like(x)
            outer, dim, inner = self.dims
            y, s = top[0].data, self._scale(bottom).data
            b = self.blobs[-1].data if self.bias_term else None
            run_parts(lambda r: k.scale_forward(
                native.ptr(x), native.ptr(s), _address(b), native.ptr(y), _address(saved),
                outer, dim, inner, r.start, r.stop), channel_parts(dim))
        else:
            if top[0] is bottom[0]:
                self.saved_input = x.copy()
            outer, dim, inner = self.dims
            s = self._scale(bottom).data.reshape(1, dim, 1)
            np.multiply(x.reshape(outer, dim, inner), s,
                        out=top[0].data.reshape(outer, dim, inner))
            if self.bias_term:
                bo, bd, bi = self.bias_dims
                top[0].data.reshape(bo, bd, bi)[...] += self.blobs[-1].data.reshape(1, bd, 1)
        if self.relu_top is not None:
            relu_forward(top[0].data, top[0].data, self.relu_top)

    def folds_relu(self, top, slope):
        """A ReLU in place on its one top in forward, after the map (in the BatchNorm's pass
        where that applies the map: BatchNormLayer.scale_top)."""
        return top and len(self.param.bottom) == 1

    def borrow_input(self, norm):
        """The BatchNorm before this layer wrote its top with this layer's map: its input, kept
        for backward, is that layer's normalized copy `norm`."""
        self.saved_input = self.borrowed = norm

    def prepare_forward(self, bottom, top):
        outer, dim, inner = self.dims
        s = view_as(self._scale(bottom).data, (1, dim, 1))
        x = view_as(bottom[0].data, (outer, dim, inner))
        y = view_as(top[0].data, (outer, dim, inner))
        if s is None or x is None or y is None:
            return None
        calls = [partial(np.multiply, x, s, out=y)]
        if self.bias_term:
            bo, bd, bi = self.bias_dims
            yb = view_as(top[0].data, (bo, bd, bi))
            b = view_as(self.blobs[-1].data, (1, bd, 1))
            if yb is None or b is None:
                return None
            calls.append(partial(np.add, yb, b, out=yb))
        return sequence(calls)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        k = self._kernels(bottom, top, dy, bottom[0].diff)
        if k is not None and (top[0] is not bottom[0] or self.saved_input is not None):
            self._compiled_backward(k, top, propagate_down, bottom)
            return
        if self.bias_term and self.param_propagate_down[-1]:
            bo, bd, bi = self.bias_dims
            self.blobs[-1].diff += dy.reshape(bo, bd, bi).sum(axis=(0, 2)).reshape(
                self.blobs[-1].shape)
        outer, dim, inner = self.dims
        scale = self._scale(bottom)
        learned = len(bottom) == 1
        if (learned and self.param_propagate_down[0]) or (not learned and propagate_down[1]):
            x = self.saved_input if top[0] is bottom[0] else bottom[0].data
            g = np.einsum("ijk,ijk->j", dy.reshape(outer, dim, inner),
                          x.reshape(outer, dim, inner)).reshape(scale.shape)
            if learned and bottom[0].count != scale.count:
                scale.diff += g
            else:
                scale.diff[...] = g
        if propagate_down[0]:
            s = scale.data.reshape(1, dim, 1)
            np.multiply(dy.reshape(outer, dim, inner), s,
                        out=bottom[0].diff.reshape(outer, dim, inner))

    def _compiled_backward(self, k, top, propagate_down, bottom):
        """backward's sums (in double) and bottom diff in one read of the top's diff."""
        outer, dim, inner = self.dims
        scale = self._scale(bottom)
        learned = len(bottom) == 1
        bias = self.bias_term and self.param_propagate_down[-1]
        scaled = (learned and self.param_propagate_down[0]) or \
            (not learned and propagate_down[1])
        x = self.saved_input if top[0] is bottom[0] else bottom[0].data
        defer = self.defer_to is not None and propagate_down[0] and learned
        gs = np.empty(dim) if scaled or defer else None
        gb = np.empty(dim) if bias or defer else None
        dy, dx = top[0].diff, bottom[0].diff if propagate_down[0] and not defer else None
        run_parts(lambda r: k.scale_backward(
            native.ptr(dy), native.ptr(x), native.ptr(scale.data), _address(gs), _address(gb),
            _address(dx), outer, dim, inner, r.start, r.stop), channel_parts(dim))
        if defer:
            self.defer_to.deferred_scale = (gs, gb, scale.data)
        if bias:
            self.blobs[-1].diff += gb.astype(self.dtype).reshape(self.blobs[-1].shape)
        if scaled:
            g = gs.astype(self.dtype).reshape(scale.shape)
            if learned and bottom[0].count != scale.count:
                scale.diff += g
            else:
                scale.diff[...] = g


def _address(a):
    """A kernel argument for an optional array: its data address, or 0 (NULL)."""
    return 0 if a is None else native.ptr(a)
