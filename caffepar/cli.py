"""The `caffepar` command: Caffe's tool interface (train, test, time, ...) as a thin click layer.

Errors caused by the user's files become one line on stderr and exit status 1 (`--debug` shows
the traceback); usage errors exit 2, as click does.
"""
import os
import re
import sys

import click

from caffepar.errors import CaffeparError

_CAFFE_SINGLE_DASH = re.compile(r"^-([a-z][a-z_]+)(=.*)?$")


def normalize_caffe_flags(argv):
    """Accept Caffe's gflags spellings: `-model x` and `-model=x` become `--model ...`."""
    return [f"--{m.group(1)}{m.group(2) or ''}" if (m := _CAFFE_SINGLE_DASH.match(a)) else a
            for a in argv]


def _phase(name):
    from caffepar.graph.net import TEST, TRAIN
    return TRAIN if name.upper() == "TRAIN" else TEST


def _check(test):
    """A click callback turning an options.bad_* test into BadParameter (exit 2)."""
    def callback(ctx, param, value):
        if value is not None:
            message = test(value)
            if message:
                raise click.BadParameter(message)
        return value
    return callback


def comm_options(fn):
    """The gradient communication flags of `train` and `time` (all off unless given)."""
    from caffepar.parallel import options as o
    flags = [
        click.option("--overlap", is_flag=True, default=None,
                     help="Start each bucket's gradient reduction as soon as backward has "
                          "completed it (non-blocking, progressed by a thread)."),
        click.option("--bucket-mb", type=float, default=None, callback=_check(o.bad_bucket),
                     help="Reduce gradients in buckets of this many MiB (with --overlap, "
                          "each as soon as it is complete)."),
        click.option("--merge", type=click.Choice(o.MERGES), default=None,
                     help="auto: buckets planned by the optimal merge (MG-WFBP) from a short "
                          "profile; implies --overlap."),
        click.option("--topk", type=float, default=None, callback=_check(o.bad_ratio),
                     help="Layer-wise top-k sparsification with residuals: the fraction of "
                          "each layer's gradient values sent, in (0, 1]."),
        click.option("--topk-refresh", type=int, default=None,
                     callback=_check(o.bad_refresh),
                     help="Recompute exact top-k thresholds every S iterations (default 10)."),
        click.option("--momentum-correction", is_flag=True, default=None,
                     help="With --topk and momentum SGD: each rank's residual accumulates its "
                          "velocity (momentum and weight decay included), as DGC does."),
        click.option("--hierarchical", is_flag=True, default=None,
                     help="Reduce-scatter in each node, allreduce across nodes, allgather "
                          "in the node."),
        click.option("--ranks-per-node", type=int, default=None,
                     callback=_check(o.bad_ranks_per_node),
                     help="Nodes of N consecutive ranks for --hierarchical (default: the "
                          "ranks that share memory)."),
        click.option("--timeline", type=click.Path(dir_okay=False), default=None,
                     help="Write a Chrome trace (chrome://tracing, Perfetto) of every layer "
                          "and collective of every rank to this JSON file."),
    ]
    for flag in reversed(flags):
        fn = flag(fn)
    return fn


