"""The `caffepar` command: Caffe's tool interface (train, test, time, ...) as a thin click layer.

Errors caused by the user's files become one line on stderr and exit status 1 (`--debug` shows
the traceback); usage errors exit 2, as click does.
"""
import os
import re
import sys

import click

from caffepar import _signals
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


def cost_options(fn):
    """Where AUTO and the plan take communication costs from."""
    flags = [
        click.option("--calibration", type=click.Path(dir_okay=False), default=None,
                     help="A calibration file written by `caffepar calibrate`."),
        click.option("--network", default=None,
                     help="A cluster network preset: 10gbe, 25gbe, 100gb-ib, or the network "
                          "lab's measured links lab-100mbit, lab-1gbit."),
        click.option("--alpha", type=float, default=None,
                     help="Latency per message hop in seconds (with --beta)."),
        click.option("--beta", type=float, default=None,
                     help="Seconds per byte (1 / bandwidth; with --alpha)."),
    ]
    for flag in reversed(flags):
        fn = flag(fn)
    return fn


def _cost_model(calibration=None, network=None, alpha=None, beta=None):
    """The CostModel the options name, or None."""
    from caffepar.parallel.cost import CostModel
    given = [n for n, v in (("--calibration", calibration), ("--network", network),
                            ("--alpha/--beta", alpha if alpha is not None else beta)) if v]
    if len(given) > 1:
        raise click.UsageError(f"give one of --calibration, --network, --alpha/--beta "
                               f"(got {', '.join(given)})")
    if (alpha is None) != (beta is None):
        raise click.UsageError("--alpha and --beta go together")
    if calibration:
        return CostModel.load(calibration)
    if network:
        return CostModel.preset(network)
    if alpha is not None:
        return CostModel.from_alpha_beta(alpha, beta)
    return None


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
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=lambda ctx, param, value: _print_version(ctx) if value else None,
              help="Show the version and the MPI library in use, and exit.")
@click.pass_context
def cli(ctx, debug):
    """caffepar: train, test and time Caffe models on the CPU."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if ctx.invoked_subcommand != "train":       # train's solver and launcher take them over
        _signals.release()
    ctx.obj.setdefault("argv", [])


def _print_version(ctx):
    """caffepar's version and the MPI library mpi4py runs on (the one ranks would use)."""
    from importlib.metadata import PackageNotFoundError, version
    from caffepar.parallel.mpilib import describe
    try:
        mine = version("caffepar")
    except PackageNotFoundError:
        mine = "unknown"
    click.echo(f"caffepar, version {mine}")
    click.echo(describe())
    ctx.exit()


WATCHDOG_OPTION = click.option(
    "--watchdog", default=None, type=click.FloatRange(min=0),
    help="With several ranks: end the job, naming the ranks that did not come, when a rank "
         "waits this many seconds in one collective (0: never). Default: 20 times the longest "
         "a rank computes between two collectives, at least 60 s (300 s in the first "
         "iteration, which measures engines); a rank writing a snapshot is waited for.")
ALLOW_MISSING_OPTION = click.option(
    "--allow-missing", is_flag=True,
    help="Keep the initial (filler) values of layers the weights file has nothing for, "
         "instead of refusing it (fine-tuning new layers).")


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
              type=click.Choice(["data", "hybrid", "auto"]))
@click.option("--model-parallel", "model_parallel", default="")
@click.option("--mp-threshold", default=None, type=click.IntRange(min=0))
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="Threads per rank, or of this process without --np (default: cores / "
                   "ranks).")
@click.option("--mpiexec", default=None, help="The mpiexec to start ranks with.")
@click.option("--save-profile", type=click.Path(dir_okay=False), default=None,
              help="Write every layer's forward and backward ms to this file, the compute "
                   "that `caffepar plan --profile-file` predicts iterations from (one "
                   "process, no --np).")
@click.option("--engines", "show_engines", is_flag=True,
              help="Print each Convolution and InnerProduct layer's engine per pass and by how "
                   "much it won when measured on this CPU.")
