"""Training logs in Caffe's glog format (so Caffe's log parsers read ours), per-iteration CSV, and
reading either back for `caffepar plot`."""
import csv
import io
import logging
import os
import re
import sys
import time

LOGGER = logging.getLogger("caffepar")


class GlogFormatter(logging.Formatter):
    """`I1122 05:41:13.123456 12345 solver.py:218] message`, as glog writes Caffe's lines."""

    LEVELS = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
              logging.CRITICAL: "F"}

    def __init__(self, prefix=""):
        super().__init__()
        self.prefix = prefix

    def format(self, record):
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1e6)
        head = (f"{self.LEVELS.get(record.levelno, 'I')}{t.tm_mon:02d}{t.tm_mday:02d} "
                f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{micros:06d} {record.process} "
                f"{os.path.basename(record.pathname)}:{record.lineno}] ")
        return self.prefix + head + record.getMessage()


def progress(message, *args):
    """Progress of a long step (parsing or building a huge net): in the log when one is set
    up, else on stderr, so that every command shows it."""
    if LOGGER.isEnabledFor(logging.INFO):
        LOGGER.info(message, *args)
    else:
        sys.stderr.write(f"{message % args}\n")
        sys.stderr.flush()


def note(text):
    """What a user should know of a file read (fields kept unread, and why): where progress()
    writes, once per file."""
    progress("%s", text)


def available_memory():
    """Bytes the machine can still give (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def setup_logging(log_file=None, quiet=False, prefix="", enabled=True):
    """Log to stderr (unless quiet) and to log_file, both glog-formatted."""
    LOGGER.handlers.clear()
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    if not enabled:
        LOGGER.addHandler(logging.NullHandler())
        return
    fmt = GlogFormatter(prefix)
    if not quiet:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        LOGGER.addHandler(h)
    if log_file:
        fh = logging.FileHandler(log_file, mode="a")
        fh.setFormatter(fmt)
        LOGGER.addHandler(fh)


class CsvWriter:
    """One row per training iteration: iter, loss, lr, seconds and any test outputs, with
    float32 values at the 7 significant digits they hold."""

    def __init__(self, path):
        self.path = path
        self.fields = ["iter", "loss", "lr", "seconds", "data_wait_s"]
        self.kept = None
        self.rows = []

    def keep_rows_before(self, iteration):
        """A resumed run: keep the rows the file already has for iterations before this one."""
        self.kept = []
        if not os.path.exists(self.path):
            return
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            for name in reader.fieldnames or []:
                if name not in self.fields:
                    self.fields.append(name)
            for row in reader:
                it = _int_or_none(row.get("iter"))
                if it is not None and it < iteration:
                    self.kept.append(row)

    def add(self, row):
        for key in row:
            if key not in self.fields:
                self.fields.append(key)
        self.rows.append(dict(row))

    def write(self):
        from caffepar.io.weights import atomic_write
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=self.fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(self.kept or [])
        for row in self.rows:
            w.writerow({k: format(v, ".7g") if isinstance(v, float) else v
                        for k, v in row.items()})
        atomic_write(self.path, lambda f: f.write(text.getvalue().encode("utf-8")))


def _int_or_none(text):
    try:
        return int(float(text))
    except (TypeError, ValueError):
        return None


_ITER = re.compile(r"Iteration (\d+)")
_LOSS = re.compile(r"Iteration (\d+) .*loss = ([-+\d.eE]+|nan|inf)")
_LR = re.compile(r"Iteration (\d+), lr = ([-+\d.eE]+)")
_TEST = re.compile(r"Test net output #\d+: (\S+) = ([-+\d.eE]+|nan|inf)")


def read_curves(path):
    """{"train": {"iter": [...], "loss": [...], "lr": [...]}, "test": {name: ([iters], [values])}}
    from a caffepar/Caffe log or our CSV."""
    train = {"iter": [], "loss": [], "lr_iter": [], "lr": []}
    test = {}
    if str(path).endswith(".csv"):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                it = int(float(row["iter"]))
                if row.get("loss") not in (None, ""):
                    train["iter"].append(it)
                    train["loss"].append(float(row["loss"]))
                if row.get("lr") not in (None, ""):
                    train["lr_iter"].append(it)
                    train["lr"].append(float(row["lr"]))
                for key, value in row.items():
                    if key.startswith("test/") and value not in (None, ""):
                        test.setdefault(key[5:], ([], []))
                        test[key[5:]][0].append(it)
                        test[key[5:]][1].append(float(value))
        return {"train": train, "test": test}
    test_iter = 0
    with open(path, errors="replace") as f:
        for line in f:
            if "Testing net" in line:
                m = _ITER.search(line)
                if m:
                    test_iter = int(m.group(1))
                continue
            m = _TEST.search(line)
            if m:
                test.setdefault(m.group(1), ([], []))
                test[m.group(1)][0].append(test_iter)
                test[m.group(1)][1].append(float(m.group(2)))
                continue
            m = _LR.search(line)
            if m:
                train["lr_iter"].append(int(m.group(1)))
                train["lr"].append(float(m.group(2)))
                continue
            m = _LOSS.search(line)
            if m:
                train["iter"].append(int(m.group(1)))
                train["loss"].append(float(m.group(2)))
    return {"train": train, "test": test}


def plot_curves(source, out_png):
    """Training loss, learning rate and test outputs against iterations, as one PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from caffepar.errors import CaffeparError
        raise CaffeparError("plotting needs matplotlib: pip install 'caffepar[plot]'") from None
    curves = read_curves(source)
    train, test = curves["train"], curves["test"]
    fig, axes = plt.subplots(1, 3 if train["lr"] else 2, figsize=(14, 4))
    axes[0].plot(train["iter"], train["loss"], lw=1)
    axes[0].set(title="training loss", xlabel="iteration")
    for name, (its, vals) in sorted(test.items()):
        axes[1].plot(its, vals, marker="o", lw=1, label=name)
    axes[1].set(title="test outputs", xlabel="iteration")
    if test:
        axes[1].legend()
    if train["lr"]:
        axes[2].plot(train["lr_iter"], train["lr"], lw=1)
        axes[2].set(title="learning rate", xlabel="iteration", yscale="log")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return curves
