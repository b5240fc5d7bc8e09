"""How a data-parallel run communicates its gradients: the solver's `comm_param` (a caffepar
extension of SolverParameter) with the command line's flags on top. Every option is off unless
chosen; all off is exact synchronous SGD with one allreduce after backward."""
import math
import re
from dataclasses import dataclass, replace

from caffepar.errors import PrototxtError
from caffepar.proto import caffe_pb2

MERGES = ("auto",)


def bad_ratio(value):
    return None if 0 < value <= 1 else f"top-k ratio must be in (0, 1], got {value:g}"


def bad_bucket(value):
    return None if value > 0 and math.isfinite(value) else \
        f"bucket size must be > 0 MiB, got {value:g}"


def bad_refresh(value):
    return None if value >= 1 else f"top-k refresh interval must be >= 1 iteration, got {value}"


def bad_ranks_per_node(value, ranks=None):
    if value < 1:
        return f"ranks per node must be >= 1, got {value}"
    if ranks and ranks % value:
        return f"ranks per node ({value}) must divide the number of ranks ({ranks})"
    return None


@dataclass(frozen=True)
class CommOptions:
    overlap: bool = False
    bucket_mb: float = None
    merge: str = None
    topk: float = None
    topk_refresh: int = 10
    momentum_correction: bool = False
    hierarchical: bool = False
    ranks_per_node: int = None
    timeline: str = None

    @property
    def plain(self):
        """Exact synchronous SGD, reduced as one allreduce after backward."""
        return not (self.overlap or self.bucket_mb or self.merge or self.topk or
                    self.hierarchical)

    def with_flags(self, **flags):
        """These options with every flag that was given (not None / not False) on top; a
        fixed bucket size and merge auto replace each other."""
        given = {k: v for k, v in flags.items() if v is not None and v is not False}
        if "merge" in given:
            given.setdefault("bucket_mb", None)
        if "bucket_mb" in given:
            given.setdefault("merge", None)
        options = replace(self, **given)
        if options.merge:
            options = replace(options, overlap=True)
        return options

    def conflicts(self):
        """Option names given together that do not go together, with the reason, or None."""
        if self.bucket_mb and self.merge:
            return "bucket_mb", "give a fixed bucket size or --merge auto, not both"
        if self.topk and self.hierarchical:
            return "hierarchical", ("top-k exchanges index/value pairs with allgather; it does "
                                    "not combine with the hierarchical allreduce")
        if self.momentum_correction and not self.topk:
            return "momentum_correction", "momentum correction is part of top-k (--topk)"
        if self.ranks_per_node and not self.hierarchical:
            return "ranks_per_node", "ranks per node is an option of the hierarchical reduction"
        return None

    def describe(self):
        parts = []
        if self.overlap:
            parts.append("overlapped with backward")
        if self.bucket_mb:
            parts.append(f"{self.bucket_mb:g} MiB buckets")
        if self.merge:
            parts.append(f"merge {self.merge}")
        if self.topk:
            parts.append(f"top-k {self.topk:g} (thresholds every {self.topk_refresh} "
                         "iterations" + (", momentum correction" if self.momentum_correction
                                         else "") + ")")
        if self.hierarchical:
            nodes = f"nodes of {self.ranks_per_node} rank(s)" if self.ranks_per_node \
                else "nodes by shared memory"
            parts.append(f"hierarchical ({nodes})")
        return ", ".join(parts) or "one allreduce after backward"


_FIELDS = {"overlap": "overlap", "bucket_mb": "bucket_mb", "merge": "merge",
           "topk_ratio": "topk", "topk_refresh": "topk_refresh",
           "momentum_correction": "momentum_correction",
           "hierarchical": "hierarchical", "ranks_per_node": "ranks_per_node",
           "timeline": "timeline"}


def _line_of(path, name):
    """Line of `name:` inside the solver file's comm_param block (None when not found)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, TypeError, UnicodeDecodeError):
        return None
    block = re.search(r"\bcomm_param\b", text)
    if not block:
        return None
    found = re.compile(rf"\b{name}\s*:").search(text, block.end())
    at = found.start() if found else block.start()
    return text.count("\n", 0, at) + 1


def options_from_solver(param, path=None):
    """CommOptions from a SolverParameter's comm_param; a bad value is a PrototxtError at its
    file:line (`path`: the solver prototxt the parameter was read from)."""
    if not param.HasField("comm_param"):
        return CommOptions()
    cp = param.comm_param
    values = {}
    for proto_name, name in _FIELDS.items():
        if cp.HasField(proto_name):
            values[name] = getattr(cp, proto_name)
    if "merge" in values:
        values["merge"] = None if values["merge"] == caffe_pb2.CommParameter.NONE else "auto"
    checks = {"topk": bad_ratio, "bucket_mb": bad_bucket, "topk_refresh": bad_refresh,
              "ranks_per_node": bad_ranks_per_node}
    proto_names = {v: k for k, v in _FIELDS.items()}
    for name, check in checks.items():
        if name in values:
            message = check(values[name])
            if message:
                raise PrototxtError(f"comm_param.{proto_names[name]}: {message}", path=path,
                                    line=_line_of(path, proto_names[name]))
    options = CommOptions().with_flags(**values)
    conflict = options.conflicts()
    if conflict:
        raise PrototxtError(f"comm_param: {conflict[1]}", path=path,
                            line=_line_of(path, proto_names[conflict[0]]))
    return options


def check_against_ranks(options, ranks, path=None):
    """ranks_per_node must divide the number of ranks (PrototxtError at the solver's line)."""
    if options.ranks_per_node:
        message = bad_ranks_per_node(options.ranks_per_node, ranks)
        if message:
            raise PrototxtError(message, path=path, line=_line_of(path, "ranks_per_node"))


def check_solver(options, param, path=None):
    """Momentum correction replaces the momentum of an SGD solver: it needs one."""
    if options.momentum_correction:
        from caffepar.proto.upgrade import upgrade_solver
        solver_type = upgrade_solver(param, source=path)[0].type
        if solver_type != "SGD" or param.momentum <= 0:
            raise PrototxtError(f"momentum correction needs the SGD solver with momentum > 0 "
                                f"(this one: {solver_type}, momentum {param.momentum:g})",
                                path=path)
