"""Caffe's learning-rate policies (SGDSolver::GetLearningRate).

Caffe computes the rate in single precision from float solver fields; the arithmetic here runs
in float64 on those float32 values and rounds the result to float32, which agrees with Caffe to
the last bit or one ulp.
"""
import logging
import math

import numpy as np

from caffepar.errors import SolverError

log = logging.getLogger("caffepar")

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def _f(x):
    return float(np.float32(x))


def _pow(a, b):
    """C's pow: NaN for a negative base with a fractional exponent, inf for 0 ** negative."""
    if a == 0 and b < 0:
        return math.inf
    try:
        return math.pow(a, b)
    except ValueError:
        return math.nan
    except OverflowError:
        return math.inf


def learning_rate(param, iter_, current_step=0):
    """(rate, current_step) at iteration `iter_`. `step` recomputes current_step from iter_;
    `multistep` advances it by at most one stepvalue per call, as Caffe does, so it must be
    called once per iteration (the solver does)."""
    policy = param.lr_policy
    base_lr = _f(param.base_lr)
    gamma = _f(param.gamma)
    power = _f(param.power)

    def need_gamma():
        if gamma < 0:
            raise SolverError(f'lr_policy "{policy}" needs gamma >= 0, got {gamma:g}')

    def need_stepsize():
        if param.stepsize <= 0:
            raise SolverError(f'lr_policy "{policy}" needs stepsize > 0, got {param.stepsize}')

    if policy == "fixed":
        rate = base_lr
    elif policy == "step":
        need_stepsize()
        current_step = iter_ // param.stepsize
        need_gamma()
        rate = base_lr * _pow(gamma, current_step)
    elif policy == "exp":
        need_gamma()
        rate = base_lr * _pow(gamma, iter_)
    elif policy == "inv":
        need_gamma()
        rate = base_lr * _pow(_f(1.0 + _f(gamma * iter_)), -power)
    elif policy == "multistep":
        steps = param.stepvalue
        if current_step < len(steps) and iter_ >= steps[current_step]:
            current_step += 1
            log.info("MultiStep Status: Iteration %d, step = %d", iter_, current_step)
        need_gamma()
        rate = base_lr * _pow(gamma, current_step)
    elif policy == "poly":
        if param.max_iter <= 0:
            raise SolverError('lr_policy "poly" needs max_iter > 0')
        frac = 1.0 - _f(_f(iter_) / _f(param.max_iter))
        rate = base_lr * _pow(frac, power)
    elif policy == "sigmoid":
        need_gamma()
        need_stepsize()
        z = -gamma * (iter_ - param.stepsize)
        rate = base_lr * (0.0 if z > 700 else 1.0 / (1.0 + math.exp(z)))
    else:
        raise SolverError(f'unknown lr_policy "{policy}"',
                          hint=f"known policies: {', '.join(POLICIES)}")
    return _f(rate), current_step
