"""`import caffe` after `pip install caffepar`, and the names pycaffe scripts reach for.

In-process: caffe._caffe's classes (BlobVec is what net.params holds), caffe.io.caffe_pb2, the
top-level names (init_log, log, Timer, NCCL, solver counts), warnings naming the caller's line,
and which folders named caffe count as a real pycaffe.

In a clean virtual environment: the wheel built from this tree is installed with pip (no
caffepar on the path otherwise, no system site-packages; its dependencies come from this
environment's site-packages through a path line after the new one's), and pycaffe-style
scripts written here, modelled on published ones, run as subprocesses that do a plain
`import caffe`."""
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

import _caffepar_caffe
import caffepar as caffe
from caffepar.errors import CaffeparError

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "models/cifar10_quick/deploy.prototxt"


# ---------------------------------------------------------------- in-process
def test_caffe_module_names_caffepar_modules():
    import caffe as imported
    import caffe._caffe as compiled
    from caffe.io import caffe_pb2
    assert imported is caffe and compiled is caffe._caffe and compiled.__name__ == "caffepar._caffe"
    assert caffe_pb2 is caffe.proto.caffe_pb2
    assert caffe.io.__spec__.name == "caffepar.io", "the alias must leave the module's own spec"
    with pytest.raises(ModuleNotFoundError, match="caffe.no_such_module"):
        importlib.import_module("caffe.no_such_module")


def test_caffe_module_classes_are_the_types_nets_hold(tmp_path):
    c = caffe._caffe
    assert (c.Net, c.Layer, c.SGDSolver, c.AdamSolver, c.Solver) == \
        (caffe.Net, caffe.Layer, caffe.SGDSolver, caffe.AdamSolver, caffe.Solver)
    assert issubclass(c.NesterovSolver, c.SGDSolver) and issubclass(c.SGDSolver, c.Solver)
    net = caffe.Net(str(DEPLOY), caffe.TEST)
    path = str(tmp_path / "w.caffemodel")
    net.save(path)
    loaded = caffe.Net(str(DEPLOY), path, caffe.TEST)
    for n in (net, loaded):
        assert n.params and all(type(v) is c.BlobVec for v in n.params.values())
        assert all(type(b) is c.Blob for b in n.blobs.values())
        assert all(type(b) is c.Blob for v in n.params.values() for b in v)
    for name in ("init_log", "log", "Timer", "NCCL", "has_nccl", "solver_count",
                 "set_solver_count", "solver_rank", "set_solver_rank", "set_multiprocess",
                 "layer_type_list", "get_solver", "set_random_seed", "__version__"):
        assert getattr(c, name) is getattr(caffe, name), name


def _warning_of(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe(1).f_lineno
        call()
    assert len(caught) == 1, [str(w.message) for w in caught]
    return caught[0], line


def test_warnings_name_the_callers_line():
    w, line = _warning_of(lambda: caffe.set_device(0))
    assert "set_device(0) is ignored" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, line)
    w, line = _warning_of(lambda: caffe.set_mode_gpu())
    assert (w.filename, w.lineno) == (__file__, line)
    try:
        w, line = _warning_of(lambda: caffe.set_solver_count(4))
        assert "--np 4" in str(w.message) and (w.filename, w.lineno) == (__file__, line)
        assert caffe.solver_count() == 4
    finally:
        caffe.set_solver_count(1)


def test_solver_counts_timer_and_nccl():
    assert (caffe.solver_count(), caffe.solver_rank(), caffe.has_nccl()) == (1, 0, False)
    caffe.set_solver_rank(1)
    try:
        assert caffe.solver_rank() == 1
    finally:
        caffe.set_solver_rank(0)
    with pytest.raises(ValueError):
        caffe.set_solver_count(0)
    caffe.set_multiprocess(True)
    for call in (caffe.NCCL.new_uid, lambda: caffe.NCCL(None, "uid")):
        with pytest.raises(CaffeparError, match=r"caffepar train --solver S --np N"):
            call()
    timer = caffe.Timer()
    assert timer.ms == 0.0
    timer.start()
    first = timer.ms            # reading ms stops a running timer, as Caffe's does
    assert first > 0 and timer.ms == first


