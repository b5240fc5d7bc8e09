"""Which parameterised layer runs data parallel and which model parallel, and why.

The paper's rule (hybrid): convolutions DATA; an InnerProduct MODEL when it holds more
parameters than a threshold (the big fully connected layers, where moving activations is cheaper
than reducing gradients), DATA otherwise. AUTO (`parallel_mode: AUTO`, `--parallel auto`) picks
per InnerProduct the mode the communication cost model (caffepar.parallel.cost) predicts to take
less time at this run's P and batch per rank; without a cost model it falls back to the
threshold rule. A layer's own `parallel_mode` in the prototxt wins; `--model-parallel fc6,fc7`
names layers to run MODEL whatever the default.
"""
from dataclasses import dataclass

import numpy as np

from caffepar.errors import NetError
from caffepar.proto import caffe_pb2

DATA, MODEL = "DATA", "MODEL"
DEFAULT_THRESHOLD = 8 * 2 ** 20
_MODES = {caffe_pb2.LayerParameter.DATA: DATA, caffe_pb2.LayerParameter.MODEL: MODEL,
          caffe_pb2.LayerParameter.AUTO: "AUTO"}


@dataclass
class LayerPlan:
    name: str
    type: str
    params: int
    mode: str
    reason: str
    fan_in: int = 0
    num_output: int = 0
    batch: int = 0


def comm_elements(fan_in, num_output, batch, ranks):
    """Elements moved per iteration for one InnerProduct (the paper's volumes):
    DATA reduces K*N + N gradient values; MODEL moves 3*M*K*P + 2*M*N*P activations."""
    data = fan_in * num_output + num_output
    model = 3 * batch * fan_in * ranks + 2 * batch * num_output * ranks
    return data, model


def _data_only(layer_param):
    """Why the rules (hybrid's threshold, AUTO) must leave a layer DATA, or None."""
    if layer_param.type != "InnerProduct":
        return f"{layer_param.type} layers run data parallel"
    if layer_param.inner_product_param.transpose:
        return "transpose: true; MODEL needs transpose: false (it splits the weight by rows)"
    return None


def _rule(layer_param, params, threshold):
    why = _data_only(layer_param)
    if why:
        return DATA, why
    if params > threshold:
        return MODEL, f"{params:,} parameters > threshold {threshold:,}"
    return DATA, f"{params:,} parameters <= threshold {threshold:,}"


class Planner:
    """Decides a layer's mode from its prototxt, the --model-parallel list and the run default;
    AUTO from `cost_model` at `ranks` ranks."""

    def __init__(self, default="hybrid", model_parallel=(), threshold=DEFAULT_THRESHOLD,
                 cost_model=None, ranks=1):
        if default not in ("data", "hybrid", "auto"):
            raise NetError(f'--parallel must be "data", "hybrid" or "auto", got "{default}"')
        self.default = default
        self.forced = set(model_parallel)
        self.threshold = threshold
        self.cost_model = cost_model
        self.ranks = ranks

    def decide(self, layer_param, params, fan_in=0, num_output=0, batch=0):
        """(mode, reason) for a layer with `params` parameters (an InnerProduct's K, N and
        batch per rank M let AUTO predict its communication)."""
        if layer_param.HasField("parallel_mode"):
            asked = _MODES[layer_param.parallel_mode]
            if asked == "AUTO":
                mode, why = self._auto(layer_param, params, fan_in, num_output, batch)
                return mode, f"parallel_mode: AUTO; {why}"
            return asked, f"parallel_mode: {asked} in the prototxt"
        if layer_param.name in self.forced:
            return MODEL, "--model-parallel"
        if self.default == "data":
            return DATA, "--parallel data"
        if self.default == "auto":
            mode, why = self._auto(layer_param, params, fan_in, num_output, batch)
            return mode, f"--parallel auto; {why}"
        return _rule(layer_param, params, self.threshold)

    def _auto(self, layer_param, params, fan_in, num_output, batch):
        why = _data_only(layer_param)
        if why:
            return DATA, why
        if self.cost_model is None or not (fan_in and num_output and batch):
            mode, why = _rule(layer_param, params, self.threshold)
            return mode, f"no calibration or network given, threshold rule: {why}"
        from caffepar.parallel.cost import choose_mode
        mode, data, model = choose_mode(self.cost_model, fan_in, num_output, batch, self.ranks)
        tie = " (a tie goes to DATA)" if data == model else ""
        return mode, (f"predicted comm DATA {data:.3g} ms, MODEL {model:.3g} ms at P={self.ranks}, "
                      f"batch {batch} per rank{tie}")

    def check(self, layer_param, mode, source_map=None, transpose=False):
        if mode == MODEL and layer_param.type != "InnerProduct":
            raise _not_shardable(layer_param, source_map)
        if mode == MODEL and transpose:
            raise NetError("model parallelism needs transpose: false (weights split by output "
                           "rows)", layer=layer_param.name, layer_type=layer_param.type)


