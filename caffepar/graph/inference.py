"""The inference rewrite of a TEST net: which layers a forward may run inside others, which cost
nothing, and which blobs their producers may write straight into a Concat's top.

A pure pass over a NetParameter as the Net builds it (filtered by its state, Split layers
inserted), in the shape of onnxruntime's graph transformers: each rule is a condition and a
rewrite of a graph of nodes, and the pass applies them until none applies, so that running it
on its own result changes nothing. It decides; `caffepar.graph.plan` runs what it decided.

The rule that keeps us Caffe: a rewrite fires only where no value a user can read after
forward() changes. Folding a BatchNorm, a Scale or an activation into the convolution before
it needs the three to run in place on the convolution's top, each the only reader of what the
one before wrote (Caffe's own in-place chains: only the last value is ever in the blob). Split,
Flatten and Reshape tops share their bottom's data in Caffe itself. A TEST Dropout's top may
share its bottom's data, and a producer may write into its part of a Concat's top, only where
neither blob is written again after that layer: then every blob ends the forward holding the
values the layer-by-layer forward leaves in it.

Node kinds (`Node.kind`):

* ``layer``: the layer runs as itself.
* ``epilogue``: a Convolution or InnerProduct (or a BatchNorm, Scale or Bias with fixed
  parameters, alone or not) and the in-place BatchNorm, Scale, Bias and at most one activation
  (ReLU, ReLU6, Clip, PReLU) after it, all in one call: act(x * scale + shift) per channel on
  the host's output.
* ``share``: the tops share the bottom's data (Split, Flatten, Reshape, a TEST Dropout that is
  not in place); nothing runs.
* ``free``: nothing to run (Input, Silence, an in-place TEST Dropout).
* ``concat``: a Concat whose bottoms named in `into` are written in place by their producers;
  only the others are copied.
"""
from collections import defaultdict
from dataclasses import dataclass

from caffepar.proto import caffe_pb2

TEST = caffe_pb2.TEST

#: Layers whose output an epilogue can finish: a convolution's or an InnerProduct's.
CONV_TYPES = ("Convolution", "ConvolutionDepthwise", "DepthwiseConvolution")
#: Per-channel affine maps a forward may fold into the layer before them.
AFFINE_TYPES = ("BatchNorm", "BN", "Scale", "Bias")
#: Activations an epilogue applies last.
ACTIVATION_TYPES = ("ReLU", "ReLU6", "Clip", "PReLU")
#: Layers that write their tops' data in place (never replace the arrays), so that a top may
#: be a part of a Concat's top.
REGION_WRITERS = frozenset(CONV_TYPES + AFFINE_TYPES + ACTIVATION_TYPES + (
    "InnerProduct", "Deconvolution", "Pooling", "Eltwise", "Concat", "Slice", "Softmax",
    "Permute", "PriorBox", "ShuffleChannel", "Normalize", "LRN", "Sigmoid", "TanH", "Power",
    "ELU", "AbsVal", "Crop", "Axpy", "Interp", "Upsample"))


@dataclass(frozen=True)
class Node:
    """Layers (indices into the net's layers, the host first) that a forward runs as one."""
    kind: str
    layers: tuple
    into: tuple = ()        # concat: the bottom positions its producers write in place

    @property
    def host(self):
        return self.layers[0]

    @property
    def last(self):
        return self.layers[-1]


@dataclass(frozen=True)
class Graph:
    """A net's layers (LayerParameters, read only) and the nodes a forward runs them as."""
    layers: tuple
    nodes: tuple
    phase: int = TEST

    def with_nodes(self, nodes):
        return Graph(self.layers, tuple(nodes), self.phase)


def graph_of(net_param):
    """One ``layer`` node per layer of a NetParameter (after filter_net and insert_splits, as
    caffepar.graph.net.Net builds it)."""
    layers = tuple(net_param.layer)
    return Graph(layers, tuple(Node("layer", (i,)) for i in range(len(layers))),
                 net_param.state.phase)


def fold_for_inference(graph):
    """Apply the rules until none applies; pure (the input graph is left as it is)."""
    changed = True
    while changed:
        changed = False
        for rule in RULES:
            new = rule(graph)
            if new is not graph:
                graph, changed = new, True
    return graph


def inference_graph(net_param):
    return fold_for_inference(graph_of(net_param))


