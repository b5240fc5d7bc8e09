"""The convolution API with Caffe's semantics, and the one place that picks an engine for a layer
shape (``conv_engine``)."""
import functools
import threading
import time

import numpy as np

from caffepar.nn import calibrate, native
from caffepar.nn.blas import blas_threads
from caffepar.nn.conv import band, cols, depthwise, direct, grid, pointwise, winograd
from caffepar.nn.conv.epilogue import EpilogueArgs, apply_epilogue, prepare_epilogue
from caffepar.nn.conv.geometry import bias_diff, expand, flipped_geom, flipped_weights, geom
from caffepar.nn.neuron import relu_backward, relu_forward

def rule_engine(g, cg, og, group, dt=np.dtype(np.float32)):
    """The engine fixed thresholds give a shape (without measuring)."""
    if depthwise.usable(g, cg, group, dt):
        return "depthwise"
    if winograd.usable(g, cg, og):
        return "winograd"
    if pointwise.usable(g):
        return "pointwise"
    if cols.usable(g, cg, og, group):
        return "band" if band.usable(g, group) and cg < cols.COLS_MAX_CHANNELS else "im2col"
    return "grid"


def candidates(g, cg, group, dt):
    """The engines able to run a shape, as each engine's `applicable` declares (grid takes any):
    the measured choice times only these, so an engine that cannot take a geometry (a kernel
    larger than the input, a stride, dilation or group it lacks) is never tried."""
    found = [name for name, able in (("depthwise", depthwise.applicable(g, cg, group, dt)),
                                     ("direct", direct.applicable(g, dt)),
                                     ("winograd", winograd.applicable(g)),
                                     ("pointwise", pointwise.applicable(g)),
                                     ("band", band.applicable(g, group)),
                                     ("im2col", cols.applicable(g, cg, group))) if able]
    return found + ["grid"]


#: A prepared forward whose engine measured at least this many seconds is watched in use.
WATCH_MIN = 20e-6

_forced = threading.local()     # .shape, .passes, .engine: the engine being timed for a pass
_looked = threading.local()     # .key: the measured choice the last lookup returned, or None


def _engine(g, cg, og, group, n, dt, passes="forward"):
    """The engine a shape's pass runs on: a forced one, else the measured choice (calibrate)
    for that pass ("forward", or a calibrate.backward_pass), else the rule."""
    shape = (g.in_sp, g.kernel, g.stride, g.pad, g.dilation, cg, og, group)
    _looked.key = None
    if getattr(_forced, "shape", None) == shape and _forced.passes == passes:
        return _forced.engine
    able = _candidates(g, cg, group, dt, native.mode())
    if passes != "forward" and "depthwise" in able and not depthwise.backward_applicable(g, group):
        able = tuple(e for e in able if e != "depthwise")
    mode = calibrate.mode()
    if mode in able:
        return mode
    if mode != "measure" or n == 0:
        return rule_engine(g, cg, og, group, dt)
    key = _choice_key(g, cg, og, group, n, dt, passes, blas_threads())
    if calibrate.measuring():       # a pass run inside the one being timed: as it will run
        return calibrate.cached(key, able) or rule_engine(g, cg, og, group, dt)
    engine = calibrate.choose(key, able, lambda: _timing_run(shape, n, dt, passes), key,
                              rule_engine(g, cg, og, group, dt))
    _looked.key = key
    return engine


def _observed(key, start):
    """The pass of the measured choice `key` (or None) that began at `start` has ended: told
    to calibrate.observe, which may drop a choice far slower in use than measured. Returns
    whether it did."""
    if key is None or calibrate.measuring():
        return False
    return calibrate.observe(key, time.perf_counter() - start)


@functools.lru_cache(maxsize=1024)
def _candidates(g, cg, group, dt, kernels_mode):
    """candidates, kept per shape and kernel path: every layer looks its engine up on every
    pass."""
    return tuple(candidates(g, cg, group, dt))


