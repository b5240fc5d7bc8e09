#!/usr/bin/env python
"""Published Caffe deploy nets at inference: caffepar's `net.forward()` beside OpenCV's dnn
module reading the same files and onnxruntime running caffepar's ONNX export, measured side by
side in alternating rounds in one run, and caffepar again with its optional onnxruntime engine
(CAFFEPAR_INFERENCE=onnxruntime, caffepar/graph/onnx_forward.py), written under the CPU's name:
results/inference_<vendor>_<family>.{csv,md,png}.

    python scripts/bench_inference.py [--nets-dir DIR] [--fetch] [--only NET ...]
                                      [--rounds 5] [--threads 2] [--out results/inference_<cpu>]
                                      [--fresh | --redo NET ...]

The nets (NETS: one line each, with the public repository, commit and path of its prototxt)
are read from a folder outside the repository, `$CAFFEPAR_CACHE_DIR/published_nets` (else
~/.cache/caffepar/published_nets) unless --nets-dir names another; `--fetch` downloads the
missing ones there and checks each file's SHA-256 against the copy the results were made from.
No caffemodel is fetched: every net runs with random weights, saved once as a .caffemodel that
all three tools read. Random weights are the prototxt's fillers (MSRA, std sqrt(2 / fan-in),
for a Convolution, Deconvolution or InnerProduct that names none, whose default of 0 would make
the net compute zeros), BatchNorm statistics of mean 0 and variance 1 (the forks' BN alike), and
each softmax detector's class-score convolutions (*_mbox_conf) times the net's `conf_gain`, so
that some scores beat the background class and pass the DetectionOutput's threshold (sigmoid
scores pass it without: a gain of 4 would saturate 2517 of MobileNetV2-SSDLite's float32
sigmoids at exactly 1.0, and its 100 kept detections would be a tie-break among them, no
longer a result of the net's values), and a classifier's last Convolution or
InnerProduct scaled to scores of standard deviation 1 (random weights through a deep net make
a final Softmax exactly one-hot, and every tool's output the same whatever it computed).

Per net, each tool runs in a process of its own (`--worker`), all three loaded at once and run
one at a time: in each of --rounds rounds, every tool in turn (the order rotating) times batch 1
(the median of at least --runs forward passes and --budget seconds) and then the throughput
batch (32 images, or fewer where caffepar's blobs would pass --max-blob-gib: its every blob
stays readable, so it holds them all). The best of the rounds' medians counts, so a noisy spell
on a shared machine falls on every side. Each tool runs --threads threads: caffepar's own
(OPENBLAS_NUM_THREADS), cv2.setNumThreads, onnxruntime's intra-op pool (one inter-op thread).

Correctness, at batch 1 on the same random input: every blob of caffepar's TEST forward
against the same forward with the inference path off (CAFFEPAR_INFERENCE=off, in another
process), at rtol 1e-4 with an absolute floor of 1e-5 times the blob's largest magnitude (a
sigmoid's, tanh's or softmax's output is also allowed what its input's allowance becomes
through the function: caffepar/graph/tolerance.py); the net's outputs from OpenCV and from
onnxruntime against caffepar's (detections compared as sorted rows of 7). The onnxruntime engine's blobs are checked the same way: its outputs are
onnxruntime's, every other blob is computed by caffepar's own forward when first read (the
column says how many of each). Where the installed caffepar has no inference path (it does not read
CAFFEPAR_INFERENCE) both forwards run the same code and the column says so.

Resumable: each net's row is written as soon as it is measured; a rerun skips the nets OUT.csv
already holds (--redo NET measures one again, --fresh all). The peers' kernels: the markdown
names each tool's version, the instruction sets its CPU dispatch can choose on this host, and
each tool's single-thread SGEMM rate on a 1024 x 1024 x 1024 InnerProduct.
"""
import argparse
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from cpuinfo import cpu_key, cpu_name, host_isa  # noqa: E402

RAW = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
TOOLS = ("caffepar", "engine", "opencv", "onnxruntime")
#: The columns of each tool: caffepar, caffepar with the onnxruntime engine, the peers.
KEY = {"caffepar": "caffepar", "engine": "eng", "opencv": "opencv", "onnxruntime": "ort"}
#: Each tool's correctness column.
CHECK = {"caffepar": "caffepar_check", "engine": "engine_check", "opencv": "opencv_check",
         "onnxruntime": "onnx_check"}
THROUGHPUT_BATCH = 32
RTOL = 1e-4
ATOL_SCALE = 1e-5
CARRIED = "carried allowance of "   # a dump's key of what a blob carries from its inputs


@dataclass
class PublishedNet:
    key: str
    label: str
    file: str
    repo: str
    commit: str
    path: str
    sha256: str
    kind: str = "classification"      # classification, detection, segmentation
    conf_gain: float = 1.0
    note: str = ""

    @property
    def url(self):
        return RAW.format(repo=self.repo, commit=self.commit, path=self.path)


