"""Net: a Caffe network built from a NetParameter, run forward and backward.

Construction reads as Caffe's Net::Init: read -> upgrade -> filter by NetState -> insert splits ->
create and wire layers -> decide which layers need backward -> share parameters. All learnable
parameters then live in one flat data buffer and one flat diff buffer (every parameter Blob is a
view), so a data-parallel run can reduce every gradient with a single call.
"""
import contextlib
import functools
import gc
import logging
import os
from collections import Counter, OrderedDict
from itertools import zip_longest

import numpy as np

from caffepar.blob import Blob, no_blobs
from caffepar.common import env
from caffepar.errors import CaffeparError, NetError, PrototxtError
from caffepar.graph.inference import inference_graph
from caffepar.graph.onnx_forward import OnnxForward, engine_chosen
from caffepar.graph.passes import filter_net, insert_splits
from caffepar.graph.plan import InferencePlan, StalePlan
from caffepar.nn import create_layer
from caffepar.nn.base import check_layer_types
from caffepar.proto import caffe_pb2
from caffepar.proto.text import SourceMap, read_net_text
from caffepar.proto.upgrade import upgrade_net

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST
ANONYMOUS_TOP = "(automatic)"
#: Values of CAFFEPAR_INFERENCE that turn the inference plan of TEST nets off.
INFERENCE_OFF = ("off", "0", "false", "no")
#: A net whose plan a layer made stale this many forwards in a row runs layer by layer.
STALE_PLANS = 3
#: What a layer's pass runs in when its net already ignores floating-point errors.
_NO_CHANGE = contextlib.nullcontext()

log = logging.getLogger("caffepar")


class SharedList(list):
    """A list of blob ids or flags that several layers share (Net.bottom_ids, top_ids,
    bottom_need_backward): it compares as a list, and changing it in place is an error (it
    would change every layer that shares it); a change is a new list."""

    __slots__ = ()

    def _shared(self, *args, **kwargs):
        raise TypeError("this list is shared by several layers: replace it, do not change it")

    append = extend = insert = remove = pop = clear = sort = reverse = _shared
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _shared


@contextlib.contextmanager
def _collector_paused():
    """No cyclic garbage collection inside: building a net makes several objects a layer that
    live as long as the net, and the collector, which runs again each time a quarter more
    such objects have come, would go over all of them some ten times for a net of millions
    of layers (and find nothing to free)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LayerHook:
    """A pycaffe hook as a net observer: fn(i) at the start or the end of layer i's pass."""

    __slots__ = ("pass_", "after", "fn")

    def __init__(self, pass_, after, fn):
        self.pass_, self.after, self.fn = pass_, after, fn

    def layer_start(self, pass_, i):
        if pass_ == self.pass_ and not self.after:
            self.fn(i)

    def layer_end(self, pass_, i):
        if pass_ == self.pass_ and self.after:
            self.fn(i)


def load_net_param(source):
    """A NetParameter and its SourceMap from a path, prototxt text or a NetParameter."""
    if isinstance(source, caffe_pb2.NetParameter):
        net = caffe_pb2.NetParameter()
        net.CopyFrom(source)
        smap = SourceMap(path=None)
    else:
        net, smap = read_net_text(source)
    try:
        upgraded, _notes = upgrade_net(net, source=smap.path, copy=False)
    except PrototxtError as e:
        if e.line is None and net.layer and net.layers and smap.v1_layer_lines:
            e.line = smap.v1_layer_lines[0]
        raise
    return upgraded, smap