@functools.lru_cache(maxsize=1024)
def _choice_key(g, cg, og, group, n, dt, passes, threads):
    """The shape's key in the engine cache (built once: formatting it cost more than the
    lookup)."""
    return (f"{n}x{cg * group}x{'x'.join(map(str, g.in_sp))} {og * group} "
            f"k{'x'.join(map(str, g.kernel))} s{'x'.join(map(str, g.stride))} "
            f"p{'x'.join(map(str, g.pad))} d{'x'.join(map(str, g.dilation))} g{group} {dt.name}"
            f" {passes} t{threads}")


def _timing_run(shape, n, dt, passes):
    """run(engine): one pass of a shape on random data with that engine. A backward whose dx
    may run as a forward convolution (`_flipped_dx`) has that forward's engine chosen first, so
    that it is timed as it will run."""
    in_sp, kernel, stride, pad, dilation, cg, og, group = shape
    g = geom(in_sp, kernel, stride, pad, dilation)
    rng = np.random.default_rng(0)
    x = calibrate.random_array(rng, (n, cg * group) + in_sp, dt)
    w = calibrate.random_array(rng, (og * group, cg) + kernel, dt, 0.1)
    y_shape = (n, og * group) + g.out
    if passes == "forward":
        y = calibrate.written_array(y_shape, dt)

        def work():
            conv_forward(x, w, None, stride, pad, dilation, group, out=y)
    else:
        dy = calibrate.random_array(rng, y_shape, dt)
        need_dx, need_dw = passes != "backward no dx", passes != "backward dx"
        dx = calibrate.written_array(x.shape, dt) if need_dx else None
        gt = _flipped_dx(g, cg) if need_dx else None
        if gt is not None and "im2col" in candidates(g, cg, group, dt):
            _engine(gt, og, cg, group, n, dt, "forward")

        def work():
            conv_backward(dy, x, w, stride, pad, dilation, group, need_dx=need_dx,
                          need_dw=need_dw, dx_out=dx)

    def run(engine):
        _forced.shape, _forced.passes, _forced.engine = shape, passes, engine
        try:
            work()
        finally:
            _forced.shape = None

    return run


def conv_engines(in_spatial, w_shape, stride, pad, dilation, group, batch=None,
                 dtype=np.float32, need_dx=True, need_dw=True, transposed=False):
    """{pass: (engine, its calibrate entry or None)}: the engines a convolution's forward and
    backward run on (direct, winograd, pointwise, band, im2col or grid), measured for the batch
    when one is given (as the layers run), else the rule's. A Deconvolution (`transposed`,
    `in_spatial` its top's) runs the convolution's passes the other way round: its forward is
    the convolution's dx, its backward the dw (and, for its dx, the forward)."""
    g = geom(in_spatial, w_shape[2:], stride, pad, dilation)
    cg, og = w_shape[1], w_shape[0] // group
    dt = np.dtype(dtype)
    if batch is None:
        return {"forward": (rule_engine(g, cg, og, group, dt), None)}

    def looked_up(passes):
        return calibrate.with_entry(lambda: _engine(g, cg, og, group, batch, dt, passes))

    if not transposed:
        return {"forward": looked_up("forward"),
                "backward": looked_up(calibrate.backward_pass(need_dx, need_dw))}
    found = {"forward": looked_up("backward dx")}
    if need_dw:
        found["backward"] = looked_up("backward no dx")
    if need_dx:
        found["backward dx"] = looked_up("forward")
    return found


def conv_engine(in_spatial, w_shape, stride, pad, dilation, group, batch=None,
                dtype=np.float32, need_dx=True, need_dw=True):
    """The engine of a convolution (conv_engines) in words: "im2col" when its passes share it,
    else "forward direct, backward im2col"; benchmarks and `caffepar time` print it."""
    found = conv_engines(in_spatial, w_shape, stride, pad, dilation, group, batch, dtype,
                         need_dx, need_dw)
    return calibrate.describe(found)