@click.option("--memory", "show_memory", is_flag=True,
              help="Print the memory floor (parameters, activations and their diffs), the "
                   "measured peak and the largest blobs.")
@comm_options
@cost_options
@WATCHDOG_OPTION
@ALLOW_MISSING_OPTION
@click.option("--gpu", default=None, hidden=True)
@click.pass_context
def time_cmd(ctx, model, weights, iterations, phase, level, stage, ranks, default_mode,
             model_parallel, mp_threshold, threads, mpiexec, save_profile, show_engines,
             show_memory, watchdog, allow_missing, gpu, calibration, network, alpha, beta, **comm_flags):
    """Time forward and backward of every layer, as `caffe time`."""
    from caffepar.graph.net import Net
    from caffepar.parallel.options import CommOptions
    from caffepar.timing import benchmark, format_benchmark, format_memory, peak_rss
    start_rss = peak_rss()
    _warn_gpu(gpu)
    if comm_flags.get("momentum_correction"):
        raise click.UsageError("--momentum-correction needs a solver's momentum: it is an "
                               "option of caffepar train")
    if save_profile and ranks and ranks > 1:
        raise click.UsageError("--save-profile times one process (the compute a rank does, "
                               "which plan adds communication to); drop --np")
    options = CommOptions().with_flags(**_comm_flags(ranks, comm_flags))
    cost_model = _cost_model(calibration, network, alpha, beta)
    _relaunch_if_asked(ctx, ranks, threads, mpiexec)
    comm = _world_comm(ctx, watchdog)
    extra = {}
    if comm.size > 1:
        from caffepar.parallel.model_parallel import layer_factory
        planner = _planner(default_mode, model_parallel, mp_threshold, cost_model, comm.size)
        extra = {"shard": (comm.rank, comm.size), "layer_factory": layer_factory(comm, planner)}
    net = Net(model, phase=_phase(phase), level=level, stages=stage, **extra)
    if weights:
        net.copy_from(weights, allow_missing=allow_missing)
    say = click.echo if comm.rank == 0 else (lambda *a, **k: None)
    result = benchmark(net, iterations, comm=comm, options=options, cost_model=cost_model,
                       progress=lambda i, ms: say(
        f"Iteration: {i} forward-backward time: {ms:.2f} ms."))
    say(format_benchmark(net, result, engines=show_engines))
    if show_memory:
        say(format_memory(net, start_rss))
    if save_profile:
        from caffepar.timing import profile_dict
        from caffepar.timing import save_profile as save_profile_file
        save_profile_file(save_profile, profile_dict(net, result, _net_batch(net)))
        say(f"Wrote the profile to {save_profile}")
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
@click.option("--on-nonfinite", "on_nonfinite", default="stop", show_default=True,
              type=click.Choice(["stop", "continue"]),
              help="At a NaN or infinite loss: stop naming the first layer whose output is "
                   "not finite, or train on as Caffe does.")
@click.option("--sighup_effect", "--sighup-effect", default="snapshot", show_default=True,
              type=click.Choice(["stop", "snapshot", "none"]))
@click.option("--log", "log_file", default=None, type=click.Path(dir_okay=False),
              help="Also write the log (glog format) to this file.")
@click.option("--csv", "csv_file", default=None, type=click.Path(dir_okay=False),
              help="Per-iteration CSV (default: <snapshot_prefix>_log.csv).")
@click.option("--np", "ranks", default=None, type=click.IntRange(min=1),
              help="Run on this many MPI ranks (started with the bundled mpiexec).")
@click.option("--parallel", "default_mode", default="hybrid", show_default=True,
              type=click.Choice(["data", "hybrid", "auto"]),
              help="Mode of layers without parallel_mode: all data parallel, or the paper's "
                   "hybrid (big InnerProducts model parallel).")
@click.option("--model-parallel", "model_parallel", default="",
              help="Comma-separated InnerProduct layers to run model parallel.")
