"""The prepared forward of a TEST net over a range of layers: what caffepar.graph.inference
decided, each node made one call bound to the blobs' arrays, built once per range and set of
arrays and then run as a plain loop.

Building a plan reshapes the layers of the range (as a forward does), lets the producers that
the pass chose write into their part of a Concat's top and points Split, Flatten and Reshape
tops (and shared TEST Dropout tops) at their bottoms' data, then asks every layer for its
prepared call (Layer.prepare_forward). A convolution or InnerProduct with layers folded into it
gets an Epilogue whose per-channel scale and shift the plan recomputes at every forward from
the folded layers' current parameters, for all of them at once (_EpilogueParams): weights
copied in or edited between forwards take effect. Layers without a prepared call run as a net
runs them, reshape then forward.

A plan is bound to arrays: the net checks before each forward that the inputs of the range
and the parameters are the arrays it was built on (reshaping an input, or another net sharing
its weights, makes a new plan), and a layer that runs as itself and replaces a top array that
later calls read ends the plan (StalePlan): the net finishes that forward layer by layer.
"""
from functools import partial
from operator import attrgetter, is_

import numpy as np

from caffepar.graph.inference import ACTIVATION_TYPES, AFFINE_TYPES, Node
from caffepar.nn import conv
from caffepar.nn.prepared import epilogue_call, view_as

ALIAS_TYPES = ("Split", "Flatten", "Reshape")
_data = attrgetter("data")


def _plain(layer):
    """No ReLU or image step handed to the layer's next forward: set only where one was (a
    layer given an attribute it did not have costs a net of millions of layers 640 bytes a
    layer, Net.forward_layer)."""
    if layer.relu_top is not None:
        layer.relu_top = None
    if layer.step_top is not None:
        layer.step_top = None


class StalePlan(Exception):
    """Layer `layer`, run as itself, replaced an array that later calls of the plan read."""

    def __init__(self, layer):
        super().__init__(layer)
        self.layer = layer