def _comm_flags(ranks, flags):
    """The comm flags given on the command line (name -> value), checked against each other
    and against --np."""
    given = {k: v for k, v in flags.items() if v is not None}
    for name in ("topk_refresh", "momentum_correction"):
        if name in given and "topk" not in given:
            raise click.UsageError(f"--{name.replace('_', '-')} needs --topk")
    if "ranks_per_node" in given and "hierarchical" not in given:
        raise click.UsageError("--ranks-per-node needs --hierarchical")
    if "bucket_mb" in given and "merge" in given:
        raise click.UsageError("give --bucket-mb or --merge auto, not both")
    if "topk" in given and "hierarchical" in given:
        raise click.UsageError("--topk does not combine with --hierarchical (top-k exchanges "
                               "index/value pairs with allgather)")
    if ranks and "ranks_per_node" in given:
        from caffepar.parallel.options import bad_ranks_per_node
        message = bad_ranks_per_node(given["ranks_per_node"], ranks)
        if message:
            raise click.BadParameter(message, param_hint="'--ranks-per-node'")
    return given


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="caffepar")
@click.pass_context
def cli(ctx, debug):
    """caffepar: train, test and time Caffe models on the CPU."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    ctx.obj.setdefault("argv", [])


@cli.command("time")
@click.option("--model", required=True, type=click.Path(dir_okay=False),
              help="Net prototxt to benchmark.")
@click.option("--weights", type=click.Path(dir_okay=False), default=None,
              help="Optional caffemodel to load first.")
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1),
              help="Forward-backward passes to average over.")
@click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False),
              default="TRAIN", show_default=True)
@click.option("--level", default=0, type=int, help="Net state level.")
@click.option("--stage", multiple=True, help="Net state stage (repeatable).")
@click.option("--np", "ranks", default=None, type=click.IntRange(min=1),
              help="Time a parallel run on this many MPI ranks (adds comm ms and MB).")
@click.option("--parallel", "default_mode", default="hybrid", show_default=True,
              type=click.Choice(["data", "hybrid"]))
@click.option("--model-parallel", "model_parallel", default="")
@click.option("--mp-threshold", default=None, type=click.IntRange(min=0))
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="BLAS threads per rank (default: cores / ranks).")
@click.option("--mpiexec", default=None, help="The mpiexec to start ranks with.")
@comm_options
@click.option("--gpu", default=None, hidden=True)
@click.pass_context
def time_cmd(ctx, model, weights, iterations, phase, level, stage, ranks, default_mode,
             model_parallel, mp_threshold, threads, mpiexec, gpu, **comm_flags):
    """Time forward and backward of every layer, as `caffe time`."""
    from caffepar.graph.net import Net
    from caffepar.parallel.comm import world_comm
    from caffepar.parallel.options import CommOptions
    from caffepar.timing import benchmark, format_benchmark
    _warn_gpu(gpu)
    if comm_flags.get("momentum_correction"):
        raise click.UsageError("--momentum-correction needs a solver's momentum: it is an "
                               "option of caffepar train")
    if comm_flags.get("merge"):
        from caffepar.parallel.options import MERGE_UNAVAILABLE
        raise click.UsageError(MERGE_UNAVAILABLE)
    options = CommOptions().with_flags(**_comm_flags(ranks, comm_flags))
    _relaunch_if_asked(ctx, ranks, threads, mpiexec)
    comm = world_comm()
    ctx.obj["comm"] = comm
    extra = {}
    if comm.size > 1:
        from caffepar.parallel.model_parallel import layer_factory
        planner = _planner(default_mode, model_parallel, mp_threshold)
        extra = {"shard": (comm.rank, comm.size), "layer_factory": layer_factory(comm, planner)}
    net = Net(model, phase=_phase(phase), level=level, stages=stage, weights=weights, **extra)
    say = click.echo if comm.rank == 0 else (lambda *a, **k: None)
    result = benchmark(net, iterations, comm=comm, options=options, progress=lambda i, ms: say(
        f"Iteration: {i} forward-backward time: {ms:.2f} ms."))
    say(format_benchmark(net, result))
    if options.timeline:
        say(f"Wrote the timeline to {options.timeline}")


@cli.command("train")
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="Solver prototxt.")
@click.option("--weights", default=None,
              help="Caffemodel(s) to fine-tune from, comma-separated (copied by layer name).")
@click.option("--snapshot", default=None, type=click.Path(dir_okay=False),
              help="Solverstate to resume from.")
@click.option("--iterations", default=None, type=click.IntRange(min=0),
              help="Override the solver's max_iter.")
@click.option("--level", default=0, type=int, help="Net state level of the train net.")
@click.option("--stage", multiple=True, help="Net state stage of the train net (repeatable).")
@click.option("--sigint_effect", "--sigint-effect", default="stop", show_default=True,
              type=click.Choice(["stop", "snapshot", "none"]),
              help="What Ctrl-C does: snapshot and stop, snapshot and go on, or nothing.")
@click.option("--sighup_effect", "--sighup-effect", default="snapshot", show_default=True,
              type=click.Choice(["stop", "snapshot", "none"]))
@click.option("--log", "log_file", default=None, type=click.Path(dir_okay=False),
              help="Also write the log (glog format) to this file.")
@click.option("--csv", "csv_file", default=None, type=click.Path(dir_okay=False),
              help="Per-iteration CSV (default: <snapshot_prefix>_log.csv).")
@click.option("--np", "ranks", default=None, type=click.IntRange(min=1),
              help="Run on this many MPI ranks (started with the bundled mpiexec).")
@click.option("--parallel", "default_mode", default="hybrid", show_default=True,
              type=click.Choice(["data", "hybrid"]),
              help="Mode of layers without parallel_mode: all data parallel, or the paper's "
                   "hybrid (big InnerProducts model parallel).")
@click.option("--model-parallel", "model_parallel", default="",
              help="Comma-separated InnerProduct layers to run model parallel.")
@click.option("--mp-threshold", default=None, type=click.IntRange(min=0),
              help="Parameter count above which hybrid runs an InnerProduct model parallel.")
@click.option("--log-all-ranks", is_flag=True, help="Log from every rank, prefixed with it.")
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="BLAS threads per rank (default: cores / ranks).")
@click.option("--mpiexec", default=None, help="The mpiexec to start ranks with.")
@comm_options
@click.option("--gpu", default=None, hidden=True)
@click.pass_context
def train_cmd(ctx, solver, weights, snapshot, iterations, level, stage, sigint_effect,
              sighup_effect, log_file, csv_file, ranks, default_mode, model_parallel,
              mp_threshold, log_all_ranks, threads, mpiexec, gpu, **comm_flags):
    """Train a net with a solver, as `caffe train`; with --np, over MPI ranks."""
    from caffepar.parallel.comm import world_comm
    from caffepar.training import run_training
    _warn_gpu(gpu)
    if weights and snapshot:
        raise click.UsageError("give --weights or --snapshot, not both "
                               "(Caffe: snapshot restores the weights too)")
    comm_flags = _comm_flags(ranks, comm_flags)
    if ranks and ranks > 1:
        from caffepar.proto.text import read_solver_text
        from caffepar.training import comm_options
        comm_options(read_solver_text(solver), solver, comm_flags, ranks)
    _relaunch_if_asked(ctx, ranks, threads, mpiexec)
    comm = world_comm()
    ctx.obj["comm"] = comm
    planner = _planner(default_mode, model_parallel, mp_threshold)
    run_training(solver, weights=weights, snapshot=snapshot, iterations=iterations,
                 level=level, stages=stage, sigint_effect=sigint_effect,
                 sighup_effect=sighup_effect, log_file=log_file, csv_file=csv_file,
                 comm=comm, planner=planner, log_all_ranks=log_all_ranks,
                 comm_flags=comm_flags)


@cli.command("test")
@click.option("--model", required=True, type=click.Path(dir_okay=False))
@click.option("--weights", required=True, type=click.Path(dir_okay=False))
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--level", default=0, type=int)
@click.option("--stage", multiple=True)
@click.option("--log", "log_file", default=None, type=click.Path(dir_okay=False))
@click.option("--gpu", default=None, hidden=True)
def test_cmd(model, weights, iterations, level, stage, log_file, gpu):
    """Score a trained model over `iterations` batches, as `caffe test`."""
    from caffepar.training import run_test
    _warn_gpu(gpu)
    run_test(model, weights, iterations, level=level, stages=stage, log_file=log_file)


@cli.command("plot")
@click.argument("source", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_png", type=click.Path(dir_okay=False))
def plot_cmd(source, out_png):
    """Draw training loss, test outputs and learning rate from a log or CSV."""
    from caffepar.logs import plot_curves
    curves = plot_curves(source, out_png)
    click.echo(f"wrote {out_png} ({len(curves['train']['iter'])} training points, "
               f"{len(curves['test'])} test output(s))")


@cli.group("data")
def data_group():
    """Build Caffe datasets: CIFAR-10 and MNIST to LMDB, image lists to LMDB, mean images."""


@data_group.command("cifar10")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
def data_cifar10(src, dst):
    """CIFAR-10 binary batches in SRC -> DST/cifar10_{train,test}_lmdb (convert_cifar_data)."""
    from caffepar.data.tools import convert_cifar10
    convert_cifar10(src, dst)


@data_group.command("mnist")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
def data_mnist(src, dst):
    """MNIST idx files in SRC (.gz accepted) -> DST/mnist_{train,test}_lmdb (convert_mnist_data)."""
    from caffepar.data.tools import convert_mnist
    from caffepar.errors import MissingFileError
    os.makedirs(dst, exist_ok=True)
    for split, stem in (("train", "train"), ("test", "t10k")):
        found = {}
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            for name in (f"{stem}-{kind}", f"{stem}-{kind}.gz", f"{stem}-{kind}".replace("-idx", ".idx")):
                if os.path.exists(os.path.join(src, name)):
                    found[kind] = os.path.join(src, name)
                    break
            else:
                raise MissingFileError(os.path.join(src, f"{stem}-{kind}[.gz]"), "MNIST file")
        n = convert_mnist(found["images-idx3-ubyte"], found["labels-idx1-ubyte"],
                          os.path.join(dst, f"mnist_{split}_lmdb"))
        click.echo(f"mnist_{split}_lmdb: {n} records")


@data_group.command("imageset")
@click.argument("root", type=click.Path(exists=True, file_okay=False))
@click.argument("listfile", type=click.Path(exists=True, dir_okay=False))
@click.argument("db", type=click.Path())
@click.option("--resize_height", "--resize-height", default=0, type=click.IntRange(min=0))
@click.option("--resize_width", "--resize-width", default=0, type=click.IntRange(min=0))
@click.option("--shuffle", is_flag=True, help="Shuffle the list before converting.")
@click.option("--encoded", is_flag=True, help="Store the encoded image bytes.")
@click.option("--encode_type", "--encode-type", default="", help="Re-encode as png or jpg.")
@click.option("--gray", is_flag=True, help="Store single-channel images.")
@click.option("--backend", default="lmdb", type=click.Choice(["lmdb", "leveldb"]))
def data_imageset(root, listfile, db, resize_height, resize_width, shuffle, encoded,
                  encode_type, gray, backend):
    """Images named in LISTFILE ("path label" lines, under ROOT) -> DB (convert_imageset)."""
    from caffepar.data.tools import convert_imageset
    convert_imageset(root, listfile, db, resize_height=resize_height,
                     resize_width=resize_width, shuffle=shuffle, encoded=encoded,
                     gray=gray, encode_type=encode_type, backend=backend)


@data_group.command("mean")
@click.argument("db", type=click.Path(exists=True))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--backend", default="lmdb", type=click.Choice(["lmdb", "leveldb"]))
def data_mean(db, out, backend):
    """Mean image of DB as a BlobProto (compute_image_mean)."""
    from caffepar.data.tools import compute_image_mean
    compute_image_mean(db, out, backend=backend)


@cli.command("plan")
@click.option("--model", required=True, type=click.Path(dir_okay=False))
@click.option("--np", "ranks", default=2, show_default=True, type=click.IntRange(min=1),
              help="Number of ranks to plan for.")
@click.option("--parallel", "default", default="hybrid", show_default=True,
              type=click.Choice(["data", "hybrid"]),
              help="Default mode of layers without parallel_mode.")
@click.option("--model-parallel", "model_parallel", default="",
              help="Comma-separated InnerProduct layers to run MODEL whatever the default.")
@click.option("--mp-threshold", default=None, type=click.IntRange(min=0),
              help="Parameter count above which hybrid runs an InnerProduct MODEL.")
@click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False),
              default="TRAIN", show_default=True)
@click.option("--profile", "profile_iterations", default=0, show_default=True,
              type=click.IntRange(min=0),
              help="Time this many forward/backward passes here and say whether the net is "
                   "AlexNet-like (seed 004) and where it splits.")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="Profile at this batch per rank (default: the prototxt's).")
def plan_cmd(model, ranks, default, model_parallel, mp_threshold, phase, profile_iterations,
             batch):
    """Print each parameterised layer's parallel mode and why."""
    from caffepar.graph.net import Net
    from caffepar.parallel.plan import format_plan, make_plan
    net = Net(model, phase=_phase(phase))
    plans = make_plan(net, _planner(default, model_parallel, mp_threshold), net.source_map)
    net_batch = next((b.shape[0] for n, b in net.blobs.items()
                      if n in net.inputs or n == "data"), None)
    click.echo(format_plan(plans, ranks, batch or net_batch))
    if profile_iterations:
        from caffepar.graph.passes import with_batch
        from caffepar.parallel.buckets import detect_alexnet_like
        from caffepar.parallel.gradsync import layer_parameters
        from caffepar.timing import benchmark
        if batch and batch != net_batch:
            net = Net(with_batch(net.param, batch), phase=_phase(phase))
        result = benchmark(net, profile_iterations)
        detection = detect_alexnet_like([l.name for l in net.layers], result.backward_ms,
                                        layer_parameters(net))
        click.echo(f"Backward profile ({profile_iterations} iteration(s) in this process at "
                   f"batch {batch or net_batch}, {result.backward_ms.sum():.1f} ms): "
                   f"{detection.describe()}")