@click.option("--mp-threshold", default=None, type=click.IntRange(min=0),
              help="Parameter count above which hybrid runs an InnerProduct model parallel.")
@click.option("--log-all-ranks", is_flag=True, help="Log from every rank, prefixed with it.")
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="Threads per rank, or of this process without --np (default: cores / "
                   "ranks).")
@click.option("--mpiexec", default=None, help="The mpiexec to start ranks with.")
@comm_options
@cost_options
@WATCHDOG_OPTION
@ALLOW_MISSING_OPTION
@click.option("--gpu", default=None, hidden=True)
@click.pass_context
def train_cmd(ctx, solver, weights, snapshot, iterations, level, stage, sigint_effect,
              on_nonfinite, sighup_effect, log_file, csv_file, ranks, default_mode,
              model_parallel, mp_threshold, log_all_ranks, threads, mpiexec, watchdog,
              allow_missing, gpu, calibration, network, alpha, beta, **comm_flags):
    """Train a net with a solver, as `caffe train`; with --np, over MPI ranks."""
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
    cost_model = _cost_model(calibration, network, alpha, beta)
    _relaunch_if_asked(ctx, ranks, threads, mpiexec)
    comm = _world_comm(ctx, watchdog)
    planner = _planner(default_mode, model_parallel, mp_threshold, cost_model, comm.size)
    run_training(solver, weights=weights, snapshot=snapshot, iterations=iterations,
                 level=level, stages=stage, sigint_effect=sigint_effect,
                 sighup_effect=sighup_effect, on_nonfinite=on_nonfinite, log_file=log_file,
                 csv_file=csv_file, comm=comm, planner=planner, log_all_ranks=log_all_ranks,
                 comm_flags=comm_flags, allow_missing=allow_missing)


@cli.command("test")
@click.option("--model", required=True, type=click.Path(dir_okay=False))
@click.option("--weights", required=True, type=click.Path(dir_okay=False))
@click.option("--iterations", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--level", default=0, type=int)
@click.option("--stage", multiple=True)
@click.option("--log", "log_file", default=None, type=click.Path(dir_okay=False))
@ALLOW_MISSING_OPTION
@click.option("--gpu", default=None, hidden=True)
def test_cmd(model, weights, iterations, level, stage, log_file, allow_missing, gpu):
    """Score a trained model over `iterations` batches, as `caffe test`."""
    from caffepar.training import run_test
    _warn_gpu(gpu)
    run_test(model, weights, iterations, level=level, stages=stage, log_file=log_file,
             allow_missing=allow_missing)


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
              help="Number of ranks to plan for (no ranks are started).")
@click.option("--parallel", "default", default="hybrid", show_default=True,
              type=click.Choice(["data", "hybrid", "auto"]),
              help="Default mode of layers without parallel_mode.")
@click.option("--model-parallel", "model_parallel", default="",
              help="Comma-separated InnerProduct layers to run MODEL whatever the default.")
@click.option("--mp-threshold", default=None, type=click.IntRange(min=0),
              help="Parameter count above which hybrid runs an InnerProduct MODEL.")
@click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False),
              default="TRAIN", show_default=True)
@click.option("--profile", "profile_iterations", default=0, show_default=True,
              type=click.IntRange(min=0),
              help="Time this many forward/backward passes here: the compute of the predicted "
                   "iteration, and whether the net is AlexNet-like (the patent application "
                   "'Model training method and device for AlexNet-like networks') and where it "
                   "splits.")
@click.option("--profile-file", type=click.Path(dir_okay=False), default=None,
              help="Take the compute from a profile saved by --save-profile.")
@click.option("--save-profile", type=click.Path(dir_okay=False), default=None,
              help="Write the --profile timings to this file (for --profile-file).")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="Batch per rank to plan and profile at (default: the prototxt's).")
@click.option("--ranks-per-node", default=8, show_default=True, type=click.IntRange(min=1),
              help="Node size for the predicted hierarchical reduction.")