def _check(x, w, group, what):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise ValueError(f"{what}: expected x (N, C, *S) and w with as many axes, got "
                         f"{x.shape} and {w.shape}")
    if group < 1 or w.shape[0] % group:
        raise ValueError(f"{what}: {w.shape[0]} filters are not divisible by group {group}")


def _dtype(*arrays):
    dt = np.result_type(*[a.dtype for a in arrays if a is not None])
    if dt.kind != "f":
        dt = np.dtype(np.float64)
    return dt


def _bias_shape(nd):
    return (1, -1) + (1,) * nd


def _target(out, shape, dt, what):
    """(array to compute into, caller's array to copy to at the end or None).

    Results go straight into ``out`` when it is a C-contiguous array of the
    result's dtype; otherwise into a temporary copied over once.
    """
    if out is None:
        return np.empty(shape, dt), None
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype == dt and out.flags.c_contiguous and out.flags.writeable:
        return out, None
    return np.empty(shape, dt), out


def _deliver(result, final):
    if final is None:
        return result
    final[...] = result
    return final


def conv_forward(x, w, b, stride, pad, dilation, group, out=None, relu=None, after=None,
                 epilogue=None):
    """x (N, C, *S), w (O, C//group, *K), b (O,) or None -> y (N, O, *S_out), C-contiguous.

    With ``out`` (shape (N, O, *S_out)) the result is written there and
    returned, saving the caller a copy. With ``relu`` (a negative_slope) a ReLU follows
    (inside the engine's passes where it can). With ``after`` (a native.ImageStep on out's
    images) that step follows: on each image as it is written where the engine can take it,
    else over the whole batch. With ``epilogue`` (an epilogue.Epilogue; b must then be None,
    its bias folded into the epilogue's shift) the output is act(conv * scale + shift).
    """
    if epilogue is not None and (b is not None or relu is not None or after is not None):
        raise ValueError("conv_forward: an epilogue takes the place of b, relu and after")
    x = np.asarray(x)
    w = np.asarray(w)
    _check(x, w, group, "conv_forward")
    dt = _dtype(x, w, b)
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    if c != cg * group:
        raise ValueError(f"conv_forward: input has {c} channels, weights expect {cg * group}")
    g = geom(x.shape[2:], w.shape[2:], stride, pad, dilation)
    x = x.astype(dt, copy=False)
    w = w.astype(dt, copy=False)
    y, final = _target(out, (n, o) + g.out, dt, "conv_forward")
    bias = None if b is None else np.asarray(b, dt).reshape(o)
    if n:
        start = time.perf_counter()
        taken = _conv_forward_into(g, x, w, bias, y, group, dt, relu, after, epilogue)
        _observed(getattr(_looked, "key", None), start)
        if relu is not None and not taken:
            relu_forward(y, y, relu)
        if epilogue is not None and not taken:
            apply_epilogue(y, epilogue)
    y = _deliver(y, final)
    if after is not None and not after.ran:
        after.run()
    return y


def prepare_conv_forward(x, w, stride, pad, dilation, group, y, epilogue=None):
    """A call with no arguments that runs conv_forward(x, w, None, ..., out=y,
    epilogue=epilogue): for a forward that runs the same shapes again and again (an inference
    plan), with whatever x, w and the epilogue's arrays hold at the time of each call. The
    arrays are bound by identity: the caller keeps them (and their shapes) while it uses the
    call."""
    x, w = np.asarray(x), np.asarray(w)
    _check(x, w, group, "prepare_conv_forward")
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    dt = _dtype(x, w)
    g = geom(x.shape[2:], w.shape[2:], stride, pad, dilation)
    if (c != cg * group or y.shape != (n, o) + g.out or y.dtype != dt or x.dtype != dt
            or w.dtype != dt or not (y.flags.c_contiguous and x.flags.c_contiguous)):
        def run():
            conv_forward(x, w, None, stride, pad, dilation, group, out=y, epilogue=epilogue)
        return run
    if n == 0:
        return lambda: None
    prepared = _Prepared(g, x, w, y, group, dt, epilogue)
    return prepared if prepared.key is not None else prepared.run