@cli.group("convert")
def convert_group():
    """Convert Caffe models: upgrade old formats, inspect, change weight formats, export ONNX."""


@convert_group.command("upgrade")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", required=False, type=click.Path(dir_okay=False))
@click.option("--check", is_flag=True, help="Only report what would change; write nothing.")
def convert_upgrade(src, dst, check):
    """Old (V0/V1) net prototxt, solver or binary caffemodel SRC -> current format DST."""
    from caffepar.convert.upgrade import upgrade_file
    if not dst and not check:
        raise click.UsageError("give DST, or --check to only report")
    result = upgrade_file(src, dst, check=check)
    for note in result.notes:
        click.echo(note)
    if not result.changed:
        click.echo(f"{src}: already in the current format ({result.kind})")
    if result.written:
        click.echo(f"wrote {dst}")


@convert_group.command("info")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("weights", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False),
              default="TEST", show_default=True)
@click.option("--level", default=0, type=int)
@click.option("--stage", multiple=True)
def convert_info(model, weights, phase, level, stage):
    """Layers, shapes, parameters, FLOPs and parallel modes of MODEL; with WEIGHTS, which
    layers match, are missing or are unused."""
    from caffepar.convert.info import format_info, net_info
    click.echo(format_info(net_info(model, weights, phase=_phase(phase), level=level,
                                    stages=stage)))