@click.option("--topk", "topk_ratio", default=0.01, show_default=True,
              type=click.FloatRange(min=0, min_open=True, max=1),
              help="Ratio for the predicted top-k option.")
@cost_options
def plan_cmd(model, ranks, default, model_parallel, mp_threshold, phase, profile_iterations,
             profile_file, save_profile, batch, ranks_per_node, topk_ratio, calibration, network,
             alpha, beta):
    """Print each parameterised layer's parallel mode and why; with a network, a calibration
    or --alpha/--beta, the predicted communication per mode and the iteration time of DATA,
    HYBRID and AUTO."""
    from caffepar.fillers import shapes_only
    from caffepar.graph.net import Net
    from caffepar.graph.passes import with_batch
    from caffepar.parallel.plan import format_plan, make_plan
    from caffepar.timing import load_profile
    if save_profile and not profile_iterations:
        raise click.UsageError("--save-profile needs --profile N")
    if profile_file and profile_iterations:
        raise click.UsageError("give --profile N or --profile-file, not both")
    cost_model = _cost_model(calibration, network, alpha, beta)
    profile = load_profile(profile_file) if profile_file else None
    with shapes_only():
        net = Net(model, phase=_phase(phase))
        net_batch = _net_batch(net)
        if batch and batch != net_batch:
            net = Net(with_batch(net.param, batch), phase=_phase(phase))
    batch = batch or net_batch
    planner = _planner(default, model_parallel, mp_threshold, cost_model, ranks)
    plans = make_plan(net, planner, net.source_map)
    click.echo(format_plan(plans, ranks, batch, cost_model))
    if profile_iterations:
        from caffepar.parallel.buckets import detect_alexnet_like
        from caffepar.parallel.gradsync import layer_parameters
        from caffepar.timing import benchmark, profile_dict
        from caffepar.timing import save_profile as save_profile_file
        net = Net(net.param, phase=_phase(phase))
        result = benchmark(net, profile_iterations)
        detection = detect_alexnet_like([l.name for l in net.layers], result.backward_ms,
                                        layer_parameters(net))
        click.echo(f"Backward profile ({profile_iterations} iteration(s) in this process at "
                   f"batch {batch}, {result.backward_ms.sum():.1f} ms): "
                   f"{detection.describe()}")
        profile = profile_dict(net, result, batch)
        if save_profile:
            save_profile_file(save_profile, profile)
            click.echo(f"wrote the profile to {save_profile}")
    if cost_model is not None:
        click.echo(format_prediction(net, model_parallel, mp_threshold, cost_model, ranks,
                                     batch, profile))
        if profile:
            click.echo(format_options(net, cost_model, ranks, batch, profile, ranks_per_node,
                                      topk_ratio))


def _net_batch(net):
    """The batch of the net's first blob (its input or first data layer's top)."""
    return next((b.shape[0] for b in net.blobs.values() if b.shape), None)


def format_prediction(net, model_parallel, mp_threshold, cost_model, ranks, batch, profile):
    """Predicted iteration time of DATA, HYBRID and AUTO (no overlap of compute and comm)."""
    from caffepar.parallel.cost import MODEL, describe
    from caffepar.parallel.plan import DEFAULT_THRESHOLD, compare_plans
    from caffepar.timing import profile_compute_ms
    compute = profile_compute_ms(profile, batch) if profile else None
    lines = ["", f"Communication model: {describe(cost_model)}"]
    if profile:
        lines.append(f"Compute: forward + backward {compute:.1f} ms at batch {batch} per rank "
                     f"(profile at batch {profile['batch']} on {profile.get('cpus', '?')} "
                     f"CPUs of {profile.get('machine') or 'this machine'}"
                     f"{', scaled linearly' if profile['batch'] != batch else ''}; a MODEL "
                     "layer computes the same FLOPs as DATA)")
    else:
        lines.append("Compute: not given (--profile N measures it here, --profile-file F "
                     "takes a saved one); comm alone below")
    lines.append(f"Predicted per iteration at P={ranks}, batch {batch} per rank (compute and "
                 "communication one after the other):")
    lines.append(f"  {'plan':<8}{'compute ms':>12}{'comm ms':>12}{'iteration ms':>14}  "
                 "model parallel layers")
    compared = compare_plans(net, cost_model, ranks, [n for n in model_parallel.split(",") if n],
                             DEFAULT_THRESHOLD if mp_threshold is None else mp_threshold,
                             net.source_map)
    for name, (plans, comm) in compared.items():
        split = ", ".join(p.name for p in plans if p.mode == MODEL) or "none"
        total = f"{compute + comm:>14.1f}" if compute is not None else f"{'-':>14}"
        shown = f"{compute:>12.1f}" if compute is not None else f"{'-':>12}"
        lines.append(f"  {name:<8}{shown}{comm:>12.2f}{total}  {split}")
    return "\n".join(lines)


