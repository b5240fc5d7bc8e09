"""Pure NetParameter -> NetParameter rewrites that Net runs before building layers:
keep the layers whose include/exclude rules match the NetState, then insert Split layers where a
blob feeds several bottoms. Each returns a new message and leaves its input alone, or, asked
`inplace` by a caller that owns the net (Net), the net itself where it changes nothing or only
drops a few layers: a net of millions of layers is then not copied (a copy costs about 0.7 KB a
layer, and protobuf gives the memory of the old one back only when all of it goes)."""
from array import array

from caffepar.errors import NetError
from caffepar.proto import caffe_pb2


def state_meets_rule(state, rule):
    """Caffe's NetStateRule test: phase, level range and required / forbidden stages."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def _without_layers(net):
    """A copy of the net's fields but its layers (copying them all to delete them would cost
    a huge net its size again: the memory of deleted messages is not given back)."""
    out = caffe_pb2.NetParameter()
    for field, value in net.ListFields():
        if field.name == "layer":
            continue
        target = getattr(out, field.name)
        if hasattr(target, "extend"):       # a repeated field
            target.extend(value)
        elif field.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(out, field.name, value)
    return out


def _copied(net):
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    return out


def filter_net(net, smap=None, inplace=False):
    """Keep only the layers the net's `state` selects. A kept layer whose bottom only layers
    the rules dropped make is an error that says so, and which state would keep them."""
    if not any(layer.include or layer.exclude for layer in net.layer):
        return net if inplace else _copied(net)
    keep = []
    made, dropped = set(net.input), {}
    for layer in net.layer:
        if layer.include and layer.exclude:
            raise NetError("specify either include rules or exclude rules, not both",
                           layer=layer.name, path=smap and smap.path,
                           line=smap and smap.line_of(layer.name))
        if layer.include:
            kept = any(state_meets_rule(net.state, r) for r in layer.include)
        else:
            kept = not any(state_meets_rule(net.state, r) for r in layer.exclude)
        keep.append(kept)
        if kept:
            for j, name in enumerate(layer.bottom):
                if name not in made and name in dropped:
                    raise NetError(
                        f'bottom blob "{name}" (bottom index {j}) is made only by '
                        f"{_names(dropped[name])}, which the include/exclude rules drop in "
                        f"this state ({_state_text(net.state)})",
                        layer=layer.name, layer_type=layer.type, path=smap and smap.path,
                        line=smap and smap.line_of(layer.name),
                        hint=_keeping_state(net.state, dropped[name]))
            made.update(layer.top)
        else:
            for name in layer.top:
                dropped.setdefault(name, []).append(layer)
    gone = [i for i, kept in enumerate(keep) if not kept]
    if inplace and 64 * len(gone) <= len(keep):
        for i in reversed(gone):           # a few: each deletion moves the layers after it
            del net.layer[i]
        return net
    out = _without_layers(net)
    for layer, kept in zip(net.layer, keep):
        if kept:
            out.layer.add().CopyFrom(layer)
    return out


def _names(layers):
    """Layers named once each: nets often give one name to a producer per phase or stage."""
    counts = {}
    for l in layers:
        counts[l.name, l.type] = counts.get((l.name, l.type), 0) + 1
    return ", ".join(f'layer "{name}" ({kind})' if n == 1 else f'{n} layers "{name}" ({kind})'
                     for (name, kind), n in counts.items())


def _state_text(state):
    phase = caffe_pb2.Phase.Name(state.phase)
    stages = ", ".join(state.stage) or "none"
    return f"phase {phase}, level {state.level}, stages: {stages}"


def _keeping_state(state, layers):
    """How the command line would keep one of `layers`: every distinct way, each the --stage
    (or --phase, --level) options that meet an include rule, or dropping an exclude rule's
    stage."""
    ways = list(dict.fromkeys(w for w in (_keeping_one(state, l) for l in layers) if w))
    if len(ways) > 2:
        return "; ".join(ways[:-1]) + "; or " + ways[-1]
    return " or ".join(ways) or None


def _keeping_one(state, layer):
    for rule in layer.include:
        if any(s in state.stage for s in rule.not_stage):
            continue
        options = []
        if rule.HasField("phase") and rule.phase != state.phase:
            options.append(f"--phase {caffe_pb2.Phase.Name(rule.phase)}")
        if rule.HasField("min_level") and state.level < rule.min_level:
            options.append(f"--level {rule.min_level}")
        if rule.HasField("max_level") and state.level > rule.max_level:
            options.append(f"--level {rule.max_level}")
        options += [f"--stage {s}" for s in rule.stage if s not in state.stage]
        if options:
            return f'{" ".join(options)} keeps layer "{layer.name}"'
    for rule in layer.exclude:
        if state_meets_rule(state, rule):
            gone = [s for s in rule.stage if s in state.stage]
            if gone:
                return f'without --stage {" ".join(gone)}, layer "{layer.name}" is kept'
    return None


def split_layer_name(layer_name, blob_name, top_index):
    return f"{blob_name}_{layer_name}_{top_index}_split"


def split_blob_name(layer_name, blob_name, top_index, split_index):
    return f"{blob_name}_{layer_name}_{top_index}_split_{split_index}"


def insert_splits(net, smap=None, inplace=False):
    """Give every blob used more than once (as bottom, or as a weighted loss) its own Split layer,
    so that each consumer gets a separate diff and the Split sums them. A first walk counts the
    consumers of each top (an array for first tops, a dict for the others, so that a net of
    millions of layers takes a few bytes a layer); the net is rewritten only where some top
    has more than one."""
    count0 = array("L", bytes(array("L").itemsize * len(net.layer)))
    counts, loss_weight = {}, {}

    def consumed(src):
        if src[1] == 0:
            count0[src[0]] += 1
        else:
            counts[src] = counts.get(src, 0) + 1

    last_top = {}
    for i, layer in enumerate(net.layer):
        for j, name in enumerate(layer.bottom[:]):  # a slice: a list, faster than the field
            src = last_top.get(name)
            if src is None:
                raise NetError(f"unknown bottom blob \"{name}\" (bottom index {j})",
                               layer=layer.name, layer_type=layer.type,
                               path=smap and smap.path, line=smap and smap.line_of(layer.name))
            consumed(src)
        tops = layer.top[:]
        for j, name in enumerate(tops):
            last_top[name] = (i, j)
        weights = layer.loss_weight
        if not weights:
            continue
        for j in range(min(len(weights), len(tops))):
            src = last_top[tops[j]]
            loss_weight[src] = weights[j]
            if weights[j]:
                consumed(src)
    if max(count0, default=0) <= 1 and max(counts.values(), default=0) <= 1:
        return net if inplace else _copied(net)

    def consumers(src):
        return count0[src[0]] if src[1] == 0 else counts.get(src, 0)

    out = _without_layers(net)
    last_top, next_split = {}, {}
    for i, layer in enumerate(net.layer):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j, name in enumerate(layer.bottom):
            src = last_top[name]
            if consumers(src) > 1:
                k = next_split.get(src, 0)
                next_split[src] = k + 1
                new.bottom[j] = split_blob_name(net.layer[src[0]].name, name, src[1], k)
        for j, name in enumerate(layer.top):
            last_top[name] = (i, j)
        for j, name in enumerate(new.top):
            src = (i, j)
            count = consumers(src)
            if count > 1:
                split = out.layer.add()
                split.name = split_layer_name(layer.name, name, j)
                split.type = "Split"
                split.bottom.append(name)
                weight = loss_weight.get(src, 0.0)
                for k in range(count):
                    split.top.append(split_blob_name(layer.name, name, j, k))
                    if weight:
                        split.loss_weight.append(weight if k == 0 else 0.0)
                if weight:
                    new.ClearField("loss_weight")
                    next_split[src] = next_split.get(src, 0) + 1
    return out


def with_batch(net, batch):
    """The net with every input and data layer producing `batch` samples (Input and DummyData
    shapes' first axis, data layers' batch_size)."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    for shape in out.input_shape:
        shape.dim[0] = batch
    if out.input_dim:
        out.input_dim[0] = batch
    for layer in out.layer:
        for shape in list(layer.input_param.shape) + list(layer.dummy_data_param.shape):
            if shape.dim:
                shape.dim[0] = batch
        if layer.dummy_data_param.num:
            layer.dummy_data_param.num[:] = [batch] * len(layer.dummy_data_param.num)
        for field in ("data_param", "image_data_param", "hdf5_data_param", "memory_data_param",
                      "window_data_param"):
            if layer.HasField(field):
                getattr(layer, field).batch_size = batch
    return out