@convert_group.command("npz")
@click.argument("weights", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
def convert_npz(weights, out):
    """Caffemodel (binary or HDF5) or snapshot WEIGHTS -> OUT.npz, keys <layer>/<blob index>."""
    from caffepar.convert.npz import open_weights, save_npz
    n = save_npz(open_weights(weights), out)
    click.echo(f"wrote {out} ({n} arrays)")


@convert_group.command("caffemodel")
@click.argument("npz", type=click.Path(exists=True, dir_okay=False))
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--allow-missing", is_flag=True,
              help="Keep filler values for net layers the npz has no weights for.")
def convert_caffemodel(npz, model, out, allow_missing):
    """NPZ weights + net MODEL -> caffemodel OUT (HDF5 when OUT ends in .h5)."""
    from caffepar.convert.npz import convert_weights
    _report_conversion(*convert_weights(npz, out, model=model, allow_missing=allow_missing), out)


@convert_group.command("weights")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--model", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Load into this net first (shapes checked, its layer definitions written).")
@click.option("--allow-missing", is_flag=True,
              help="With --model: keep filler values for layers SRC has no weights for.")
def convert_weights_cmd(src, dst, model, allow_missing):
    """Weights SRC (binary/HDF5 caffemodel, npz, or a .solverstate snapshot) -> DST, weights
    only; the format follows DST's name (.h5, .npz, else binary)."""
    from caffepar.convert.npz import convert_weights
    _report_conversion(*convert_weights(src, dst, model=model, allow_missing=allow_missing), dst)


