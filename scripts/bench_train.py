#!/usr/bin/env python
"""caffepar's speed on the bundled nets against PyTorch and BVLC Caffe, measured side by side in
alternating rounds in one run, written under the CPU's name: results/cpu_speed_<vendor>_<family>
.{md,csv,png} (amd_zen4, intel_skylakex, ...), with _avx2 (or the build's instruction set) added
when the kernels are built for less than the host has (CAFFEPAR_CFLAGS=-march=haswell on an
AVX-512 host: the AVX2 result until a real AVX2 host is met).

    python scripts/bench_train.py [--nets cifar10_quick,alexnet,vgg16,mobilenet_v2,shufflenet_v2]
                                  [--rounds 3] [--caffe PATH/TO/caffe] [--nets-dir DIR]
                                  [--out results/cpu_speed_<cpu>]

The bundled nets train from models/<net>/train_val_dummy.prototxt. MobileNet v2 and ShuffleNet
v2 (batch 16) train from the published deploy prototxts that scripts/bench_inference.py keeps
outside the repository (--nets-dir, default $CAFFEPAR_CACHE_DIR/published_nets; its --fetch
downloads them), made into training nets at run time (DummyData in place of the input,
SoftmaxWithLoss in place of the final Softmax, BatchNorm on batch statistics); PyTorch runs the
same graph, one module per layer, and BVLC Caffe the same net with its depthwise layers as
grouped Convolution (it has no ShuffleChannel: ShuffleNet v2 gets no Caffe figure, and the
results say why). Where Caffe's OpenBLAS takes this AVX-512 CPU for an older core (Debian's
0.3.21 on some Xeons) and OPENBLAS_CORETYPE is not set, Caffe runs with
OPENBLAS_CORETYPE=SkylakeX, and the results say so.

Per net, each round runs in turn:
- training iterations (forward + backward + SGD update) of caffepar and of the same
  architecture in PyTorch on the CPU with the same thread count (`pip install torch==2.13.0`),
  each side --repeat times and for --budget seconds at least;
- forward + backward as `caffepar time` runs it and, with --caffe, `caffe time` on the same
  prototxt (models/<net>/train_val_dummy.prototxt, Caffe in a subprocess, with the same
  OPENBLAS_* settings);
and the fastest of the rounds counts, so a noisy spell on a shared machine falls on every side.
Convolution engines are measured afresh at the start (unless --keep-engines).
Also: max pooling 3x3/2 on cifar10_quick's pool1 (100x32x32x32) forward + backward, the SGD
update alone, and the engine each convolution runs on. The machine's load average is recorded
with the figures: figures taken under load are marked as such.
"""
import argparse
import atexit
import csv
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402
from cpuinfo import build_isa, cpu_key, cpu_name, isa_suffix  # noqa: E402

NETS = {"cifar10_quick": 100, "alexnet": 16, "vgg16": 4, "mobilenet_v2": 16,
        "shufflenet_v2": 16}
TIME_ITERATIONS = {"cifar10_quick": 10, "alexnet": 3, "vgg16": 2, "mobilenet_v2": 3,
                   "shufflenet_v2": 3}
# Nets trained from a published deploy prototxt (kept outside the repository, in the folder
# scripts/bench_inference.py reads: --nets-dir), made into a training net at run time.
PUBLISHED = {"mobilenet_v2": "mobilenet_v2_deploy.prototxt",
             "shufflenet_v2": "shufflenet_v2_1x_deploy.prototxt"}
# Layer types of Caffe's forks that BVLC Caffe does not have, and how (if at all) the Caffe
# prototxt says the same thing.
NOT_IN_BVLC = {"ShuffleChannel": None, "ConvolutionDepthwise": "Convolution",
               "DepthwiseConvolution": "Convolution"}
MADE = {}               # name -> (caffepar's prototxt, Caffe's prototxt or the reason it has none)


def model_path(name):
    if name in PUBLISHED:
        return MADE[name][0]
    return ROOT / f"models/{name}/train_val_dummy.prototxt"


def caffe_model_path(name):
    """The prototxt `caffe time` runs: the same net, in BVLC Caffe's types; a str saying why
    there is none."""
    if name in PUBLISHED:
        return MADE[name][1]
    return model_path(name)


