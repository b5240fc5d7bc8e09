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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="caffepar")
@click.pass_context
def cli(ctx, debug):
    """caffepar: train, test and time Caffe models on the CPU."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


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
@click.option("--gpu", default=None, hidden=True)
def time_cmd(model, weights, iterations, phase, level, stage, gpu):
    """Time forward and backward of every layer, as `caffe time`."""
    from caffepar.timing import benchmark, format_benchmark
    from caffepar.graph.net import Net
    _warn_gpu(gpu)
    net = Net(model, phase=_phase(phase), level=level, stages=stage, weights=weights)
    result = benchmark(net, iterations, progress=lambda i, ms: click.echo(
        f"Iteration: {i} forward-backward time: {ms:.2f} ms."))
    click.echo(format_benchmark(net, result))


def _warn_gpu(gpu):
    if gpu is not None:
        click.echo("warning: caffepar computes on the CPU; -gpu is ignored", err=True)


def main(argv=None):
    argv = normalize_caffe_flags(sys.argv[1:] if argv is None else list(argv))
    debug = "--debug" in argv
    try:
        cli.main(args=argv, prog_name="caffepar", standalone_mode=False)
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