def describe(graph):
    """The nodes as text, one line each: kind, then the layers by name (the host first)."""
    lines = []
    for node in graph.nodes:
        names = " + ".join(graph.layers[i].name for i in node.layers)
        if node.kind == "concat":
            lp = graph.layers[node.host]
            names += " <- " + ", ".join(lp.bottom[j] for j in node.into)
        lines.append(f"{node.kind} {names}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- facts about layers
def _phase(graph, lp):
    return lp.phase if lp.HasField("phase") else graph.phase


def _loss(lp):
    return any(w != 0 for w in lp.loss_weight)


def _in_place(lp):
    return len(lp.bottom) == 1 and len(lp.top) == 1 and lp.top[0] == lp.bottom[0]


def _is_epilogue_host(graph, lp):
    """A layer whose single top an epilogue can finish, per channel along axis 1."""
    if len(lp.bottom) != 1 or len(lp.top) != 1 or _loss(lp):
        return False
    if lp.type in CONV_TYPES:
        return lp.convolution_param.axis == 1 and lp.top[0] != lp.bottom[0]
    if lp.type == "InnerProduct":
        return lp.inner_product_param.axis == 1 and lp.top[0] != lp.bottom[0]
    return _is_affine(graph, lp)


def _is_affine(graph, lp):
    """A per-channel (axis 1) affine map of its one bottom with fixed parameters in this
    phase."""
    if len(lp.bottom) != 1 or len(lp.top) != 1 or _loss(lp):
        return False
    if lp.type == "BatchNorm":
        p = lp.batch_norm_param
        return p.use_global_stats if p.HasField("use_global_stats") else \
            _phase(graph, lp) == TEST
    if lp.type == "BN":
        from caffepar.nn.segmentation import bn_uses_fixed_statistics
        return bn_uses_fixed_statistics(lp, _phase(graph, lp))
    if lp.type == "Scale":
        p = lp.scale_param
        return p.axis == 1 and p.num_axes == 1
    if lp.type == "Bias":
        p = lp.bias_param
        return p.axis == 1 and p.num_axes == 1
    return False


def _is_activation(lp):
    return lp.type in ACTIVATION_TYPES and len(lp.bottom) == 1 and len(lp.top) == 1 \
        and not _loss(lp)


def _versions(graph):
    """(producer, readers): for each bottom (layer, position), the (layer, top position) that
    wrote the value it reads; for each such value, the (layer, position) pairs reading it."""
    last, producer, readers = {}, {}, defaultdict(list)
    for i, lp in enumerate(graph.layers):
        for j, name in enumerate(lp.bottom):
            src = last.get(name)
            producer[i, j] = src
            readers[src].append((i, j))
        for j, name in enumerate(lp.top):
            last[name] = (i, j)
    return producer, readers


# ---------------------------------------------------------------- rules
def fold_into_epilogue(graph):
    """A BatchNorm, Scale or Bias, or an activation, in place on the output of the node before
    it (the layer right after that node's last layer, the only reader of what it wrote) joins
    that node's epilogue; affine maps only while it has no activation."""
    producer, readers = _versions(graph)
    nodes = list(graph.nodes)
    changed = False
    k = 0
    while k < len(nodes):
        node = nodes[k]
        host = graph.layers[node.host]
        if node.kind == "layer" and _is_affine(graph, host):
            nodes[k] = node = Node("epilogue", node.layers)
            changed = True
        m = node.last + 1
        if k + 1 < len(nodes) and node.kind in ("layer", "epilogue") \
                and nodes[k + 1].kind == "layer" and nodes[k + 1].host == m \
                and _is_epilogue_host(graph, host) and _joins(graph, node, m, producer, readers):
            nodes[k] = Node("epilogue", node.layers + (m,))
            del nodes[k + 1]
            changed = True
            continue
        k += 1
    return graph.with_nodes(nodes) if changed else graph


def _joins(graph, node, m, producer, readers):
    """Whether layer m can join the epilogue of `node`, which ends just before it."""
    member, host = graph.layers[m], graph.layers[node.host]
    if not _in_place(member) or member.top[0] != host.top[0]:
        return False
    if producer[m, 0] != (node.last, 0) or readers[node.last, 0] != [(m, 0)]:
        return False
    if any(graph.layers[i].type in ACTIVATION_TYPES for i in node.layers[1:]):
        return False
    return _is_affine(graph, member) or _is_activation(member)


def free_layers(graph):
    """Split, Flatten and Reshape share their bottom's data (as in Caffe); Input and Silence
    run nothing; a TEST Dropout that scales at train time (Caffe's) is the identity: nothing to
    run in place, else its top shares the bottom's data where neither is written after it."""
    nodes = list(graph.nodes)
    changed = False
    storage = None
    for k, node in enumerate(nodes):
        if node.kind != "layer":
            continue
        lp = graph.layers[node.host]
        kind = None
        if lp.type in ("Split", "Flatten", "Reshape"):
            kind = "share"
        elif lp.type in ("Input", "Silence"):
            kind = "free"
        elif lp.type == "Dropout" and _phase(graph, lp) == TEST and not _loss(lp) \
                and getattr(lp.dropout_param, "scale_train", True) and len(lp.top) == 1:
            if _in_place(lp):
                kind = "free"
            else:
                if storage is None:
                    storage = _Storage(graph.with_nodes(nodes))
                d = node.host
                if all(w <= d for w in storage.touching(storage.bottom(d, 0)) |
                       storage.touching(storage.top(d, 0))):
                    kind = "share"
                    storage = None      # its top now shares its bottom's data
        if kind is not None:
            nodes[k] = Node(kind, node.layers)
            changed = True
    return graph.with_nodes(nodes) if changed else graph


def concat_in_place(graph):
    """A Concat's bottoms whose producers may write into their part of its top: every layer
    writing that data writes its tops in place (REGION_WRITERS), all of them run before the
    Concat, no other Concat takes that data, and nothing writes the Concat's top after it."""
    storage = _Storage(graph)
    nodes = list(graph.nodes)
    changed = False
    for k, node in enumerate(nodes):
        lp = graph.layers[node.host]
        if node.kind != "layer" or lp.type != "Concat" or len(lp.top) != 1 or _loss(lp):
            continue
        c = node.host
        top = storage.top(c, 0)
        if any(w > c for w in storage.touching(top)):
            continue
        into, seen = [], {top}
        for j in range(len(lp.bottom)):
            sid = storage.bottom(c, j)
            if sid is None or sid in seen or sid in storage.part_of:
                continue
            seen.add(sid)
            writers = storage.touching(sid)
            if not writers or max(writers) >= c or any(
                    graph.layers[w].type not in REGION_WRITERS or _loss(graph.layers[w])
                    for w in writers):
                continue
            into.append(j)
        if into:
            nodes[k] = Node("concat", node.layers, tuple(into))
            storage.add_parts(top, [storage.bottom(c, j) for j in into])
            changed = True
    return graph.with_nodes(nodes) if changed else graph


class _Storage:
    """Which blobs share data in a forward of the graph, and which layers write it. A top
    written in place is its bottom's data; a Split, Flatten or Reshape top (or a shared
    Dropout's) is its bottom's data; a Concat's bottom written in place is a part of its
    top's data. Data is named by the (layer, top position) that first made it."""

    ALIASES = ("Split", "Flatten", "Reshape")

    def __init__(self, graph):
        node_of = {i: node for node in graph.nodes for i in node.layers}
        self.own = defaultdict(set)         # data -> layers writing it
        self.part_of, self.parts = {}, defaultdict(list)
        self.tops, self.bottoms = {}, {}
        last = {}
        for i, lp in enumerate(graph.layers):
            node = node_of[i]
            for j, name in enumerate(lp.bottom):
                self.bottoms[i, j] = last.get(name)
            alias = lp.type in self.ALIASES or (node.kind == "share" and lp.type == "Dropout")
            for j, name in enumerate(lp.top):
                if j < len(lp.bottom) and lp.bottom[j] == name and self.bottoms[i, j]:
                    sid = self.bottoms[i, j]
                    self.own[sid].add(i)
                elif alias and lp.bottom and self.bottoms[i, 0] is not None:
                    sid = self.bottoms[i, 0]
                else:
                    sid = (i, j)
                    self.own[sid].add(i)
                self.tops[i, j] = sid
                last[name] = sid
            if node.kind == "concat" and i == node.host:
                self.add_parts(self.tops[i, 0], [self.bottoms[i, j] for j in node.into])

    def add_parts(self, whole, parts):
        for part in parts:
            self.part_of[part] = whole
            self.parts[whole].append(part)

    def top(self, i, j):
        return self.tops[i, j]

    def bottom(self, i, j):
        return self.bottoms.get((i, j))

    def touching(self, sid):
        """The layers that write this data: its own writers, those of the parts of it (a
        Concat's top), and those of what it is a part of."""
        if sid is None:
            return set()
        out, stack = set(), [sid]
        while stack:
            s = stack.pop()
            out |= self.own[s]
            stack.extend(self.parts[s])
        whole = self.part_of.get(sid)
        while whole is not None:     # the Concat that made it copies the other parts alone
            out |= self.own[whole] - {whole[0]}
            whole = self.part_of.get(whole)
        return out


RULES = (fold_into_epilogue, free_layers, concat_in_place)