def training_net(deploy, batch, bvlc=False):
    """A published deploy NetParameter as a training net: DummyData (constant data, label 0) in
    place of its input, its final Softmax dropped and SoftmaxWithLoss on the scores in its
    place, BatchNorm on batch statistics (no use_global_stats). With bvlc, depthwise layers
    become Convolution with group = channels; a type BVLC Caffe has no form of raises
    ValueError naming it."""
    from caffepar.proto import caffe_pb2
    net = caffe_pb2.NetParameter(name=deploy.name)
    if deploy.input_shape:
        shape = list(deploy.input_shape[0].dim)
    elif deploy.input_dim:
        shape = list(deploy.input_dim)
    else:
        shape = [list(lp.input_param.shape[0].dim) for lp in deploy.layer
                 if lp.type == "Input"][0]
    data = net.layer.add(name="data", type="DummyData", top=["data", "label"])
    data.dummy_data_param.shape.add(dim=[batch] + shape[1:])
    data.dummy_data_param.shape.add(dim=[batch])
    data.dummy_data_param.data_filler.add(type="constant", value=0.5)
    data.dummy_data_param.data_filler.add(type="constant", value=0)
    layers = [lp for lp in deploy.layer if lp.type != "Input"]
    if layers and layers[-1].type == "Softmax":
        layers = layers[:-1]
    for lp in layers:
        copy = net.layer.add()
        copy.CopyFrom(lp)
        if copy.type == "BatchNorm":
            copy.batch_norm_param.ClearField("use_global_stats")
        if bvlc and copy.type in NOT_IN_BVLC:
            if NOT_IN_BVLC[copy.type] is None:
                raise ValueError(f"BVLC Caffe has no {copy.type} layer ({copy.name})")
            copy.type = NOT_IN_BVLC[lp.type]
            copy.convolution_param.group = copy.convolution_param.num_output
    net.layer.add(name="loss", type="SoftmaxWithLoss", bottom=[layers[-1].top[0], "label"],
                  top=["loss"])
    return net


def make_published(name, batch, folder, out_dir):
    """Write the training prototxts of a published net (caffepar's, Caffe's) into out_dir."""
    from google.protobuf import text_format
    from caffepar.proto.text import read_net_text
    path = Path(folder) / PUBLISHED[name]
    if not path.exists():
        raise SystemExit(f"{name}: {path} is missing (scripts/bench_inference.py --fetch "
                         f"downloads the published nets into that folder)")
    deploy, _ = read_net_text(str(path))
    ours = Path(out_dir) / f"{name}_train_dummy.prototxt"
    ours.write_text(text_format.MessageToString(training_net(deploy, batch)))
    try:
        theirs = Path(out_dir) / f"{name}_train_dummy_bvlc.prototxt"
        theirs.write_text(text_format.MessageToString(training_net(deploy, batch, bvlc=True)))
    except ValueError as e:
        theirs = str(e)
    MADE[name] = (ours, theirs)


def dummy_solver_param(name, batch):
    """SGD on a bundled net's DummyData variant at `batch`, with constant input (no time spent
    drawing random data)."""
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import read_net_text
    net, _ = read_net_text(str(model_path(name)))
    for layer in net.layer:
        if layer.type == "DummyData":
            layer.dummy_data_param.data_filler[0].type = "constant"
            layer.dummy_data_param.data_filler[0].value = 0.5
            for shape in layer.dummy_data_param.shape:
                shape.dim[0] = batch
    param = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, weight_decay=0.0005,
                                      lr_policy="fixed", max_iter=10 ** 6, display=0,
                                      snapshot_after_train=False, random_seed=1,
                                      snapshot_prefix=os.path.join(tempfile.gettempdir(),
                                                                   "bench_train"))
    param.net_param.CopyFrom(net)
    return param


def iteration_flops(net):
    from bench_layers import layer_flops
    return sum(layer_flops(net, i) for i, l in enumerate(net.layers)
               if l.type in ("Convolution", "InnerProduct"))


