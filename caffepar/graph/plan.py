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
            layer.relu_top = layer.step_top = None
            layer.reshape(self._bottoms(i), self._tops(i))
        self.kinds = {i: node.kind for node in nodes for i in node.layers}
        self.copied = {}
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
        as itself propagates with the loss so far in `loss`."""
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
        with np.errstate(all="ignore"):
            if i == self.start and self.refresh is not None:
                self.refresh()
            if call is not None:
                call()
        for j, blob in self.losses:
            if j == i:
                loss += float(np.vdot(blob.data, blob.diff))
        for o in observers:
            o.layer_end("forward", i)
        return loss

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
                    view = view_as(bottom.data, t.shape)
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
        layer, bottom, top = net.layers[i], self._bottoms(i), self._tops(i)
        read = {b for k in range(i + 1, self.end + 1) for b in net.bottom_ids[k]}
        checks = tuple((net.blob_list[t], net.blob_list[t].data) for t in net.top_ids[i]
                       if t in read)

        def run():
            layer.relu_top = layer.step_top = None
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
        """The arrays the plan is bound to that something outside it could replace: the
        blobs the range reads but does not make, and every parameter of its layers."""
        net = self.net
        made = set()
        for i in range(self.start, self.end + 1):
            if self.kinds.get(i) != "free" or net.layers[i].type == "Dropout":
                made.update(net.top_ids[i])
        blobs = []
        for i in range(self.start, self.end + 1):
            blobs += [net.blob_list[b] for b in net.bottom_ids[i] if b not in made]
            if self.kinds.get(i) == "free" and net.layers[i].type != "Dropout":
                blobs += self._tops(i)
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
    few NumPy calls for all of them: each folded layer is y = a * x + b per channel (a and b
    from its parameters, in float64), and an epilogue composes its layers' maps in order,
    starting from the host's bias."""

    def __init__(self, dtype, capacity):
        self.dtype = np.dtype(dtype)
        self.sources, self.size = [], 0     # the parameter arrays read, as 1-D views
        self.hosts = []                      # (offset, channels, bias offset, [maps])
        self.channels = 0
        self.scale = np.ones(capacity, self.dtype)
        self.shift = np.zeros(capacity, self.dtype)

    def _param(self, array, count):
        """The offset of a parameter array's values in the gathered vector, or None where it
        does not hold `count` values."""
        flat = view_as(array, (-1,))
        if flat is None or flat.size != count:
            return None
        self.sources.append(flat)
        self.size += count
        return self.size - count

    def add(self, bias, chain, channels):
        """An epilogue of `channels` channels: the host's bias blob (or None) and its affine
        layers in order; (scale, shift) views, or None where a parameter does not fit."""
        maps = []
        size, count = self.size, len(self.sources)
        for layer in chain:
            m = self._map(layer, channels)
            if m is None:
                self.size, self.sources[count:] = size, []
                return None
            maps.append(m)
        bias_at = None
        if bias is not None:
            bias_at = self._param(bias.data, channels)
            if bias_at is None:
                self.size, self.sources[count:] = size, []
                return None
        offset = self.channels
        self.hosts.append((offset, channels, bias_at, maps))
        self.channels += channels
        return self.scale[offset:offset + channels], self.shift[offset:offset + channels]

    def _map(self, layer, c):
        """(kind, offsets of its parameters, eps) of one folded layer."""
        b = layer.blobs
        if layer.type == "BatchNorm":
            offsets = (self._param(b[0].data, c), self._param(b[1].data, c),
                       self._param(b[2].data, 1))
            return None if None in offsets else ("batchnorm", offsets, layer.eps)
        if layer.type == "BN" and not layer.segnet:
            offsets = tuple(self._param(blob.data, c) for blob in b[:4])
            return None if None in offsets else ("pspnet", offsets, layer.eps)
        if layer.type in ("Scale", "BN"):
            scale = self._param(b[0].data, c)
            shift = self._param(b[1].data, c) if len(b) > 1 else None
            has_shift = len(b) > 1
            if scale is None or (has_shift and shift is None):
                return None
            return ("scale", (scale, shift), 0.0)
        shift = self._param(b[0].data, c)       # Bias
        return None if shift is None else ("bias", (shift,), 0.0)

    def finish(self):
        """Index arrays for the gathered vector; the views handed to the epilogues."""
        n = self.channels
        if not self.hosts:
            return
        self.p = np.zeros(self.size, np.float64)
        self.s64, self.b64 = np.ones(n), np.zeros(n)
        self.kinds = {}     # kind -> (lists of parameter indices per role, eps, a/b positions)
        rows = []           # per epilogue: a list of a/b positions of its maps, in order
        count = 0
        for offset, c, bias_at, maps in self.hosts:
            positions = []
            for kind, offsets, eps in maps:
                entry = self.kinds.setdefault(kind, {"idx": [], "eps": [], "at": []})
                idx = [np.arange(o, o + c) if o is not None else None for o in offsets]
                if kind == "batchnorm":
                    idx[2] = np.full(c, offsets[2])
                entry["idx"].append(idx)
                entry["eps"].append(np.full(c, eps))
                entry["at"].append(np.arange(count, count + c))
                positions.append(np.arange(count, count + c))
                count += c
            rows.append(positions)
        self.a, self.b = np.ones(count), np.zeros(count)
        for kind, entry in self.kinds.items():
            roles = len(entry["idx"][0])
            idx = []
            for r in range(roles):
                parts = [row[r] for row in entry["idx"]]
                if any(p is None for p in parts):     # Scale with and without a bias term
                    have = [k for k, p in enumerate(parts) if p is not None]
                    idx.append((_compact(np.concatenate([entry["at"][k] for k in have]))
                                if have else None,
                                _compact(np.concatenate([parts[k] for k in have]))
                                if have else None))
                else:
                    idx.append((None, _compact(np.concatenate(parts))))
            entry["roles"] = idx
            entry["at"] = _compact(np.concatenate(entry["at"]))
            entry["eps"] = np.concatenate(entry["eps"])
        self.rounds = []
        depth = max(len(r) for r in rows)
        for d in range(depth):
            ch = [np.arange(o, o + c) for (o, c, _, _), r in zip(self.hosts, rows) if len(r) > d]
            ab = [r[d] for r in rows if len(r) > d]
            self.rounds.append((_compact(np.concatenate(ch)), _compact(np.concatenate(ab))))
        with_bias = [(o, c, at) for o, c, at, _ in self.hosts if at is not None]
        self.bias = None
        if with_bias:
            self.bias = (_compact(np.concatenate([np.arange(o, o + c) for o, c, _ in with_bias])),
                         _compact(np.concatenate([np.arange(at, at + c)
                                                  for _, c, at in with_bias])))
    def refresh(self):
        p, a, b = self.p, self.a, self.b
        np.concatenate(self.sources, out=p)
        for kind, entry in self.kinds.items():
            roles, at = entry["roles"], entry["at"]
            if kind == "batchnorm":
                mean, var, fac = (_take(p, r[1]) for r in roles)
                f = np.zeros_like(fac)
                np.divide(1.0, fac, out=f, where=fac != 0)
                mean *= f
                var *= f
                var += entry["eps"]
                np.sqrt(var, out=var)
                np.divide(1.0, var, out=var)
                a[at] = var
                mean *= var
                b[at] = -mean
            elif kind == "pspnet":
                slope, bias, mean, var = (_take(p, r[1]) for r in roles)
                var += entry["eps"]
                np.sqrt(var, out=var)
                np.divide(slope, var, out=var)
                a[at] = var
                mean *= var
                np.subtract(bias, mean, out=bias)
                b[at] = bias
            elif kind == "scale":
                a[at] = p[roles[0][1]]
                shift_at, shift = roles[1]
                if shift is not None:
                    b[shift_at if shift_at is not None else at] = p[shift]
            else:
                b[at] = p[roles[0][1]]
        s, t = self.s64, self.b64
        s.fill(1.0)
        t.fill(0.0)
        if self.bias is not None:
            t[self.bias[0]] = p[self.bias[1]]
        for ch, ab in self.rounds:
            av = a[ab]
            s[ch] = s[ch] * av
            t[ch] = t[ch] * av + b[ab]
        np.copyto(self.scale[:len(s)], s, casting="same_kind")
        np.copyto(self.shift[:len(t)], t, casting="same_kind")


def _take(p, index):
    """p[index] as an array of its own."""
    return p[index].copy() if isinstance(index, slice) else p[index]


def _compact(index):
    """An index array as a slice where it is a run of consecutive positions."""
    if len(index) and index[-1] - index[0] == len(index) - 1 and \
            np.array_equal(index, np.arange(index[0], index[0] + len(index))):
        return slice(int(index[0]), int(index[-1]) + 1)
    return index