class InferencePlan:
    """The nodes of an inference graph (caffepar.graph.inference) for layers start .. end of a
    net, as prepared calls."""

    def __init__(self, net, graph, start, end):
        self.net, self.start, self.end = net, start, end
        nodes = _in_range(graph, start, end)
        unshare(net)
        for i in range(start, end + 1):
            layer = net.layers[i]
            _plain(layer)
            layer.reshape(self._bottoms(i), self._tops(i))
        self.kinds = {i: node.kind for node in nodes for i in node.layers}
        self.copied, self.generic = {}, set()
        self._share(nodes)
        self.params = _EpilogueParams(net.dtype, sum(
            net.blob_list[net.top_ids[node.host][0]].shape[1] for node in nodes
            if node.kind == "epilogue" and net.blob_list[net.top_ids[node.host][0]].num_axes > 1))
        steps = []
        for node in nodes:
            steps.extend(self._steps(node))
        self.params.finish()
        self.refresh = self.params.refresh if self.params.hosts else None
        self.steps = tuple(steps)
        self.calls = tuple(call for call, _ in steps if call is not None)
        self.by_layer = {layers[0]: call for call, layers in steps}
        self.host_of = {i: layers[0] for call, layers in steps for i in layers[1:]
                        if call is not None}
        self.losses = [(i, net.blob_list[t]) for i in range(start, end + 1)
                       for j, t in enumerate(net.top_ids[i]) if net.layers[i].loss_weights[j]]
        self._watch(nodes)

    # ------------------------------------------------------------ running
    def valid(self):
        """Whether the inputs and parameters are still the arrays the plan was built on."""
        return all(map(is_, map(_data, self._watched), self._arrays))

    def forward(self):
        """Run the plan; the weighted loss of the range's tops. A StalePlan from a layer run
        as itself propagates (that layer has run; the loss so far is _loss(layer))."""
        observers = self.net.observers
        with np.errstate(all="ignore"):     # as a net's forward: values are Caffe's to carry
            if self.refresh is not None:
                self.refresh()
            if observers:
                self._run_observed(observers)
            else:
                for call in self.calls:
                    call()
        return self._loss(self.end)

    def forward_layer(self, i, loss=0.0):
        """Layer i's part of the plan (nothing for a layer folded into another or free), as
        Net.forward_layer: the epilogues' parameters are made at the first layer."""
        observers = self.net.observers
        for o in observers:
            o.layer_start("forward", i)
        call = self.by_layer.get(i)
        with self.net._float_errors():
            if i == self.start and self.refresh is not None:
                self.refresh()
            if call is not None:
                call()
        loss += self.layer_loss(i)
        for o in observers:
            o.layer_end("forward", i)
        return loss

    def layer_loss(self, i):
        """The weighted loss of layer i's tops."""
        return sum(float(np.vdot(blob.data, blob.diff)) for j, blob in self.losses if j == i)

    def _run_observed(self, observers):
        for call, layers in self.steps:
            for o in observers:
                o.layer_start("forward", layers[0])
            if call is not None:
                call()
            for o in observers:
                o.layer_end("forward", layers[0])
            for i in layers[1:]:
                for o in observers:
                    o.layer_start("forward", i)
                    o.layer_end("forward", i)

    def _loss(self, last):
        loss = 0.0
        for i, blob in self.losses:
            if i <= last:
                loss += float(np.vdot(blob.data, blob.diff))
        return loss

    # ------------------------------------------------------------ building
    def _bottoms(self, i):
        return [self.net.blob_list[b] for b in self.net.bottom_ids[i]]

    def _tops(self, i):
        return [self.net.blob_list[t] for t in self.net.top_ids[i]]

    def _share(self, nodes):
        """Concat parts (outermost Concat first, so that a part of a part is a view of its
        view), then the tops that share their bottom's data, in layer order."""
        net = self.net
        alias_of = {}
        for node in nodes:
            lp = net.layers[node.host]
            if node.kind == "share" and (lp.type in ALIAS_TYPES or lp.type == "Dropout"):
                for t in net.top_ids[node.host]:
                    alias_of[t] = net.bottom_ids[node.host][0]
        made_by = {}
        for i in range(self.start, self.end + 1):
            for t in net.top_ids[i]:
                if t not in net.bottom_ids[i]:
                    made_by.setdefault(t, i)
        for node in reversed(nodes):
            if node.kind == "concat":
                self._parts(node, alias_of, made_by)
        for node in nodes:
            if node.kind == "share":
                i = node.host
                bottom = net.blob_list[net.bottom_ids[i][0]]
                for t in self._tops(i):
                    view = bottom.data if t.shape == bottom.shape else \
                        view_as(bottom.data, t.shape)
                    if view is None:        # no view of that shape: the layer copies
                        self.kinds[i] = "layer"
                        break
                    t.data = view

    def _parts(self, node, alias_of, made_by):
        """Make the root blob of each part the pass chose a view of its place in the Concat's
        top, where that place is contiguous and every layer between is in the range."""
        net, c = self.net, node.host
        layer = net.layers[c]
        bottoms = self._bottoms(c)
        views = layer.parts(bottoms, self._tops(c))
        copied = set(range(len(bottoms)))
        for j in node.into:
            root = net.bottom_ids[c][j]
            while root in alias_of:
                root = alias_of[root]
            p = made_by.get(root)
            if p is None or p >= c or net.layers[p].type in ALIAS_TYPES + ("Dropout",):
                continue
            region, blob = views[j], net.blob_list[root]
            view = view_as(region, blob.shape) if region.flags.c_contiguous else None
            if view is None:
                continue
            blob.data = view
            net._region_blobs.append(blob)
            copied.discard(j)
        self.copied[c] = copied

    def _steps(self, node):
        """[(call or None, layers)] for a node: one step, or one per layer where the node
        cannot be prepared as one."""
        kind = node.kind
        if kind in ("free", "share") and all(self.kinds[i] == kind for i in node.layers):
            return [(None, node.layers)]
        if kind == "epilogue":
            call = self._epilogue(node)
            if call is not None:
                return [(call, node.layers)]
            return [(self._layer(i), (i,)) for i in node.layers]
        if kind == "concat":
            c = node.host
            return [(self.net.layers[c].prepare_forward(self._bottoms(c), self._tops(c),
                                                        copied=self.copied[c]), (c,))]
        return [(self._layer(i), (i,)) for i in node.layers]

    def _layer(self, i):
        layer = self.net.layers[i]
        call = layer.prepare_forward(self._bottoms(i), self._tops(i))
        return call if call is not None else self._generic(i)

    def _generic(self, i):
        """Layer i as a net runs it; checks that it left the tops later layers read."""
        net = self.net
        self.generic.add(i)
        layer, bottom, top = net.layers[i], self._bottoms(i), self._tops(i)
        read = {b for k in range(i + 1, self.end + 1) for b in net.bottom_ids[k]}
        checks = tuple((net.blob_list[t], net.blob_list[t].data) for t in net.top_ids[i]
                       if t in read)

        def run():
            _plain(layer)
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
            for blob, array in checks:
                if blob.data is not array:
                    raise StalePlan(i)
        return run

    def _epilogue(self, node):
        """A host and the layers folded into it as one call, or None where the shapes or
        parameters do not fit one (the layers then run one by one)."""
        net, h = self.net, node.host
        host = net.layers[h]
        bottom, top = self._bottoms(h), self._tops(h)
        y = top[0].data
        if y.ndim < 2:
            return None
        channels = y.shape[1]
        chain = [host] if host.type in AFFINE_TYPES else []
        chain += [net.layers[i] for i in node.layers[1:] if net.layers[i].type in AFFINE_TYPES]
        acts = [net.layers[i] for i in node.layers[1:]
                if net.layers[i].type in ACTIVATION_TYPES]
        ep = conv.Epilogue()
        if acts and not _activation(acts[0], ep, channels):
            return None
        bias = host.blobs[1] if host.type not in AFFINE_TYPES and \
            getattr(host, "bias_term", False) else None
        if chain:
            made = self.params.add(bias, chain, channels)
            if made is None:
                return None
            ep.scale, ep.shift = made
        elif bias is not None and host.type != "InnerProduct":
            ep.shift = bias.data        # an InnerProduct adds its own bias without a shift
        if host.type in AFFINE_TYPES:
            return epilogue_call(bottom[0].data, y, ep)
        return host.prepare_forward(bottom, top, epilogue=ep)

    def _watch(self, nodes):
        """The arrays the plan is bound to, which something outside it could replace (a
        reshaped input, a blob reshaped by hand, weights shared with another net): every
        blob of the range but the tops of layers that run as themselves (those may replace
        their arrays at every forward, as DetectionOutput does; _generic checks the ones read
        later) and the tops that share their bottom's data (a forward layer by layer points
        them at it again, as a new view of the same data), and every parameter of its
        layers."""
        net = self.net
        seen, blobs = set(), []
        shared = {t for i in range(self.start, self.end + 1) if self.kinds.get(i) == "share"
                  for t in net.top_ids[i]}
        for i in range(self.start, self.end + 1):
            ids = [b for b in net.bottom_ids[i] if b not in shared]
            if i not in self.generic and self.kinds.get(i) != "share":
                ids += net.top_ids[i]
            for b in ids:
                if b not in seen:
                    seen.add(b)
                    blobs.append(net.blob_list[b])
            blobs += list(net.layers[i].blobs)
        self._watched = tuple(blobs)
        self._arrays = tuple(b.data for b in blobs)