def format_options(net, cost_model, ranks, batch, profile, ranks_per_node, topk_ratio):
    """Predicted iteration of the all-DATA plan with each gradient communication option."""
    from caffepar.parallel.buckets import gradient_units
    from caffepar.parallel.cost import node_model
    from caffepar.parallel.schedule import OPTIONS, predict_options
    scale = batch / profile["batch"]
    names = net._layer_names
    forward = sum(profile["forward_ms"].get(n, 0.0) for n in names) * scale
    backward = [profile["backward_ms"].get(n, 0.0) * scale for n in names]
    nodes = ranks_per_node if ranks % ranks_per_node == 0 and ranks_per_node < ranks else None
    units = gradient_units(net)
    predicted = predict_options(units, forward, backward, 0.0, cost_model, ranks, topk_ratio,
                                nodes, node_model())
    from caffepar.parallel.buckets import describe_buckets
    from caffepar.parallel.schedule import merge_buckets
    merged, (per_layer, after) = merge_buckets(units, backward, cost_model, ranks)
    lines = ["", f"Gradient options, every layer DATA (top-k ratio {topk_ratio:g}, selection "
                 "not modelled; hierarchical: "
             + (f"nodes of {nodes} ranks over shared memory" if nodes else
                f"--ranks-per-node {ranks_per_node} does not split {ranks} ranks, one node")
             + "; communication as if a network card moved it while the cores compute):",
             f"  {'option':<15}{'iteration ms':>14}{'comm ms':>10}{'exposed ms':>12}"]
    for option in OPTIONS:
        m = predicted[option]
        lines.append(f"  {option:<15}{m.iteration_s * 1e3:>14.1f}{m.comm_s * 1e3:>10.1f}"
                     f"{m.exposed_s * 1e3:>12.1f}")
    lines.append(f"Optimal merge (--merge auto): buckets {describe_buckets(merged)}; backward + "
                 f"communication {per_layer:.1f} ms with a bucket per layer, {after:.1f} ms "
                 "merged")
    return "\n".join(lines)


@cli.command("calibrate")
@click.option("--np", "ranks", default=None, type=click.IntRange(min=2),
              help="Ranks to measure on (started with the bundled mpiexec); required unless "
                   "started under mpiexec.")
@click.option("--transport", default="shm", show_default=True,
              type=click.Choice(["shm", "tcp"]),
              help="shm: MPI's own choice on this machine; tcp: MPI's network path over "
                   "loopback (every rank as if on its own node).")
@click.option("-o", "--output", "output", default="calibration.json", show_default=True,
              type=click.Path(dir_okay=False),
              help="Calibration file; fits at other P already in it are kept.")
