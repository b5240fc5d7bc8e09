"""Caffe's gradient preprocessing and update rules, applied in place to one parameter blob.

Each function follows the order of operations of Caffe's CPU code (SGDSolver::ClipGradients,
Normalize, Regularize and the solvers' ComputeUpdateValue), rounding to the blob's dtype after
every step as Caffe's BLAS calls do. They work on flat chunks of a blob so that a solver can bound
its scratch memory: `g` is the gradient (overwritten with the value to subtract from the data),
`hist` the history arrays of the same chunk, `scratch` one or two work arrays of the same size.
"""
import math

import numpy as np

from caffepar.errors import SolverError


def clip_gradients(diffs, clip):
    """Scale every gradient by clip / ||g|| when the global L2 norm exceeds `clip` (< 0: off).
    Returns (norm, scale) when it scaled, else None."""
    diffs = list(diffs)
    if clip < 0 or not diffs:
        return None
    f = diffs[0].dtype.type
    sumsq = f(0)
    for d in diffs:
        flat = d.reshape(-1)
        sumsq += f(np.dot(flat, flat))
    norm = f(math.sqrt(sumsq))
    if norm > clip:
        scale = f(clip) / norm
        for d in diffs:
            d *= scale
        return float(norm), float(scale)
    return None


def normalize(g, iter_size):
    """Undo the accumulation over iter_size forward/backward passes."""
    if iter_size != 1:
        g *= g.dtype.type(1.0 / iter_size)


REGULARIZATION = {"L2": 1, "L1": 2}
"""regularization_type -> its code in the compiled update."""


def regularization_code(kind):
    code = REGULARIZATION.get(kind)
    if code is None:
        raise SolverError(f'unknown regularization_type "{kind}" (known: L2, L1)')
    return code


def regularize(g, data, local_decay, kind, scratch):
    """Add weight decay: L2 adds decay * w, L1 adds decay * sign(w)."""
    if not local_decay:
        return
    t = g.dtype.type(local_decay)
    if regularization_code(kind) == 1:
        np.multiply(data, t, out=scratch)
    else:
        np.sign(data, out=scratch)
        scratch *= t
    g += scratch


class Rule:
    """One solver type's ComputeUpdateValue. `num_history` history sets of N blobs each.

    The compiled update (`caffepar.nn.native`, update.inc) repeats each rule's steps in the same
    order; `code` names the rule there and `kernel_args` gives its constants."""

    num_history = 1
    num_scratch = 1
    code = None

    def __init__(self, param):
        self.param = param

    def check(self):
        pass

    def update(self, g, hist, local_rate, iter_, scratch):
        raise NotImplementedError

    def kernel_args(self, local_rate, iter_):
        """(rate, momentum, second, delta) for the compiled update: second is RMSProp's
        rms_decay or Adam's momentum2, and Adam's rate includes its bias correction."""
        p = self.param
        return float(local_rate), p.momentum, p.rms_decay, p.delta


class SGD(Rule):
    """h = lr * g + momentum * h; step = h."""

    num_scratch = 0
    code = 0

    def update(self, g, hist, local_rate, iter_, scratch):
        h, = hist
        f = g.dtype.type
        g *= f(local_rate)
        h *= f(self.param.momentum)
        h += g
        g[...] = h


class Nesterov(Rule):
    """h' = lr * g + momentum * h; step = (1 + momentum) * h' - momentum * h."""

    code = 1

    def update(self, g, hist, local_rate, iter_, scratch):
        h, = hist
        s = scratch[0]
        f = g.dtype.type
        m = f(self.param.momentum)
        s[...] = h
        g *= f(local_rate)
        h *= m
        h += g
        np.multiply(h, f(1) + m, out=g)
        s *= -m
        g += s


