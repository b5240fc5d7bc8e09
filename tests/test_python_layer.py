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


@pytest.mark.parametrize("source, last_line", [
    ('raise RuntimeError("no GPU here")\n', "RuntimeError: no GPU here"),
    ("def broken(:\n    pass\n", "SyntaxError: invalid syntax (failing_module.py, line 1)"),
])
@pytest.mark.parametrize("command", ["info", "time", "train"])
def test_python_module_that_fails_to_import_is_one_line(tmp_path, capsys, source, last_line,
                                                        command):
    """A module whose own code raises (or does not compile) is named with its layer and the
    error's last line, without a traceback, in every command; --debug shows the traceback."""
    from caffepar.cli import main
    (tmp_path / "failing_module.py").write_text(source)
    net = tmp_path / "net.prototxt"
    net.write_text(NET % ("Python", 'python_param { module: "failing_module" layer: "L" }'))
    (tmp_path / "solver.prototxt").write_text(f'net: "{net}"\nbase_lr: 0.1\nmax_iter: 1\n'
                                              'lr_policy: "fixed"\n')
    argv = {"info": ["convert", "info", str(net)],
            "time": ["time", "--model", str(net), "--iterations", "1"],
            "train": ["train", "--solver", str(tmp_path / "solver.prototxt")]}[command]
    try:
        with pytest.raises(SystemExit) as ended:
            main(argv)
        err = capsys.readouterr().err
        assert ended.value.code == 1
        assert err.strip().splitlines()[-1] == (
            f'caffepar: {net}:5: error: layer "loss" (Python): python module "failing_module" '
            f'(class "L") failed to import: {last_line}'), err
        assert "Traceback" not in err
        sys.modules.pop("failing_module", None)
        with pytest.raises(Exception) as shown:
            main(["--debug"] + argv)
        assert isinstance(shown.value.__cause__, (RuntimeError, SyntaxError))
    finally:
        sys.modules.pop("failing_module", None)
        sys.path[:] = [p for p in sys.path if p != str(tmp_path)]