NETS = [
    PublishedNet("mobilenet_v1", "MobileNet v1", "mobilenet_deploy.prototxt",
                 "shicai/MobileNet-Caffe", "a0b0c46152e658559956158d7c2bf42bb029c09e",
                 "mobilenet_deploy.prototxt",
                 "8e6a26b8f2c7cf7a066d571660cfd8a1544a5a25399df33ad499f3d733f16729"),
    PublishedNet("mobilenet_v2", "MobileNet v2", "mobilenet_v2_deploy.prototxt",
                 "shicai/MobileNet-Caffe", "a0b0c46152e658559956158d7c2bf42bb029c09e",
                 "mobilenet_v2_deploy.prototxt",
                 "06a0820a5edc6d2c24e83e0b95824d0dae464ced3d5db82f51e461098a03b887"),
    PublishedNet("shufflenet_v1", "ShuffleNet v1 1x (g3)", "shufflenet_1x_g3_deploy.prototxt",
                 "farmingyard/ShuffleNet", "b9624442bd410bbd2aadc820122b138e63039d70",
                 "shufflenet_1x_g3_deploy.prototxt",
                 "1f2f039871b399d9689077e34b5c0a1fe202584f4809fb3e3e6a6abe407abe21"),
    PublishedNet("shufflenet_v2", "ShuffleNet v2 1x", "shufflenet_v2_1x_deploy.prototxt",
                 "farmingyard/ShuffleNet", "b9624442bd410bbd2aadc820122b138e63039d70",
                 "shufflenet_v2_1x_deploy.prototxt",
                 "9ef1b0027fc04c30e363b8d17fa10e50ba1c6fc55082b4ee5b9ac707a7959967"),
    PublishedNet("squeezenet_v1.1", "SqueezeNet 1.1", "squeezenet_v1.1_deploy.prototxt",
                 "forresti/SqueezeNet", "51147dc0681638c28aad593b9e923f3500117125",
                 "SqueezeNet_v1.1/deploy.prototxt",
                 "d041bfb2ab4b32fda4ff6c6966684132f2924e329916aa5bfe9285c6b23e3d1c"),
    PublishedNet("googlenet", "GoogLeNet", "bvlc_googlenet_deploy.prototxt", "BVLC/caffe",
                 "9b891540183ddc834a02b2bd81b31afae71b2153",
                 "models/bvlc_googlenet/deploy.prototxt",
                 "fa36cd4112a3240a29600a5aa35333f31bec33daa1a6085b0af308a9f50f0c50"),
    PublishedNet("resnet50", "ResNet-50", "ResNet-50-deploy.prototxt",
                 "KaimingHe/deep-residual-networks", "a7026cb6d478e131b765b898c312e25f9f6dc031",
                 "prototxt/ResNet-50-deploy.prototxt",
                 "2f8fb64f68c6bcda94eb2640f80aed94efb91664122e72a6b7587012cc57dedc"),
    PublishedNet("densenet121", "DenseNet-121", "DenseNet_121.prototxt", "shicai/DenseNet-Caffe",
                 "d47f7b7292989a02dd853526f2faf9ceaaf23526", "DenseNet_121.prototxt",
                 "baeed2a423794c2c8dc1a80ad96e961112224fa1d319d535735ba93a2b535170"),
    PublishedNet("mobilenet_ssd", "MobileNet-SSD", "MobileNetSSD_deploy.prototxt",
                 "chuanqi305/MobileNet-SSD", "bb17b6c3eef36d80be441ae8e5339be66e8e3b7a",
                 "deploy.prototxt",
                 "2d180f723b3109e21f8287f6b3c691390d07b60eed998327cd3259ffa0e50608",
                 "detection", conf_gain=4.0),
    PublishedNet("res10_ssd_face", "res10 SSD face detector", "res10_300x300_ssd_deploy.prototxt",
                 "mpolinowski/opencv-face-detection", "2561628982c456b8cc5a9e643e1a36bb60428d54",
                 "face_detector/deploy.prototxt",
                 "67afdce8a84dd0b1667e9f57d7c54b3fca751e101635f120719be6c9fbba957d",
                 "detection", note="a copy of OpenCV's samples/dnn/face_detector/deploy.prototxt"),
    PublishedNet("ssdlite_mobilenet_v2", "MobileNetV2-SSDLite", "MobileNetV2-SSDLite_voc_deploy.prototxt",
                 "chuanqi305/MobileNetv2-SSDLite", "4032c415d2c85250ba207a173a3b8d7dfb599ae8",
                 "ssdlite/voc/deploy.prototxt",
                 "6b2de35000a573255b90f6c366aaa697451c0d218a16663fc18a7cc12c465b96",
                 "detection"),        # sigmoid scores: no gain (module docstring)
    PublishedNet("ssd300_vgg16", "SSD300 VGG-16", "VGG_VOC0712_SSD_300x300_deploy.prototxt",
                 "shangzw12/ssd", "f21d8a23426d7a76102bc19fe69f24f6359070d4",
                 "jobs/VGGNet/VOC0712/SSD_300x300/deploy.prototxt",
                 "62d5afc4c0a6a77ba6381656a8a9a6338b3f3e5f95a572eefca09ae6d058a695",
                 "detection", conf_gain=4.0,
                 note="the deploy net weiliu89/caffe's examples/ssd/ssd_pascal.py writes"),
    PublishedNet("rfb320", "RFB-320 face detector", "RFB-320.prototxt",
                 "Linzaer/Ultra-Light-Fast-Generic-Face-Detector-1MB",
                 "dffdddda9794a50607cba8f318507a28c1c27cab", "caffe/model/RFB-320/RFB-320.prototxt",
                 "d2d93df9e05dd16888e7fd6b3f13676fc9b5020f07dc7f904e2d6157ecefc9f4", "detection",
                 note="boxes and scores as dense outputs (no DetectionOutput)"),
    PublishedNet("enet", "ENet (segmentation)", "enet_deploy_final.prototxt", "TimoSaemann/ENet",
                 "bb681cc5df1945f8d625aa0de8aeaf33a6bd4550",
                 "prototxts/enet_deploy_final.prototxt",
                 "e93331af261c79f7ceeb82bbd955023fe2ea897ef60968fbdcbfe9cdde3825a4",
                 "segmentation", note="512 x 1024; the forks' BN and Upsample"),
    PublishedNet("fcn8s", "FCN-8s VOC (segmentation)", "voc-fcn8s_deploy.prototxt",
                 "shelhamer/fcn.berkeleyvision.org", "1305c7378a9f0ab44b2c936f4d60e4687e3d8743",
                 "voc-fcn8s/deploy.prototxt",
                 "4e87632aba2cda27e7dc810a6197d6f66fcd631045a595dec6bb4a4c90b7e9ca",
                 "segmentation", note="500 x 500, VGG-16 with 100 pixels of padding"),
]
BY_KEY = {n.key: n for n in NETS}
CONV_TYPES = ("Convolution", "Deconvolution", "ConvolutionDepthwise", "DepthwiseConvolution",
              "InnerProduct")


# ------------------------------------------------------------------------- the published files
def nets_dir(override=None):
    if override:
        return Path(override)
    sys.path.insert(0, str(ROOT))
    from caffepar.nn.native import cache_dir
    return cache_dir() / "published_nets"


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fetch(folder, nets):
    """Download the nets missing from `folder`; a file whose SHA-256 differs from the one the
    committed results were made from is kept, with a warning (the row records its hash)."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in nets:
        target = folder / n.file
        if not target.exists():
            try:
                with urllib.request.urlopen(n.url, timeout=60) as r:
                    target.write_bytes(r.read())
                print(f"fetched {n.repo}/{n.path}")
            except OSError as e:
                print(f"could not fetch {n.url}: {e}")
                continue
        if sha256(target) != n.sha256:
            print(f"warning: {target} is not the file the results were made from "
                  f"(SHA-256 {sha256(target)[:16]}, expected {n.sha256[:16]})")


# ------------------------------------------------------------------------- weights and inputs
def random_weights(model, weights, conf_gain=1.0, seed=1):
    """Save the net's random weights (see the module docstring) as a .caffemodel; returns the
    blobs' bytes at the prototxt's batch, per image."""
    sys.path.insert(0, str(ROOT))
    import caffepar as caffe
    from caffepar.proto.text import read_net_text
    param, _ = read_net_text(str(model))
    named_filler = set()
    for lp in param.layer:
        cp = lp.inner_product_param if lp.type == "InnerProduct" else lp.convolution_param
        if cp.HasField("weight_filler"):
            named_filler.add(lp.name)
    caffe.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    net = caffe.Net(str(model), caffe.TEST)
    for name, layer in zip(net._layer_names, net.layers):
        blobs = net.params.get(name, [])
        if layer.type in CONV_TYPES and blobs and name not in named_filler:
            w = blobs[0].data
            fan_in = int(np.prod(w.shape[1:])) or 1
            w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / fan_in)
        if layer.type == "BatchNorm":
            blobs[0].data[...], blobs[1].data[...], blobs[2].data[...] = 0, 1, 1
        if layer.type == "BN" and len(blobs) == 4:      # moving mean and variance
            blobs[2].data[...], blobs[3].data[...] = 0, 1
        if layer.type in CONV_TYPES and name.endswith("mbox_conf") and blobs:
            blobs[0].data[...] *= conf_gain
    calm_classifier(net)
    net.save(str(weights))
    first = net.blobs[net.inputs[0]].shape[0] if net.inputs else 1
    return sum(b.data.nbytes for b in net.blobs.values()) / max(first, 1)


def calm_classifier(net):
    """Scale the classifier (the Convolution or InnerProduct whose top a final Softmax reads)
    so that its scores have a standard deviation of 1 on the benchmark's input: random weights
    through a deep net give scores in the hundreds, whose softmax is exactly one-hot, and
    outputs that agree whatever the tools computed before it."""
    writer = {}
    for i, tops in enumerate(net.top_ids):
        for t in tops:
            writer[t] = i
    names = list(net.blobs)
    for out in net.outputs:
        i = writer.get(names.index(out))
        if i is None or net.layers[i].type != "Softmax":
            continue
        scores = net.bottom_ids[i][0]
        j = writer.get(scores)
        if j is None or net.layers[j].type not in CONV_TYPES:
            continue
        shapes = {n: net.blobs[n].data.shape for n in net.inputs}
        for n, x in make_inputs(shapes, shapes[net.inputs[0]][0]).items():
            net.blobs[n].data[...] = x
        net.forward()
        spread = float(np.std(net.blobs[names[scores]].data))
        if spread > 0 and np.isfinite(spread):
            for b in net.params[net._layer_names[j]]:
                b.data[...] /= spread


def make_inputs(shapes, batch, seed=7):
    """The same input for every tool: uniform in [-1, 1), one array per net input."""
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(-1, 1, (batch,) + tuple(shape[1:])).astype(np.float32)
            for name, shape in shapes.items()}


# ------------------------------------------------------------------------- comparing
def scale_of(a):
    return float(np.max(np.abs(a))) if a.size else 0.0


def blob_diff(got, want, carried=None):
    """(max |got - want| / the blob's largest magnitude, whether they agree at RTOL with the
    absolute floor ATOL_SCALE x that magnitude, plus the allowance `carried` from the blob's
    inputs through a sigmoid, tanh or softmax: caffepar/graph/tolerance.py)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return np.inf, False
    if not got.size:
        return 0.0, True
    scale = scale_of(want) or 1.0
    diff = np.abs(got - want)
    allowed = RTOL * np.abs(want) + ATOL_SCALE * scale
    if carried is not None:
        allowed = allowed + carried
    ok = bool(np.all(diff <= allowed))
    return float(diff.max() / scale), ok