def _in_range(graph, start, end):
    """The graph's nodes within layers start .. end; a node cut by the range runs its layers
    in it one by one."""
    out = []
    for node in graph.nodes:
        inside = tuple(i for i in node.layers if start <= i <= end)
        if len(inside) == len(node.layers):
            out.append(node)
        else:
            out.extend(Node("layer", (i,)) for i in inside)
    return out


def unshare(net):
    """Give back their own arrays (with the values they hold) to the blobs a plan made parts
    of a Concat's top, and point the tops that share their bottom's data at it again."""
    if not net._region_blobs:
        return
    old = []
    for blob in net._region_blobs:
        old.append(blob.data)
        blob.data = blob.data.copy()
    net._region_blobs = []
    for i, layer in enumerate(net.layers):
        if layer.type not in ALIAS_TYPES + ("Dropout",) or not net.bottom_ids[i]:
            continue
        bottom = net.blob_list[net.bottom_ids[i][0]]
        for t in net.top_ids[i]:
            top = net.blob_list[t]
            if top is bottom or not any(np.may_share_memory(top.data, a) for a in old):
                continue
            view = view_as(bottom.data, top.shape) if top.count == bottom.count else None
            top.data = view if view is not None else top.data.copy()


def _activation(layer, ep, channels):
    """Set ep's activation from an activation layer; False where it does not fit."""
    if layer.type == "ReLU":
        ep.act, ep.slope = "relu", layer.slope
    elif layer.type == "ReLU6":
        ep.act, ep.lo, ep.hi = "clip", 0.0, 6.0
    elif layer.type == "Clip":
        ep.act, ep.lo, ep.hi = "clip", layer.lo, layer.hi
    else:
        slopes = layer.blobs[0].data
        if slopes.size not in (1, channels):
            return False
        ep.act, ep.slopes = "prelu", slopes
    return True


