"""Recurrent layers (RNN, LSTM) and LSTMUnit, computed with an explicit time loop.

Semantics follow Caffe's RecurrentLayer, which unrolls the recurrence into an internal net:
bottoms x (T x N x ...), cont (T x N: 0 starts a new sequence), optional x_static (N x ...),
then with expose_hidden the initial hidden state(s); parameter blobs appear in the order the
unrolled net first uses them. Without expose_hidden the last state of one forward is the first
state of the next. As in Caffe, gradients stop at the batch boundary: diffs on exposed final
states are ignored and exposed initial-state bottoms receive no diff.
"""
import numpy as np

from caffepar.nn.base import Layer, register
from caffepar.nn.blas import gemm


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _unit_tanh(x):
    """tanh written as LSTMUnit does: 2 sigmoid(2x) - 1."""
    return 2.0 * _sigmoid(2.0 * x) - 1.0


def lstm_unit_forward(c_prev, gates, cont):
    """One LSTM step on (N, H) / (N, 4H) / (N,); returns c, h and the activations backward needs."""
    hd = c_prev.shape[1]
    i = _sigmoid(gates[:, :hd])
    f = _sigmoid(gates[:, hd:2 * hd])
    f *= cont[:, None]
    o = _sigmoid(gates[:, 2 * hd:3 * hd])
    g = _unit_tanh(gates[:, 3 * hd:])
    c = f * c_prev + i * g
    tanh_c = _unit_tanh(c)
    h = o * tanh_c
    return c, h, (i, f, o, g, tanh_c)


def lstm_unit_backward(c_prev, acts, dc, dh, dgates):
    """Gradients of one step: fills dgates (N, 4H), returns the diff of c_prev."""
    i, f, o, g, tanh_c = acts
    hd = c_prev.shape[1]
    c_term = dc + dh * o * (1 - tanh_c * tanh_c)
    dgates[:, :hd] = c_term * g * i * (1 - i)
    dgates[:, hd:2 * hd] = c_term * c_prev * f * (1 - f)
    dgates[:, 2 * hd:3 * hd] = dh * tanh_c * o * (1 - o)
    dgates[:, 3 * hd:] = c_term * i * (1 - g * g)
    return c_term * f