def caffepar_step(name, batch):
    """One SGD iteration of the bundled net as a callable, its update alone (the solver's
    ApplyUpdate) as another, the solver, its GEMM FLOPs, and the seconds of the first
    iteration (which measures the convolution engines when they are not cached)."""
    from caffepar.solvers import get_solver
    solver = get_solver(dummy_solver_param(name, batch))
    start = time.perf_counter()
    solver.step(1)
    first = time.perf_counter() - start
    return ((lambda: solver.step(1)), solver.apply_update, solver, iteration_flops(solver.net),
            first)


AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def blas_core(program, env):
    """(library, the core OpenBLAS picks for `program` with `env`): the OpenBLAS it loads
    (ldd), asked in a process of its own with that environment. (None, None) when it has none."""
    ldd = subprocess.run(["ldd", program], capture_output=True, text=True).stdout
    libs = [line.split("=>")[1].split()[0] for line in ldd.splitlines()
            if "=>" in line and re.search(r"lib(open)?blas", line)]
    for lib in libs:
        code = ("import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).openblas_get_corename; "
                "f.restype = ctypes.c_char_p; print(f().decode())")
        got = subprocess.run([sys.executable, "-c", code, os.path.realpath(lib)],
                             capture_output=True, text=True, env=env)
        if got.returncode == 0 and got.stdout.strip():
            return os.path.realpath(lib), got.stdout.strip()
    return None, None


def caffe_env(caffe):
    """The environment `caffe time` runs in, and a sentence on its OpenBLAS's kernels: where
    OpenBLAS takes this AVX-512 CPU for an older core (Debian's 0.3.21 on an Ice Lake server
    falls back to Prescott) and OPENBLAS_CORETYPE is not set, it is set to SkylakeX for Caffe's
    runs, so that Caffe's GEMMs run the AVX-512 kernels, as NumPy's OpenBLAS does."""
    from cpuinfo import host_isa
    env = dict(os.environ)
    lib, core = blas_core(caffe, env)
    if lib is None:
        return env, "Caffe's BLAS is not OpenBLAS (its kernels not checked)"
    said = f"Caffe's OpenBLAS ({Path(lib).name}) runs the {core} kernels"
    if ("OPENBLAS_CORETYPE" not in os.environ and host_isa() == "AVX-512"
            and core not in AVX512_CORES):
        env["OPENBLAS_CORETYPE"] = "SkylakeX"
        _, forced = blas_core(caffe, env)
        said = (f"Caffe's OpenBLAS ({Path(lib).name}) takes this CPU for {core}; "
                f"with OPENBLAS_CORETYPE=SkylakeX, set for Caffe's runs, it runs the {forced} "
                f"kernels")
    elif "OPENBLAS_CORETYPE" in os.environ:
        said += f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})"
    return env, said


def time_command(command, name, iterations, model=None, env=None):
    """`caffepar time` or `caffe time` (command: the program and its spelling of the flags) on
    the net's prototxt in a subprocess, as a callable returning its average forward-backward
    ms: the same prototxt (for Caffe, the same net in its types), and each side in a process
    of its own."""
    def run():
        out = subprocess.run(command + ["time", "-model", str(model or model_path(name)),
                                        "-iterations", str(iterations)],
                             capture_output=True, text=True, cwd=ROOT, env=env)
        found = re.search(r"Average Forward-Backward: ([\d.]+) ms", out.stderr + out.stdout)
        if not found:
            raise SystemExit(f"{command[-1]} time failed on {name}: "
                             f"{(out.stderr or out.stdout)[-500:]}")
        return float(found.group(1))
    return run


def conv_engines(solver):
    net = solver.net
    return "; ".join(f"{net._layer_names[i]}:{layer.engine(net.blob_list[net.bottom_ids[i][0]].shape)}"
                    for i, layer in enumerate(net.layers) if layer.type == "Convolution")