class AdaGrad(Rule):
    """h += g^2; step = lr * g / (sqrt(h) + delta)."""

    code = 2

    def check(self):
        if self.param.momentum != 0:
            raise SolverError("Momentum cannot be used with AdaGrad.")

    def update(self, g, hist, local_rate, iter_, scratch):
        h, = hist
        s = scratch[0]
        f = g.dtype.type
        np.multiply(g, g, out=s)
        h += s
        np.sqrt(h, out=s)
        s += f(self.param.delta)
        np.divide(g, s, out=s)
        np.multiply(s, f(local_rate), out=g)


class RMSProp(Rule):
    """h = (1 - d) * g^2 + d * h; step = lr * g / (sqrt(h) + delta)."""

    code = 3

    def check(self):
        if self.param.momentum != 0:
            raise SolverError("Momentum cannot be used with RMSProp.")
        if not 0 <= self.param.rms_decay < 1:
            raise SolverError("rms_decay should lie between 0 and 1.")

    def update(self, g, hist, local_rate, iter_, scratch):
        h, = hist
        s = scratch[0]
        f = g.dtype.type
        decay = f(self.param.rms_decay)
        np.multiply(g, g, out=s)
        s *= f(1) - decay
        h *= decay
        h += s
        np.sqrt(h, out=s)
        s += f(self.param.delta)
        np.divide(g, s, out=s)
        np.multiply(s, f(local_rate), out=g)


class AdaDelta(Rule):
    """hg = m * hg + (1 - m) * g^2; u = g * sqrt((hu + delta) / (hg + delta));
    hu = m * hu + (1 - m) * u^2; step = lr * u."""

    num_history = 2
    num_scratch = 2
    code = 4

    def update(self, g, hist, local_rate, iter_, scratch):
        hg, hu = hist
        s, t = scratch
        f = g.dtype.type
        m = f(self.param.momentum)
        one_m = f(1) - m
        delta = f(self.param.delta)
        np.multiply(g, g, out=s)
        s *= one_m
        hg *= m
        hg += s
        np.add(hu, delta, out=s)
        np.add(hg, delta, out=t)
        np.divide(s, t, out=s)
        np.sqrt(s, out=s)
        g *= s
        np.multiply(g, g, out=s)
        s *= one_m
        hu *= m
        hu += s
        g *= f(local_rate)


class Adam(Rule):
    """m = b1 * m + (1 - b1) * g; v = b2 * v + (1 - b2) * g^2;
    step = lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), t = iter + 1."""

    num_history = 2
    code = 5

    @staticmethod
    def correction(b1, b2, iter_):
        t = iter_ + 1
        return math.sqrt(1.0 - float(b2) ** t) / (1.0 - float(b1) ** t)

    def kernel_args(self, local_rate, iter_):
        f = type(local_rate)
        p = self.param
        correction = f(self.correction(f(p.momentum), f(p.momentum2), iter_))
        return float(local_rate * correction), p.momentum, p.momentum2, p.delta

    def update(self, g, hist, local_rate, iter_, scratch):
        mh, vh = hist
        s = scratch[0]
        f = g.dtype.type
        b1 = f(self.param.momentum)
        b2 = f(self.param.momentum2)
        correction = f(self.correction(b1, b2, iter_))
        np.multiply(g, f(1) - b1, out=s)
        mh *= b1
        mh += s
        np.multiply(g, g, out=s)
        s *= f(1) - b2
        vh *= b2
        vh += s
        np.sqrt(vh, out=s)
        s += f(self.param.delta)
        np.divide(mh, s, out=s)
        np.multiply(s, f(local_rate) * correction, out=g)


RULES = {"SGD": SGD, "Nesterov": Nesterov, "AdaGrad": AdaGrad, "RMSProp": RMSProp,
         "AdaDelta": AdaDelta, "Adam": Adam}


def make_rule(type_name, param):
    cls = RULES.get(type_name)
    if cls is None:
        raise SolverError(f'unknown solver type "{type_name}"',
                          hint=f"known types: {', '.join(RULES)}")
    rule = cls(param)
    rule.check()
    return rule