class RecurrentLayer(Layer):
    """What RNN and LSTM share: bottom/top layout, input projections, state carrying."""

    num_states = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        expose = self.param.recurrent_param.expose_hidden
        self.min_bottoms = 2 + (self.num_states if expose else 0)
        self.max_bottoms = self.min_bottoms + 1
        self.exact_tops = 1 + (self.num_states if expose else 0)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def layer_setup(self, bottom, top):
        p = self.param.recurrent_param
        self.hidden = self.positive(p.num_output, "num_output")
        self.expose = p.expose_hidden
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 2:
            raise self.error(f"bottom[0] must have at least 2 axes (timesteps, streams, ...), "
                             f"got shape {x.shape}")
        if cont.num_axes != 2 or cont.shape != x.shape[:2]:
            raise self.error(f"bottom[1] (cont) must be timesteps x streams {x.shape[:2]}, got "
                             f"{cont.shape}")
        self.T = x.shape[0]
        self.input_dim = int(np.prod(x.shape[2:]))
        self.static = len(bottom) > 2 + (self.num_states if self.expose else 0)
        if self.static:
            if bottom[2].num_axes < 1 or bottom[2].shape[0] != x.shape[1]:
                raise self.error(f"x_static (bottom[2]) must have the streams ({x.shape[1]}) as "
                                 f"its first axis, got shape {bottom[2].shape}")
            self.static_dim = int(np.prod(bottom[2].shape[1:]))
        self.states = None
        if not self.blobs_already_set(len(self.param_shapes())):
            for shape, kind in self.param_shapes():
                self.add_param_blob(shape, p.weight_filler if kind == "w" else p.bias_filler)
        else:
            for blob, (shape, _) in zip(self.blobs, self.param_shapes()):
                if blob.shape != shape:
                    raise self.error(f"parameter blob shape {blob.shape}, expected {shape}")

    def reshape(self, bottom, top):
        x, cont = bottom[0], bottom[1]
        if x.num_axes < 2 or x.shape[0] != self.T:
            raise self.error(f"input number of timesteps changed: expected {self.T}, got shape "
                             f"{x.shape}")
        n = x.shape[1]
        if cont.shape != (self.T, n):
            raise self.error(f"cont must have shape {(self.T, n)}, got {cont.shape}")
        if int(np.prod(x.shape[2:])) != self.input_dim:
            raise self.error(f"input size changed: expected {self.input_dim} values per step, "
                             f"got shape {x.shape}")
        if self.static and (bottom[2].shape[0] != n or
                            int(np.prod(bottom[2].shape[1:])) != self.static_dim):
            raise self.error(f"x_static shape {bottom[2].shape} does not match {n} streams of "
                             f"{self.static_dim} values")
        if self.expose:
            first = 3 if self.static else 2
            for j, b in enumerate(bottom[first:]):
                if b.shape != (1, n, self.hidden):
                    raise self.error(f"exposed hidden bottom {first + j} must have shape "
                                     f"{(1, n, self.hidden)}, got {b.shape}")
            for t in top[1:]:
                t.reshape((1, n, self.hidden))
        top[0].reshape((self.T, n, self.output_dim()))
        if self.states is not None and self.states[0].shape[0] != n:
            self.states = None
        self.n = n

    def output_dim(self):
        return self.hidden

    def initial_states(self, bottom):
        n = self.n
        if self.expose:
            first = 3 if self.static else 2
            return [b.data.reshape(n, self.hidden) for b in bottom[first:first + self.num_states]]
        if self.states is None:
            return [np.zeros((n, self.hidden), self.dtype) for _ in range(self.num_states)]
        return self.states

    def project_inputs(self, bottom, w_x, b_x, w_static):
        """x W^T + b for all steps at once (T, N, G), and x_static W_s^T (N, G) or None."""
        x = bottom[0].data.reshape(self.T * self.n, self.input_dim)
        gx = np.empty((self.T * self.n, w_x.shape[0]), self.dtype)
        gemm(x, w_x.T, gx)
        gx += b_x
        gs = None
        if self.static:
            xs = bottom[2].data.reshape(self.n, self.static_dim)
            gs = np.empty((self.n, w_static.shape[0]), self.dtype)
            gemm(xs, w_static.T, gs)
        return gx.reshape(self.T, self.n, -1), gs

    def project_backward(self, bottom, propagate_down, dg, ix, ib, istatic):
        """Input-projection gradients from dg (T, N, G), the gradient of the pre-activations."""
        tn = self.T * self.n
        dg2 = dg.reshape(tn, -1)
        x = bottom[0].data.reshape(tn, self.input_dim)
        if self.param_propagate_down[ix]:
            gemm(dg2.T, x, self.blobs[ix].diff, beta=1.0)
        if self.param_propagate_down[ib]:
            self.blobs[ib].diff += dg2.sum(axis=0)
        if propagate_down[0]:
            gemm(dg2, self.blobs[ix].data, bottom[0].diff.reshape(tn, self.input_dim))
        if self.static:
            ds = dg.sum(axis=0)
            xs = bottom[2].data.reshape(self.n, self.static_dim)
            if self.param_propagate_down[istatic]:
                gemm(ds.T, xs, self.blobs[istatic].diff, beta=1.0)
            if propagate_down[2]:
                gemm(ds, self.blobs[istatic].data,
                     bottom[2].diff.reshape(self.n, self.static_dim))

    def check_cont_backward(self, propagate_down):
        if propagate_down[1]:
            raise self.error("cannot backpropagate to sequence indicators (cont)")


