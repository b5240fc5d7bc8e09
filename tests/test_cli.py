"""The command line: `caffepar time` on the bundled models, Caffe's flag spellings, and the
corpus of broken inputs, each of which must end with exit 1 and one line naming the problem."""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from caffepar.cli import main, normalize_caffe_flags

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "bad_inputs"


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_caffe_flag_spellings():
    assert normalize_caffe_flags(["time", "-model", "m.prototxt", "-iterations=3", "-gpu", "0"]) \
        == ["time", "--model", "m.prototxt", "--iterations=3", "--gpu", "0"]
    assert normalize_caffe_flags(["-1", "-h"]) == ["-1", "-h"]


@pytest.mark.parametrize("model", ["cifar10_quick/train_val_dummy.prototxt",
                                   "cifar10_quick/deploy.prototxt",
                                   "alexnet/deploy.prototxt",
                                   "vgg16/train_val_dummy.prototxt"])
def test_time_prints_caffe_table(model, capsys):
    code, out, err = run(["time", "-model", str(ROOT / "models" / model), "-iterations", "1"],
                         capsys)
    assert code == 0, err
    assert "Average time per layer:" in out
    first_conv = "conv1_1" if "vgg16" in model else "conv1"
    assert f"{first_conv}\tforward:" in out and f"{first_conv}\tbackward:" in out
    assert "Average Forward-Backward:" in out and "*** Benchmark ends ***" in out
    if model.startswith("cifar10_quick"):      # timed as training runs them: folded
        assert any(line.strip().startswith("relu2\tforward:")
                   and line.endswith("\t(runs inside conv2)") for line in out.splitlines())


def _caffemodel(tmp_path):
    import caffepar as caffe
    net = caffe.Net(str(BAD / "small.prototxt"), caffe.TEST)
    path = tmp_path / "small.caffemodel"
    net.save(str(path))
    return path


CASES = {
    "syntax_error": (["--model", BAD / "syntax_error.prototxt"],
                     r"syntax_error.prototxt:13: error: syntax error"),
    "unknown_type": (["--model", BAD / "unknown_type.prototxt"],
                     r'unknown_type.prototxt:8: error: unknown layer type: "Convolutoin" '
                     r'\(layer "conv1", line 8; did you mean "Convolution"\?\)'),
    "unknown_bottom": (["--model", BAD / "unknown_bottom.prototxt"],
                       r'unknown_bottom.prototxt:8: error: layer "conv1".*unknown bottom blob "dta"'),
    "duplicate_top": (["--model", BAD / "duplicate_top.prototxt"],
                      r'duplicate_top.prototxt:15: error: layer "conv2".*top blob "out" produced '
                      r"by multiple sources"),
    "mixed_layers": (["--model", BAD / "mixed_layers.prototxt"],
                     r"mixed_layers.prototxt:8: error: .*'layer'.*'layers'"),
    "wrong_blob_count": (["--model", BAD / "wrong_blob_count.prototxt"],
                         r'wrong_blob_count.prototxt:8: error: layer "loss" \(SoftmaxWithLoss\): '
                         r"takes exactly 2 bottom blob\(s\), got 1"),
    "kernel_zero": (["--model", BAD / "kernel_zero.prototxt"],
                    r'kernel_zero.prototxt:8: error: layer "conv1" \(Convolution\): kernel_size '
                    r"must be > 0, got 0"),
    "missing_model": (["--model", BAD / "no_such.prototxt"], r"no_such.prototxt: error: .*not found"),
}