def torch_model(name):
    import torch.nn as nn

    def conv(c, o, k, s=1, p=0, g=1):
        return nn.Conv2d(c, o, k, stride=s, padding=p, groups=g)

    if name == "cifar10_quick":
        return nn.Sequential(
            conv(3, 32, 5, p=2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(inplace=True),
            conv(32, 32, 5, p=2), nn.ReLU(inplace=True), nn.AvgPool2d(3, 2, ceil_mode=True),
            conv(32, 64, 5, p=2), nn.ReLU(inplace=True), nn.AvgPool2d(3, 2, ceil_mode=True),
            nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.Linear(64, 10)), (3, 32, 32)
    if name == "alexnet":
        lrn = lambda: nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=1.0)  # noqa: E731
        return nn.Sequential(
            conv(3, 96, 11, s=4), nn.ReLU(inplace=True), lrn(), nn.MaxPool2d(3, 2, ceil_mode=True),
            conv(96, 256, 5, p=2, g=2), nn.ReLU(inplace=True), lrn(),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            conv(256, 384, 3, p=1), nn.ReLU(inplace=True),
            conv(384, 384, 3, p=1, g=2), nn.ReLU(inplace=True),
            conv(384, 256, 3, p=1, g=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
            nn.Flatten(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 1000)), (3, 227, 227)
    layers, c = [], 3
    for n, reps in [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]:
        for _ in range(reps):
            layers += [conv(c, n, 3, p=1), nn.ReLU(inplace=True)]
            c = n
        layers.append(nn.MaxPool2d(2, 2))
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
               nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(4096, 1000)]
    return nn.Sequential(*layers), (3, 224, 224)