@register("LSTM")
class LSTMLayer(RecurrentLayer):
    """Long short-term memory. Blobs: W_xc (4H x I), b_c (4H), [W_xc_static (4H x S)],
    W_hc (4H x H); gate rows ordered i, f, o, g."""

    num_states = 2

    def param_shapes(self):
        g = 4 * self.hidden
        shapes = [((g, self.input_dim), "w"), ((g,), "b")]
        if self.static:
            shapes.append(((g, self.static_dim), "w"))
        shapes.append(((g, self.hidden), "w"))
        return shapes

    def forward(self, bottom, top):
        w_static = self.blobs[2].data if self.static else None
        w_h = self.blobs[-1].data
        gx, gs = self.project_inputs(bottom, self.blobs[0].data, self.blobs[1].data, w_static)
        cont = bottom[1].data
        h_prev, c_prev = self.initial_states(bottom)
        n, hd = self.n, self.hidden
        self.h_conted = np.empty((self.T, n, hd), self.dtype)
        self.c_prevs = np.empty((self.T, n, hd), self.dtype)
        self.acts = []
        hs = top[0].data
        gates = np.empty((n, 4 * hd), self.dtype)
        for t in range(self.T):
            np.multiply(h_prev, cont[t][:, None], out=self.h_conted[t])
            gemm(self.h_conted[t], w_h.T, gates)
            gates += gx[t]
            if gs is not None:
                gates += gs
            self.c_prevs[t] = c_prev
            c, h, acts = lstm_unit_forward(c_prev, gates, cont[t])
            self.acts.append(acts)
            hs[t] = h
            h_prev, c_prev = h, c
        self.states = [np.array(h_prev), np.array(c_prev)]
        if self.expose:
            top[1].data[...] = h_prev
            top[2].data[...] = c_prev

    def backward(self, top, propagate_down, bottom):
        self.check_cont_backward(propagate_down)
        n, hd = self.n, self.hidden
        cont = bottom[1].data
        w_h = self.blobs[-1].data
        dy = top[0].diff
        dgates = np.empty((self.T, n, 4 * hd), self.dtype)
        dh_next = np.zeros((n, hd), self.dtype)
        dc_next = np.zeros((n, hd), self.dtype)
        for t in range(self.T - 1, -1, -1):
            dh = dy[t] + dh_next
            dc_next = lstm_unit_backward(self.c_prevs[t], self.acts[t], dc_next, dh, dgates[t])
            dh_next = dgates[t] @ w_h
            dh_next *= cont[t][:, None]
        ih = len(self.blobs) - 1
        if self.param_propagate_down[ih]:
            gemm(dgates.reshape(-1, 4 * hd).T, self.h_conted.reshape(-1, hd),
                 self.blobs[ih].diff, beta=1.0)
        self.project_backward(bottom, propagate_down, dgates, 0, 1, 2)


@register("RNN")
class RNNLayer(RecurrentLayer):
    """Elman RNN: h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h), o_t = tanh(W_ho h_t + b_o).
    Blobs: W_xh, b_h, [W_xh_static], W_hh, W_ho, b_o."""

    num_states = 1

    def param_shapes(self):
        h = self.hidden
        shapes = [((h, self.input_dim), "w"), ((h,), "b")]
        if self.static:
            shapes.append(((h, self.static_dim), "w"))
        shapes += [((h, h), "w"), ((h, h), "w"), ((h,), "b")]
        return shapes

    def forward(self, bottom, top):
        s = 1 if self.static else 0
        w_static = self.blobs[2].data if self.static else None
        w_hh, w_ho, b_o = (self.blobs[2 + s + k].data for k in range(3))
        gx, gs = self.project_inputs(bottom, self.blobs[0].data, self.blobs[1].data, w_static)
        cont = bottom[1].data
        (h_prev,) = self.initial_states(bottom)
        n, hd = self.n, self.hidden
        self.h_conted = np.empty((self.T, n, hd), self.dtype)
        self.h = np.empty((self.T, n, hd), self.dtype)
        for t in range(self.T):
            np.multiply(h_prev, cont[t][:, None], out=self.h_conted[t])
            z = self.h[t]
            gemm(self.h_conted[t], w_hh.T, z)
            z += gx[t]
            if gs is not None:
                z += gs
            np.tanh(z, out=z)
            h_prev = z
        o = top[0].data.reshape(self.T * n, hd)
        gemm(self.h.reshape(-1, hd), w_ho.T, o)
        o += b_o
        np.tanh(o, out=o)
        self.states = [np.array(h_prev)]
        if self.expose:
            top[1].data[...] = h_prev

    def backward(self, top, propagate_down, bottom):
        self.check_cont_backward(propagate_down)
        s = 1 if self.static else 0
        i_hh, i_ho, i_bo = 2 + s, 3 + s, 4 + s
        n, hd = self.n, self.hidden
        cont = bottom[1].data
        o = top[0].data.reshape(-1, hd)
        dzo = top[0].diff.reshape(-1, hd) * (1 - o * o)
        hflat = self.h.reshape(-1, hd)
        if self.param_propagate_down[i_ho]:
            gemm(dzo.T, hflat, self.blobs[i_ho].diff, beta=1.0)
        if self.param_propagate_down[i_bo]:
            self.blobs[i_bo].diff += dzo.sum(axis=0)
        dh_out = (dzo @ self.blobs[i_ho].data).reshape(self.T, n, hd)
        w_hh = self.blobs[i_hh].data
        dz = np.empty((self.T, n, hd), self.dtype)
        dh_next = np.zeros((n, hd), self.dtype)
        for t in range(self.T - 1, -1, -1):
            h = self.h[t]
            np.multiply(dh_out[t] + dh_next, 1 - h * h, out=dz[t])
            dh_next = dz[t] @ w_hh
            dh_next *= cont[t][:, None]
        if self.param_propagate_down[i_hh]:
            gemm(dz.reshape(-1, hd).T, self.h_conted.reshape(-1, hd), self.blobs[i_hh].diff,
                 beta=1.0)
        self.project_backward(bottom, propagate_down, dz, 0, 1, 2)