def _report_conversion(fmt, report, out):
    """The load report's lines (when weights went through a net), then what was written."""
    for line in report.lines() if report else []:
        click.echo(line)
    click.echo(f"wrote {out} ({fmt})")


@convert_group.command("onnx")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("weights", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--verify", is_flag=True,
              help="Run the export in onnxruntime on random input and compare with caffepar.")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="Batch size of the exported graph (default: the prototxt's).")
@click.option("--opset", default=None, type=click.IntRange(13, 17),
              help="ONNX opset (default 17).")
@click.option("--allow-missing", is_flag=True,
              help="Keep filler values for layers WEIGHTS has no weights for.")
def convert_onnx(model, weights, out, verify, batch, opset, allow_missing):
    """Deploy net MODEL with WEIGHTS -> OUT.onnx (TEST phase; inputs/outputs keep Caffe's
    blob names)."""
    from caffepar.convert.onnx_export import DEFAULT_OPSET, export_onnx
    result = export_onnx(model, weights, out, batch=batch, allow_missing=allow_missing,
                         opset=opset or DEFAULT_OPSET)
    shapes = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in result.inputs.items())
    click.echo(f"wrote {out}: inputs {shapes}; outputs {', '.join(result.outputs)}")
    if verify:
        from caffepar.convert.verify import verify_onnx
        check = verify_onnx(result)
        for line in check.lines():
            click.echo(line)
        if not check.ok:
            from caffepar.errors import CaffeparError
            raise CaffeparError(f"onnxruntime and caffepar differ by more than "
                                f"{check.tolerance:g}", path=out)
        click.echo("verified: onnxruntime matches caffepar")