@click.option("--max-mb", default=16.0, show_default=True, type=click.FloatRange(min=0.001),
              help="Largest message measured, MiB.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(min=3))
@click.option("--mpiexec", default=None, help="The mpiexec to start ranks with.")
@click.pass_context
def calibrate_cmd(ctx, ranks, transport, output, max_mb, repeats, mpiexec):
    """Measure latency and bandwidth of each collective caffepar runs (alpha-beta fit per
    collective) and save them for plan, train and time (--calibration FILE)."""
    from caffepar.parallel.comm import launched_by_mpi
    from caffepar.parallel.cost import CostModel
    previous = None
    if os.path.exists(output):
        previous = CostModel.load(output)
        if previous.transport and previous.transport != transport:
            raise click.UsageError(f"{output} holds a {previous.transport} calibration; "
                                   f"write the {transport} one to another file")
    if not launched_by_mpi():
        if not ranks:
            raise click.UsageError("give --np P (2 or more ranks)")
        from caffepar.parallel.launch import relaunch, strip_option
        sys.exit(relaunch(ranks, strip_option(ctx.obj["argv"], {"--np", "--mpiexec"}), 1,
                          mpiexec, transport=transport))
    from caffepar.parallel.calibrate import calibrate, fit_error
    comm = _world_comm(ctx, 0)
    if comm.size < 2:
        raise CaffeparError("calibrate measures collectives between ranks: it needs 2 or more "
                            "(--np P, or mpiexec -n P)")
    ctx.obj["comm"] = comm
    say = click.echo if comm.rank == 0 else (lambda *a, **k: None)
    from caffepar.parallel.mpilib import describe
    say(f"{describe()}; launched by {_launcher_name()}")
    say(f"Calibrating {comm.size} ranks over {transport}: "
        f"{', '.join(('allreduce', 'allgather', 'reduce_scatter', 'alltoall', 'bcast'))}, "
        f"4 B to {max_mb:g} MiB, median of {repeats}")
    model = calibrate(comm, transport, int(max_mb * 2 ** 20), repeats, progress=lambda n, t: say(
        f"{n:>12,} B  " + "  ".join(f"{op} {s * 1e3:.4f} ms" for op, s in t.items())))
    if comm.rank == 0:
        for op, (a, b) in model.fit_for(comm.size).items():
            say(f"{op:<15} alpha {a * 1e6:8.2f} us   beta {b * 1e9:8.4f} ns/B "
                f"({1 / b / 1e9:.2f} GB/s)")
        say(f"fit's median relative error on its own samples: "
            f"{100 * fit_error(model, comm.size):.0f}%")
        if previous is not None:
            model = previous.merged(model)
        model.info[f"P{comm.size}"]["mpi"] = describe()
        model.source = os.path.basename(output)
        model.save(output)
        say(f"wrote {output} (fits at P={', '.join(map(str, sorted(model.fits)))})")


def _launcher_name():
    """What started this rank: Slurm's srun (and its PMI plugin), or an mpiexec."""
    if os.environ.get("SLURM_STEP_ID") and os.environ.get("SLURM_MPI_TYPE") and \
            "MPI_LOCALNRANKS" not in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return f"srun --mpi={os.environ['SLURM_MPI_TYPE']}"
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return "Open MPI's mpirun"
    return "mpiexec"


def _add_netlab():
    from caffepar.netlab import netlab_group
    cli.add_command(netlab_group)


_add_netlab()


@cli.group("convert")
def convert_group():
    """Convert Caffe models: upgrade old formats, inspect, change weight formats, export ONNX."""


def net_state_options(fn):
    """--phase/--level/--stage: which layers of the net are built, as in train, test and time."""
    fn = click.option("--stage", multiple=True, help="Net state stage (repeatable).")(fn)
    fn = click.option("--level", default=0, type=int, help="Net state level.")(fn)
    return click.option("--phase", type=click.Choice(["TRAIN", "TEST"], case_sensitive=False),
                        default="TEST", show_default=True)(fn)


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
@net_state_options
def convert_caffemodel(npz, model, out, allow_missing, phase, level, stage):
    """NPZ weights + net MODEL -> caffemodel OUT (HDF5 when OUT ends in .h5)."""
    from caffepar.convert.npz import convert_weights
    _report_conversion(*convert_weights(npz, out, model=model, allow_missing=allow_missing,
                                        phase=_phase(phase), level=level, stages=stage), out)


@convert_group.command("weights")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--model", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Load into this net first (shapes checked, its layer definitions written).")
@click.option("--allow-missing", is_flag=True,
              help="With --model: keep filler values for layers SRC has no weights for.")