@register("LSTMUnit")
class LSTMUnitLayer(Layer):
    """One LSTM step: bottoms c_{t-1} (1 x N x H), gate inputs (1 x N x 4H), cont (1 x N);
    tops c_t, h_t."""

    exact_bottoms = 3
    exact_tops = 2

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def reshape(self, bottom, top):
        n = bottom[0].shape[1] if bottom[0].num_axes > 1 else -1
        for i, b in enumerate(bottom):
            axes = 2 if i == 2 else 3
            if b.num_axes != axes or b.shape[0] != 1 or b.shape[1] != n:
                raise self.error(f"bottom[{i}] must have {axes} axes of shape (1, {n}, ...), got "
                                 f"{b.shape}")
        self.hd = bottom[0].shape[2]
        if bottom[1].shape[2] != 4 * self.hd:
            raise self.error(f"gate input must have 4 x {self.hd} values per stream, got "
                             f"{bottom[1].shape}")
        top[0].reshape(bottom[0].shape)
        top[1].reshape(bottom[0].shape)
        self.n = n

    def forward(self, bottom, top):
        c_prev = bottom[0].data.reshape(self.n, self.hd)
        gates = bottom[1].data.reshape(self.n, 4 * self.hd)
        cont = bottom[2].data.reshape(self.n)
        c, h, _ = lstm_unit_forward(c_prev, gates, cont)
        top[0].data[...] = c.reshape(top[0].shape)
        top[1].data[...] = h.reshape(top[1].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[2]:
            raise self.error("cannot backpropagate to sequence indicators (cont)")
        if not (propagate_down[0] or propagate_down[1]):
            return
        c_prev = bottom[0].data.reshape(self.n, self.hd)
        gates = bottom[1].data.reshape(self.n, 4 * self.hd)
        cont = bottom[2].data.reshape(self.n)
        _, _, acts = lstm_unit_forward(c_prev, gates, cont)
        acts = acts[:4] + (_unit_tanh(top[0].data.reshape(self.n, self.hd)),)
        dgates = np.empty((self.n, 4 * self.hd), self.dtype)
        dc_prev = lstm_unit_backward(c_prev, acts, top[0].diff.reshape(self.n, self.hd),
                                     top[1].diff.reshape(self.n, self.hd), dgates)
        if propagate_down[0]:
            bottom[0].diff[...] = dc_prev.reshape(bottom[0].shape)
        if propagate_down[1]:
            bottom[1].diff[...] = dgates.reshape(bottom[1].shape)