def torch_from_caffe(param, shapes):
    """The same architecture as a training NetParameter, written in PyTorch: one module per
    Caffe layer (a BatchNorm and the Scale after it as one BatchNorm2d, as a PyTorch user
    writes it), run in the prototxt's order. `shapes`: every blob's shape (for the channel
    counts)."""
    import torch
    import torch.nn as nn
    from caffepar.proto import caffe_pb2
    P = caffe_pb2.PoolingParameter

    def pair(rep, h, w, default):
        if h or w:
            return (h, w)
        return (rep[0], rep[0]) if len(rep) else (default, default)

    class Shuffle(nn.Module):
        def __init__(self, group):
            super().__init__()
            self.group = group

        def forward(self, x):
            n, c, h, w = x.shape
            return x.view(n, self.group, c // self.group, h, w).transpose(1, 2).reshape(n, c, h, w)

    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.mods = nn.ModuleList()
            self.program = []       # (kind, module index or argument, bottoms, tops)

        def add(self, kind, module, bottoms, tops):
            if isinstance(module, nn.Module):
                self.mods.append(module)
                module = len(self.mods) - 1
            self.program.append((kind, module, list(bottoms), list(tops)))

        def forward(self, x):
            blobs = {"data": x}
            for kind, arg, bottoms, tops in self.program:
                if kind == "module":
                    blobs[tops[0]] = self.mods[arg](blobs[bottoms[0]])
                elif kind == "sum":
                    out = blobs[bottoms[0]]
                    for b in bottoms[1:]:
                        out = out + blobs[b]
                    blobs[tops[0]] = out
                elif kind == "concat":
                    blobs[tops[0]] = torch.cat([blobs[b] for b in bottoms], 1)
                elif kind == "slice":
                    for t, part in zip(tops, torch.split(blobs[bottoms[0]], arg, 1)):
                        blobs[t] = part
            return blobs[self.program[-1][3][0]]

    g = Graph()
    layers = [lp for lp in param.layer if lp.type not in ("DummyData", "SoftmaxWithLoss")]
    skip = set()
    for i, lp in enumerate(layers):
        if i in skip:
            continue
        bottoms, tops = lp.bottom, lp.top
        if lp.type in ("Convolution", "ConvolutionDepthwise", "DepthwiseConvolution"):
            cp = lp.convolution_param
            cin = shapes[bottoms[0]][1]
            group = cin if lp.type != "Convolution" else cp.group
            g.add("module", nn.Conv2d(cin, cp.num_output, pair(cp.kernel_size, cp.kernel_h,
                                                               cp.kernel_w, 1),
                                      stride=pair(cp.stride, cp.stride_h, cp.stride_w, 1),
                                      padding=pair(cp.pad, cp.pad_h, cp.pad_w, 0),
                                      dilation=pair(cp.dilation, 0, 0, 1), groups=group,
                                      bias=cp.bias_term), bottoms, tops)
        elif lp.type == "BatchNorm":
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            affine = nxt is not None and nxt.type == "Scale" and nxt.bottom[0] == tops[0]
            if affine:
                skip.add(i + 1)
                tops = nxt.top
            g.add("module", nn.BatchNorm2d(shapes[bottoms[0]][1], eps=lp.batch_norm_param.eps,
                                           affine=affine), bottoms, tops)
        elif lp.type == "ReLU":
            g.add("module", nn.ReLU(inplace=bottoms[0] == tops[0]), bottoms, tops)
        elif lp.type == "ReLU6":
            g.add("module", nn.ReLU6(inplace=bottoms[0] == tops[0]), bottoms, tops)
        elif lp.type == "Pooling":
            pp = lp.pooling_param
            if pp.global_pooling:
                mod = nn.AdaptiveMaxPool2d(1) if pp.pool == P.MAX else nn.AdaptiveAvgPool2d(1)
            else:
                k = pair(pp.kernel_size and [pp.kernel_size], pp.kernel_h, pp.kernel_w, 1)
                st = pair(pp.stride and [pp.stride], pp.stride_h, pp.stride_w, 1)
                pd = pair([pp.pad], pp.pad_h, pp.pad_w, 0)
                mod = (nn.MaxPool2d(k, st, pd, ceil_mode=True) if pp.pool == P.MAX else
                       nn.AvgPool2d(k, st, pd, ceil_mode=True))
            g.add("module", mod, bottoms, tops)
        elif lp.type == "Eltwise":
            g.add("sum", None, bottoms, tops)
        elif lp.type == "Concat":
            g.add("concat", None, bottoms, tops)
        elif lp.type == "Slice":
            points = [0] + list(lp.slice_param.slice_point) + [shapes[bottoms[0]][1]]
            g.add("slice", [b - a for a, b in zip(points, points[1:])], bottoms, tops)
        elif lp.type == "ShuffleChannel":
            g.add("module", Shuffle(lp.shuffle_channel_param.group), bottoms, tops)
        elif lp.type == "Dropout":
            g.add("module", nn.Dropout(lp.dropout_param.dropout_ratio), bottoms, tops)
        else:
            raise SystemExit(f"no PyTorch form for {lp.type} ({lp.name})")
    return g


def torch_step(name, batch, threads, solver=None):
    import torch
    torch.set_num_threads(threads)
    if name in PUBLISHED:
        from caffepar.proto.text import read_net_text
        param, _ = read_net_text(str(model_path(name)))
        shapes = {n: tuple(b.data.shape) for n, b in solver.net.blobs.items()}
        model, shape = torch_from_caffe(param, shapes), shapes["data"][1:]
        ours = sum(b.data.size for layer_name, layer in zip(solver.net._layer_names,
                                                           solver.net.layers)
                   if layer.type != "BatchNorm"            # statistics, not parameters
                   for b in solver.net.params.get(layer_name, []))
        theirs = sum(p.numel() for p in model.parameters())
        if ours != theirs:
            raise SystemExit(f"{name}: the PyTorch model has {theirs} parameters, caffepar's "
                             f"net {ours}: not the same architecture")
    else:
        model, shape = torch_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, weight_decay=0.0005)
    x = torch.full((batch,) + shape, 0.5)
    y = torch.zeros(batch, dtype=torch.long)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x).flatten(1), y).backward()
        opt.step()

    step()
    return step


def torch_facts():
    import torch
    return (f"PyTorch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}")