@pytest.mark.parametrize("text, message", [
    ("", "net.prototxt: error: the net has no layers"),
    ('name: "only a name"\n', "net.prototxt: error: the net has no layers"),
    ('layer { name: "x" type: "Input" top: "x" include { phase: TEST }\n'
     '        input_param { shape { dim: 1 } } }\n',
     "net.prototxt: error: no layer of the net is in phase TRAIN (level 0)"),
    ('layer { name: "a" type: "Foo" top: "a" }\n'
     'layer { name: "b" type: "Reorg" bottom: "a" top: "b" }\n'
     'layer { name: "c" type: "Foo" bottom: "b" top: "c" }\n',
     'net.prototxt:1: error: unknown layer types: "Foo" (layer "a", line 1), '
     '"Reorg" (layer "b", line 2; a layer of the YOLOv2 ports of Caffe), "Foo" (layer "c", '
     'line 3) (known types: '),
    ('layer { name: "in" type: "Input" top: "data" }\n'
     'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "y"\n'
     '        inner_product_param { num_output: 2 } }\n',
     'net.prototxt:2: error: layer "ip" (InnerProduct): bottom blob "data" has no shape: '
     'the Input layer that makes it gives none'),
    ('layer { name: "in" type: "Input" top: "data"\n'
     '        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }\n'
     'layer { name: "c" type: "Convolution" bottom: "data" top: "y" parallel_mode: MODEL\n'
     '        convolution_param { num_output: 2 kernel_size: 3 } }\n',
     'net.prototxt:3: error: layer "c" (Convolution): only InnerProduct layers can run model '
     'parallel (parallel_mode: MODEL)'),
    ('layer { name: "in" type: "Input" top: "data"\n'
     '        input_param { shape { dim: 100000 dim: 3 dim: 1000 dim: 1000 } } }\n',
     'net.prototxt:1: error: layer "in" (Input): out of memory for top "data": a blob of shape '
     '(100000, 3, 1000, 1000) needs 2.2 TiB (data and diff)'),
])
def test_empty_nets_and_every_unknown_type_at_once(tmp_path, monkeypatch, capsys, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(text)
    code, _out, err = run(["time", "--model", "net.prototxt", "--iterations", "1"], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"caffepar: {message}"), lines
    assert "did you mean" not in lines[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line_and_exit_1(case, capsys):
    args, pattern = CASES[case]
    code, out, err = run(["time", "--iterations", "1"] + [str(a) for a in args], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    import re
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err


def test_weights_shape_mismatch_names_layer_and_shapes(tmp_path, capsys):
    weights = _caffemodel(tmp_path)
    code, out, err = run(["time", "--iterations", "1", "--model", str(BAD / "small_wider.prototxt"),
                          "--weights", str(weights)], capsys)
    assert code == 1
    line, = err.strip().splitlines()
    assert 'layer "ip1" param 0: shape mismatch' in line
    assert "5 144" in line and "7 144" in line


def test_truncated_caffemodel(tmp_path, capsys):
    weights = _caffemodel(tmp_path)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    code, out, err = run(["time", "--iterations", "1", "--model", str(BAD / "small.prototxt"),
                          "--weights", str(weights)], capsys)
    assert code == 1
    line, = err.strip().splitlines()
    assert "small.caffemodel: error: truncated or corrupt caffemodel" in line


def test_missing_weights_file(capsys):
    code, out, err = run(["time", "--iterations", "1", "--model", str(BAD / "small.prototxt"),
                          "--weights", str(BAD / "absent.caffemodel")], capsys)
    assert code == 1
    assert "absent.caffemodel: error: weights file not found" in err


def test_console_script_exit_code_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", "time", "--model",
                           str(BAD / "kernel_zero.prototxt")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "kernel_size must be > 0" in proc.stderr


def test_plan_prints_modes_and_refuses_model_parallel_convolutions(capsys):
    model = str(ROOT / "models/vgg16/train_val_dummy.prototxt")
    code, out, err = run(["plan", "--model", model, "--np", "4"], capsys)
    assert code == 0, err
    modes = {line.split()[0]: line.split()[3] for line in out.splitlines()
             if line.startswith(("conv", "fc"))}
    assert modes["conv1_1"] == "DATA" and modes["fc6"] == "MODEL" and modes["fc7"] == "MODEL"
    assert modes["fc8"] == "DATA"
    code, out, err = run(["plan", "--model", model, "--parallel", "data"], capsys)
    assert code == 0
    assert all(line.split()[3] == "DATA" for line in out.splitlines()
               if line.startswith(("conv", "fc")))
    code, out, err = run(["plan", "--model", model, "--model-parallel", "conv1_1"], capsys)
    assert code == 1
    assert 'layer "conv1_1" (Convolution): only InnerProduct layers can run model parallel' in err


NAN_NET = """
layer { name: "data" type: "DummyData" top: "x" top: "label"
        dummy_data_param { shape { dim: 4 dim: 8 } shape { dim: 4 }
                           data_filler { type: "gaussian" } data_filler { type: "constant" } } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "h"
        inner_product_param { num_output: 8 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "log" type: "Log" bottom: "h" top: "lh" }
layer { name: "ip2" type: "InnerProduct" bottom: "lh" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }
"""


def test_nonfinite_loss_stops_naming_the_layer_or_trains_on(tmp_path, monkeypatch, capsys):
    """log of negative activations: NaN from the first iteration."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NAN_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 4\n'
        'snapshot: 2\nsnapshot_prefix: "snap"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a raw NumPy warning would reach the user
        code, _out, err = run(["train", "--solver", "solver.prototxt"], capsys)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        'caffepar: error: iteration 0: the loss is nan; the first layer with a non-finite '
        'output is "log" (top "lh"). Stopped before the update (this run wrote no snapshot '
        'yet; lower base_lr, or --on-nonfinite continue to train on as Caffe does)')
    assert not list(tmp_path.glob("snap_iter_*"))
    code, _out, err = run(["train", "--solver", "solver.prototxt", "--on-nonfinite",
                           "continue"], capsys)
    assert code == 0
    assert "Snapshotting weights that are not all finite (NaN or infinite) at iteration 2" in err
    assert (tmp_path / "snap_iter_4.caffemodel").exists()


def test_convert_info_wires_layers_that_share_a_name(tmp_path, capsys):
    (tmp_path / "net.prototxt").write_text("""
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 4 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "a"
        inner_product_param { num_output: 3 } }
layer { name: "fc" type: "InnerProduct" bottom: "a" top: "b"
        inner_product_param { num_output: 2 } }
""")
    code, out, err = run(["convert", "info", str(tmp_path / "net.prototxt")], capsys)
    assert code == 0, err
    wiring = [" ".join(l.split()[2:5]) for l in out.splitlines() if l.startswith("fc ")]
    assert wiring == ["data -> a", "a -> b"]


@pytest.mark.parametrize("sig, code, line", [("SIGINT", 130, "aborted"),
                                             ("SIGTERM", 143, "caffepar: SIGTERM received "
                                                              "while starting; stopped")])
def test_signal_while_starting_is_one_line(sig, code, line):
    """Ctrl-C or SIGTERM while the command still imports: one line and the signal's status,
    no traceback (the command ends at once when the signal comes after it has finished)."""
    import signal
    import time
    stopped = 0
    for delay in (0.15, 0.3):
        proc = subprocess.Popen([sys.executable, "-m", "caffepar.cli", "convert", "info",
                                 str(BAD / "small.prototxt")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(delay)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
        assert "Traceback" not in err
        if proc.returncode != 0:
            assert (proc.returncode, err.strip()) == (code, line)
            stopped += 1
    assert stopped, "every signal came after the command had finished"


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_debug_info_of_diverging_values_prints_inf_without_numpy_warnings(tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NAN_NET.replace('type: "Log" ', 'type: "ReLU" ')
                                           .replace("std: 1 }", "std: 1e19 }"))
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1\ndisplay: 1\n'
        'debug_info: true\n')
    code, _out, err = run(["train", "--solver", "solver.prototxt", "--on-nonfinite",
                           "continue"], capsys)
    assert code == 0, err
    assert "L2 norm = (inf" in err


def test_methods_are_named_by_their_papers_not_by_numbers():
    """Users have papers, not internal numbers: no "seed 00N" in the README, the CLI help or the
    package's docstrings and messages."""
    import re
    from click.testing import CliRunner
    from caffepar.cli import cli
    numbering = re.compile(r"seed 00\d|\b00[1-4]'s\b", re.I)
    texts = {"README.md": (ROOT / "README.md").read_text()}
    texts.update({str(p.relative_to(ROOT)): p.read_text()
                  for p in sorted((ROOT / "caffepar").rglob("*.py"))})
    runner = CliRunner()
    commands = [[]] + [[name] for name in cli.commands] + [
        ["convert", name] for name in getattr(cli.commands.get("convert"), "commands", {})]
    for args in commands:
        texts[" ".join(["caffepar"] + args + ["--help"])] = runner.invoke(cli, args + ["--help"]).output
    found = [name for name, text in texts.items() if numbering.search(text)]
    assert found == []
    assert "Ju Tao, Kang Heting, Liu Shuai and Huo" in texts["README.md"]


def test_time_threads_applies_without_np(capsys):
    """--threads sets the thread count of a one-process run too (it used to reach only ranks
    started with --np)."""
    from caffepar.nn import blas
    before = blas.blas_threads()
    want = 1 if before > 1 else 2
    try:
        code, out, err = run(["time", "-model", str(BAD / "small.prototxt"), "-iterations", "1",
                              "--threads", str(want)], capsys)
        assert code == 0, err
        assert blas.blas_threads() == (want if blas._THREADS is not None else 1)
    finally:
        blas.set_blas_threads(before)