def test_init_log_and_log_name_the_caller(capsys):
    from caffepar.logs import LOGGER
    handlers, level, propagate = LOGGER.handlers[:], LOGGER.level, LOGGER.propagate
    try:
        caffe.init_log()
        line = sys._getframe().f_lineno + 1
        caffe.log("hello from a script")
        caffe.init_log(2)
        caffe.log("not shown below ERROR")
        with pytest.raises(ValueError, match="0 \\(INFO\\) to 3"):
            caffe.init_log(5)
    finally:
        LOGGER.handlers[:] = handlers
        LOGGER.setLevel(level)
        LOGGER.propagate = propagate
    err = capsys.readouterr().err
    assert f" {os.path.basename(__file__)}:{line}] hello from a script" in err
    assert err.startswith("I") and "not shown" not in err


def _package(folder, name="caffe", compiled=False, init="raise ImportError('unbuilt')\n"):
    pkg = folder / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    if compiled:
        (pkg / "_caffe.so").write_bytes(b"")
    return pkg


def test_only_a_caffe_with_its_compiled_module_is_real(tmp_path):
    unbuilt, built, namespace, single = (tmp_path / n for n in ("unbuilt", "built", "ns", "mod"))
    _package(unbuilt)
    _package(built, compiled=True)
    (namespace / "caffe").mkdir(parents=True)
    single.mkdir()
    (single / "caffe.py").write_text("")
    find = _caffepar_caffe.real_caffe_spec
    for path in ([str(unbuilt)], [str(namespace)], [str(single)], [str(tmp_path)]):
        assert find(path) is None, path
    spec = find([str(unbuilt), str(namespace), str(built)])
    assert spec is not None and spec.origin == str(built / "caffe" / "__init__.py")