class Net:
    """A Caffe net. Attribute names follow pycaffe (`blobs`, `params`, `layers`, `inputs`,
    `outputs`); `forward_from_to` / `backward_from_to` are Caffe's ForwardFromTo / BackwardFromTo."""

    def __init__(self, source, phase=TEST, level=0, stages=(), weights=None, dtype=np.float32,
                 shard=(0, 1), layer_factory=None):
        with _collector_paused():
            self._construct(source, phase, level, stages, dtype, shard, layer_factory)
        if weights is not None:
            self.copy_from(weights)
        if phase == TEST and layer_factory is None and self.shard == (0, 1) and \
                engine_chosen(env("CAFFEPAR_INFERENCE", "on")):
            self._onnx = OnnxForward(self)

    def _construct(self, source, phase, level, stages, dtype, shard, layer_factory):
        param, smap = load_net_param(source)
        param.state.phase = phase
        param.state.level = level
        del param.state.stage[:]
        param.state.stage.extend(stages)
        self.source_map = smap
        self.source_dir = os.path.dirname(os.path.abspath(smap.path)) \
            if smap.path and not smap.path.startswith("<") else os.getcwd()
        self.dtype = np.dtype(dtype)
        self.phase = phase
        self.shard = tuple(shard)
        self.layer_factory = layer_factory
        # Told layer_start(kind, i) / layer_end(kind, i) around every layer's forward and
        # backward (kind "forward" or "backward"): timelines, gradient reduction during backward.
        self.observers = []
        self._hooks = []            # pycaffe's before_forward & co (LayerHook)
        # The inference plan of a TEST forward (caffepar.graph.plan), the rewrite it runs
        # (caffepar.graph.inference), the blobs it made parts of a Concat's top, and the
        # range of the last forward it ran (a backward runs that forward again layer by layer).
        self._plan = None
        self._graph = None
        self._region_blobs = []
        self._stale_plans = 0
        self._unfused = 0
        self._errors_ignored = 0
        self._planned_range = None
        self._onnx = None           # the onnxruntime engine, where chosen (onnx_forward)
        self.name = param.name
        if not (param.layer or param.layers):
            raise NetError("the net has no layers", path=smap.path)
        param = insert_splits(filter_net(param, smap, inplace=True), smap, inplace=True)
        if not param.layer:
            stages = f", stages {', '.join(stages)}" if stages else ""
            raise NetError(f"no layer of the net is in phase {'TRAIN' if phase == TRAIN else 'TEST'}"
                           f" (level {level}{stages})", path=smap.path)
        check_layer_types(param.layer, smap)
        self._check_memory(len(param.layer), smap)
        self.param = param
        self._build(param)

    # ---------------------------------------------------------------- construction
    #: Memory a layer of a built net takes beyond its blobs' data (measured: 1.33 KB a layer, at
    #: the peak, on a net of 3 million in-place ReLU layers, the text parsed, the net filtered,
    #: split and built: results/prototxt_parse.md), with a margin.
    BYTES_PER_LAYER = 1536
    #: Nets with at least this many layers show their build's progress.
    PROGRESS_LAYERS = 50000
    #: A TEST net of more layers runs its forward layer by layer, with no inference plan: the
    #: plan costs some 90 us and 2 KB a layer to make (measured on a chain of in-place
    #: ReLUs), which a net of millions of tiny layers would not win back in ten forwards, and
    #: its memory would double the net's.
    PLAN_MAX_LAYERS = 100000

    def _check_memory(self, layers, smap):
        """Refuse a net whose layers alone would need more memory than the machine has."""
        from caffepar.logs import available_memory
        need, have = layers * self.BYTES_PER_LAYER, available_memory()
        if have is not None and need > have:
            size = lambda n: f"{n / 2 ** 30:.1f} GB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MB"
            raise NetError(f"the net has {layers:,} layers: building them needs about "
                           f"{size(need)}, and this machine has {size(have)} available",
                           path=smap.path)

    def _where(self, layer_param):
        return self.source_map.where(layer_param.name)

    def _check_input_shapes(self, layer_param, bottoms, where):
        """A layer that failed on a bottom an Input layer left without a shape: say so."""
        for bid in bottoms:
            if bid in self.input_ids and self.blob_list[bid].data.ndim == 0:
                raise NetError(f'bottom blob "{self.blob_names[bid]}" has no shape: the Input '
                               "layer that makes it gives none (input_param { shape { dim: ... "
                               "} }), and nothing reshaped it", layer=layer_param.name,
                               layer_type=layer_param.type, **where)

    def _build(self, param):
        """Create and wire the layers. A layer costs the net a few hundred bytes beyond its
        LayerParameter: lists of blob ids and flags that many layers share are one
        SharedList, its name is one string, where it is written is looked up only if an error
        asks, and the by-name indexes are made when first read (_index)."""
        self.layers = []
        self._layer_names = []
        self.bottom_ids = []
        self.top_ids = []
        self.blob_list = []
        self.blob_names = []
        blob_index = {}
        available = {}          # blobs no layer has read yet, in order: the net's outputs
        blob_need_backward = []
        self.bottom_need_backward = []
        self.layer_need_backward = []
        self.input_ids = []
        self._shared = {}
        shared = self._shared_list
        total = len(param.layer)
        shown = 0
        if total >= self.PROGRESS_LAYERS:
            from caffepar.logs import progress
        layer_params = param.layer
        for index in range(total):
            layer_param = layer_params[index]    # no iterator: it would hold the wrapper
            if total >= self.PROGRESS_LAYERS and 10 * index // total > shown:
                shown = 10 * index // total
                progress("Building %s: %d%% (%s of %s layers)", self.source_map.path,
                         10 * shown, f"{index:,}", f"{total:,}")
            name, layer_type = layer_param.name, layer_param.type
            if not layer_param.HasField("phase"):
                layer_param.phase = self.phase
            where = self.source_map.where(name)
            if layer_param.HasField("parallel_mode") and layer_type != "InnerProduct" and \
                    layer_param.parallel_mode == caffe_pb2.LayerParameter.MODEL:
                raise NetError("only InnerProduct layers can run model parallel "
                               "(parallel_mode: MODEL)", layer=name, layer_type=layer_type,
                               **where)
            bottom_names, top_names = layer_param.bottom[:], layer_param.top[:]  # lists
            propagate_down = layer_param.propagate_down
            if propagate_down and len(propagate_down) != len(bottom_names):
                raise NetError("propagate_down must be given either 0 or bottom_size times",
                               layer=name, layer_type=layer_type, **where)
            layer = self.layer_factory and self.layer_factory(layer_param, self.phase,
                                                              self.dtype, where)
            layer = layer or create_layer(layer_param, self.phase, self.dtype, where)
            layer.name = name
            layer.net_dir = self.source_dir
            layer.shard = self.shard
            self.layers.append(layer)
            self._layer_names.append(name)
            bottoms, bneed = [], []
            need_backward = False
            for j, blob in enumerate(bottom_names):
                if blob not in available:
                    raise NetError(f'unknown bottom blob "{blob}" (bottom index {j})',
                                   layer=name, layer_type=layer_type, **where)
                bid = blob_index[blob]
                del available[blob]
                bottoms.append(bid)
                nb = blob_need_backward[bid]
                if propagate_down:
                    nb = bool(propagate_down[j])
                bneed.append(nb)
                need_backward |= blob_need_backward[bid]
            tops = []
            num_top = len(top_names)
            if layer.auto_top_blobs:
                num_top = max(num_top, layer.min_tops or 0, layer.exact_tops or 0)
            for j in range(num_top):
                if j >= len(top_names):
                    # Caffe's AutoTopBlobs: an anonymous top the prototxt left out. No other
                    # layer can take it as a bottom and it is no net output, but its loss counts.
                    tops.append(len(self.blob_list))
                    self.blob_list.append(Blob((), self.dtype))
                    self.blob_names.append(ANONYMOUS_TOP)
                    blob_need_backward.append(False)
                    continue
                blob = top_names[j]
                if j < len(bottom_names) and blob == bottom_names[j]:
                    tops.append(blob_index[blob])
                elif blob in blob_index:
                    raise NetError(f'top blob "{blob}" produced by multiple sources',
                                   layer=name, layer_type=layer_type, **where)
                else:
                    bid = len(self.blob_list)
                    self.blob_list.append(Blob((), self.dtype))
                    self.blob_names.append(blob)
                    blob_need_backward.append(False)
                    blob_index[blob] = bid
                    tops.append(bid)
                    if layer_type == "Input":
                        self.input_ids.append(bid)
                available.pop(blob, None)
                available[blob] = None
            self.bottom_ids.append(shared(bottoms))
            self.top_ids.append(shared(tops))
            self.bottom_need_backward.append(shared(bneed))
            bottom_blobs = [self.blob_list[i] for i in bottoms]
            top_blobs = [self.blob_list[i] for i in tops]
            try:
                layer.setup(bottom_blobs, top_blobs)
            except MemoryError as e:
                blobs = "/".join(f'"{self.blob_names[i]}"' for i in tops)
                raise layer.error(f"out of memory for top {blobs}: {e}" if str(e) else
                                  "out of memory") from None
            except (CaffeparError, ValueError, IndexError) as e:
                self._check_input_shapes(layer_param, bottoms, where)
                if isinstance(e, CaffeparError):
                    raise
                raise layer.error(str(e)) from None
            layer.loss_weights = self._shared.setdefault(layer.loss_weights, layer.loss_weights)
            if not layer.blobs and layer_type != "Python":
                layer.blobs = no_blobs(self.dtype)
            if layer.blobs or layer_param.param:
                specs = layer_param.param
                if len(specs) > len(layer.blobs):
                    raise layer.error(f"too many param specs ({len(specs)}) for "
                                      f"{len(layer.blobs)} parameter blob(s)")
                layer.param_propagate_down = []
                for k in range(len(layer.blobs)):
                    lr = specs[k].lr_mult if k < len(specs) else 1.0
                    layer.param_propagate_down.append(lr != 0)
                    need_backward |= lr != 0
            else:
                layer.param_propagate_down = ()
            self.layer_need_backward.append(need_backward)
            if need_backward:
                for t in tops:
                    blob_need_backward[t] = True
            layer.in_net(layer_params, index)
            layer_param = propagate_down = specs = None
        del self._shared
        self._decide_backward(param, blob_need_backward)
        self.output_ids = [blob_index[n] for n in sorted(available)]
        self._share_params()
        self._index()
        self._fold_relus()
        self._fold_steps()
        self._pair_norm_scale()

    def _shared_list(self, values):
        """`values` as a SharedList, one object for every equal one (most layers' blob ids and
        flags repeat: a list of their own would cost a huge net 50-100 bytes a layer)."""
        key = tuple(values)
        found = self._shared.get(key)
        if found is None:
            found = self._shared[key] = SharedList(key)
        return found

    def _fold_relus(self):
        """Which in-place ReLUs run inside a neighbour's passes (Layer.folds_relu): in
        forward, inside the layer before that makes their blob (its only top, no loss on it);
        in backward, inside the layer after that takes it (its only bottom, the only layer
        reading it that does not write it in place: a BatchNorm and a Scale in place before
        the ReLU run their backward after the ReLU's either way, and Splits give any other
        reader of the ReLU's output a blob of its own). {ReLU index: negative_slope} for each
        direction; a ReLU folded in a direction does not run itself when its neighbour runs in
        the same pass."""
        self.relu_in_producer, self.relu_in_consumer = {}, {}
        outside = Counter(b for ids, tops in zip(self.bottom_ids, self.top_ids) for b in ids
                          if b not in tops)
        for r, relu in enumerate(self.layers):
            if (relu.type != "ReLU" or len(self.bottom_ids[r]) != 1
                    or self.top_ids[r] != self.bottom_ids[r] or any(relu.loss_weights)):
                continue
            blob, slope = self.bottom_ids[r][0], relu.slope
            p, c = r - 1, r + 1
            if (p >= 0 and self.top_ids[p] == [blob] and not any(self.layers[p].loss_weights)
                    and self.layers[p].folds_relu(True, slope)):
                self.relu_in_producer[r] = slope
            if (c < len(self.layers) and self.bottom_ids[c] == [blob] and outside[blob] == 1
                    and blob not in self.top_ids[c] and self.layer_need_backward[r]
                    and self.layer_need_backward[c] and self.bottom_need_backward[c][0]
                    and self.layers[c].folds_relu(False, slope)):
                self.relu_in_consumer[r] = slope

    def _pair_norm_scale(self):
        """Training's in-place chains BatchNorm (batch statistics) -> Scale (one bottom, its
        learned map): {BatchNorm index: Scale index} and back. In a pass over both, the
        BatchNorm applies the Scale's map as it normalizes (forward), and the Scale leaves its
        diff to the BatchNorm's backward, which needs the same sums (BatchNormLayer)."""
        from caffepar.nn.common import ScaleLayer
        from caffepar.nn.normalization import BatchNormLayer
        self.scale_of_norm, self.norm_of_scale = {}, {}
        for i in range(len(self.layers) - 1):
            norm, scale = self.layers[i], self.layers[i + 1]
            if (type(norm) is BatchNormLayer and type(scale) is ScaleLayer
                    and not norm.use_global and len(self.bottom_ids[i + 1]) == 1
                    and self.top_ids[i] == self.bottom_ids[i + 1] == self.top_ids[i + 1]
                    and not any(norm.loss_weights) and not any(scale.loss_weights)):
                self.scale_of_norm[i] = i + 1
                self.norm_of_scale[i + 1] = i

    def _fold_steps(self):
        """Which layers run as image steps inside the layer before them
        (Layer.takes_image_steps, Layer.image_step): a layer whose only bottom is the only top
        of the layer before, read by nothing else, with no loss on either -- or the top of an
        in-place ReLU between them that runs inside that layer's forward (_fold_relus). Both
        {step layer: the layer it runs inside}: step_forward for forward; step_backward for
        backward too (both layers run backward, the step's down to the blob between them, and
        a ReLU between them runs inside the step's backward)."""
        self.step_forward, self.step_backward = {}, {}
        readers = Counter(b for ids in self.bottom_ids for b in ids)
        for p in range(1, len(self.layers)):
            c = p - 1
            relu = c in self.relu_in_producer
            if relu:
                c -= 1
            if not (len(self.bottom_ids[p]) == 1 and self.top_ids[c] == self.bottom_ids[p]
                    and readers[self.bottom_ids[p][0]] == 1 + relu
                    and len(self.top_ids[p]) == 1
                    and self.top_ids[p] != self.bottom_ids[p]
                    and not any(self.layers[c].loss_weights)
                    and not any(self.layers[p].loss_weights)
                    and self.layers[c].takes_image_steps()
                    and self.layers[p].gives_image_steps()):
                continue
            self.step_forward[p] = c
            if (self.layer_need_backward[p] and self.bottom_need_backward[p][0]
                    and self.layer_need_backward[c]
                    and (not relu or p - 1 in self.relu_in_consumer)):
                self.step_backward[p] = c
        self._steps_inside = {c: p for p, c in self.step_forward.items()}
        self._steps_inside_backward = {c: p for p, c in self.step_backward.items()}

    def _decide_backward(self, param, blob_need_backward):
        """Caffe's rule: only layers on a path to a loss run backward; force_backward overrides."""
        self._shared = {}
        shared = self._shared_list
        under_loss, skip = set(), set()
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            contributes = False
            skip_down = True
            for j, t in enumerate(self.top_ids[i]):
                name = self.blob_names[t]
                if layer.loss_weights[j] or name in under_loss:
                    contributes = True
                if name not in skip:
                    skip_down = False
            need = list(self.bottom_need_backward[i])
            if self.layer_need_backward[i] and skip_down:
                self.layer_need_backward[i] = False
                need = [False] * len(self.bottom_ids[i])
            if not contributes:
                self.layer_need_backward[i] = False
            for j, b in enumerate(self.bottom_ids[i]):
                if contributes:
                    under_loss.add(self.blob_names[b])
                else:
                    need[j] = False
                if not need[j]:
                    skip.add(self.blob_names[b])
            self.bottom_need_backward[i] = shared(need)
        if param.force_backward:
            for i, layer in enumerate(self.layers):
                self.layer_need_backward[i] = True
                self.bottom_need_backward[i] = shared(
                    need or layer.allow_force_backward(j)
                    for j, need in enumerate(self.bottom_need_backward[i]))
                layer.param_propagate_down = [True] * len(layer.blobs) if layer.blobs else ()
        for i, layer in enumerate(self.layers):
            layer.bottom_need_diff = self.bottom_need_backward[i]
        del self._shared

    def _share_params(self):
        """Resolve ParamSpec names, then move every learnable blob into the flat buffers."""
        self.learnable_params = []
        self.param_owner = []
        self.param_layer_index = []
        self.lr_mults = []
        self.decay_mults = []
        owner_by_name = {}
        sharers = []
        for i, layer in enumerate(self.layers):
            specs = layer.param.param if layer.blobs else ()
            for k, blob in enumerate(layer.blobs):
                spec = specs[k] if k < len(specs) else caffe_pb2.ParamSpec()
                self.param_layer_index.append((i, k))
                if spec.name and spec.name in owner_by_name:
                    owner = owner_by_name[spec.name]
                    self.param_owner.append(owner)
                    sharers.append((i, k, owner, spec))
                    continue
                if spec.name:
                    owner_by_name[spec.name] = len(self.param_owner)
                self.param_owner.append(-1)
                self.learnable_params.append(blob)
                self.lr_mults.append([spec.lr_mult, spec.HasField("lr_mult")])
                self.decay_mults.append([spec.decay_mult, spec.HasField("decay_mult")])
        self.learnable_index = {}
        li = 0
        for n, owner in enumerate(self.param_owner):
            if owner < 0:
                self.learnable_index[n] = li
                li += 1
        # Replicated parameters first, then those a model-parallel layer holds a shard of, so
        # that a data-parallel run reduces all replicated gradients as one contiguous region.
        owners = [self.param_layer_index[n] for n, o in enumerate(self.param_owner) if o < 0]
        sharded = [bool(getattr(self.layers[i], "sharded", False)) for i, _ in owners]
        order = [j for j in range(len(owners)) if not sharded[j]] + \
                [j for j in range(len(owners)) if sharded[j]]
        total = sum(b.count for b in self.learnable_params)
        self.param_data = np.zeros(total, self.dtype)
        self.param_diff = np.zeros(total, self.dtype)
        self.param_offsets = [0] * len(self.learnable_params)
        self.replicated_count = sum(self.learnable_params[j].count for j in order
                                    if not sharded[j])
        offset = 0
        for j in order:
            blob = self.learnable_params[j]
            n = blob.count
            view = self.param_data[offset:offset + n].reshape(blob.shape)
            view[...] = blob.data
            blob.data = view
            blob.diff = self.param_diff[offset:offset + n].reshape(blob.shape)
            self.param_offsets[j] = offset
            offset += n
        for i, k, owner, spec in sharers:
            layer = self.layers[i]
            oi, ok = self.param_layer_index[owner]
            owner_blob = self.layers[oi].blobs[ok]
            mine = layer.blobs[k]
            where = self._where(layer.param)
            if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE:
                if mine.count != owner_blob.count:
                    raise NetError(f'cannot share param "{spec.name}" owned by layer '
                                   f'"{self._layer_names[oi]}": count mismatch, owner shape '
                                   f"{owner_blob.shape_string()}, this layer expects "
                                   f"{mine.shape_string()}", layer=layer.name, **where)
            elif mine.shape != owner_blob.shape:
                raise NetError(f'cannot share param "{spec.name}" owned by layer '
                               f'"{self._layer_names[oi]}": shape mismatch, owner shape '
                               f"{owner_blob.shape_string()}, this layer expects "
                               f"{mine.shape_string()}", layer=layer.name, **where)
            shared = Blob((), self.dtype)
            shared.is_param = True
            shared.data = owner_blob.data.reshape(mine.shape)
            shared.diff = owner_blob.diff.reshape(mine.shape)
            layer.blobs[k] = shared
            learn = self.learnable_index[owner]
            for store, value, has in ((self.lr_mults, spec.lr_mult, spec.HasField("lr_mult")),
                                      (self.decay_mults, spec.decay_mult,
                                       spec.HasField("decay_mult"))):
                if has:
                    if store[learn][1] and store[learn][0] != value:
                        raise NetError(f'shared param "{spec.name}" has mismatched multipliers',
                                       layer=layer.name, **where)
                    store[learn] = [value, True]

    _LAZY = ("blobs", "layer_dict", "top_names", "bottom_names", "blob_loss_weights")

    def _index(self):
        """pycaffe's indexes: `params`, `inputs`, `outputs` now, the by-name ones of every
        layer and blob (`blobs`, `layer_dict`, `top_names`, `bottom_names`,
        `blob_loss_weights`) when first read: each costs a net of millions of layers a
        hundred bytes or more a layer."""
        for name in self._LAZY:
            self.__dict__.pop(name, None)
        self.params = OrderedDict((l.name, l.blobs) for l in self.layers if l.blobs)
        self.inputs = [self.blob_names[i] for i in self.input_ids]
        self.outputs = [self.blob_names[i] for i in self.output_ids]

    @functools.cached_property
    def blobs(self):
        return OrderedDict((n, self.blob_list[i]) for i, n in enumerate(self.blob_names))

    @functools.cached_property
    def layer_dict(self):
        return OrderedDict(zip(self._layer_names, self.layers))

    @functools.cached_property
    def top_names(self):
        return OrderedDict((self._layer_names[i], [self.blob_names[t] for t in ids])
                           for i, ids in enumerate(self.top_ids))

    @functools.cached_property
    def bottom_names(self):
        return OrderedDict((self._layer_names[i], [self.blob_names[b] for b in ids])
                           for i, ids in enumerate(self.bottom_ids))

    @functools.cached_property
    def blob_loss_weights(self):
        weights = OrderedDict((n, 0.0) for n in self.blob_names)
        for i, layer in enumerate(self.layers):
            for j, t in enumerate(self.top_ids[i]):
                weights[self.blob_names[t]] = layer.loss_weights[j]
        return weights

    # ---------------------------------------------------------------- running
    def _blobs_of(self, ids):
        return [self.blob_list[i] for i in ids]

    def layer_index(self, name):
        try:
            return self._layer_names.index(name)
        except ValueError:
            raise NetError(f'no layer named "{name}" in net "{self.name}"') from None

    def forward_from_to(self, start=0, end=None):
        """Run layers start..end inclusive; return the weighted loss they produce. Each layer
        reshapes first, as Caffe's Layer::Forward does, so a reshaped input just works. A TEST
        net runs its inference plan (inference_plan) instead, where it has one."""
        end = len(self.layers) - 1 if end is None else end
        onnx = self._onnx
        if onnx is not None and not onnx.busy and not onnx.failed:
            whole = start == 0 and end == len(self.layers) - 1
            if whole and not self.observers and self.inference_enabled() and onnx.forward():
                self._planned_range = (start, end)
                return 0.0
            # A whole forward refused at these shapes computes every blob anew.
            with onnx.paused(materialize=not whole):
                return self.forward_from_to(start, end)
        plan = self.inference_plan(start, end)
        if plan is not None:
            self._planned_range = (start, end)
            try:
                loss = plan.forward()
                self._stale_plans = 0
                return loss
            except StalePlan as stale:
                self._plan = None
                self._stale_plans += 1
                if self._stale_plans == STALE_PLANS:
                    log.debug("net %s: layer %s replaced its tops in %d forwards in a row; "
                              "the net runs layer by layer", self.name,
                              self._layer_names[stale.layer], STALE_PLANS)
                loss = plan._loss(stale.layer)
                with self.unfused(), self.float_errors_ignored():
                    for i in range(stale.layer + 1, end + 1):
                        loss = self.forward_layer(i, loss, stale.layer + 1, end)
                return loss
        loss = 0.0
        with self.float_errors_ignored():
            for i in range(start, end + 1):
                loss = self.forward_layer(i, loss, start, end)
        return loss

    # ---------------------------------------------------------------- inference
    def inference_enabled(self):
        """Whether a forward of this net runs the inference plan: a TEST net (built by one
        process: a parallel run's layers communicate) of at most PLAN_MAX_LAYERS layers
        without force_backward, unless CAFFEPAR_INFERENCE=off or inside unfused()."""
        return (self.phase == TEST and not self._unfused and self.layer_factory is None
                and not self._hooks
                and len(self.layers) <= self.PLAN_MAX_LAYERS
                and not self.param.force_backward and self._stale_plans < STALE_PLANS
                and env("CAFFEPAR_INFERENCE", "on").strip().lower() not in INFERENCE_OFF)

    @contextlib.contextmanager
    def float_errors_ignored(self):
        """Passes inside run with NumPy's floating-point errors ignored once for all their
        layers: forward_layer and backward_layer otherwise do it layer by layer, some 3 us a
        call (a net of millions of layers: seconds a pass)."""
        self._errors_ignored += 1
        try:
            with np.errstate(all="ignore"):
                yield self
        finally:
            self._errors_ignored -= 1

    def _float_errors(self):
        return _NO_CHANGE if self._errors_ignored else np.errstate(all="ignore")

    @contextlib.contextmanager
    def unfused(self):
        """Forwards inside run layer by layer, as with CAFFEPAR_INFERENCE=off."""
        self._unfused += 1
        try:
            yield self
        finally:
            self._unfused -= 1

    def inference_graph(self):
        """The inference rewrite of this net (caffepar.graph.inference), made once."""
        if self._graph is None:
            self._graph = inference_graph(self.param)
        return self._graph

    def inference_plan(self, start=0, end=None):
        """The prepared plan of a forward over layers start .. end (caffepar.graph.plan), made
        again when the range, an input array or a parameter array changed; None where the
        net runs layer by layer (inference_enabled)."""
        if not self.inference_enabled():
            return None
        end = len(self.layers) - 1 if end is None else end
        plan = self._plan
        if plan is not None and plan.start == start and plan.end == end and plan.valid():
            return plan
        self._plan = None
        self._plan = InferencePlan(self, self.inference_graph(), start, end)
        return self._plan

    def forward_host(self, i):
        """The layer whose forward runs layer i inside its own (an epilogue of the inference
        plan, or a ReLU or pooling folded as in training), or None."""
        planned = self.forward_host_table()
        if planned is not None:
            return planned.get(i)
        if i in self.norm_of_scale and self.layers[i - 1].scaled:
            return i - 1
        return i - 1 if i in self.relu_in_producer else self.step_forward.get(i)

    def forward_host_table(self):
        """{layer: the layer whose forward runs it} of the inference plan a forward runs, or
        None where forwards run layer by layer (then forward_host knows)."""
        if self.inference_enabled() and self._plan is not None:
            return self._plan.host_of
        return None

    def _rerun_unfused(self):
        """Before a backward: the last forward again layer by layer where it ran a plan, so
        that every layer holds what its backward reads (layers without bottoms, which make
        the inputs, are not run again)."""
        if self._planned_range is None:
            return
        start, end = self._planned_range
        self._planned_range = None
        with self.unfused(), self.float_errors_ignored():
            for i in range(start, end + 1):
                if self.bottom_ids[i]:
                    self.forward_layer(i, 0.0, start, end)

    def backward_from_to(self, start=None, end=0):
        if self._onnx is not None and not self._onnx.busy and not self._onnx.failed:
            with self._onnx.paused():
                return self.backward_from_to(start, end)
        self._rerun_unfused()
        start = len(self.layers) - 1 if start is None else start
        with self.float_errors_ignored():
            for i in range(start, end - 1, -1):
                self.backward_layer(i, self.layer_need_backward[i], start, end)

    def forward_layer(self, i, loss=0.0, start=None, end=None):
        """Reshape and forward layer i; return `loss` plus the weighted loss of its tops. In a
        pass over layers start .. end, a ReLU folded into the layer before it (_fold_relus)
        runs there when both are in the pass (not in a net with hooks)."""
        if self._hooks:
            start = end = None
        if start is not None and self.phase == TEST and not self._unfused:
            plan = self._plan
            if i == start or plan is None or plan.start != start or plan.end != end:
                plan = self.inference_plan(start, end)
            if plan is not None:
                self._planned_range = (start, end)
                try:
                    return plan.forward_layer(i, loss)
                except StalePlan:           # layer i ran; the next one makes a new plan
                    self._plan = None
                    self._stale_plans += 1
                    return loss + plan.layer_loss(i)
        layer = self.layers[i]
        blobs = self.blob_list
        bottoms = [blobs[k] for k in self.bottom_ids[i]]
        tops = [blobs[k] for k in self.top_ids[i]]
        scale = None
        if start is None:
            folded = stepped = False
            relu = None
        else:
            folded = start < i and i in self.relu_in_producer
            stepped = i in self.step_forward and start <= self.step_forward[i]
            relu = self.relu_in_producer.get(i + 1) if i < end else None
            if self.scale_of_norm and i < end:
                s = self.scale_of_norm.get(i)
                if s is not None:
                    scale = self.layers[s]
                    relu_after = self.relu_in_producer.get(s + 1) if s < end else None
                    if relu_after is not scale.relu_top:
                        scale.relu_top = relu_after
            n = self.norm_of_scale.get(i) if self.norm_of_scale else None
            if n is not None and start <= n and self.layers[n].scaled:
                folded = True           # the BatchNorm before applied its map
        observers = self.observers
        for o in observers:
            o.layer_start("forward", i)
        # What the net hands a layer for one call (relu_top, step_top; relu_bottom and
        # step_top_diff in backward) is set only where it changes from the class's None: an
        # attribute a layer did not have unshares its attribute table, 640 bytes a layer (2 GB
        # more for a net of 3 million layers after one forward).
        if relu is not layer.relu_top:
            layer.relu_top = relu
        if scale is not layer.scale_top:
            layer.scale_top = scale
        with _NO_CHANGE if self._errors_ignored else np.errstate(all="ignore"):
            # non-finite values are Caffe's to carry, ours to report once (the solver's
            # non-finite check)
            if not stepped:
                layer.reshape(bottoms, tops)
            if start is not None and self._steps_inside.get(i, end + 1) <= end:
                layer.step_top = self._forward_step(self._steps_inside[i], end)
            if not (folded or stepped):
                layer.forward(bottoms, tops)
            if layer.step_top is not None:
                layer.step_top = None
        weights = layer.loss_weights
        if any(weights):
            for j, top in enumerate(tops):
                if weights[j]:
                    loss += float(np.vdot(top.data, top.diff))
        for o in observers:
            o.layer_end("forward", i)
        return loss

    def _relu_after(self, i, start, end):
        """The negative_slope of the ReLU folded into layer i in a forward pass over
        start .. end, or None."""
        return self.relu_in_producer.get(i + 1) if start is not None and i < end else None

    def _forward_step(self, p, end):
        """Layer p reshaped and its forward as an image step for the layer before it."""
        layer = self.layers[p]
        bottoms, tops = self._blobs_of(self.bottom_ids[p]), self._blobs_of(self.top_ids[p])
        relu = self._relu_after(p, p, end)
        if relu is not layer.relu_top:
            layer.relu_top = relu
        layer.reshape(bottoms, tops)
        return layer.image_step(bottoms, tops, True)

    def backward_layer(self, i, run=True, start=None, end=None):
        """Backward of layer i when `run`; observers hear of the layer either way, so one
        that waits for a parameter's gradient learns when backward has passed its layer. In a
        pass from layer start down to end, a ReLU folded into the layer after it runs there
        when both are in the pass (not in a net with hooks)."""
        if self._hooks:
            start = end = None
        for o in self.observers:
            o.layer_start("backward", i)
        layer = self.layers[i]
        relu = self.relu_in_consumer.get(i - 1) if start is not None and i > end else None
        if relu is not layer.relu_bottom:
            layer.relu_bottom = relu
        n = self.norm_of_scale.get(i) if self.norm_of_scale else None
        if n is not None:
            defer = self.layers[n] if (start is not None and n >= end and run
                                       and self.layer_need_backward[n]
                                       and self.bottom_need_backward[n][0]
                                       and self.bottom_need_backward[i][0]) else None
            if defer is not layer.defer_to:
                layer.defer_to = defer
        if start is not None and i < start and i in self.relu_in_consumer:
            run = False
        if start is not None and i in self.step_backward and self.step_backward[i] >= end:
            run = False
        p = self._steps_inside_backward.get(i)
        if run and start is not None and p is not None and p <= start:
            layer.step_top_diff = self.layers[p].image_step(
                self._blobs_of(self.bottom_ids[p]), self._blobs_of(self.top_ids[p]), False)
        if run:
            with self._float_errors():
                layer.backward(self._blobs_of(self.top_ids[i]), self.bottom_need_backward[i],
                               self._blobs_of(self.bottom_ids[i]))
        if layer.step_top_diff is not None:
            layer.step_top_diff = None
        for o in self.observers:
            o.layer_end("backward", i)

    # pycaffe's hooks: fn(layer index) before or after each layer's forward or backward. A net
    # with hooks runs layer by layer with nothing folded or fused, so that a hook reads every
    # blob as Caffe leaves it between two layers.
    def before_forward(self, fn):
        self._add_hook("forward", False, fn)

    def after_forward(self, fn):
        self._add_hook("forward", True, fn)

    def before_backward(self, fn):
        self._add_hook("backward", False, fn)

    def after_backward(self, fn):
        self._add_hook("backward", True, fn)

    def _add_hook(self, pass_, after, fn):
        if not callable(fn):
            raise NetError(f"a {'after' if after else 'before'}_{pass_} hook must be callable "
                           f"(it is called with the layer's index), got {type(fn).__name__}")
        hook = LayerHook(pass_, after, fn)
        self._hooks.append(hook)
        self.observers.append(hook)
        self._plan = None

    def forward_backward(self):
        loss = self.forward_from_to()
        self.backward_from_to()
        return loss

    def reshape(self):
        onnx = self._onnx
        if onnx is not None and not onnx.busy and not onnx.failed:
            # Caffe keeps the values of blobs whose shape stays: those of the last forward.
            same = onnx.saved_inputs is not None and all(
                b.shape == s.shape for b, s in zip(onnx.inputs, onnx.saved_inputs))
            with onnx.paused(materialize=same):
                return self.reshape()
        self._plan = None
        for i, layer in enumerate(self.layers):
            layer.reshape(self._blobs_of(self.bottom_ids[i]), self._blobs_of(self.top_ids[i]))

    def clear_param_diffs(self):
        self.param_diff[...] = 0

    # ---------------------------------------------------------------- pycaffe API
    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """pycaffe's Net.forward: set inputs from kwargs, run, return the output blobs' data."""
        outputs = set(self.outputs) | set(blobs or ())
        start_i = self.layer_index(start) if start is not None else 0
        if end is not None:
            end_i = self.layer_index(end)
            outputs = set(self.top_names[end]) | set(blobs or ())
        else:
            end_i = len(self.layers) - 1
        for name, value in kwargs.items():
            if name not in self.inputs:
                raise NetError(f'"{name}" is not an input of net "{self.name}" '
                               f"(inputs: {', '.join(self.inputs)})")
            value = np.asarray(value)
            if value.shape[:1] != self.blobs[name].shape[:1]:
                raise NetError(f'input "{name}" has batch {value.shape[:1]}, the net expects '
                               f"{self.blobs[name].shape[:1]}; reshape the blob first")
            self.blobs[name].data[...] = value
        self.forward_from_to(start_i, end_i)
        return {name: self.blobs[name].data for name in sorted(outputs)}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """pycaffe's Net.backward: set output diffs from kwargs, run, return the input diffs."""
        wanted = set(self.inputs) | set(diffs or ())
        start_i = self.layer_index(start) if start is not None else len(self.layers) - 1
        if end is not None:
            end_i = self.layer_index(end)
            wanted = set(self.bottom_names[end]) | set(diffs or ())
        else:
            end_i = 0
        for name, value in kwargs.items():
            if name not in self.outputs:
                raise NetError(f'"{name}" is not an output of net "{self.name}"')
            self.blobs[name].diff[...] = value
        self.backward_from_to(start_i, end_i)
        return {name: self.blobs[name].diff for name in sorted(wanted)}

    def forward_all(self, blobs=None, **kwargs):
        """Forward inputs of any length in the net's batch size; outputs concatenated."""
        outs = {name: [] for name in set(self.outputs) | set(blobs or ())}
        if not kwargs:
            for name, value in self.forward(blobs=blobs).items():
                outs[name].append(value.copy())
        for chunk, n in self._batches(kwargs):
            for name, value in self.forward(blobs=blobs, **chunk).items():
                outs[name].append(value[:n].copy())
        return _concatenated(outs)

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
        """forward_all and backward_all in one sweep: kwargs hold inputs and output diffs in
        any length; returns (outputs, input diffs), each concatenated."""
        fwd_in = {k: v for k, v in kwargs.items() if k in self.inputs}
        bwd_in = {k: v for k, v in kwargs.items() if k in self.outputs}
        unknown = set(kwargs) - set(fwd_in) - set(bwd_in)
        if unknown:
            raise NetError(f"not an input or output of net \"{self.name}\": "
                           f"{', '.join(sorted(unknown))}")
        outs = {name: [] for name in set(self.outputs) | set(blobs or ())}
        grads = {name: [] for name in set(self.inputs) | set(diffs or ())}
        fwd_batches = list(self._batches(fwd_in)) or [({}, None)]
        bwd_batches = list(self._batches(bwd_in)) or [({}, None)]
        for (fwd, n), (bwd, _) in zip_longest(fwd_batches, bwd_batches, fillvalue=({}, None)):
            for name, value in self.forward(blobs=blobs, **fwd).items():
                outs[name].append(value[:n].copy())
            for name, value in self.backward(diffs=diffs, **bwd).items():
                grads[name].append(value[:n].copy())
        return _concatenated(outs), _concatenated(grads)

    def _batches(self, arrays):
        """Split same-length arrays into chunks of the net's batch size (the last zero-padded);
        yields (chunk, number of real items)."""
        if not arrays:
            return
        total = len(next(iter(arrays.values())))
        batch = self.blobs[next(iter(arrays))].shape[0]
        for start in range(0, total, batch):
            chunk = {}
            for name, value in arrays.items():
                part = np.asarray(value[start:start + batch])
                if len(part) < batch:
                    pad = np.zeros((batch - len(part),) + part.shape[1:], part.dtype)
                    part = np.concatenate([part, pad])
                chunk[name] = part
            yield chunk, min(batch, total - start)

    def set_input_arrays(self, data, labels):
        """Feed arrays to the net's first MemoryData layer, with pycaffe's checks. The layer
        keeps references to the arrays (no copy), as pycaffe does."""
        layer = next((l for l in self.layers if l.type == "MemoryData"), None)
        if layer is None:
            raise NetError("set_input_arrays may only be called if the net has a MemoryData layer")
        labels = np.asarray(labels) if not isinstance(labels, np.ndarray) else labels
        if labels.ndim == 1:
            labels = np.ascontiguousarray(labels[:, None, None, None])
        for name, arr, dims in (("data array", data, (layer.channels, layer.height, layer.width)),
                                ("labels array", labels, (1, 1, 1))):
            if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
                raise NetError(f"{name} must be C contiguous")
            if arr.ndim != 4:
                raise NetError(f"{name} must be 4-d")
            if arr.dtype != np.float32:
                raise NetError(f"{name} must be float32")
            for axis, what in zip(range(1, 4), ("number of channels", "height", "width")):
                if arr.shape[axis] != dims[axis - 1]:
                    raise NetError(f"{name} has wrong {what}")
        if data.shape[0] != labels.shape[0]:
            raise NetError("data and labels must have the same first dimension")
        if data.shape[0] % layer.batch_size:
            raise NetError("first dimensions of input arrays must be a multiple of batch size")
        layer.reset(data, labels, data.shape[0])

    def copy_from(self, path, allow_missing=True):
        """Caffe's CopyTrainedLayersFrom (layers the file lacks keep their values, unless
        allow_missing is False: then they are an error)."""
        from caffepar.io.weights import copy_weights_files
        copy_weights_files(self, [path], allow_missing=allow_missing)

    def load_hdf5(self, path):
        """Caffe's CopyTrainedLayersFromHDF5: weights by layer name from an HDF5 caffemodel."""
        from caffepar.io.weights import copy_weights_into, read_caffemodel_hdf5
        copy_weights_into(self, read_caffemodel_hdf5(path))

    def share_with(self, other):
        """Share trained layers' parameter data with another net (Caffe's ShareTrainedLayersWith)."""
        self._plan = None
        for layer in self.layers:
            src = other.layer_dict.get(layer.name)
            if src is None or not layer.blobs:
                continue
            if len(src.blobs) != len(layer.blobs):
                raise NetError(f"incompatible number of blobs ({len(src.blobs)} vs "
                               f"{len(layer.blobs)})", layer=layer.name)
            for mine, theirs in zip(layer.blobs, src.blobs):
                if mine.shape != theirs.shape:
                    raise NetError(f"cannot share weights: shape {theirs.shape} vs {mine.shape}",
                                   layer=layer.name)
                mine.data = theirs.data
        if not any(np.shares_memory(b.data, self.param_data) for b in self.learnable_params):
            self.param_data = np.zeros(0, self.dtype)

    def to_proto(self, write_diff=False):
        from caffepar.io.weights import net_to_proto
        return net_to_proto(self, write_diff)

    def save(self, path):
        from caffepar.io.weights import save_caffemodel
        save_caffemodel(self, path)

    def save_hdf5(self, path):
        from caffepar.io.weights import save_caffemodel_hdf5
        save_caffemodel_hdf5(self, path)


def _concatenated(parts_by_name):
    return {name: np.concatenate(parts) if parts and parts[0].ndim else np.asarray(parts)
            for name, parts in parts_by_name.items()}