def pool1_ms(rounds):
    """cifar10_quick pool1 (MAX 3x3/2 on 100x32x32x32) forward + backward, fastest of the
    rounds."""
    from bench_layers import best_time
    from caffepar.nn import pooling
    x = np.random.default_rng(0).standard_normal((100, 32, 32, 32), dtype=np.float32)
    g = pooling.PoolGeometry(3, 3, 0, 0, 2, 2)
    g.reshape(32, 32)
    y = np.empty((100, 32, g.oh, g.ow), np.float32)
    dy, dx = np.ones_like(y), np.empty_like(x)

    def step():
        pooling.max_pool_backward(g, pooling.max_pool_forward(g, x, y), dy, dx)

    step()
    return min(best_time(step, 10) for _ in range(rounds)) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--repeat", type=int, default=3, help="runs per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per net")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="seconds of training steps per side and round at least (runs beyond "
                         "--repeat): a short step (cifar10_quick's 40 ms) gets a dozen samples "
                         "where host noise moves single runs by 15-25%%")
    ap.add_argument("--caffe", default=None, help="a BVLC Caffe `caffe` binary to compare with")
    ap.add_argument("--nets-dir", default=None,
                    help="the folder of published prototxts that " + ", ".join(PUBLISHED) +
                         " are made from (default: $CAFFEPAR_CACHE_DIR/published_nets, as "
                         "scripts/bench_inference.py)")
    ap.add_argument("--out", default=None,
                    help="write OUT.md, OUT.csv and OUT.png (default: results/cpu_speed_<cpu>; "
                         "empty: print only)")
    ap.add_argument("--fresh", action="store_true",
                    help="drop the rows of OUT.csv for nets not run now (by default they are "
                         "kept, so the nets can be measured one run each and the file resumed)")
    ap.add_argument("--keep-engines", action="store_true",
                    help="use the convolution engines measured earlier on this machine (by "
                         "default they are measured afresh, in a temporary cache)")
    args = ap.parse_args()
    # Stopped with SIGTERM (a long run on a shared machine): clean up as on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from bench_inference import nets_dir
    published = nets_dir(args.nets_dir)
    made = tempfile.mkdtemp(prefix="caffepar-bench-nets-")
    atexit.register(shutil.rmtree, made, True)
    if not args.keep_engines:
        # Engines measured afresh; the compiled kernels (named by the hash of their sources,
        # compiler and CPU) are taken from the usual cache when they are there.
        fresh = tempfile.mkdtemp(prefix="caffepar-bench-")
        atexit.register(shutil.rmtree, fresh, True)
        for lib in published.parent.glob("kernels-*.so"):
            shutil.copy2(lib, fresh)
        os.environ["CAFFEPAR_CACHE_DIR"] = fresh
    from bench_layers import fastest, sgemm_rate
    from caffepar.nn import native
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    rate = sgemm_rate()
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    k = native.kernels(np.float32)
    env_caffe, caffe_blas = caffe_env(args.caffe) if args.caffe else (None, "")
    if caffe_blas:
        print(caffe_blas)
    kernels = (f"compiled for {build_isa(k.vector_bytes)} ({k.vector_bytes}-byte vectors, "
               f"{k.registers} registers)" if k is not None else "NumPy")
    if args.out is None:
        suffix = isa_suffix(build_isa(k.vector_bytes) if k is not None else "numpy")
        args.out = str(ROOT / f"results/cpu_speed_{cpu_key()}{suffix}")
    print(f"{cpu_name()}; {threads} thread(s); SGEMM {rate:.1f} GFLOP/s; kernels: {kernels}; "
          f"PyTorch {'installed' if have_torch else 'not installed'}; "
          f"Caffe {args.caffe or 'not given'}; load average {load_start:.2f}")
    head = (f"{'net':<14}{'batch':>6}{'step ms':>9}{'PyTorch':>9}{'ratio':>7}"
            f"{'f+b ms':>9}{'Caffe':>9}{'ratio':>7}{'% SGEMM':>9}{'update':>8}")
    print("\n" + head)
    rows = []
    for name in args.nets.split(","):
        batch = NETS[name]
        if name in PUBLISHED:
            make_published(name, batch, published, made)
        ours_step, update, solver, flops, first = caffepar_step(name, batch)
        steps = [ours_step] + ([torch_step(name, batch, threads, solver)] if have_torch
                               else [])
        timers = [time_command([sys.executable, "-m", "caffepar.cli"], name,
                               TIME_ITERATIONS[name])]
        caffe_model = caffe_model_path(name)
        caffe_said = "yes" if args.caffe else "no"
        if args.caffe and isinstance(caffe_model, str):
            caffe_said = caffe_model            # the reason Caffe cannot run this net
        elif args.caffe:
            timers.append(time_command([args.caffe], name, TIME_ITERATIONS[name], caffe_model,
                                       env_caffe))
        step_s = [np.inf] * len(steps)
        fb_ms = [np.inf] * len(timers)
        for _ in range(args.rounds):        # alternating: every side in every round
            step_s = [min(a, b) for a, b in zip(step_s, fastest(steps, args.repeat, 1,
                                                                args.budget))]
            fb_ms = [min(a, t()) for a, t in zip(fb_ms, timers)]
        update_ms = fastest([update], args.repeat, args.rounds)[0] * 1e3
        row = {"net": name, "batch": batch, "caffepar_step_ms": step_s[0] * 1e3,
               "pytorch_step_ms": step_s[1] * 1e3 if have_torch else np.nan,
               "caffepar_fb_ms": fb_ms[0], "caffe_fb_ms": fb_ms[1] if len(fb_ms) > 1 else np.nan,
               "sgemm_pct": 100 * flops / step_s[0] / 1e9 / rate, "update_ms": update_ms,
               "first_s": first, "engines": conv_engines(solver), "caffe": caffe_said}
        row["vs_pytorch"] = row["caffepar_step_ms"] / row["pytorch_step_ms"]
        row["vs_caffe"] = row["caffepar_fb_ms"] / row["caffe_fb_ms"]
        rows.append(row)
        print(f"{name:<14}{batch:>6}{row['caffepar_step_ms']:>9.1f}{row['pytorch_step_ms']:>9.1f}"
              f"{row['vs_pytorch']:>7.2f}{row['caffepar_fb_ms']:>9.1f}{row['caffe_fb_ms']:>9.1f}"
              f"{row['vs_caffe']:>7.2f}{row['sgemm_pct']:>8.0f}%{update_ms:>8.1f}", flush=True)
        print(f"{'':14}engines: {row['engines']} (first iteration {first:.1f} s)", flush=True)
        del ours_step, update, solver, steps        # one net's memory at a time
        gc.collect()
    pool = pool1_ms(args.rounds)
    load_end = os.getloadavg()[0]
    for row in rows:
        row.update(started=started, load=f"{load_start:.2f}-{load_end:.2f}", pool1_ms=pool)
    print(f"\ncifar10_quick pool1 (MAX 3x3/2, 100x32x32x32) forward + backward: {pool:.2f} ms")
    print(f"load average (1 min): {load_start:.2f} at the start, {load_end:.2f} at the end")
    if args.out:
        if not args.fresh:
            rows = kept_rows(Path(args.out), rows)
        write_results(Path(args.out), rows, pool, dict(
            cpu=f"{cpu_name()} [{cpu_key()}; {native.cpu_model()}]", threads=threads, sgemm=rate, kernels=kernels, started=started,
            load=(load_start, load_end), caffe=args.caffe, caffe_blas=caffe_blas,
            torch=torch_facts() if have_torch else "", rounds=args.rounds,
            repeat=args.repeat, budget=args.budget,
            coretype=os.environ.get("OPENBLAS_CORETYPE", "(OpenBLAS's choice)"),
            builds=", ".join(f"{v}={os.environ[v]}" for v in ("CAFFEPAR_CFLAGS",
                                                             "ATEN_CPU_CAPABILITY",
                                                             "ONEDNN_MAX_CPU_ISA")
                             if os.environ.get(v))))


