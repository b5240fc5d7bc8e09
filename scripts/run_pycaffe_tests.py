#!/usr/bin/env python
"""Run pycaffe's own test suite and examples against caffepar, from a Caffe checkout.

    python scripts/run_pycaffe_tests.py CAFFE_ROOT [-v] [-k PATTERN] [--fcn FCN_ROOT]

CAFFE_ROOT is a BVLC Caffe source tree (nothing is downloaded). `import caffe` gives caffepar
(caffe.proto.caffe_pb2, caffe.draw, caffe.coord_map, ... included) and every test module of
python/caffe/test runs unchanged, test_nccl aside (NCCL is multi-GPU only). Then the examples:
examples/pycaffe/caffenet.py (NetSpec) must write the layers of models/bvlc_reference_caffenet
and a net that builds and runs; linreg.prototxt with layers/pyloss.py must give the loss and
gradients of caffepar's own EuclideanLoss; examples/finetune_pascal_detection's net (WindowData,
a loss without a top) must build and train on windows made here; python/draw_net.py must draw a
net (PNG when Graphviz's dot is installed, else its .raw dot source). With --fcn, a checkout of
fcn.berkeleyvision.org: every */net.py there (NetSpec and coord_map's crop) must write the
prototxts committed beside it (param_str dicts compared as dicts: those files were written by
Python 2). Tests run in a scratch directory (test_solver writes snapshots to the working
directory). The last line counts the results.
Needs the dev extras (six, which pycaffe's tests import, and pydot).
"""
import argparse
import os
import runpy
import shutil
import sys
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SKIPPED_MODULES = {"test_nccl"}


def _python_compat():
    """Names pycaffe's tests use that Python 3.12 removed from unittest (deprecated aliases)."""
    case = unittest.TestCase
    for old, new in (("assertRaisesRegexp", "assertRaisesRegex"), ("assertEquals", "assertEqual"),
                     ("assertItemsEqual", "assertCountEqual")):
        if not hasattr(case, old):
            setattr(case, old, getattr(case, new))


def _test_modules(test_dir, pattern):
    names = sorted(p.stem for p in test_dir.glob("test_*.py") if p.stem not in SKIPPED_MODULES)
    return [n for n in names if not pattern or pattern in n]


def _layer_signature(net):
    """What makes CaffeNet CaffeNet: each weighted or pooling layer's type and geometry."""
    rows = []
    for layer in net.layer:
        if layer.type in ("Convolution", "InnerProduct"):
            c = layer.convolution_param
            ip = layer.inner_product_param
            rows.append((layer.type, c.num_output or ip.num_output, tuple(c.kernel_size),
                         tuple(c.stride) or (1,), tuple(c.pad) or (0,), c.group))
        elif layer.type in ("Pooling", "LRN", "ReLU", "Dropout", "SoftmaxWithLoss"):
            p = layer.pooling_param
            rows.append((layer.type, p.kernel_size, p.stride, layer.lrn_param.local_size))
    return rows