def split_carried(dump):
    """(blobs, carried allowances) of a caffepar dump."""
    blobs = {n: a for n, a in dump.items() if not n.startswith(CARRIED)}
    return blobs, {n[len(CARRIED):]: a for n, a in dump.items() if n.startswith(CARRIED)}


def sorted_detections(d):
    rows = np.asarray(d, np.float64).reshape(-1, 7)
    return rows[np.lexsort(rows.T[::-1])]


def compare_outputs(got, want, detections, carried=None):
    """'agrees (...)' or 'differs (...)': another tool's outputs against caffepar's, one
    phrase for all outputs of the net."""
    carried = carried or {}
    worst, ok, counts = 0.0, True, []
    for name, w in want.items():
        if name not in got:
            return f"differs: no output {name}"
        g = got[name]
        if detections.get(name):
            g, w = sorted_detections(g), sorted_detections(w)
            counts.append(len(w))
            if g.shape != w.shape:
                return f"differs: {len(g)} detections, caffepar {len(w)}"
        elif np.size(g) == np.size(w):
            g = np.reshape(g, np.shape(w))
        d, good = blob_diff(g, w, None if detections.get(name) else carried.get(name))
        worst, ok = max(worst, d), ok and good
    what = f"{', '.join(map(str, counts))} detections, " if counts else ""
    return f"{'agrees' if ok else 'differs'} ({what}max diff {worst:.1e} of scale)"


def compare_blobs(fused, plain):
    """'all N blobs equal (...)' or 'differs: blob ...': every blob of the inference path's
    forward against the plain one (a dump, with its carried allowances)."""
    plain, carried = split_carried(plain)
    fused, _ = split_carried(fused)
    bad, worst = [], 0.0
    for name, want in plain.items():
        if name not in fused:
            bad.append(f"{name} missing")
            continue
        d, ok = blob_diff(fused[name], want, carried.get(name))
        worst = max(worst, d)
        if not ok:
            bad.append(f"{name} ({d:.1e})")
    if bad:
        return f"{len(bad)} of {len(plain)} blobs differ: " + ", ".join(bad[:4]) + \
            (" ..." if len(bad) > 4 else "")
    return f"all {len(plain)} blobs equal (max diff {worst:.1e} of scale)"


def ratio(ours, theirs):
    """caffepar's time over the peer's (< 1: caffepar faster); NaN where either is missing."""
    try:
        ours, theirs = float(ours), float(theirs)
    except (TypeError, ValueError):
        return float("nan")
    if not (ours > 0 and theirs > 0) or np.isnan(ours) or np.isnan(theirs):
        return float("nan")
    return ours / theirs


def best_median(rounds):
    """The best (lowest) of the rounds' median times; NaN when no round ran."""
    medians = [float(np.median(r)) for r in rounds if len(r)]
    return min(medians) if medians else float("nan")


# ------------------------------------------------------------------------- the workers
def inference_switch_present():
    """Whether the installed caffepar reads CAFFEPAR_INFERENCE (has an inference path)."""
    for path in (ROOT / "caffepar").rglob("*.py"):
        if "CAFFEPAR_INFERENCE" in path.read_text(errors="replace"):
            return True
    return False