class _EpilogueParams:
    """The per-channel scale and shift of every epilogue of a plan, one run of a flat array
    each, made at every forward from the current parameters of the layers folded in, with a
    few NumPy calls for all of them. Each folded layer is a map y = a * x + b per channel (a
    and b from its parameters, in float64); an epilogue composes its maps in order, starting
    from the host's bias. The parameters are gathered by one concatenate, laid out role by
    role (all means, then all variances, ...), and the maps' a and b depth by depth (every
    epilogue's first map, then every second one), so that each step reads and writes runs."""

    KINDS = {"batchnorm": 3, "pspnet": 4, "scale": 2, "bias": 1}

    def __init__(self, dtype, capacity):
        self.dtype = np.dtype(dtype)
        self.hosts = []         # (offset, channels, bias array or None, [(kind, arrays, eps)])
        self.channels = 0
        self.scale = np.ones(capacity, self.dtype)
        self.shift = np.zeros(capacity, self.dtype)

    def add(self, bias, chain, channels):
        """An epilogue of `channels` channels: the host's bias blob (or None) and its affine
        layers in order; its (scale, shift) views, or None where a parameter does not fit."""
        maps = [self._map(layer, channels) for layer in chain]
        if any(m is None for m in maps):
            return None
        if bias is not None:
            bias = _flat(bias.data, channels)
            if bias is None:
                return None
        offset = self.channels
        self.hosts.append((offset, channels, bias, maps))
        self.channels += channels
        return self.scale[offset:offset + channels], self.shift[offset:offset + channels]

    @staticmethod
    def _map(layer, c):
        """(kind, parameter arrays (1-D views, None: absent), eps) of one folded layer."""
        b = layer.blobs
        if layer.type == "BatchNorm":
            arrays = [_flat(b[0].data, c), _flat(b[1].data, c), _flat(b[2].data, 1)]
            kind, eps = "batchnorm", layer.eps
        elif layer.type == "BN" and not layer.segnet:
            arrays = [_flat(blob.data, c) for blob in b[:4]]
            kind, eps = "pspnet", layer.eps
        elif layer.type in ("Scale", "BN"):
            arrays = [_flat(b[0].data, c), _flat(b[1].data, c) if len(b) > 1 else False]
            kind, eps = "scale", 0.0
        else:
            arrays, kind, eps = [_flat(b[0].data, c)], "bias", 0.0
        if any(a is None for a in arrays):
            return None
        return kind, [a if a is not False else None for a in arrays], eps

    def finish(self):
        """Lay the parameters and maps out; the index runs of each step."""
        if not self.hosts:
            return
        n = self.channels
        depth = max(len(maps) for _, _, _, maps in self.hosts)
        order = []          # (depth, host offset, channels, kind, arrays, eps), a/b order
        for d in range(depth):
            for offset, c, _, maps in self.hosts:
                if d < len(maps):
                    order.append((d, offset, c) + maps[d])
        sources, size = [], 0

        def gather(arrays):
            nonlocal size
            start = size
            for a in arrays:
                sources.append(a)
                size += a.size
            return slice(start, size)

        with_bias = [(o, c, b) for o, c, b, _ in self.hosts if b is not None]
        self.bias = None
        if with_bias:
            self.bias = (_compact(np.concatenate([np.arange(o, o + c) for o, c, _ in with_bias])),
                         gather([b for _, _, b in with_bias]))
        at, count = [], 0
        for entry in order:
            at.append(slice(count, count + entry[2]))
            count += entry[2]
        self.kinds = []
        for kind in self.KINDS:
            mine = [(k, e) for k, e in enumerate(order) if e[3] == kind]
            if not mine:
                continue
            positions = _compact(np.concatenate([np.arange(at[k].start, at[k].stop)
                                                 for k, _ in mine]))
            roles = []
            for r in range(self.KINDS[kind]):
                have = [(k, e) for k, e in mine if e[4][r] is not None]
                if not have:
                    roles.append(None)
                    continue
                where = positions if len(have) == len(mine) else _compact(np.concatenate(
                    [np.arange(at[k].start, at[k].stop) for k, _ in have]))
                roles.append((where, gather([e[4][r] for _, e in have])))
            counts = np.array([e[2] for _, e in mine])
            eps = np.repeat([e[5] for _, e in mine], counts)
            self.kinds.append((kind, positions, roles, counts, eps))
        self.rounds = []
        for d in range(depth):
            ks = [k for k, e in enumerate(order) if e[0] == d]
            ch = _compact(np.concatenate([np.arange(order[k][1], order[k][1] + order[k][2])
                                          for k in ks]))
            ab = _compact(np.concatenate([np.arange(at[k].start, at[k].stop) for k in ks]))
            self.rounds.append((ch, ab))
        self.sources = sources
        self.gather, self.raw = _gather(sources, size)
        self.last = None
        self.p = np.zeros(size)
        self.a, self.b = np.ones(count), np.zeros(count)
        self.s64, self.t64 = np.ones(n), np.zeros(n)

    def refresh(self):
        """Gather the parameters; where they changed since the last forward, make every
        epilogue's scale and shift from them."""
        self.gather()
        if self.last is not None and np.array_equal(self.raw, self.last):
            return
        self.last = self.raw.copy()
        p, a, b = self.p, self.a, self.b
        np.copyto(p, self.raw)
        for kind, at, roles, counts, eps in self.kinds:
            if kind == "batchnorm":     # Caffe's: statistics divided by the factor, 0 if 0
                fac = p[roles[2][1]]
                inv = np.zeros_like(fac)
                np.divide(1.0, fac, out=inv, where=fac != 0)
                inv = np.repeat(inv, counts)
                var = p[roles[1][1]] * inv
                var += eps
                np.sqrt(var, out=var)
                np.divide(1.0, var, out=var)
                a[at] = var
                np.multiply(p[roles[0][1]], inv, out=inv)
                inv *= var
                np.negative(inv, out=inv)
                b[at] = inv
            elif kind == "pspnet":      # slope * (x - mean) / sqrt(var + eps) + bias
                var = p[roles[3][1]] + eps
                np.sqrt(var, out=var)
                np.divide(p[roles[0][1]], var, out=var)
                a[at] = var
                var *= p[roles[2][1]]
                np.subtract(p[roles[1][1]], var, out=var)
                b[at] = var
            elif kind == "scale":
                a[at] = p[roles[0][1]]
                if roles[1] is not None:
                    b[roles[1][0]] = p[roles[1][1]]
            else:
                b[at] = p[roles[0][1]]
        s, t = self.s64, self.t64
        s.fill(1.0)
        t.fill(0.0)
        if self.bias is not None:
            t[self.bias[0]] = p[self.bias[1]]
        for ch, ab in self.rounds:
            av = a[ab]
            s[ch] *= av
            if isinstance(ch, slice):
                np.multiply(t[ch], av, out=t[ch])
                t[ch] += b[ab]
            else:
                t[ch] = t[ch] * av + b[ab]
        n = len(s)
        np.copyto(self.scale[:n], s, casting="same_kind")
        np.copyto(self.shift[:n], t, casting="same_kind")