class _Prepared:
    """prepare_conv_forward's call: the engine chosen once and its arguments bound; a pass
    far slower than its engine measured (calibrate.observe) makes it choose again."""

    def __init__(self, g, x, w, y, group, dt, epilogue):
        self.bound = (g, x, w, y, group, dt, epilogue)
        self._prepare()

    def _prepare(self):
        g, x, w, y, group, dt, epilogue = self.bound
        o, cg = w.shape[:2]
        engine = _engine(g, cg, o // group, group, x.shape[0], dt)
        # watched in use (calibrate.observe) unless it measured too fast to be worth a check
        self.key = _looked.key if calibrate.watched_seconds(_looked.key) >= WATCH_MIN else None
        self.engine = engine
        if engine == "depthwise" and w.flags.c_contiguous:
            epi = EpilogueArgs(epilogue, o, dt)
            call = depthwise.forward_call(g, x, w, y, group, dt, epi)
            if epi.refresh is None:
                self.run = call
            else:
                def run():
                    epi.refresh()
                    call()
                self.run = run
            return
        finish = None
        if epilogue is not None and not epilogue.is_identity:
            finish = prepare_epilogue(y, EpilogueArgs(epilogue, o, dt)) \
                if native.kernels(dt) is not None else (lambda: apply_epilogue(y, epilogue))
        if engine == "pointwise":
            conv = pointwise.prepare_forward(g, x, w, y, group)
        else:
            def conv():
                _conv_forward_into(g, x, w, None, y, group, dt, engine=engine)
        if finish is None:
            self.run = conv
            return

        def run():
            conv()
            finish()
        self.run = run

    def __call__(self):
        if self.key is None:
            self.run()
            return
        start = time.perf_counter()
        self.run()
        if _observed(self.key, start):
            self._prepare()


def _conv_forward_into(g, x, w, bias, y, group, dt, relu=None, after=None, epilogue=None,
                       engine=None):
    """Whether the engine took the ReLU `relu` (a negative_slope) or the epilogue too (and the
    step `after`: after.ran). `engine`: the one to run (default: the shape's choice)."""
    o, cg = w.shape[:2]
    if engine is None:
        engine = _engine(g, cg, o // group, group, x.shape[0], dt)
    if engine == "depthwise" and relu is None:
        depthwise.forward(g, x, w, bias, y, group, dt, epilogue)
        return True
    if engine == "depthwise":
        depthwise.forward(g, x, w, bias, y, group, dt)
    elif engine == "direct":
        taken = direct.forward(g, x, w, bias, y, group, dt, relu, after)
        return taken and epilogue is None
    elif engine == "winograd":
        winograd.forward(x, w, bias, y, g.pad, group, dt)
    elif engine == "pointwise":
        pointwise.forward(x, w, y, group, g)
        if bias is not None:
            y += bias.reshape(_bias_shape(g.nd))
    elif engine == "band":
        band.forward(g, x, w, bias, y, dt)
    elif engine == "im2col":
        cols.forward(g, x, w, bias, y, group, dt)
    else:
        grid.forward(g, x, w, bias, y, group, dt)


def conv_backward(dy, x, w, stride, pad, dilation, group,
                  need_dx=True, need_dw=True, need_db=True, dx_out=None, dx_relu=None,
                  before=None):
    """Gradients of conv_forward: (dx or None, dw or None, db or None).

    ``x`` is only read for dw; when need_dw is False it may be any object
    with the input's ``shape``. dw/db are this call's gradient alone. With
    ``dx_out`` (x's shape) dx is written there and returned. With ``dx_relu``,
    (gate, negative_slope), the backward of a ReLU whose output gate (x's shape) is
    follows on dx (inside the engine's passes where it can). With ``before`` (a
    native.ImageStep that makes dy), that step first: on each run of images just before the
    engine reads them where it can take it, else over the whole batch.
    """
    dy = np.asarray(dy)
    w = np.asarray(w)
    x_shape = tuple(x.shape)
    if need_dw:
        x = np.asarray(x)
    dt = _dtype(dy, w, x if need_dw else None)
    if dx_relu is not None and need_dx:
        gate = np.ascontiguousarray(dx_relu[0], dt)
        if gate.shape != x_shape:
            raise ValueError(f"conv_backward: the ReLU's output has shape {gate.shape}, "
                             f"expected {x_shape}")
        dx_relu = (gate, float(dx_relu[1]))
    if before is not None and dy.dtype != dt:
        before.run()
        before = None
    return _conv_backward(dy.astype(dt, copy=False), x if need_dw else None, x_shape,
                          w.astype(dt, copy=False), stride, pad, dilation, group,
                          need_dx, need_dw, need_db, dt, dx_out,
                          dx_relu if need_dx else None, before)


def _conv_backward(dy, x, x_shape, w, stride, pad, dilation, group,
                   need_dx, need_dw, need_db, dt, dx_out=None, dx_relu=None, before=None):
    if len(x_shape) < 3 or w.ndim != len(x_shape):
        raise ValueError(f"conv_backward: expected x (N, C, *S) and w with as many axes, "
                         f"got {x_shape} and {w.shape}")
    if group < 1 or w.shape[0] % group:
        raise ValueError(f"conv_backward: {w.shape[0]} filters are not divisible by "
                         f"group {group}")
    n, c = x_shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    if c != cg * group:
        raise ValueError(f"conv_backward: input has {c} channels, weights expect {cg * group}")
    g = geom(x_shape[2:], w.shape[2:], stride, pad, dilation)
    if dy.shape != (n, o) + g.out:
        raise ValueError(f"conv_backward: dy has shape {dy.shape}, expected {(n, o) + g.out}")
    if not (need_dx or need_dw or need_db):
        if before is not None:
            before.run()
        return None, None, None
    start = time.perf_counter()
    engine = _engine(g, cg, og, group, n, dt, calibrate.backward_pass(need_dx, need_dw))
    key = _looked.key
    whole = engine in ("winograd", "direct", "depthwise") and n > 0   # dx written in full
    if before is not None and not (whole and engine == "direct" and direct.takes_dy_step(
            g, w, group, need_dw, dt, before, dy)):
        before.run()        # a pass of its own, before anything reads dy
        before = None
    use_cols = engine in ("band", "im2col") and n > 0 and (need_dx or need_dw)
    dx = final = None
    if need_dx:
        dx, final = _target(dx_out, x_shape, dt, "conv_backward")
        if not (g.x_full or use_cols or whole):
            dx.fill(0)
    relu_done = False
    if whole and engine == "direct":
        dw, db, relu_done = direct.backward(g, dy, x, w, dx, group, need_dw, dt, need_db,
                                            dx_relu, before)
        if need_db and db is None:
            db = bias_diff(dy, dt)
    elif whole and engine == "depthwise":
        dw = depthwise.backward(g, dy, x, w, dx, group, need_dw, dt)
        db = bias_diff(dy, dt) if need_db else None
    elif whole:
        dw = winograd.backward(dy, x, w, dx, g.pad, group, need_dw, dt)
        db = bias_diff(dy, dt) if need_db else None
    elif use_cols:
        dw, db = _cols_backward(g, engine, dy, x, w, dx, group, need_dw, need_db, dt)
    else:
        db = bias_diff(dy, dt) if need_db else None
        dw = None
        if n == 0:
            dw = np.zeros(w.shape, dt) if need_dw else None
        elif engine == "pointwise" and (need_dx or need_dw):
            dw = pointwise.backward(np.ascontiguousarray(dy), x, w, dx, group, need_dw, g)
        elif need_dx or need_dw:
            dw = grid.backward(g, dy, x, w, dx, group, need_dw, dt)
    if dx_relu is not None and not relu_done:
        relu_backward(dx_relu[0], dx, dx, dx_relu[1])
    _observed(key, start)
    return (None if dx is None else _deliver(dx, final)), dw, db


def _cols_backward(g, engine, dy, x, w, dx, group, need_dw, need_db, dt):
    """(dw, db) of a band or im2col layer, and dx: a forward convolution of dy with flipped
    kernels when channels are many, else col2im."""
    cg = w.shape[1]
    need_dx = dx is not None
    dy = np.ascontiguousarray(dy)
    gt = _flipped_dx(g, cg) if need_dx else None
    if gt is not None:
        # dx is a forward convolution in its own right (dy has og channels per group):
        # small images stay on the band path, others take the engine that shape suits.
        if engine == "band":
            band.forward(gt, dy, flipped_weights(w, group), None, dx, dt)
        else:
            _conv_forward_into(gt, dy, flipped_weights(w, group), None, dx, group, dt)
    if engine == "im2col":
        return cols.backward(g, dy, x, w, dx if gt is None else None, group,
                               need_dw, need_db, dt)
    dw = db = None
    if need_dw:
        dw, db = band.backward(g, dy, x, w, need_db, dt)
    elif need_db:
        db = bias_diff(dy, dt)
    if need_dx and gt is None:
        cols.backward(g, dy, x, w, dx, group, False, False, dt)
    return dw, db


def _flipped_dx(g, cg):
    """The geometry of the forward convolution that computes a band or im2col layer's dx
    (with flipped kernels) when its channels are many, else None (col2im)."""
    return flipped_geom(g) if cg >= cols.FLIP_MIN_CHANNELS else None


def _deconv_geom_shape(x_shape, w, stride, pad, dilation, group):
    nd = len(x_shape) - 2
    kernel = w.shape[2:]
    stride = expand(stride, nd, "stride")
    pad = expand(pad, nd, "pad")
    dilation = expand(dilation, nd, "dilation")
    out = tuple(s * (i - 1) + d * (k - 1) + 1 - 2 * p
                for i, k, s, p, d in zip(x_shape[2:], kernel, stride, pad, dilation))
    if min(out, default=1) < 1:
        raise ValueError(f"deconvolution output would be empty: input {tuple(x_shape[2:])}")
    return (x_shape[0], w.shape[1] * group) + out


def deconv_forward(x, w, b, stride, pad, dilation, group, out=None):
    """Caffe Deconvolution: x (N, Cin, *S), w (Cin, Cout//group, *K), b (Cout,).

    With ``out`` the result is written there and returned.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    _check(x, w, group, "deconv_forward")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"deconv_forward: input has {x.shape[1]} channels, weights expect "
                         f"{w.shape[0]}")
    dt = _dtype(x, w, b)
    y_shape = _deconv_geom_shape(x.shape, w, stride, pad, dilation, group)
    y, final = _target(out, y_shape, dt, "deconv_forward")
    _conv_backward(x.astype(dt, copy=False), None, y_shape, w.astype(dt, copy=False),
                   stride, pad, dilation, group, True, False, False, dt, y)
    if b is not None:
        y += np.asarray(b, dt).reshape(_bias_shape(len(y_shape) - 2))
    return _deliver(y, final)


def deconv_backward(dy, x, w, stride, pad, dilation, group,
                    need_dx=True, need_dw=True, need_db=True, dx_out=None):
    """Gradients of deconv_forward: (dx or None, dw or None, db or None)."""
    dy = np.asarray(dy)
    x = np.asarray(x)
    w = np.asarray(w)
    dt = _dtype(dy, x, w)
    dy = dy.astype(dt, copy=False)
    x = x.astype(dt, copy=False)
    w = w.astype(dt, copy=False)
    db = bias_diff(dy, dt) if need_db else None
    dx = conv_forward(dy, w, None, stride, pad, dilation, group, out=dx_out) \
        if need_dx else None
    dw = None
    if need_dw:
        _, dw, _ = _conv_backward(x, dy, dy.shape, w, stride, pad, dilation, group,
                                  False, True, False, dt)
    return dx, dw, db