# ---------------------------------------------------------------- a clean environment
@pytest.fixture(scope="module")
def clean_python(tmp_path_factory):
    """A virtual environment's python with only the caffepar wheel built from this tree."""
    try:
        import setuptools  # noqa: F401  (builds the wheel without fetching a build backend)
    except ImportError:
        pytest.skip("setuptools is not installed: cannot build caffepar's wheel offline")
    work = tmp_path_factory.mktemp("clean")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "_caffepar_caffe.py"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "caffepar", src / "caffepar",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    run = dict(capture_output=True, text=True, env=_clean_env())
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                            "--no-build-isolation", "-q", "-w", str(work / "dist"), str(src)],
                           **run)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel, = (work / "dist").glob("caffepar-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "_caffepar_caffe" in z.read("_caffepar_caffe.pth").decode()
    venv = work / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **run)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                                "--no-deps", "--no-index", "-q", str(wheel)], **run)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], **run).stdout.strip()
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    Path(purelib, "zz_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(python, script, cwd, *args, timeout=300):
    done = subprocess.run([str(python), str(script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=_clean_env(), timeout=timeout)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_clean_environment_imports_caffe(clean_python, tmp_path):
    script = _write(tmp_path / "names.py", """
        import caffe
        import caffepar
        assert caffe is caffepar and caffe.Net is caffepar.Net
        print(caffe.__file__)
        for name in ("init_log", "log", "Timer", "NCCL", "has_nccl", "solver_count",
                     "set_solver_count", "solver_rank", "set_solver_rank", "set_multiprocess"):
            getattr(caffe, name)
        assert caffe.io.caffe_pb2.NetParameter and caffe._caffe.BlobVec
        """)
    done = _run(clean_python, script, tmp_path)
    installed = Path(done.stdout.strip())
    assert clean_python.parent.parent in installed.parents, installed
    assert ROOT not in installed.parents


def test_a_real_pycaffe_beside_the_script_is_imported(clean_python, tmp_path):
    """A caffe package with its compiled _caffe is imported, not caffepar; an unbuilt one
    earlier on the path is passed over for it."""
    built = tmp_path / "opt"
    _package(built, compiled=True, init="REAL = True\n")
    _package(tmp_path / "checkout")
    script = _write(tmp_path / "checkout" / "which.py", f"""
        import sys
        sys.path.append({str(built)!r})
        import caffe
        assert caffe.REAL and "caffepar" not in sys.modules, caffe
        print("real")
        """)
    assert _run(clean_python, script, tmp_path).stdout.strip() == "real"


MERGE_BN = """
    # Folds BatchNorm + Scale into the convolution before them, as MobileNet-SSD's merge_bn.py.
    import os
    import sys

    import numpy as np
    caffe_root = '/home/user/caffe/'
    sys.path.insert(0, caffe_root + 'python')
    import caffe
    from caffe.proto import caffe_pb2
    from google.protobuf import text_format

    model, folded = sys.argv[1], "folded.prototxt"
    spec = caffe_pb2.NetParameter()
    text_format.Merge(open(model).read(), spec)
    out = caffe_pb2.NetParameter()
    out.CopyFrom(spec)
    del out.layer[:]
    follow = {}
    for l in spec.layer:
        if l.type in ("BatchNorm", "Scale"):
            follow[l.bottom[0]][l.type] = l.name
            continue
        layer = out.layer.add()
        layer.MergeFrom(l)
        if l.type in ("Convolution", "Deconvolution"):
            layer.convolution_param.bias_term = True
            follow[l.top[0]] = {"conv": l.name}
    open(folded, "w").write("{}".format(out))

    net = caffe.Net(model, caffe.TEST)
    rng = np.random.RandomState(0)
    for name, blobs in net.params.items():
        for b in blobs:
            b.data[...] = rng.uniform(0.5, 1.5, b.data.shape)
    net2 = caffe.Net(folded, caffe.TEST)
    checked = 0
    for key in net2.params.keys():
        if type(net2.params[key]) is not caffe._caffe.BlobVec:
            continue
        checked += 1
        names = [v for v in follow.values() if v["conv"] == key][0]
        conv, bn, scale = (net.params[names[k]] for k in ("conv", "BatchNorm", "Scale"))
        wt = conv[0].data
        deconv = net.layer_dict[key].type == "Deconvolution"
        channels = wt.shape[1] if deconv else wt.shape[0]
        factor = bn[2].data[0]
        factor = 1.0 / factor if factor != 0 else 0
        rstd = 1.0 / np.sqrt(bn[1].data * factor + 1e-5)
        shape = (1, channels, 1, 1) if deconv else (channels, 1, 1, 1)
        net2.params[key][0].data[...] = wt * (rstd * scale[0].data).reshape(shape)
        net2.params[key][1].data[...] = (0 - bn[0].data * factor) * rstd * scale[0].data \\
            + scale[1].data
    assert checked == 2, checked
    net2.save("folded.caffemodel")

    x = rng.uniform(-1, 1, net.blobs["data"].data.shape)
    want = net.forward(data=x)["up"].copy()
    check = caffe.Net(folded, "folded.caffemodel", caffe.TEST)
    got = check.forward(data=x)["up"]
    assert np.allclose(got, want, rtol=1e-3, atol=1e-4), abs(got - want).max()
    print("folded", checked)
"""

BN_NET = """
    name: "bn_net"
    layer { name: "data" type: "Input" top: "data"
            input_param { shape { dim: 1 dim: 3 dim: 6 dim: 6 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 4 kernel_size: 3 bias_term: false } }
    layer { name: "conv/bn" type: "BatchNorm" bottom: "conv" top: "conv" }
    layer { name: "conv/scale" type: "Scale" bottom: "conv" top: "conv"
            scale_param { bias_term: true } }
    layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
    layer { name: "up" type: "Deconvolution" bottom: "conv" top: "up"
            convolution_param { num_output: 2 kernel_size: 2 stride: 2 bias_term: false } }
    layer { name: "up/bn" type: "BatchNorm" bottom: "up" top: "up" }
    layer { name: "up/scale" type: "Scale" bottom: "up" top: "up"
            scale_param { bias_term: true } }
"""


def test_merge_bn_style_script(clean_python, tmp_path):
    net = _write(tmp_path / "bn_net.prototxt", BN_NET)
    script = _write(tmp_path / "merge_bn.py", MERGE_BN)
    assert "folded 2" in _run(clean_python, script, tmp_path, net).stdout


CLASSIFY = """
    # As BVLC's python/classify.py, run from a Caffe checkout whose python/caffe is not built.
    import os
    import sys

    import numpy as np

    import caffe

    here = os.path.dirname(__file__)
    model, weights, image, out = sys.argv[1:5]
    assert caffe.__name__ == "caffepar", caffe.__file__
    caffe.set_mode_cpu()
    mean = np.load(os.path.join(here, "caffe/imagenet/mean.npy"))
    classifier = caffe.Classifier(model, weights, image_dims=[40, 40], mean=mean,
                                  raw_scale=255.0, channel_swap=[2, 1, 0])
    inputs = [caffe.io.load_image(image)]
    predictions = classifier.predict(inputs, True)
    np.save(out, predictions)

    # open_nsfw's classify_nsfw.py: an image from bytes, a Transformer, forward_all by name.
    from io import BytesIO
    net = caffe.Net(model, weights, caffe.TEST)
    t = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_mean("data", np.array([104, 117, 123]))
    t.set_raw_scale("data", 255)
    t.set_channel_swap("data", (2, 1, 0))
    img = caffe.io.load_image(BytesIO(open(image, "rb").read()))
    H, W, _ = img.shape
    _, _, h, w = net.blobs["data"].data.shape
    crop = img[(H - h) // 2:(H - h) // 2 + h, (W - w) // 2:(W - w) // 2 + w, :]
    x = t.preprocess("data", crop)
    x.shape = (1,) + x.shape
    scores = net.forward_all(blobs=["prob"], **{net.inputs[0]: x})["prob"][0]
    print("classified", predictions.shape, round(float(scores.sum()), 4))
"""


def test_classify_style_script_beside_an_unbuilt_caffe(clean_python, tmp_path):
    from PIL import Image
    checkout = tmp_path / "caffe_checkout" / "python"
    _package(checkout, init="from .pycaffe import Net\n")
    (checkout / "caffe" / "pycaffe.py").write_text("from ._caffe import Net\n")
    (checkout / "caffe" / "imagenet").mkdir()
    np.save(checkout / "caffe/imagenet/mean.npy", np.full((3, 40, 40), 110.0, np.float32))
    caffe.set_random_seed(5)
    net = caffe.Net(str(DEPLOY), caffe.TEST)
    for blobs in net.params.values():
        blobs[0].data[...] = np.random.default_rng(0).standard_normal(blobs[0].shape) * 0.05
    weights = tmp_path / "w.caffemodel"
    net.save(str(weights))
    image = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 52, 3), np.uint8)).save(image)
    script = _write(checkout / "classify.py", CLASSIFY)
    done = _run(clean_python, script, checkout, DEPLOY, weights, image, tmp_path / "out.npy")
    assert "classified (1, 10) 1.0" in done.stdout
    predictions = np.load(tmp_path / "out.npy")
    assert predictions.shape == (1, 10) and abs(predictions.sum() - 1) < 1e-5