class Examples(unittest.TestCase):
    caffe_root = None

    def test_caffenet_netspec(self):
        """caffenet.py writes CaffeNet's layers; the TEST net runs on dummy data."""
        import caffe
        from caffepar.proto.text import read_net_text
        runpy.run_path(str(self.caffe_root / "examples/pycaffe/caffenet.py"), run_name="__main__")
        train, _ = read_net_text("train.prototxt")
        test, _ = read_net_text("test.prototxt")
        reference, _ = read_net_text(str(self.caffe_root /
                                         "models/bvlc_reference_caffenet/train_val.prototxt"))
        self.assertEqual(_layer_signature(train), _layer_signature(reference))
        self.assertEqual([l.type for l in test.layer][-2:], ["SoftmaxWithLoss", "Accuracy"])
        data = test.layer[0]
        self.assertEqual((data.type, data.data_param.batch_size), ("Data", 50))
        data.type = "DummyData"
        data.ClearField("data_param")
        data.ClearField("transform_param")
        for dims in ((2, 3, 227, 227), (2,)):
            data.dummy_data_param.shape.add().dim.extend(dims)
        net = caffe.Net(test, caffe.TEST)
        out = net.forward()
        self.assertEqual(net.blobs[test.layer[-3].top[0]].data.shape, (2, 1000))
        self.assertTrue(0 <= out[test.layer[-1].top[0]].item() <= 1)

    def test_linreg_pyloss(self):
        """linreg.prototxt's Python EuclideanLossLayer agrees with caffepar's EuclideanLoss."""
        import caffe
        import numpy as np
        from caffepar.proto.text import read_net_text
        sys.path.insert(0, str(self.caffe_root / "examples/pycaffe/layers"))
        param, _ = read_net_text(str(self.caffe_root / "examples/pycaffe/linreg.prototxt"))
        python_net = caffe.Net(param, caffe.TRAIN)
        param.layer[-1].type = "EuclideanLoss"
        param.layer[-1].ClearField("python_param")
        native_net = caffe.Net(param, caffe.TRAIN)
        native_net.share_with(python_net)
        loss_py = python_net.forward()["loss"].item()
        python_net.backward()
        for name in ("x", "y", "ipx", "ipy"):
            native_net.blobs[name].data[...] = python_net.blobs[name].data
        loss = native_net.forward(start="loss")["loss"].item()
        native_net.backward()
        ipx, ipy = python_net.blobs["ipx"].data, python_net.blobs["ipy"].data
        self.assertAlmostEqual(loss_py, float(((ipx - ipy) ** 2).sum() / ipx.shape[0] / 2),
                               places=4)
        self.assertAlmostEqual(loss_py, loss, places=4)
        for name in ("ipx", "ipy"):
            np.testing.assert_allclose(python_net.blobs[name].diff, native_net.blobs[name].diff,
                                       rtol=1e-5, atol=1e-7)
            dw_py, dw = python_net.params[name][0].diff, native_net.params[name][0].diff
            self.assertTrue(np.abs(dw).max() > 0)
            np.testing.assert_allclose(dw_py, dw, rtol=1e-4, atol=1e-6)

    def test_finetune_pascal_detection_net(self):
        """examples/finetune_pascal_detection (WindowData, a loss layer with no top) builds and
        trains, on a window file and images made here instead of PASCAL's."""
        import caffe
        import numpy as np
        from PIL import Image
        from caffepar.io import array_to_blobproto
        from caffepar.proto.text import read_net_text
        rng = np.random.default_rng(0)
        lines = []
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(f"{i}.png")
            lines += [f"# {i}", os.path.abspath(f"{i}.png"), "3", "60", "80", "2",
                      f"{i + 1} 0.8 5 5 50 40", "0 0.1 30 20 79 59"]
        Path("windows.txt").write_text("\n".join(lines) + "\n")
        mean = np.full((1, 3, 256, 256), 110, np.float32)
        Path("mean.binaryproto").write_bytes(array_to_blobproto(mean).SerializeToString())
        param, _ = read_net_text(str(self.caffe_root / "examples/finetune_pascal_detection/"
                                                       "pascal_finetune_trainval_test.prototxt"))
        for layer in param.layer:
            if layer.type == "WindowData":
                layer.window_data_param.source = os.path.abspath("windows.txt")
                layer.window_data_param.batch_size = 4
                layer.transform_param.mean_file = os.path.abspath("mean.binaryproto")
        self.assertFalse(param.layer[-2].top, "the loss layer is written without a top")
        net = caffe.Net(param, caffe.TRAIN)
        self.assertEqual(net.outputs, [])
        loss = net.forward_backward()
        self.assertTrue(np.isfinite(loss) and loss > 0)
        self.assertEqual(list(net.blobs["label"].data[:3]), [0, 0, 0])
        accuracy = caffe.Net(param, caffe.TEST).forward()["accuracy"].item()
        self.assertTrue(0 <= accuracy <= 1)

    def test_draw_net_script(self):
        """python/draw_net.py draws linreg.prototxt."""
        ext = "png" if shutil.which("dot") else "raw"
        out = Path(f"linreg.{ext}")
        argv = sys.argv
        sys.argv = ["draw_net.py", str(self.caffe_root / "examples/pycaffe/linreg.prototxt"),
                    str(out), "--phase", "TRAIN", "--display_lrm"]
        try:
            runpy.run_path(str(self.caffe_root / "python/draw_net.py"), run_name="__main__")
        finally:
            sys.argv = argv
        head = out.read_bytes()
        if ext == "png":
            self.assertTrue(head.startswith(b"\x89PNG"), "draw_net.py wrote no PNG")
        else:
            self.assertIn(b"ipx_InnerProduct", head)