@net_state_options
def convert_weights_cmd(src, dst, model, allow_missing, phase, level, stage):
    """Weights SRC (binary/HDF5 caffemodel, npz, or a .solverstate snapshot) -> DST, weights
    only; the format follows DST's name (.h5, .npz, else binary)."""
    from caffepar.convert.npz import convert_weights
    _report_conversion(*convert_weights(src, dst, model=model, allow_missing=allow_missing,
                                        phase=_phase(phase), level=level, stages=stage), dst)


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
              help="Fix the exported graph's batch size (default: free, any batch).")
@click.option("--dynamic-spatial", is_flag=True,
              help="Free height and width too (fully convolutional nets).")
@click.option("--opset", default=None, type=click.IntRange(13, 17),
              help="ONNX opset (default 17).")
@click.option("--allow-missing", is_flag=True,
              help="Keep filler values for layers WEIGHTS has no weights for.")
@click.option("--phase", type=click.Choice(["TEST"], case_sensitive=False), default="TEST",
              show_default=True, help="An exported net runs inference: TEST only.")
@click.option("--level", default=0, type=int, help="Net state level.")
@click.option("--stage", multiple=True, help="Net state stage (repeatable).")
def convert_onnx(model, weights, out, verify, batch, dynamic_spatial, opset, allow_missing,
                 phase, level, stage):
    """Deploy net MODEL with WEIGHTS -> OUT.onnx (TEST phase; inputs/outputs keep Caffe's
    blob names; the batch size free unless --batch fixes it)."""
    from caffepar.convert.onnx_export import DEFAULT_OPSET, export_onnx
    result = export_onnx(model, weights, out, batch=batch, allow_missing=allow_missing,
                         opset=opset or DEFAULT_OPSET, level=level, stages=stage,
                         dynamic_spatial=dynamic_spatial)
    shapes = ", ".join(f"{i.name} {_dims(i)}" for i in result.model.graph.input)
    click.echo(f"wrote {out}: inputs {shapes}; outputs {', '.join(result.outputs)}")
    if result.note:
        click.echo(f"note: {result.note}")
    if verify:
        from caffepar.convert.verify import verify_onnx
        sizes = [result.inputs] + ([result.other_inputs] if result.other_inputs else [])
        for input_shapes in sizes:
            check = verify_onnx(result, input_shapes=input_shapes)
            click.echo("at " + ", ".join(f"{n} {'x'.join(map(str, s))}"
                                         for n, s in input_shapes.items()) + ":")
            for line in check.lines():
                click.echo("  " + line)
            if not check.ok:
                from caffepar.errors import CaffeparError
                raise CaffeparError(f"onnxruntime and caffepar differ by more than "
                                    f"{check.tolerance:g}", path=out)
        click.echo("verified: onnxruntime matches caffepar" +
                   (" at both sizes" if len(sizes) > 1 else ""))


def _dims(value_info):
    """An ONNX input's shape as `batchx3x32x32`."""
    return "x".join(str(d.dim_value or d.dim_param or "?")
                    for d in value_info.type.tensor_type.shape.dim)


def _planner(default_mode, model_parallel, mp_threshold, cost_model=None, ranks=1):
    from caffepar.parallel.plan import DEFAULT_THRESHOLD, Planner
    return Planner(default_mode, [n for n in model_parallel.split(",") if n],
                   DEFAULT_THRESHOLD if mp_threshold is None else mp_threshold,
                   cost_model=cost_model, ranks=ranks)


