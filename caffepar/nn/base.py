"""The Layer contract every Caffe layer type implements, and the registry keyed by type string."""
import difflib
import functools

import numpy as np

from caffepar.blob import Blob, BlobVec
from caffepar.errors import LayerError, NetError
from caffepar.fillers import fill, filling
from caffepar.proto.forks import FORK_LAYER_TYPES, fork_of_type
from caffepar.proto.upgrade import V1_TYPE_NAMES

LAYERS = {}


def register(type_name):
    """Class decorator: register a layer under its Caffe type string. The V1 enum spelling
    (CONVOLUTION for Convolution) is found through the upgrade table, not registered twice."""

    def wrap(cls):
        if type_name in LAYERS:
            raise RuntimeError(f"layer type {type_name} registered twice")
        cls.type = type_name
        LAYERS[type_name] = cls
        return cls

    return wrap


def reshaped_by_shape(reshape):
    """Decorates the reshape of a layer whose reshape depends on its bottoms' shapes (and its
    own parameters) alone: a net reshapes every layer before each forward, and a repeat with
    the bottoms and tops as the last reshape left them returns at once (a convolution's took
    90 us of a cifar10_quick step's Python, out of cache between the large passes)."""
    @functools.wraps(reshape)
    def once(self, bottom, top):
        shapes = tuple(b.data.shape for b in bottom) + tuple(t.data.shape for t in top)
        if self.__dict__.get("_reshaped_for") == shapes:
            return
        reshape(self, bottom, top)
        self._reshaped_for = (tuple(b.data.shape for b in bottom)
                              + tuple(t.data.shape for t in top))
    return once


def _known(type_name):
    return LAYERS.get(type_name) or LAYERS.get(V1_TYPE_NAMES.get(type_name, ""))


def _spelling_of(type_name):
    """A registered type that `type_name` is a slip of (case, a letter or two), else None:
    only near-identical names, so that a type caffepar lacks (a fork's, such as
    DepthwiseConvolution) is not taken for another one."""
    lowered = {k.lower(): k for k in LAYERS}
    if type_name.lower() in lowered:
        return lowered[type_name.lower()]
    close = difflib.get_close_matches(type_name, LAYERS, n=1, cutoff=0.85)
    return close[0] if close else None


def layer_class(type_name, layer_name=None, line=None, path=None):
    """The class for a Caffe type string; V1 enum names (CONVOLUTION) are accepted too."""
    cls = _known(type_name)
    if cls is None:
        close = _spelling_of(type_name)
        raise NetError(f'unknown layer type "{type_name}" (known types: {", ".join(sorted(LAYERS))})',
                       path=path, line=line, layer=layer_name,
                       hint=fork_of_type(type_name) or (f'did you mean "{close}"?' if close
                                                        else None))
    return cls


def check_layer_types(layer_params, source_map=None):
    """One error naming every layer of unknown type in a net (with its layer and line), rather
    than stopping at the first."""
    unknown = [lp for lp in layer_params if _known(lp.type) is None]
    if not unknown:
        return
    path = source_map.path if source_map is not None else None
    lines = [source_map.line_of(lp.name) if source_map is not None else None for lp in unknown]
    parts = []
    for lp, line in zip(unknown, lines):
        where = f'layer "{lp.name}"' + (f", line {line}" if line else "")
        close = _spelling_of(lp.type)
        fork = FORK_LAYER_TYPES.get(lp.type)
        parts.append(f'"{lp.type}" ({where}' + (f"; a layer of {fork}" if fork else "")
                     + (f'; did you mean "{close}"?' if close and not fork else "") + ")")
    kinds = len({lp.type for lp in unknown})
    raise NetError(f"unknown layer type{'s' if kinds > 1 else ''}: {', '.join(parts)} (known "
                   f"types: {', '.join(sorted(LAYERS))})", path=path, line=lines[0])


_NO_LOSS = [(0.0,) * n for n in range(8)]     # loss weights of layers with no loss, by tops