def make_plan(net, planner=None, source_map=None):
    """A LayerPlan for every layer of `net` (a built, unsharded Net) that has parameters."""
    planner = planner or Planner()
    unknown = planner.forced - set(net._layer_names)
    if unknown:
        raise NetError(f"--model-parallel names layers not in the net: {', '.join(sorted(unknown))}")
    plans = []
    for i, layer in enumerate(net.layers):
        if not layer.blobs:
            if layer.param.HasField("parallel_mode") and \
                    layer.param.parallel_mode == caffe_pb2.LayerParameter.MODEL:
                raise _not_shardable(layer.param, source_map)
            continue
        params = sum(b.count for b in layer.blobs)
        shape = {}
        if layer.type == "InnerProduct":
            bottom = net.blob_list[net.bottom_ids[i][0]].shape
            axis = layer.param.inner_product_param.axis
            axis = axis if axis >= 0 else len(bottom) + axis
            shape = {"fan_in": layer.k, "num_output": layer.num_output,
                     "batch": int(np.prod(bottom[:axis]))}
        mode, reason = planner.decide(layer.param, params, **shape)
        planner.check(layer.param, mode, source_map, getattr(layer, "transpose", False))
        lp = LayerPlan(layer.name, layer.type, params, mode, reason)
        if layer.type == "InnerProduct":
            lp.fan_in, lp.num_output, lp.batch = layer.k, layer.num_output, shape["batch"]
        plans.append(lp)
    return plans


def _not_shardable(layer_param, source_map):
    return NetError("only InnerProduct layers can run model parallel (parallel_mode: MODEL)",
                    layer=layer_param.name, layer_type=layer_param.type,
                    path=source_map and source_map.path,
                    line=source_map and source_map.line_of(layer_param.name))


def format_plan(plans, ranks, batch=None, cost_model=None):
    """The table `caffepar plan` prints; with a cost model, each InnerProduct's predicted comm
    time in either mode."""
    lines = [f"{'layer':<14}{'type':<14}{'params':>14}  {'mode':<6} why"]
    for p in plans:
        lines.append(f"{p.name:<14}{p.type:<14}{p.params:>14,}  {p.mode:<6} {p.reason}")
        if p.type == "InnerProduct" and cost_model is not None and p.batch and \
                "predicted comm" not in p.reason:
            from caffepar.parallel.cost import choose_mode
            better, data, model = choose_mode(cost_model, p.fan_in, p.num_output, p.batch, ranks)
            lines.append(f"{'':<14}{'':<14}{'':>14}  {'':<6} predicted comm per iteration at "
                         f"batch {p.batch} x {ranks} ranks: DATA {data:.4g} ms, MODEL "
                         f"{model:.4g} ms ({better} faster)")
        elif p.type == "InnerProduct" and batch:
            data, model = comm_elements(p.fan_in, p.num_output, batch, ranks)
            better = MODEL if model < data else DATA
            lines.append(f"{'':<14}{'':<14}{'':>14}  {'':<6} per iteration at batch {batch} x "
                         f"{ranks} ranks: DATA moves {data:,} values, MODEL {model:,} "
                         f"({better} moves less)")
    total = sum(p.params for p in plans)
    sharded = sum(p.params for p in plans if p.mode == MODEL)
    lines.append(f"{ranks} ranks: {total:,} parameters, {sharded:,} "
                 f"({100 * sharded / max(total, 1):.1f}%) split by output across ranks, "
                 f"{total - sharded:,} replicated and reduced with one allreduce")
    return "\n".join(lines)


def shard_rows(n, ranks):
    """Row counts and offsets of an n-row weight split contiguously over ranks (the first
    n % ranks ranks hold one extra row)."""
    counts = np.array([n // ranks + (r < n % ranks) for r in range(ranks)], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return counts, offsets


PLANS = (("DATA", "data"), ("HYBRID", "hybrid"), ("AUTO", "auto"))


def compare_plans(net, cost_model, ranks, model_parallel=(), threshold=DEFAULT_THRESHOLD,
                  source_map=None):
    """{DATA, HYBRID, AUTO: (LayerPlans, predicted comm ms of one iteration)}: every layer
    data parallel; the paper's threshold rule; AUTO from `cost_model`."""
    from caffepar.parallel.cost import iteration_comm_ms
    out = {}
    for name, default in PLANS:
        forced = () if name == "DATA" else model_parallel
        plans = make_plan(net, Planner(default, forced, threshold, cost_model, ranks),
                          source_map)
        out[name] = plans, iteration_comm_ms(plans, {p.name: p.mode for p in plans},
                                             cost_model, ranks)
    return out