def _relaunch_if_asked(ctx, ranks, threads, mpiexec):
    """`--np P` outside an MPI launch: run this same command under mpiexec and exit with it.
    Otherwise `--threads` applies to this process."""
    from caffepar.parallel.comm import launched_by_mpi
    if ranks and ranks > 1 and not launched_by_mpi():
        from caffepar.parallel.launch import relaunch, strip_option
        sys.exit(relaunch(ranks, strip_option(ctx.obj["argv"], {"--np", "--mpiexec"}), threads,
                          mpiexec))
    if threads:
        from caffepar.nn.blas import set_blas_threads
        if not set_blas_threads(threads):
            click.echo("warning: --threads is ignored: the BLAS in use (CAFFEPAR_BLAS=scipy) "
                       "has no thread count to set", err=True)


def _warn_gpu(gpu):
    if gpu is not None:
        click.echo("warning: caffepar computes on the CPU; -gpu is ignored", err=True)


def _world_comm(ctx, watchdog):
    """This process's communicator; in a multi-rank job, registered with caffepar's launcher
    and watched (see comm.Watchdog)."""
    from caffepar.parallel.comm import world_comm
    from caffepar.parallel.mpilib import prepare_environment
    prepare_environment()
    comm = world_comm()
    ctx.obj["comm"] = comm
    if comm.size > 1:
        from caffepar.parallel.launch import register_rank
        register_rank(comm)
        comm.start_watchdog(watchdog)
    return comm


def failure(error, debug=False):
    """(exit status, the one line to print) for an exception that ended a command; the line is
    None where the exception should propagate (one process: --debug, or an unexpected error,
    whose traceback is the report)."""
    if isinstance(error, (click.exceptions.Abort, KeyboardInterrupt)):
        return 130, "aborted"
    if isinstance(error, click.exceptions.Exit):
        return error.exit_code, ""
    if isinstance(error, _signals.StartSignal):
        return 128 + error.signum, str(error)
    if isinstance(error, click.ClickException):
        return error.exit_code, f"Error: {error.format_message()}"
    if isinstance(error, SystemExit):
        code = error.code
        return (code if isinstance(code, int) else 0 if code is None else 1), ""
    if debug:
        return 1, None
    if isinstance(error, CaffeparError):
        return 1, f"caffepar: {error}"
    if isinstance(error, MemoryError):
        return 1, f"caffepar: error: out of memory{f' ({error})' if str(error) else ''}"
    if isinstance(error, OSError):
        where = f"{error.filename}: " if getattr(error, "filename", None) else ""
        return 1, f"caffepar: {where}error: {error.strerror or error}"
    from caffepar.parallel.comm import mpi_failure
    return 1, mpi_failure(error)


def _end_rank(comm, error, debug):
    """A rank of a multi-rank job that did not finish ends the job, reporting why in one line."""
    from caffepar.parallel.launch import abort_all
    code, line = failure(error, debug)
    if debug:
        import traceback
        traceback.print_exception(error)
    if isinstance(error, SystemExit) or isinstance(error, click.exceptions.Exit):
        line = f"caffepar: exited (status {code}) before the job finished"
        code = code or 1
    elif line is None:
        import traceback
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})" \
            if frame else ""
        line = (f"caffepar: error: {type(error).__name__}: {error}{where}" +
                ("" if debug else "; --debug shows the traceback"))
    abort_all(comm, line if code == 130 else f"[rank {comm.rank}] {line}", code)


def main(argv=None):
    argv = normalize_caffe_flags(sys.argv[1:] if argv is None else list(argv))
    debug = "--debug" in argv
    obj = {"argv": argv}
    try:
        _signals.interruptible()
        cli.main(args=argv, prog_name="caffepar", standalone_mode=False, obj=obj)
    except BaseException as e:
        comm = obj.get("comm")
        if comm is not None and comm.size > 1:
            _end_rank(comm, e, debug)
        code, line = failure(e, debug)
        if line is None:
            raise
        if isinstance(e, click.ClickException):
            e.show()
        elif line:
            click.echo(line, err=True)
        sys.exit(code)
    comm = obj.get("comm")
    if comm is not None and comm.size > 1:
        from caffepar.parallel.launch import finish_rank
        finish_rank(comm)
    sys.exit(0)


if __name__ == "__main__":
    main()