class Worker:
    """One tool in a process of its own, loaded once and then told what to run, line by line
    (JSON), so that the tools alternate without sharing an interpreter, threads or memory."""

    def __init__(self, tool, spec, env=None):
        self.tool = tool
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", tool, json.dumps(spec)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._answer()

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            return {"error": f"exited with status {self.proc.returncode}"}
        return json.loads(line)

    def ask(self, **cmd):
        if "error" in self.info:
            return self.info
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            self.info = answer
        return answer

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _first_line(e):
    """The line of an exception's text that says what went wrong (OpenCV's messages run over
    several lines, the reason on the one with "error:")."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    said = [line[1:].strip() for line in text if line.startswith(">")] + \
        [line.split("error:", 1)[1].strip() for line in text if "error:" in line]
    return (said[0] if said else text[-1] if text else type(e).__name__)[:240]


def openblas_cores():
    """{library: OpenBLAS's chosen core} for the OpenBLAS copies loaded in this process."""
    import ctypes
    found = {}
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    for lib in sorted(libs):
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("openblas_get_corename", "openblas_get_corename64_",
                    "scipy_openblas_get_corename64_", "scipy_openblas_get_corename"):
            fn = getattr(handle, sym, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                found[Path(lib).name] = fn().decode()
                break
    return found


AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")
_OPENCV_BLAS = []


def opencv_blas_fix():
    """({variable: value}, sentence) for OpenCV's worker: the opencv-python wheels bundle an
    OpenBLAS of their own (0.3.15 in 4.x wheels), which takes an AVX-512 CPU it does not know
    for an old core (Prescott on an Ice Lake server); OPENBLAS_CORETYPE=SkylakeX then gives it
    its AVX-512 kernels, as NumPy's OpenBLAS has them. Nothing where the user set
    OPENBLAS_CORETYPE or the host has no AVX-512. Asked once, in a process of its own."""
    if _OPENCV_BLAS:
        return _OPENCV_BLAS[0]
    fix, said = {}, ""
    if "OPENBLAS_CORETYPE" not in os.environ and host_isa() == "AVX-512":
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import cv2, bench_inference "
                "as b; print(json.dumps(b.openblas_cores()))")
        got = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts")],
                             capture_output=True, text=True)
        try:
            cores = json.loads(got.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            cores = {}
        old = sorted({c for c in cores.values() if c not in AVX512_CORES})
        if old:
            fix = {"OPENBLAS_CORETYPE": "SkylakeX"}
            said = (f"OPENBLAS_CORETYPE=SkylakeX set for OpenCV (its bundled OpenBLAS took this "
                    f"CPU for {', '.join(old)})")
    _OPENCV_BLAS.append((fix, said))
    return fix, said


class CaffeparTool:
    def __init__(self, spec):
        sys.path.insert(0, str(ROOT))
        import caffepar as caffe
        from caffepar.nn import native
        self.net = caffe.Net(spec["model"], spec["weights"], caffe.TEST)
        k = native.kernels(np.float32)
        self.isa = (f"kernels {({64: 'AVX-512', 32: 'AVX2', 16: 'SSE'}).get(k.vector_bytes)}"
                    if k is not None else "NumPy kernels (no compiled kernels: not its speed)")
        cores = openblas_cores()
        if cores:
            self.isa += ", OpenBLAS " + ", ".join(sorted(set(cores.values())))
        self.outputs = list(self.net.outputs)

    @property
    def engine(self):
        """What ran the last forward where the onnxruntime engine was asked for."""
        onnx = getattr(self.net, "_onnx", None)
        if onnx is None:
            return None
        why = onnx.runs_own_plan()
        return f"its own plan ({why})" if why else \
            f"onnxruntime {__import__('onnxruntime').__version__}"

    def set_input(self, feeds):
        for name, value in feeds.items():
            self.net.blobs[name].reshape(*value.shape)
        self.net.reshape()
        for name, value in feeds.items():
            self.net.blobs[name].data[...] = value

    def run(self):
        self.net.forward()

    def outputs_now(self, all_blobs=False):
        # A forward first: the engine's first forward at a size is checked against caffepar's
        # own, which leaves its values. The outputs are read first: with the onnxruntime
        # engine, reading another blob runs caffepar's own forward for the rest (the outputs
        # keep onnxruntime's values).
        self.net.forward()
        names = self.outputs + ([n for n in self.net.blobs if n not in self.outputs]
                                if all_blobs else [])
        arrays = {n: np.array(self.net.blobs[n].data) for n in names}
        if all_blobs:
            try:
                from caffepar.graph.tolerance import carried_allowances
            except ImportError:         # an older caffepar: each blob held to its own rounding
                return arrays
            carried = carried_allowances(self.net, arrays.__getitem__)
            arrays.update((CARRIED + n, a) for n, a in carried.items())
        return arrays


class OpenCVTool:
    def __init__(self, spec):
        import cv2
        cv2.setNumThreads(spec["threads"])
        self.cv2 = cv2
        self.net = cv2.dnn.readNetFromCaffe(spec["model"], spec["weights"])
        self.net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        self.net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        self.names = spec["opencv_outputs"]
        info = cv2.getBuildInformation()
        found = re.search(r"Dispatched code generation:\s*(.*)", info)
        dispatched = found.group(1).split() if found else []
        flags = set(_cpu_flags())
        usable = [d for d in dispatched if all(f in flags for f in OPENCV_ISA_FLAGS.get(d, ()))]
        self.isa = (f"OpenCV {cv2.__version__}, code dispatched at run time for "
                    f"{' '.join(dispatched) or 'none'}; this CPU runs "
                    f"{usable[-1] if usable else 'the baseline'} and below")
        cores = openblas_cores()
        if cores:
            self.isa += "; OpenBLAS in its process: " + ", ".join(sorted(set(cores.values())))
        if spec.get("opencv_blas"):
            self.isa += f" ({spec['opencv_blas']})"

    def set_input(self, feeds):
        for name, value in feeds.items():
            self.net.setInput(np.ascontiguousarray(value), name)

    def run(self):
        return self.net.forward(self.names)

    def outputs_now(self, all_blobs=False):
        return dict(zip(self.names, (np.array(o) for o in self.run())))


OPENCV_ISA_FLAGS = {"SSE4_1": ("sse4_1",), "SSE4_2": ("sse4_2",), "AVX": ("avx",),
                    "FP16": ("f16c",), "AVX2": ("avx2", "fma"),
                    "AVX512_SKX": ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"),
                    "AVX512_ICL": ("avx512f", "avx512vnni", "avx512vbmi", "avx512vbmi2")}


def _cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    return []


class OnnxTool:
    def __init__(self, spec):
        import onnxruntime as ort
        self.ort = ort
        self.spec = spec
        self.sessions = {}
        flags = set(_cpu_flags())
        best = ("AVX-512 (avx512f)" if "avx512f" in flags else "AVX2" if "avx2" in flags
                else "SSE")
        self.isa = (f"onnxruntime {ort.__version__}, MLAS kernels chosen from CPUID: {best}"
                    + (", AVX512-VNNI" if "avx512_vnni" in flags else ""))
        self.session(spec["onnx"]["1"])

    def session(self, path):
        if path not in self.sessions:
            so = self.ort.SessionOptions()
            so.intra_op_num_threads = self.spec["threads"]
            so.inter_op_num_threads = 1
            so.execution_mode = self.ort.ExecutionMode.ORT_SEQUENTIAL
            self.sessions[path] = self.ort.InferenceSession(
                path, so, providers=["CPUExecutionProvider"])
        return self.sessions[path]

    def set_input(self, feeds):
        batch = next(iter(feeds.values())).shape[0]
        path = self.spec["onnx"].get(str(batch), self.spec["onnx"]["any"])
        self.current = self.session(path)
        names = [i.name for i in self.current.get_inputs()]
        self.feeds = {n: feeds[n] for n in names}
        self.names = [o.name for o in self.current.get_outputs()]

    def run(self):
        return self.current.run(None, self.feeds)

    def outputs_now(self, all_blobs=False):
        return dict(zip(self.names, self.run()))


def worker_main(tool, spec):
    """Load the tool, say so with its facts, then answer commands until told to quit."""
    spec = json.loads(spec)
    out = sys.stdout
    sys.stdout = sys.stderr             # only answers go to the pipe
    try:
        t0 = time.perf_counter()
        impl = {"caffepar": CaffeparTool, "engine": CaffeparTool, "opencv": OpenCVTool,
                "onnxruntime": OnnxTool}[tool](spec)
        shapes = {k: tuple(v) for k, v in spec["inputs"].items()}
        impl.set_input(make_inputs(shapes, 1))
        impl.run()
        answer = {"ready": True, "isa": impl.isa, "load_s": time.perf_counter() - t0}
        if getattr(impl, "engine", None):
            answer["isa"] = f"engine {impl.engine}; {impl.isa}"
    except Exception as e:  # each tool's own exceptions: the row says why
        answer = {"error": _first_line(e)}
    print(json.dumps(answer), file=out, flush=True)
    if "error" in answer:
        return
    batch_now = 1
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["batch"] != batch_now:
                impl.set_input(make_inputs(shapes, cmd["batch"]))
                impl.run()                  # the first pass at a new size is not timed
                batch_now = cmd["batch"]
            if cmd["cmd"] == "time":
                times, start = [], time.perf_counter()
                while (len(times) < cmd["min_runs"] or
                       (time.perf_counter() - start < cmd["budget"] and
                        len(times) < cmd["max_runs"])):
                    t = time.perf_counter()
                    impl.run()
                    times.append(time.perf_counter() - t)
                answer = {"times": times}
                if getattr(impl, "engine", None):
                    answer["ran"] = impl.engine
            elif cmd["cmd"] == "dump":
                arrays = impl.outputs_now(cmd.get("all_blobs", False))
                np.savez(cmd["path"], **{f"b{i}": a for i, a in enumerate(arrays.values())})
                answer = {"names": list(arrays)}
                if getattr(impl, "engine", None):
                    answer["ran"] = impl.engine
            else:
                answer = {"error": f"unknown command {cmd['cmd']}"}
        except Exception as e:  # noqa: BLE001  (reported, the driver goes on)
            answer = {"error": _first_line(e)}
        print(json.dumps(answer), file=out, flush=True)


def load_dump(path, names):
    with np.load(path) as z:
        return {n: z[f"b{i}"] for i, n in enumerate(names)}


# ------------------------------------------------------------------------- one net
def output_writers(model):
    """{top: (name, type) of the layer that last writes it}: OpenCV names a net's outputs by
    that layer, and a DetectionOutput's rows are compared as detections."""
    sys.path.insert(0, str(ROOT))
    from caffepar.proto.text import read_net_text
    param, _ = read_net_text(str(model))
    writer = {}
    for lp in param.layer:
        for top in lp.top:
            writer[top] = (lp.name, lp.type)
    return writer


def prepare(net, model, work, max_blob_bytes):
    """Weights, ONNX exports and what the workers need to know, in a process of its own (it
    builds the net at the throughput batch to export it when the export fixes the batch)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "
        "'/scripts'); import bench_inference as b; print(json.dumps(b.prepare_here(*sys.argv[2:])))")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT), str(model), str(work),
                           str(net.conf_gain), str(max_blob_bytes)],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        return {"error": (err[-1] if err else f"exit {proc.returncode}")[:240]}
    return json.loads(lines[-1])


def prepare_here(model, work, conf_gain, max_blob_bytes):
    sys.path.insert(0, str(ROOT))
    import caffepar as caffe
    from caffepar.errors import CaffeparError
    work = Path(work)
    weights = work / "random.caffemodel"
    try:
        per_image = random_weights(model, weights, float(conf_gain))
    except CaffeparError as e:
        return {"error": "caffepar refuses: " + _first_line(e)}
    net = caffe.Net(str(model), str(weights), caffe.TEST)
    inputs = {n: list(net.blobs[n].shape) for n in net.inputs}
    writers = output_writers(model)
    detections = {o: writers.get(o, ("", ""))[1] == "DetectionOutput" for o in net.outputs}
    batch = THROUGHPUT_BATCH
    while batch > 1 and per_image * batch > float(max_blob_bytes):
        batch //= 2
    spec = {"model": str(model), "weights": str(weights), "inputs": inputs,
            "outputs": list(net.outputs), "detections": detections,
            "layers": len(net.layers), "blob_mib_per_image": per_image / 2 ** 20,
            "throughput_batch": batch, "onnx": {},
            "opencv_outputs": [writers.get(o, (o, ""))[0] for o in net.outputs]}
    del net
    try:
        from caffepar.convert.onnx_export import export_onnx
        res = export_onnx(str(model), str(weights), str(work / "any.onnx"))
        spec["onnx"]["any"] = spec["onnx"]["1"] = spec["onnx"][str(batch)] = str(work / "any.onnx")
        if res.note:                            # the batch is fixed: one export per batch size
            spec["onnx_note"] = res.note
            for b in sorted({1, batch}):
                export_onnx(str(model), str(weights), str(work / f"b{b}.onnx"), batch=b)
                spec["onnx"][str(b)] = str(work / f"b{b}.onnx")
    except Exception as e:  # noqa: BLE001  (the export's refusal is the row's answer)
        spec["onnx_error"] = _first_line(e)
    return spec


def run_net(net, model, args, scratch):
    """One row: the net measured and checked."""
    row = {"net": net.key, "label": net.label, "kind": net.kind, "sha256": sha256(model)[:16],
           "started": time.strftime("%Y-%m-%d %H:%M")}
    load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix=f"{net.key}-", dir=scratch))
    spec = prepare(net, model, work, args.max_blob_gib * 2 ** 30)
    if "error" in spec:
        row.update(caffepar_check=spec["error"], opencv_check="-", onnx_check="-")
        return row
    spec["threads"] = args.threads
    batch = spec["throughput_batch"]
    row.update(layers=spec["layers"], throughput_batch=batch,
               blob_mib_per_image=spec["blob_mib_per_image"])
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads))
    peers_env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS=str(args.threads))
    detections = spec["detections"]

    # Correctness first, at batch 1: every blob with the inference path on and off.
    plain = Worker("caffepar", spec, dict(env, CAFFEPAR_INFERENCE="off"))
    answer = plain.ask(cmd="dump", batch=1, path=str(work / "plain.npz"), all_blobs=True)
    plain.close()
    # The engine's blobs in a process of its own: a blob read becomes an output of its
    # sessions from then on, which the timed one must not have.
    engine_env = dict(env, CAFFEPAR_INFERENCE="onnxruntime")
    check = Worker("engine", spec, engine_env)
    engine_dump = check.ask(cmd="dump", batch=1, path=str(work / "engine.npz"), all_blobs=True) \
        if "error" not in check.info else {"error": check.info["error"]}
    engine_dump.setdefault("isa", check.info.get("isa", ""))
    check.close()
    fix, spec["opencv_blas"] = opencv_blas_fix()
    workers = {"caffepar": Worker("caffepar", spec, env),
               "engine": Worker("engine", spec, engine_env),
               "opencv": Worker("opencv", spec, dict(peers_env, **fix))}
    if "onnx_error" in spec:
        row["onnx_check"] = "export refuses: " + spec["onnx_error"]
    else:
        workers["onnxruntime"] = Worker("onnxruntime", spec, peers_env)
    try:
        ours = workers["caffepar"].ask(cmd="dump", batch=1, path=str(work / "fused.npz"),
                                       all_blobs=True)
        if "error" in ours or "error" in answer:
            row["caffepar_check"] = "fails: " + (ours.get("error") or answer.get("error"))
            return row
        fused = load_dump(work / "fused.npz", ours["names"])
        check = compare_blobs(fused, load_dump(work / "plain.npz", answer["names"]))
        row["caffepar_check"] = check + ("" if inference_switch_present() else
                                         " (no inference path yet: the same forward twice)")
        if "error" in engine_dump:
            row["engine_check"] = "fails: " + engine_dump["error"]
        else:
            outs = ", ".join(spec["outputs"])
            row["engine_check"] = (
                compare_blobs(load_dump(work / "engine.npz", engine_dump["names"]),
                              load_dump(work / "plain.npz", answer["names"])) +
                f"; {outs} from {engine_dump.get('ran', '?')}, the others computed when read")
        want = {o: fused[o] for o in spec["outputs"]}
        carried = split_carried(load_dump(work / "plain.npz", answer["names"]))[1]
        for tool, column in (("opencv", CHECK["opencv"]), ("onnxruntime", CHECK["onnxruntime"])):
            if tool not in workers:
                continue
            w = workers[tool]
            if "error" in w.info:
                row[column] = "fails: " + w.info["error"]
                continue
            got = w.ask(cmd="dump", batch=1, path=str(work / f"{tool}.npz"))
            if "error" in got:
                row[column] = "fails: " + got["error"]
                continue
            theirs = load_dump(work / f"{tool}.npz", got["names"])
            # Outputs in caffepar's order: OpenCV's by layer name, onnxruntime's by top name.
            theirs = dict(zip(spec["outputs"], theirs.values()))
            row[column] = compare_outputs(theirs, want, detections, carried)
        row["isa"] = " || ".join(f"{t}: {w.info['isa']}" for t, w in workers.items()
                               if "isa" in w.info)
        # Speed: alternating rounds, the order rotating.
        live = [t for t in TOOLS if t in workers and "error" not in workers[t].info]
        lat = {t: [] for t in live}
        thr = {t: [] for t in live}
        own_plan = {}                   # batch -> why the engine timed its own plan there
        timing_errors = {}              # (tool, batch) -> the tool's error there
        for r in range(args.rounds):
            order = live[r % len(live):] + live[:r % len(live)]
            for b, store, runs, budget in ((1, lat, args.runs, args.budget),
                                           (batch, thr, args.batch_runs, args.batch_budget)):
                for t in order:
                    if "error" in workers[t].info:
                        continue
                    got = workers[t].ask(cmd="time", batch=b, min_runs=runs, budget=budget,
                                         max_runs=1000)
                    if "times" in got:
                        store[t].append(got["times"])
                    if got.get("ran", "").startswith("its own plan"):
                        own_plan[b] = got["ran"]
                    if "error" in got:
                        timing_errors.setdefault((t, b), got["error"])
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{t} {best_median(lat[t][-1:]) * 1e3:.2f} ms, "
                f"{batch / best_median(thr[t][-1:]):.1f} img/s" for t in live if lat[t]
                and thr[t]), flush=True)
        for b, why in sorted(own_plan.items()):
            row["engine_check"] = row.get("engine_check", "") + f"; timed at batch {b}: {why}"
        for (t, b), error in sorted(timing_errors.items()):
            row[CHECK[t]] = row.get(CHECK[t], "") + f"; fails at batch {b}: {error}"
        for t in TOOLS:
            key = KEY[t]
            if t in live and lat[t]:
                row[f"{key}_ms"] = best_median(lat[t]) * 1e3
            elif t in workers:
                row[f"{key}_ms"] = float("nan")
                if "error" in workers[t].info and not row.get(f"{t}_check", "").startswith("f"):
                    row.setdefault(CHECK[t], "fails: " + workers[t].info["error"])
            row[f"{key}_ips"] = (batch / best_median(thr[t]) if t in live and thr[t]
                                 else float("nan"))
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)
    fill_ratios(row)
    row["load"] = f"{load_start:.2f}-{os.getloadavg()[0]:.2f}"
    return row


def fill_ratios(row):
    """Latency ratios are caffepar's time over the peer's; throughput ratios the peer's images/s
    over caffepar's (so < 1 is caffepar faster in both)."""
    row["lat_vs_opencv"] = ratio(row.get("caffepar_ms"), row.get("opencv_ms"))
    row["lat_vs_ort"] = ratio(row.get("caffepar_ms"), row.get("ort_ms"))
    row["thr_vs_opencv"] = ratio(row.get("opencv_ips"), row.get("caffepar_ips"))
    row["thr_vs_ort"] = ratio(row.get("ort_ips"), row.get("caffepar_ips"))
    row["eng_lat_vs_opencv"] = ratio(row.get("eng_ms"), row.get("opencv_ms"))
    row["eng_lat_vs_ort"] = ratio(row.get("eng_ms"), row.get("ort_ms"))
    row["eng_thr_vs_opencv"] = ratio(row.get("opencv_ips"), row.get("eng_ips"))
    row["eng_thr_vs_ort"] = ratio(row.get("ort_ips"), row.get("eng_ips"))
    return row


# ------------------------------------------------------------------------- peers' kernels
def gemm_rates(scratch):
    """Each tool's single-thread SGEMM rate (GFLOP/s) on a 1024 x 1024 x 1024 InnerProduct:
    a check that each runs its best kernels on this CPU."""
    proto = Path(scratch) / "gemm.prototxt"
    proto.write_text('name: "gemm"\ninput: "x"\ninput_shape { dim: 1024 dim: 1024 }\n'
                     'layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y" '
                     'inner_product_param { num_output: 1024 bias_term: false '
                     'weight_filler { type: "gaussian" std: 0.01 } } }\n')
    spec = prepare(PublishedNet("gemm", "", "", "", "", "", ""), proto, Path(scratch),
                   2 ** 40)
    if "error" in spec:
        return {}
    spec["threads"] = 1
    rates = {}
    fix, spec["opencv_blas"] = opencv_blas_fix()
    for tool in TOOLS:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        w = Worker(tool, dict(spec, inputs={"x": [1024, 1024]}),
                   dict(env, **fix) if tool == "opencv" else env)
        got = w.ask(cmd="time", batch=1024, min_runs=10, budget=1.0, max_runs=200)
        w.close()
        if "times" in got:
            rates[tool] = 2 * 1024 ** 3 / min(got["times"]) / 1e9
    return rates


# ------------------------------------------------------------------------- results
FIELDS = ["net", "label", "kind", "layers", "caffepar_ms", "opencv_ms", "ort_ms",
          "lat_vs_opencv", "lat_vs_ort", "throughput_batch", "caffepar_ips", "opencv_ips",
          "ort_ips", "thr_vs_opencv", "thr_vs_ort", "caffepar_check", "opencv_check",
          "onnx_check", "blob_mib_per_image", "isa", "sha256", "started", "load",
          "eng_ms", "eng_ips", "eng_lat_vs_opencv", "eng_lat_vs_ort", "eng_thr_vs_opencv",
          "eng_thr_vs_ort", "engine_check"]
NUMERIC = {"layers", "caffepar_ms", "opencv_ms", "ort_ms", "lat_vs_opencv", "lat_vs_ort",
           "throughput_batch", "caffepar_ips", "opencv_ips", "ort_ips", "thr_vs_opencv",
           "thr_vs_ort", "blob_mib_per_image", "eng_ms", "eng_ips", "eng_lat_vs_opencv",
           "eng_lat_vs_ort", "eng_thr_vs_opencv", "eng_thr_vs_ort"}


def read_rows(path):
    """The rows of a results CSV (numbers as floats; NaN where empty)."""
    rows = []
    try:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows.append({k: (_num(v) if k in NUMERIC else v) for k, v in r.items()})
    except OSError:
        pass
    return rows


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _fmt(v, digits=2):
    if isinstance(v, float):
        return "" if np.isnan(v) else f"{v:.{digits}f}"
    return "" if v is None else str(v)


def _bold(v):
    text = _fmt(v)
    return f"**{text}**" if text else ""


def merged(old, new):
    """Old rows with this run's rows in their place, in NETS' order."""
    by = {r["net"]: r for r in old}
    by.update({r["net"]: r for r in new})
    order = [n.key for n in NETS]
    return sorted(by.values(), key=lambda r: order.index(r["net"]) if r["net"] in order else 99)


def goal_marks(row, prefix=""):
    """The issue's goals for a row: batch-1 latency <= 1.0x OpenCV, <= 1.0x onnxruntime on
    ResNet-50 and GoogLeNet, <= 1.5x onnxruntime on the mobile nets; batch throughput at
    least OpenCV's. {goal: True/False} for the goals that apply and were measured; `prefix`
    "eng_": the onnxruntime engine's."""
    marks = {}
    if not np.isnan(row.get(prefix + "lat_vs_opencv", np.nan)):
        marks["latency <= 1.0x OpenCV"] = row[prefix + "lat_vs_opencv"] <= 1.0
    limit = 1.0 if row["net"] in ("resnet50", "googlenet") else \
        1.5 if row["net"] in MOBILE else None
    if limit and not np.isnan(row.get(prefix + "lat_vs_ort", np.nan)):
        marks[f"latency <= {limit}x onnxruntime"] = row[prefix + "lat_vs_ort"] <= limit
    if not np.isnan(row.get(prefix + "thr_vs_opencv", np.nan)):
        marks["throughput >= OpenCV"] = row[prefix + "thr_vs_opencv"] <= 1.0
    return marks


MOBILE = {"mobilenet_v1", "mobilenet_v2", "shufflenet_v1", "shufflenet_v2", "mobilenet_ssd",
          "ssdlite_mobilenet_v2", "rfb320", "squeezenet_v1.1"}


def write_results(out, rows, info):
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k), 4) if isinstance(r.get(k), float) else r.get(k, "")
                        for k in FIELDS})
    lines = [
        "# Published Caffe nets at inference: caffepar vs OpenCV dnn and onnxruntime",
        "",
        f"Written by `python scripts/bench_inference.py` ({info['rounds']} alternating rounds "
        f"per net; the best of the rounds' medians counts). CPU: {info['cpu']}; "
        f"{info['threads']} threads for each tool. Random weights (fillers; BatchNorm mean 0, "
        f"variance 1), the same random input for every tool. Each net's row has the time and "
        f"the 1-minute load average of its own run (loaded: other jobs shared the cores; "
        f"ratios from alternating rounds, absolute times noisy).",
        "",
    ] + ([info["note"], ""] if info.get("note") else []) + [
        "Batch 1: median latency of `net.forward()` (caffepar), `net.forward()` on the same "
        "prototxt and caffemodel (OpenCV dnn, its own CPU backend) and `session.run` on "
        "caffepar's ONNX export (onnxruntime, CPU provider). Ratio = caffepar's time / the "
        "peer's (< 1: caffepar faster). Batch N: images per second; ratio = the peer's "
        "images/s / caffepar's (< 1: caffepar faster).",
        "",
        "| net | caffepar ms | OpenCV ms | onnxruntime ms | vs OpenCV | vs onnxruntime | "
        "batch | caffepar img/s | OpenCV img/s | onnxruntime img/s | vs OpenCV | "
        "vs onnxruntime |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {_fmt(r.get('caffepar_ms'), 1)} | {_fmt(r.get('opencv_ms'), 1)} "
            f"| {_fmt(r.get('ort_ms'), 1)} | {_bold(r.get('lat_vs_opencv'))} | "
            f"{_bold(r.get('lat_vs_ort'))} | {_fmt(r.get('throughput_batch'), 0)} | "
            f"{_fmt(r.get('caffepar_ips'), 1)} | {_fmt(r.get('opencv_ips'), 1)} | "
            f"{_fmt(r.get('ort_ips'), 1)} | {_bold(r.get('thr_vs_opencv'))} | "
            f"{_bold(r.get('thr_vs_ort'))} |")
    engine_rows = [r for r in rows if not np.isnan(r.get("eng_ms", np.nan))]
    if engine_rows:
        lines += ["", "With the optional onnxruntime engine (`CAFFEPAR_INFERENCE=onnxruntime`, "
                  "`pip install caffepar[onnx]`): caffepar's `net.forward()` runs its own ONNX "
                  "export in onnxruntime (written for speed: an LRN as elementwise steps, MAX "
                  "pooling's padding the op's own), the outputs copied into their blobs; any "
                  "other blob is computed by caffepar's own forward when first read. Same "
                  "rounds, same ratios:", "",
                  "| net | caffepar + onnxruntime engine ms | vs OpenCV | vs onnxruntime | batch "
                  "| img/s | vs OpenCV | vs onnxruntime |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in engine_rows:
            lines.append(
                f"| {r['label']} | {_fmt(r.get('eng_ms'), 1)} | "
                f"{_bold(r.get('eng_lat_vs_opencv'))} | {_bold(r.get('eng_lat_vs_ort'))} | "
                f"{_fmt(r.get('throughput_batch'), 0)} | {_fmt(r.get('eng_ips'), 1)} | "
                f"{_bold(r.get('eng_thr_vs_opencv'))} | {_bold(r.get('eng_thr_vs_ort'))} |")
    lines += ["", "Goals (issue 34): batch-1 latency at most 1.0x OpenCV on every net, at most "
              "1.0x onnxruntime on ResNet-50 and GoogLeNet and 1.5x on the mobile nets; "
              "batch-32 throughput at least OpenCV's.", ""]
    for prefix, title in (("", "caffepar's own kernels"),
                          ("eng_", "caffepar with the onnxruntime engine")):
        lines += [f"{title}:", ""]
        for r in rows:
            marks = goal_marks(r, prefix)
            if marks:
                met = [g for g, ok in marks.items() if ok]
                missed = [g for g, ok in marks.items() if not ok]
                lines.append(f"- {r['label']}: " + (f"met: {', '.join(met)}" if met else "") +
                             ("; " if met and missed else "") +
                             (f"**missed: {', '.join(missed)}**" if missed else ""))
        lines.append("")
    lines += ["", "## Correctness (batch 1, the same input)", "",
              "caffepar: every blob after the TEST forward against the forward with "
              "`CAFFEPAR_INFERENCE=off`; OpenCV and onnxruntime: the net's outputs against "
              f"caffepar's (detections as sorted rows). Agreement: rtol {RTOL:g}, with an "
              f"absolute floor of {ATOL_SCALE:g} x the blob's largest magnitude, plus, for a "
              "blob a Sigmoid, TanH or Softmax makes, what its input's allowance becomes "
              "through the function's slope (caffepar/graph/tolerance.py); the diff is "
              "given as a fraction of that magnitude.", "",
              "| net | layers | caffepar blobs | caffepar blobs, onnxruntime engine | "
              "OpenCV outputs | onnxruntime outputs |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {_fmt(r.get('layers'), 0)} | {r.get('caffepar_check', '')}"
                     f" | {r.get('engine_check', '')} | {r.get('opencv_check', '')} | "
                     f"{r.get('onnx_check', '')} |")
    lines += ["", "## The tools and their kernels", ""]
    for tool, text in info.get("isa", {}).items():
        lines.append(f"- {tool}: {text}")
    if info.get("gemm"):
        lines.append("- single-thread SGEMM, 1024 x 1024 x 1024 InnerProduct: " + ", ".join(
            f"{t} {g:.0f} GFLOP/s" for t, g in info["gemm"].items()))
    lines += ["", "## The nets", "",
              "Published deploy prototxts (not part of this repository; `--fetch` downloads "
              "them):", ""]
    for n in NETS:
        lines.append(f"- {n.label}: {n.repo} `{n.path}` at {n.commit[:10]}"
                     + (f" ({n.note})" if n.note else ""))
    lines += ["", "Rows: " + "; ".join(
        f"{r['label']} measured {r.get('started', '')}, load {r.get('load', '')}" +
        (" **loaded**" if loaded(r.get("load", ""), info["threads"]) else "") for r in rows), ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    plot(out, rows)


def loaded(load, threads):
    """Whether a row's run shared the cores: a load average above 0.5 at its start, or above
    the benchmark's own threads + 0.5 at its end."""
    try:
        start, end = (float(v) for v in load.split("-"))
    except ValueError:
        return False
    return start > 0.5 or end > threads + 0.5


def plot(out, rows):
    from figures import pyplot
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    x = np.arange(len(rows))
    for ax, (a, b), title in ((axes[0], ("lat_vs_opencv", "lat_vs_ort"),
                               "batch 1 latency: caffepar / peer"),
                              (axes[1], ("thr_vs_opencv", "thr_vs_ort"),
                               "batch 32 throughput: peer / caffepar")):
        for off, key, label in ((-0.3, a, "own kernels vs OpenCV dnn"),
                                (-0.1, b, "own kernels vs onnxruntime"),
                                (0.1, "eng_" + a, "onnxruntime engine vs OpenCV dnn"),
                                (0.3, "eng_" + b, "onnxruntime engine vs onnxruntime")):
            vals = [r.get(key, np.nan) for r in rows]
            ax.bar(x + off, [v if not np.isnan(v) else 0 for v in vals], 0.2, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.5, color="C1", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(title, fontsize=8)
        ax.legend(fontsize=7)
    axes[1].set_xticks(x, [r["label"] for r in rows], rotation=40, ha="right", fontsize=7)
    fig.suptitle("caffepar vs OpenCV dnn and onnxruntime (< 1: caffepar faster)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


# ------------------------------------------------------------------------- main
def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets-dir", default=None, help="the folder of published prototxts "
                    "(default: $CAFFEPAR_CACHE_DIR/published_nets)")
    ap.add_argument("--fetch", action="store_true", help="download the missing nets first")
    ap.add_argument("--only", nargs="*", default=None, metavar="NET",
                    help="these nets only: " + ", ".join(BY_KEY))
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per net (0: the "
                    "correctness checks only)")
    ap.add_argument("--runs", type=int, default=15, help="batch-1 forwards per tool and round "
                    "at least")
    ap.add_argument("--budget", type=float, default=2.0,
                    help="seconds of batch-1 forwards per tool and round at least")
    ap.add_argument("--batch-runs", type=int, default=3,
                    help="throughput-batch forwards per tool and round at least")
    ap.add_argument("--batch-budget", type=float, default=3.0,
                    help="seconds of throughput-batch forwards per tool and round at least")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-blob-gib", type=float, default=8.0,
                    help="a net whose caffepar blobs at batch 32 would pass this runs its "
                         "throughput at the largest power-of-2 batch within it")
    ap.add_argument("--out", default=None,
                    help="OUT.csv/.md/.png (default: results/inference_<cpu>)")
    ap.add_argument("--fresh", action="store_true", help="measure every net again")
    ap.add_argument("--note", default="", help="a sentence for the results' header (e.g. how "
                    "the run was made)")
    ap.add_argument("--redo", nargs="*", default=(), metavar="NET",
                    help="measure these nets again, keep the others' rows")
    ap.add_argument("--keep-engines", action="store_true",
                    help="use the convolution engines measured earlier on this machine (by "
                         "default they are measured afresh, in a temporary cache)")
    args = ap.parse_args()
    # Stopped with SIGTERM (a long run on a shared machine): clean up as on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    folder = nets_dir(args.nets_dir)
    chosen = [BY_KEY[k] for k in args.only] if args.only else NETS
    if args.fetch:
        fetch(folder, chosen)
    out = Path(args.out) if args.out else ROOT / f"results/inference_{cpu_key()}"
    scratch = Path(tempfile.mkdtemp(prefix="caffepar-bench-inference-"))
    if not args.keep_engines:
        # Engines measured afresh; the compiled kernels (named by the hash of their sources,
        # compiler and CPU) are taken from the usual cache when they are there.
        fresh = scratch / "cache"
        fresh.mkdir()
        for lib in nets_dir(None).parent.glob("kernels-*.so"):
            shutil.copy2(lib, fresh)
        os.environ["CAFFEPAR_CACHE_DIR"] = str(fresh)
    try:
        old = [] if args.fresh else read_rows(out.with_suffix(".csv"))
        # A row without a batch-1 time (a --rounds 0 run: checks only) is measured again.
        done = {r["net"] for r in old if not np.isnan(r.get("caffepar_ms", np.nan))} - \
            set(args.redo)
        info = {"cpu": f"{cpu_name()} [{cpu_key()}]", "threads": args.threads,
                "rounds": args.rounds, "note": args.note}
        print(f"{info['cpu']}; {args.threads} threads per tool; nets from {folder}; "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        new = []
        for n in chosen:
            if n.key in done:
                print(f"{n.label}: in {out.with_suffix('.csv').name} already (--redo "
                      f"{n.key} measures it again)")
                continue
            model = folder / n.file
            if not model.exists():
                print(f"{n.label}: not in {folder} (--fetch downloads {n.url})")
                continue
            print(f"{n.label} ({n.file})", flush=True)
            row = run_net(n, model, args, scratch)
            new.append(row)
            for k in ("caffepar_check", "engine_check", "opencv_check", "onnx_check"):
                print(f"  {k}: {row.get(k, '')}")
            print(f"  batch 1: caffepar {_fmt(row.get('caffepar_ms'))} ms, OpenCV "
                  f"{_fmt(row.get('opencv_ms'))} ms, onnxruntime {_fmt(row.get('ort_ms'))} ms; "
                  f"batch {_fmt(row.get('throughput_batch'), 0)}: "
                  f"{_fmt(row.get('caffepar_ips'), 1)} / {_fmt(row.get('opencv_ips'), 1)} / "
                  f"{_fmt(row.get('ort_ips'), 1)} img/s; onnxruntime engine "
                  f"{_fmt(row.get('eng_ms'))} ms, {_fmt(row.get('eng_ips'), 1)} img/s",
                  flush=True)
            rows = merged(old, new)
            info["isa"] = isa_lines(rows)
            write_results(out, rows, info)
        if new:
            info["gemm"] = gemm_rates(scratch)
            rows = merged(old, new)
            info["isa"] = isa_lines(rows)
            write_results(out, rows, info)
            print(f"wrote {out.with_suffix('.md')}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def isa_lines(rows):
    """{tool: what its CPU dispatch chose}, from the latest row that says."""
    found = {}
    for r in rows:
        for part in (r.get("isa") or "").split(" || "):
            tool, _, text = part.partition(": ")
            if tool in TOOLS and text:
                found[tool] = text
    return found


if __name__ == "__main__":
    main()