def _planner(default_mode, model_parallel, mp_threshold):
    from caffepar.parallel.plan import DEFAULT_THRESHOLD, Planner
    return Planner(default_mode, [n for n in model_parallel.split(",") if n],
                   DEFAULT_THRESHOLD if mp_threshold is None else mp_threshold)


def _relaunch_if_asked(ctx, ranks, threads, mpiexec):
    """`--np P` outside an MPI launch: run this same command under mpiexec and exit with it."""
    from caffepar.parallel.comm import launched_by_mpi
    if ranks and ranks > 1 and not launched_by_mpi():
        from caffepar.parallel.launch import relaunch, strip_option
        sys.exit(relaunch(ranks, strip_option(ctx.obj["argv"], {"--np", "--mpiexec"}), threads,
                          mpiexec))


def _warn_gpu(gpu):
    if gpu is not None:
        click.echo("warning: caffepar computes on the CPU; -gpu is ignored", err=True)


def _abort_other_ranks(obj, message):
    """In a multi-rank job a failing rank must end the others, not leave them waiting."""
    comm = obj.get("comm")
    if comm is not None and comm.size > 1:
        from caffepar.parallel.launch import abort_all
        abort_all(comm, message)


def main(argv=None):
    argv = normalize_caffe_flags(sys.argv[1:] if argv is None else list(argv))
    debug = "--debug" in argv
    obj = {"argv": argv}
    try:
        try:
            cli.main(args=argv, prog_name="caffepar", standalone_mode=False, obj=obj)
        except (CaffeparError, OSError, MemoryError) as e:
            _abort_other_ranks(obj, f"caffepar: {e}")
            raise
        except Exception:
            import traceback
            _abort_other_ranks(obj, traceback.format_exc())
            raise
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except CaffeparError as e:
        if debug:
            raise
        click.echo(f"caffepar: {e}", err=True)
        sys.exit(1)
    except MemoryError:
        if debug:
            raise
        click.echo("caffepar: error: out of memory", err=True)
        sys.exit(1)
    except OSError as e:
        if debug:
            raise
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        click.echo(f"caffepar: {where}error: {e.strerror or e}", err=True)
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    main()
