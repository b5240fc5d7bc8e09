"""LSTM, RNN and LSTMUnit: forward against a plain NumPy recurrence, gradient checks, state
carrying and exposed hidden states."""
import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

RNG = np.random.default_rng(11)


def net_text(layer, inputs, tops=("y",), extra="recurrent_param { num_output: 3 }", name="r"):
    names = " ".join(f'top: "{n}"' for n in inputs)
    shapes = " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }"
                      for s in inputs.values())
    bottoms = " ".join(f'bottom: "{n}"' for n in inputs)
    top_lines = " ".join(f'top: "{t}"' for t in tops)
    return (f'force_backward: true\nlayer {{ name: "input" type: "Input" {names}\n'
            f"  input_param {{ {shapes} }} }}\n"
            f'layer {{ name: "{name}" type: "{layer}" {bottoms} {top_lines}\n  {extra} }}\n')


def build(text, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST, dtype=dtype)


def randomize_params(net, scale=0.5):
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = RNG.standard_normal(b.shape) * scale


def run(net, **inputs):
    for k, v in inputs.items():
        net.blobs[k].data[...] = v
    net.forward()
    return net


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def ref_lstm(x, cont, w_xc, b_c, w_hc, xs=None, w_s=None, h0=None, c0=None):
    t_, n = cont.shape
    hd = w_hc.shape[1]
    h = np.zeros((n, hd)) if h0 is None else h0
    c = np.zeros((n, hd)) if c0 is None else c0
    out = []
    for t in range(t_):
        k = cont[t][:, None]
        z = x[t].reshape(n, -1) @ w_xc.T + b_c + (k * h) @ w_hc.T
        if xs is not None:
            z = z + xs.reshape(n, -1) @ w_s.T
        i, f, o, g = (z[:, j * hd:(j + 1) * hd] for j in range(4))
        c = k * sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        out.append(h)
    return np.stack(out), h, c


def ref_rnn(x, cont, w_xh, b_h, w_hh, w_ho, b_o, xs=None, w_s=None, h0=None):
    t_, n = cont.shape
    h = np.zeros((n, w_hh.shape[0])) if h0 is None else h0
    out = []
    for t in range(t_):
        z = x[t].reshape(n, -1) @ w_xh.T + b_h + (cont[t][:, None] * h) @ w_hh.T
        if xs is not None:
            z = z + xs.reshape(n, -1) @ w_s.T
        h = np.tanh(z)
        out.append(np.tanh(h @ w_ho.T + b_o))
    return np.stack(out), h


CONT = np.array([[0, 0], [1, 1], [1, 0], [1, 1]], float)


def test_lstm_param_layout():
    net = build(net_text("LSTM", {"x": (4, 2, 5), "cont": (4, 2)}))
    assert [b.shape for b in net.params["r"]] == [(12, 5), (12,), (12, 3)]
    net = build(net_text("LSTM", {"x": (4, 2, 5), "cont": (4, 2), "xs": (2, 6)}))
    assert [b.shape for b in net.params["r"]] == [(12, 5), (12,), (12, 6), (12, 3)]
    net = build(net_text("RNN", {"x": (4, 2, 5), "cont": (4, 2), "xs": (2, 6)}))
    assert [b.shape for b in net.params["r"]] == [(3, 5), (3,), (3, 6), (3, 3), (3, 3), (3,)]


@pytest.mark.parametrize("static", [False, True])
def test_lstm_forward_and_gradients(static):
    x = RNG.standard_normal((4, 2, 2, 2))
    inputs = {"x": x, "cont": CONT}
    if static:
        inputs["xs"] = RNG.standard_normal((2, 3))
    text = net_text("LSTM", {k: v.shape for k, v in inputs.items()},
                    extra='recurrent_param { num_output: 3 weight_filler { type: "gaussian" '
                          'std: 0.5 } bias_filler { type: "uniform" min: -0.5 max: 0.5 } }')
    net = run(build(text), **inputs)
    p = [b.data for b in net.params["r"]]
    if static:
        want, _, _ = ref_lstm(x, CONT, p[0], p[1], p[3], inputs["xs"], p[2])
    else:
        want, _, _ = ref_lstm(x, CONT, *p)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-10)
    check_net_gradients(text, inputs, skip_bottoms=("cont",))


@pytest.mark.parametrize("static", [False, True])
def test_rnn_forward_and_gradients(static):
    x = RNG.standard_normal((4, 2, 3))
    inputs = {"x": x, "cont": CONT}
    if static:
        inputs["xs"] = RNG.standard_normal((2, 2))
    text = net_text("RNN", {k: v.shape for k, v in inputs.items()},
                    extra='recurrent_param { num_output: 3 weight_filler { type: "gaussian" '
                          'std: 0.6 } bias_filler { type: "gaussian" std: 0.3 } }')
    net = run(build(text), **inputs)
    p = [b.data for b in net.params["r"]]
    if static:
        want, _ = ref_rnn(x, CONT, p[0], p[1], p[3], p[4], p[5], inputs["xs"], p[2])
    else:
        want, _ = ref_rnn(x, CONT, *p)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-10)
    check_net_gradients(text, inputs, skip_bottoms=("cont",))