SOLVE = """
    # As FCN's voc-fcn8s/solve.py with surgery.py and score.py.
    import sys

    import numpy as np

    import caffe
    import score
    import surgery

    caffe.set_device(int(sys.argv[1]))
    caffe.set_mode_gpu()

    solver = caffe.SGDSolver("solver.prototxt")
    solver.net.copy_from("init.caffemodel")
    interp_layers = [k for k in solver.net.params.keys() if "up" in k]
    surgery.interp(solver.net, interp_layers)
    kernel = solver.net.params["upscore"][0].data
    assert np.allclose(kernel[0, 0], surgery.upsample_filt(4)) and not kernel[0, 1].any()

    val = ["a", "b"]
    for _ in range(2):
        solver.step(2)
        hist = score.seg_tests(solver, False, val, layer="score")
    assert hist.sum() == 2 * 16 * 16, hist.sum()
    print("solved", solver.iter)
"""

SURGERY = """
    from __future__ import division
    import caffe
    import numpy as np

    def upsample_filt(size):
        factor = (size + 1) // 2
        center = factor - 1 if size % 2 == 1 else factor - 0.5
        og = np.ogrid[:size, :size]
        return (1 - abs(og[0] - center) / factor) * (1 - abs(og[1] - center) / factor)

    def interp(net, layers):
        for l in layers:
            m, k, h, w = net.params[l][0].data.shape
            assert (m == k or k == 1) and h == w
            net.params[l][0].data[range(m), range(k), :, :] = upsample_filt(h)
"""

