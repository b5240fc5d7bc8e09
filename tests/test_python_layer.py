"""Caffe's Python layer: a pycaffe-style user module (which does `import caffe`) runs inside a
net and matches the built-in layer it re-implements."""
import sys

import numpy as np
import pytest

import caffepar as caffe
from caffepar.errors import LayerError

USER_MODULE = '''
import caffe
import numpy as np


class EuclideanLossLayer(caffe.Layer):
    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")
        self.scale = float(self.param_str or 1)

    def reshape(self, bottom, top):
        self.diff = np.zeros_like(bottom[0].data, dtype=np.float32)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = self.scale * np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if propagate_down[i]:
                sign = 1 if i == 0 else -1
                bottom[i].diff[...] = self.scale * sign * self.diff / bottom[i].num
'''

NET = """
force_backward: true
layer { name: "in" type: "Input" top: "a" top: "b"
        input_param { shape { dim: 3 dim: 4 } } }
layer { name: "loss" type: "%s" bottom: "a" bottom: "b" top: "loss" %s }
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_losses.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_losses"
    sys.modules.pop("user_losses", None)


def _run(text, a, b):
    path = text
    net = caffe.Net(path, caffe.TRAIN)
    net.blobs["a"].data[...] = a
    net.blobs["b"].data[...] = b
    loss = net.forward()["loss"].copy()
    net.backward()
    return loss, net.blobs["a"].diff.copy(), net.blobs["b"].diff.copy()


def test_python_layer_matches_builtin(tmp_path, user_module):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)).astype(np.float32)
    py = tmp_path / "py.prototxt"
    py.write_text(NET % ("Python", 'loss_weight: 1 python_param { module: "user_losses" '
                                   'layer: "EuclideanLossLayer" param_str: "2" }'))
    builtin = tmp_path / "builtin.prototxt"
    builtin.write_text(NET % ("EuclideanLoss", "loss_weight: 2"))
    got, want = _run(str(py), a, b), _run(str(builtin), a, b)
    np.testing.assert_allclose(got[0].reshape(()), 2 * want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)


def test_missing_python_class_names_the_layer(tmp_path, user_module):
    path = tmp_path / "bad.prototxt"
    path.write_text(NET % ("Python", 'python_param { module: "user_losses" layer: "Nope" }'))
    with pytest.raises(LayerError, match='layer "loss".*has no class "Nope"'):
        caffe.Net(str(path), caffe.TRAIN)