class FCNNets(unittest.TestCase):
    fcn_root = None

    def test_net_scripts_write_the_committed_prototxts(self):
        import ast
        from caffepar.proto.text import read_net_text

        def normalized(path):
            net, _ = read_net_text(str(path))
            for layer in net.layer:
                if layer.python_param.param_str:
                    value = ast.literal_eval(layer.python_param.param_str)
                    layer.python_param.param_str = repr(sorted(value.items()))
            return net

        scripts = sorted(self.fcn_root.glob("*/net.py"))
        self.assertTrue(scripts, f"no */net.py under {self.fcn_root}")
        compared = 0
        for script in scripts:
            with self.subTest(net=script.parent.name):
                out = Path(script.parent.name)
                out.mkdir()
                cwd = os.getcwd()
                os.chdir(out)
                try:
                    runpy.run_path(str(script), run_name="__main__")
                finally:
                    os.chdir(cwd)
                for written in sorted(out.glob("*.prototxt")):
                    committed = script.parent / written.name
                    if committed.exists():
                        self.assertEqual(normalized(written), normalized(committed),
                                         f"{script.parent.name}/{written.name}")
                        compared += 1
        self.assertGreater(compared, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("caffe_root", help="a BVLC Caffe source tree (python/caffe/test inside)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    ap.add_argument("-k", dest="pattern", default=None,
                    help="only test modules whose name contains this (and no examples)")
    ap.add_argument("--fcn", type=Path, default=None,
                    help="also check the net.py scripts of an fcn.berkeleyvision.org checkout")
    args = ap.parse_args()
    caffe_root = Path(args.caffe_root).resolve()
    test_dir = caffe_root / "python/caffe/test"
    if not test_dir.is_dir():
        ap.error(f"{test_dir} not found: CAFFE_ROOT must be a Caffe source tree")
    for module, extra in (("six", "six"), ("pydot", "pydot")):
        try:
            __import__(module)
        except ImportError:
            sys.exit(f"run_pycaffe_tests: pycaffe's tests need {module}: pip install {extra} "
                     "(or pip install -e '.[dev]')")

    from caffepar.pycaffe import install_as_caffe
    install_as_caffe()
    _python_compat()
    sys.path.insert(0, str(test_dir))
    Examples.caffe_root = caffe_root

    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for name in _test_modules(test_dir, args.pattern):
        suite.addTests(loader.loadTestsFromName(name))
    if not args.pattern:
        suite.addTests(loader.loadTestsFromTestCase(Examples))
    if args.fcn:
        FCNNets.fcn_root = args.fcn.resolve()
        suite.addTests(loader.loadTestsFromTestCase(FCNNets))

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="pycaffe-tests-") as scratch:
        os.chdir(scratch)
        try:
            result = unittest.TextTestRunner(verbosity=2 if args.verbose else 1).run(suite)
        finally:
            os.chdir(cwd)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print(f"pycaffe: {passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(0 if failed == 0 and result.testsRun else 1)


if __name__ == "__main__":
    main()