def _gather(sources, size):
    """(gather, buffer): gather() puts the sources' values into the buffer, in order. The
    parameters are views into one flat buffer (Net's param_data, or that of the net it
    shares weights with): then one take of their positions from it, else one concatenate."""
    root = _root(sources[0])
    buf = np.empty(size, sources[0].dtype)
    if all(_root(a) is root for a in sources) and root.ndim == 1 and \
            root.flags.c_contiguous and all(a.flags.c_contiguous and a.dtype == root.dtype
                                            for a in sources):
        start = root.__array_interface__["data"][0]
        index = np.concatenate([
            np.arange(a.size) + (a.__array_interface__["data"][0] - start) // a.itemsize
            for a in sources])
        index = _compact(index)
        if isinstance(index, slice):
            return partial(np.copyto, buf, root[index]), buf
        return partial(np.take, root, index, out=buf, mode="clip"), buf
    return partial(np.concatenate, sources, out=buf, casting="same_kind"), buf


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _flat(array, count):
    """A parameter array as a 1-D view of `count` values, or None."""
    flat = view_as(array, (-1,))
    return flat if flat is not None and flat.size == count else None


def _compact(index):
    """An index array as a slice where it is a run of consecutive positions."""
    if len(index) and index[-1] - index[0] == len(index) - 1 and \
            np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return slice(int(index[0]), int(index[-1]) + 1)
    return index