SCORE = """
    from __future__ import division
    import numpy as np

    def fast_hist(a, b, n):
        k = (a >= 0) & (a < n)
        return np.bincount(n * a[k].astype(int) + b[k], minlength=n ** 2).reshape(n, n)

    def seg_tests(solver, save_format, dataset, layer="score", gt="label"):
        net = solver.test_nets[0]
        net.share_with(solver.net)
        n_cl = net.blobs[layer].channels
        hist = np.zeros((n_cl, n_cl))
        loss = 0
        for idx in dataset:
            net.forward()
            hist += fast_hist(net.blobs[gt].data[0, 0].flatten(),
                              net.blobs[layer].data[0].argmax(0).flatten(), n_cl)
            loss += net.blobs["loss"].data.flat[0]
        print(">>> Iteration", solver.iter, "loss", loss / len(dataset),
              "overall accuracy", np.diag(hist).sum() / hist.sum())
        return hist
"""

SEG_LAYERS = """
    import caffe
    import numpy as np

    class SegDataLayer(caffe.Layer):
        def setup(self, bottom, top):
            params = eval(self.param_str)
            self.rng = np.random.RandomState(params["seed"])
            if len(top) != 2:
                raise Exception("Need to define two tops: data and label.")

        def reshape(self, bottom, top):
            self.data = self.rng.uniform(-50, 50, (3, 16, 16))
            self.label = self.rng.randint(0, 3, (1, 16, 16))
            top[0].reshape(1, *self.data.shape)
            top[1].reshape(1, *self.label.shape)

        def forward(self, bottom, top):
            top[0].data[...] = self.data
            top[1].data[...] = self.label

        def backward(self, top, propagate_down, bottom):
            pass
"""

SEG_BODY = """
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 3 kernel_size: 3 stride: 2 pad: 1
                                weight_filler { type: "gaussian" std: 0.1 } } }
    layer { name: "upscore" type: "Deconvolution" bottom: "conv" top: "upscore"
            param { lr_mult: 0 }
            convolution_param { num_output: 3 kernel_size: 4 stride: 2 bias_term: false } }
    layer { name: "score" type: "Crop" bottom: "upscore" bottom: "data" top: "score"
            crop_param { axis: 2 offset: 1 } }
"""
SEG_DATA = """
    layer { name: "data" type: "Python" top: "data" top: "label"
            python_param { module: "seg_layers" layer: "SegDataLayer" param_str: "{'seed': %d}" } }
"""
SEG_LOSS = """
    layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss"
            loss_param { normalize: false } }
"""
# The starting weights come from the same layers behind an Input layer: building the Python
# data layer here would import seg_layers into the test process.
SEG_INIT = """
    layer { name: "data" type: "Input" top: "data"
            input_param { shape { dim: 1 dim: 3 dim: 16 dim: 16 } } }
"""