class Layer:
    """One Caffe layer. Subclasses set the blob-count limits and implement
    `layer_setup` (check params, create parameter blobs), `reshape`, `forward` and `backward`,
    with Caffe's calling conventions: lists of Blobs, param diffs accumulated, bottom diffs
    overwritten."""

    type = None
    exact_bottoms = None
    min_bottoms = None
    max_bottoms = None
    exact_tops = None
    min_tops = None
    max_tops = None
    is_loss = False
    auto_top_blobs = False
    #: The negative_slope of an in-place ReLU the net has this call of forward apply to
    #: top[0] as it is written (the ReLU layer itself then does not run), or None.
    relu_top = None
    #: The in-place Scale whose map this call of forward applies to top[0] as it is written (a
    #: BatchNorm in training, Net._pair_norm_scale; the Scale itself then does not run), or
    #: None.
    scale_top = None
    #: The negative_slope of an in-place ReLU on bottom[0] whose backward this call of backward
    #: applies to bottom[0].diff as it is written (bottom[0].data holds the ReLU's output), or
    #: None.
    relu_bottom = None
    #: A native.ImageStep the net has this call of forward run on the images of top[0] as
    #: they are written (the next layer's forward, which then does not run itself), or None.
    step_top = None
    #: A native.ImageStep that makes top[0].diff, which this call of backward runs just before
    #: reading it (the next layer's backward, which then does not run itself), or None.
    step_top_diff = None

    def __init__(self, param, phase=1, dtype=np.float32, where=None):
        self._param = param
        self.name = param.name
        self.phase = phase
        self.dtype = np.dtype(dtype)
        self.where = where if where is not None else {}
        self.blobs = BlobVec(dtype=self.dtype)
        self.param_propagate_down = []
        self.loss_weights = ()
        # Which bottoms the net will want a diff for (set by the net; None: unknown). Only a
        # hint for work a layer can choose how to do (a convolution's engine); backward's
        # propagate_down decides.
        self.bottom_need_diff = None

    @property
    def param(self):
        """The LayerParameter; in a built net read from the net's list each time (in_net)."""
        held = self._param
        return held if held is not None else self._in_net[self._param_index]

    @param.setter
    def param(self, value):
        self._param = value

    def in_net(self, layer_params, index):
        """Read the LayerParameter from the net's list from now on (layer_params[index]):
        protobuf's wrapper of a message costs about 100 bytes, and holds a table of every unset
        field read through it (340 more), which a net of millions of layers cannot keep a copy
        of for each layer."""
        self._param, self._in_net, self._param_index = None, layer_params, index

    @property
    def where(self):
        """Where the layer is written (`path`, `line`, the keyword arguments of errors); in a
        net built from a file, looked up when an error asks."""
        found = self._where
        return found if found is not None else self._source_map.where(self.name)

    @where.setter
    def where(self, value):
        source_map = getattr(value, "source_map", None)
        if source_map is not None and getattr(value, "name", None) == self.name:
            self._where, self._source_map = None, source_map
        else:
            self._where = value

    def error(self, message, hint=None):
        return LayerError(message, layer=self.name, layer_type=self.param.type,
                          path=self.where.get("path"), line=self.where.get("line"), hint=hint)

    def check_blob_counts(self, bottom, top):
        exact = self.exact_bottoms
        if exact is None or len(bottom) != exact or self.min_bottoms is not None \
                or self.max_bottoms is not None:
            self._check_count("bottom", len(bottom), exact, self.min_bottoms, self.max_bottoms)
        exact = self.exact_tops
        if exact is None or len(top) != exact or self.min_tops is not None \
                or self.max_tops is not None:
            self._check_count("top", len(top), exact, self.min_tops, self.max_tops)

    def _check_count(self, what, n, exact, low, high):
        if exact is not None and n != exact:
            raise self.error(f"takes exactly {exact} {what} blob(s), got {n}")
        if low is not None and n < low:
            raise self.error(f"takes at least {low} {what} blob(s), got {n}")
        if high is not None and n > high:
            raise self.error(f"takes at most {high} {what} blob(s), got {n}")

    def setup(self, bottom, top):
        """Caffe's Layer::SetUp: check counts, set up, reshape, record loss weights."""
        self.check_blob_counts(bottom, top)
        self.layer_setup(bottom, top)
        self.reshape(bottom, top)
        self.set_loss_weights(top)

    def set_loss_weights(self, top):
        weights = self.param.loss_weight
        if not weights and not self.is_loss:
            self.loss_weights = _NO_LOSS[len(top)] if len(top) < len(_NO_LOSS) else \
                (0.0,) * len(top)
            return
        weights = list(weights)
        if self.is_loss and not weights:
            weights = [1.0]
        if len(weights) > len(top):
            raise self.error(f"has {len(weights)} loss_weight values for {len(top)} top blob(s)")
        weights += [0.0] * (len(top) - len(weights))
        self.loss_weights = tuple(weights)
        for blob, w in zip(top, weights):
            if w:
                blob.diff[...] = w

    def layer_setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError

    def forward(self, bottom, top):
        raise NotImplementedError

    def prepare_forward(self, bottom, top):
        """This layer's forward on these blobs as a call with no arguments, bound to their
        arrays as they are (caffepar.nn.prepared), for an inference plan that keeps the shapes
        and arrays; None: the plan runs reshape and forward at every call, as a net does."""
        return None

    def backward(self, top, propagate_down, bottom):
        """Layers without a backward (Accuracy, ArgMax, data layers) leave this as is."""
        if any(propagate_down):
            raise self.error("cannot backpropagate to its bottom blobs")

    def allow_force_backward(self, bottom_index):
        return True

    def folds_relu(self, top, slope):
        """Whether this layer can run an in-place ReLU of negative_slope `slope` inside its own
        passes (relu_top, relu_bottom): on its top[0] in forward (top=True) or on its bottom[0]
        in backward (top=False). Where a pass cuts its work in parts, the ReLU runs on each
        part's share while it is in cache, with no pass over memory and no hand-out of its own
        (as oneDNN's post-ops run)."""
        return False

    def takes_image_steps(self):
        """Whether this layer runs the next layer's passes inside its own loops over images
        (step_top, step_top_diff), where its engine can, and through the step's own pass
        where it cannot."""
        return False

    def gives_image_steps(self):
        """Whether image_step can hand this layer's passes to the layer before it."""
        return False

    def image_step(self, bottom, top, forward):
        """This layer's forward (forward=True) or backward as a native.ImageStep on the images
        of bottom[0], for the layer that makes bottom[0] to run; only where
        gives_image_steps()."""
        raise NotImplementedError

    # Helpers for subclasses.
    def add_param_blob(self, shape, filler=None):
        blob = Blob(shape, self.dtype)
        blob.is_param = True
        if filler is not None and filling():
            blob.data[...] = fill(filler, blob.shape, self.dtype)
        self.blobs.append(blob)
        return blob

    def blobs_already_set(self, expected):
        """True when parameter blobs were given (e.g. copied in); checks their number."""
        if self.blobs:
            if len(self.blobs) != expected:
                raise self.error(f"expected {expected} parameter blobs, found {len(self.blobs)}")
            return True
        return False

    def positive(self, value, what):
        if value <= 0:
            raise self.error(f"{what} must be > 0, got {value}")
        return value