@pytest.mark.parametrize("layer", ["LSTM", "RNN"])
def test_state_carries_across_forwards(layer):
    """Without expose_hidden, the last state of one batch starts the next (cont = 1)."""
    x = RNG.standard_normal((4, 2, 3))
    cont = np.array([[0, 0], [1, 1], [1, 1], [1, 1]], float)
    whole = build(net_text(layer, {"x": (4, 2, 3), "cont": (4, 2)}))
    randomize_params(whole)
    run(whole, x=x, cont=cont)
    half = build(net_text(layer, {"x": (2, 2, 3), "cont": (2, 2)}))
    for mine, theirs in zip(half.params["r"], whole.params["r"]):
        mine.data[...] = theirs.data
    first = run(half, x=x[:2], cont=cont[:2]).blobs["y"].data.copy()
    second = run(half, x=x[2:], cont=cont[2:]).blobs["y"].data.copy()
    np.testing.assert_allclose(np.concatenate([first, second]), whole.blobs["y"].data,
                               rtol=1e-12)


def test_lstm_expose_hidden_chains_two_halves():
    x = RNG.standard_normal((4, 2, 3))
    cont = np.array([[0, 1], [1, 1], [1, 0], [1, 1]], float)
    extra = "recurrent_param { num_output: 3 expose_hidden: true }"
    whole = build(net_text("LSTM", {"x": (4, 2, 3), "cont": (4, 2), "h0": (1, 2, 3),
                                    "c0": (1, 2, 3)}, ("y", "hT", "cT"), extra))
    randomize_params(whole)
    h0, c0 = RNG.standard_normal((1, 2, 3)), RNG.standard_normal((1, 2, 3))
    run(whole, x=x, cont=cont, h0=h0, c0=c0)
    p = [b.data for b in whole.params["r"]]
    want, h_t, c_t = ref_lstm(x, cont, *p, h0=h0[0], c0=c0[0])
    np.testing.assert_allclose(whole.blobs["y"].data, want, rtol=1e-10)
    np.testing.assert_allclose(whole.blobs["hT"].data[0], h_t, rtol=1e-10)
    np.testing.assert_allclose(whole.blobs["cT"].data[0], c_t, rtol=1e-10)
    half = build(net_text("LSTM", {"x": (2, 2, 3), "cont": (2, 2), "h0": (1, 2, 3),
                                   "c0": (1, 2, 3)}, ("y", "hT", "cT"), extra))
    for mine, theirs in zip(half.params["r"], whole.params["r"]):
        mine.data[...] = theirs.data
    run(half, x=x[:2], cont=cont[:2], h0=h0, c0=c0)
    first = half.blobs["y"].data.copy()
    run(half, x=x[2:], cont=cont[2:], h0=half.blobs["hT"].data.copy(),
        c0=half.blobs["cT"].data.copy())
    np.testing.assert_allclose(np.concatenate([first, half.blobs["y"].data]),
                               whole.blobs["y"].data, rtol=1e-12)


def test_rnn_expose_hidden():
    x = RNG.standard_normal((3, 2, 2))
    extra = "recurrent_param { num_output: 3 expose_hidden: true }"
    net = build(net_text("RNN", {"x": (3, 2, 2), "cont": (3, 2), "h0": (1, 2, 3)},
                         ("y", "hT"), extra))
    randomize_params(net)
    h0 = RNG.standard_normal((1, 2, 3))
    cont = np.ones((3, 2))
    run(net, x=x, cont=cont, h0=h0)
    want, h_t = ref_rnn(x, cont, *[b.data for b in net.params["r"]], h0=h0[0])
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-10)
    np.testing.assert_allclose(net.blobs["hT"].data[0], h_t, rtol=1e-10)


def test_recurrent_shape_errors():
    with pytest.raises(CaffeparError, match="cont"):
        build(net_text("LSTM", {"x": (4, 2, 3), "cont": (4, 3)}))
    with pytest.raises(CaffeparError, match="num_output"):
        build(net_text("RNN", {"x": (4, 2, 3), "cont": (4, 2)}, extra=""))
    with pytest.raises(CaffeparError, match="bottom"):
        build(net_text("LSTM", {"x": (4, 2, 3), "cont": (4, 2), "h0": (1, 2, 3)},
                       ("y", "hT", "cT"), "recurrent_param { num_output: 3 expose_hidden: true }"))


def test_lstm_float32():
    x = RNG.standard_normal((3, 2, 4)).astype(np.float32)
    cont = np.array([[0, 0], [1, 1], [1, 1]], np.float32)
    net = build(net_text("LSTM", {"x": x.shape, "cont": cont.shape}), dtype=np.float32)
    randomize_params(net)
    run(net, x=x, cont=cont)
    p = [b.data.astype(float) for b in net.params["r"]]
    want, _, _ = ref_lstm(x.astype(float), cont.astype(float), *p)
    assert net.blobs["y"].data.dtype == np.float32
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ LSTMUnit
@pytest.mark.parametrize("cont", [[1, 1, 0], [0, 1, 1]])
def test_lstm_unit(cont):
    c_prev = RNG.standard_normal((1, 3, 2))
    gates = RNG.standard_normal((1, 3, 8))
    cont = np.array([cont], float)
    inputs = {"c_prev": c_prev, "gates": gates, "cont": cont}
    text = net_text("LSTMUnit", {k: v.shape for k, v in inputs.items()}, ("c", "h"), extra="")
    net = run(build(text), **inputs)
    g = gates[0]
    i, f, o, gg = sigmoid(g[:, :2]), sigmoid(g[:, 2:4]), sigmoid(g[:, 4:6]), np.tanh(g[:, 6:])
    c = cont[0][:, None] * f * c_prev[0] + i * gg
    np.testing.assert_allclose(net.blobs["c"].data[0], c, rtol=1e-12)
    np.testing.assert_allclose(net.blobs["h"].data[0], o * np.tanh(c), rtol=1e-12)
    check_net_gradients(text, inputs, skip_bottoms=("cont",))