def test_fcn_solve_style_script(clean_python, tmp_path):
    for name, text in (("solve.py", SOLVE), ("surgery.py", SURGERY), ("score.py", SCORE),
                       ("seg_layers.py", SEG_LAYERS)):
        _write(tmp_path / name, text)
    _write(tmp_path / "train.prototxt", SEG_DATA % 1 + SEG_BODY + SEG_LOSS)
    _write(tmp_path / "val.prototxt", SEG_DATA % 2 + SEG_BODY + SEG_LOSS)
    _write(tmp_path / "solver.prototxt", """
        train_net: "train.prototxt"
        test_net: "val.prototxt"
        test_iter: 1
        test_interval: 999999999
        test_initialization: false
        base_lr: 1e-4
        lr_policy: "fixed"
        momentum: 0.9
        display: 0
        max_iter: 100
        snapshot_prefix: "snap"
        """)
    init = caffe.Net(str(_write(tmp_path / "init.prototxt", SEG_INIT + SEG_BODY)), caffe.TEST)
    init.save(str(tmp_path / "init.caffemodel"))
    done = _run(clean_python, tmp_path / "solve.py", tmp_path, 0)
    assert "solved 4" in done.stdout and done.stdout.count(">>> Iteration") == 2
    # The warnings name the script's lines, not caffepar's.
    assert "solve.py:10: UserWarning: caffepar computes on the CPU; set_device(0)" in done.stderr
    assert "solve.py:11: UserWarning: caffepar computes on the CPU; set_mode_gpu()" in done.stderr


DREAM = """
    # deepdream's notebook: caffe.io.caffe_pb2, force_backward, a Classifier's transformer,
    # forward to a blob, backward from it, the input reshaped between octaves.
    from io import BytesIO
    import sys

    import numpy as np
    import scipy.ndimage as nd
    from google.protobuf import text_format

    import caffe

    model = caffe.io.caffe_pb2.NetParameter()
    text_format.Merge(open(sys.argv[1]).read(), model)
    model.force_backward = True
    open("tmp.prototxt", "w").write(str(model))
    net = caffe.Classifier("tmp.prototxt", sys.argv[2], mean=np.float32([104.0, 116.0, 122.0]),
                           channel_swap=(2, 1, 0))

    def preprocess(net, img):
        return np.float32(np.rollaxis(img, 2)[::-1]) - net.transformer.mean["data"]

    def deprocess(net, img):
        return np.dstack((img + net.transformer.mean["data"])[::-1])

    def make_step(net, step_size=1.5, end="conv2", jitter=4):
        src, dst = net.blobs["data"], net.blobs[end]
        ox, oy = np.random.randint(-jitter, jitter + 1, 2)
        src.data[0] = np.roll(np.roll(src.data[0], ox, -1), oy, -2)
        net.forward(end=end)
        dst.diff[:] = dst.data
        net.backward(start=end)
        g = src.diff[0]
        src.data[:] += step_size / np.abs(g).mean() * g
        src.data[0] = np.roll(np.roll(src.data[0], -ox, -1), -oy, -2)

    img = np.float32(np.random.RandomState(0).uniform(0, 255, (40, 44, 3)))
    octaves = [preprocess(net, img)]
    octaves.append(nd.zoom(octaves[-1], (1, 0.8, 0.8), order=1))
    src = net.blobs["data"]
    detail = np.zeros_like(octaves[-1])
    for octave, base in enumerate(octaves[::-1]):
        h, w = base.shape[-2:]
        if octave > 0:
            h1, w1 = detail.shape[-2:]
            detail = nd.zoom(detail, (1, 1.0 * h / h1, 1.0 * w / w1), order=1)
        src.reshape(1, 3, h, w)
        src.data[0] = base + detail
        for i in range(2):
            make_step(net)
        detail = src.data[0] - base
    out = deprocess(net, src.data[0])
    f = BytesIO()
    np.save(f, out)
    assert out.shape == (40, 44, 3) and np.isfinite(out).all()
    print("dreamed", out.shape, sorted(net.blobs.keys())[:2])
"""


def test_deepdream_style_script(clean_python, tmp_path):
    caffe.set_random_seed(7)
    net = caffe.Net(str(DEPLOY), caffe.TEST)
    for blobs in net.params.values():
        blobs[0].data[...] = np.random.default_rng(2).standard_normal(blobs[0].shape) * 0.05
    net.save(str(tmp_path / "w.caffemodel"))
    script = _write(tmp_path / "dream.py", DREAM)
    done = _run(clean_python, script, tmp_path, DEPLOY, tmp_path / "w.caffemodel")
    assert "dreamed (40, 44, 3)" in done.stdout