FIELDS = ["net", "batch", "caffepar_step_ms", "pytorch_step_ms", "vs_pytorch", "caffepar_fb_ms",
          "caffe_fb_ms", "vs_caffe", "sgemm_pct", "update_ms", "first_s", "engines", "started",
          "load", "pool1_ms", "caffe"]


def kept_rows(out, rows):
    """This run's rows after the rows of OUT.csv for the other nets (each row keeps when it was
    measured and the load then), in the bundled nets' order: a file measured one net per run."""
    done = {r["net"] for r in rows}
    old = []
    try:
        with open(out.with_suffix(".csv"), newline="") as f:
            for r in csv.DictReader(f):
                if r["net"] in done or "started" not in r:
                    continue
                old.append({k: (r[k] if k in ("net", "engines", "started", "load", "caffe")
                                else int(r[k]) if k == "batch" else float(r[k]))
                            for k in FIELDS if k in r})
    except (OSError, ValueError, KeyError):
        return rows
    order = list(NETS)
    return sorted(old + rows, key=lambda r: order.index(r["net"]) if r["net"] in order else 99)


def write_results(out, rows, pool, info):
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = FIELDS
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})
    # The benchmark's own threads count in the load at the end: only more than that is others'.
    def loaded(load):
        start, end = (float(v) for v in load.split("-"))
        return start > 0.5 or end > info["threads"] + 0.5

    lines = [
        "# CPU speed: caffepar vs PyTorch 2.13 and BVLC Caffe",
        "",
        f"Written by `python scripts/bench_train.py` ({info['rounds']} alternating rounds per "
        f"net, each side's training step run at least {info['repeat']} times and "
        f"{info['budget']:g} s per round, fastest counts; the nets may be measured in runs of "
        f"their own, each row with its time and load). CPU: {info['cpu']}; {info['threads']} "
        f"thread(s); OPENBLAS_CORETYPE {info['coretype']}; NumPy SGEMM {info['sgemm']:.0f} "
        f"GFLOP/s; caffepar kernels: {info['kernels']}" +
        (f" ({info['builds']}: code for another instruction set than the host's best)"
         if info.get("builds") else "") + ".",
        "",
        "Training step = forward + backward + SGD update (caffepar solver step vs PyTorch). "
        "Forward+backward = `caffepar time` vs `caffe time` on models/<net>/"
        "train_val_dummy.prototxt (Caffe with the same OPENBLAS_* settings). Ratio < 1: "
        "caffepar faster. Load = 1-minute load average at the start and end of the row's run "
        "(the benchmark's own threads count at the end); a load above that marks the row as "
        "**loaded** (other jobs shared the cores: ratios from alternating rounds, absolute "
        "times noisy)." + (f" {info['torch']}." if info.get("torch") else "") +
        (f" {info['caffe_blas']}." if info.get("caffe_blas") else ""),
        "",
        "| net | batch | caffepar step ms | PyTorch step ms | ratio | caffepar f+b ms | "
        "Caffe f+b ms | ratio | update ms | measured | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['net']} | {r['batch']} | {r['caffepar_step_ms']:.1f} | "
                     f"{r['pytorch_step_ms']:.1f} | **{r['vs_pytorch']:.2f}** | "
                     f"{r['caffepar_fb_ms']:.1f} | {r['caffe_fb_ms']:.1f} | "
                     f"**{r['vs_caffe']:.2f}** | {r['update_ms']:.1f} | {r['started']} | "
                     f"{r['load']}{' **loaded**' if loaded(r['load']) else ''} |")
    pools = ", ".join(f"{r['pool1_ms']:.2f}" for r in rows)
    lines += ["", f"cifar10_quick pool1 (MAX 3x3/2, 100x32x32x32) forward + backward: "
                  f"**{pool:.2f} ms** in the latest run (in each row's run: {pools} ms).", "",
              "Convolution engines (measured on this machine at the first iteration, which "
              "took the time given):", ""]
    lines += [f"- {r['net']}: {r['engines']} (first iteration {r['first_s']:.1f} s)"
              for r in rows]
    if any(r["caffe"] == "no" for r in rows):
        lines += ["", "Caffe columns are empty where no `--caffe` binary was given."]
    for r in rows:
        if r["caffe"] not in ("yes", "no"):
            lines += ["", f"{r['net']}: no Caffe figure: {r['caffe']}."]
    if any(r["net"] in PUBLISHED for r in rows):
        lines += ["", "mobilenet_v2 and shufflenet_v2 are the published deploy prototxts "
                  "(shicai/MobileNet-Caffe, farmingyard/ShuffleNet; not part of this "
                  "repository) made into training nets at run time: DummyData in place of the "
                  "input, SoftmaxWithLoss in place of the final Softmax, BatchNorm on batch "
                  "statistics; BVLC Caffe runs depthwise layers as Convolution with group = "
                  "channels. PyTorch runs the same graph, one module per layer (BatchNorm and "
                  "its Scale as one BatchNorm2d), with the same parameter count."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["vs_pytorch"] for r in rows], 0.4, label="vs PyTorch (training step)")
    ax.bar(x + 0.2, [r["vs_caffe"] for r in rows], 0.4, label="vs Caffe (forward+backward)")
    ax.axhline(0.85, color="C0", ls="--", lw=0.8)
    ax.axhline(0.6, color="C1", ls="--", lw=0.8)
    ax.set_xticks(x, [f"{r['net']}\nbatch {r['batch']}" for r in rows])
    ax.set_ylabel("caffepar time / other's time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
