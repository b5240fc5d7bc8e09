"""pycaffe's net specification: write a net as Python calls and get its NetParameter.

    from caffepar import layers as L, params as P
    n = caffepar.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[8, 1, 28, 28]), dict(dim=[8])], ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20)
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)

`L.<Type>(*bottoms, **fields)` describes one layer; a keyword goes to the type's own
`<type>_param` message when that message has the field, else to the LayerParameter (`param`,
`include`, `loss_weight`, any `*_param`). `ntop=k` gives k tops (0: the layer itself is
returned), `in_place=True` writes the top over the bottom. Names as pycaffe gives them: a top
assigned to a NetSpec attribute takes that name, any other is `<Type><count>`; a layer is named
after its first top. Lists become repeated fields, dicts messages, and a single value given to a
repeated field is a one-element list.
"""
from collections import Counter, OrderedDict

from caffepar.proto import caffe_pb2

__all__ = ["NetSpec", "Top", "Function", "layers", "params", "to_proto", "param_name_dict"]


def param_name_dict():
    """Type name -> prefix of its parameter field, from LayerParameter's `*_param` fields whose
    message is `<Type>Parameter` (ConvolutionParameter convolution_param: Convolution ->
    convolution)."""
    names = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        message = field.message_type
        if field.name.endswith("_param") and message is not None \
                and message.name.endswith("Parameter"):
            names[message.name[:-len("Parameter")]] = field.name[:-len("_param")]
    return names


_PARAM_NAMES = param_name_dict()


def assign_proto(proto, name, value):
    """Set field `name` of message `proto` from a Python value, recursively."""
    field = getattr(proto, name)
    repeated = hasattr(field, "extend")
    if repeated and not isinstance(value, (list, tuple)):
        value = [value]
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, dict):
                message = field.add()
                for key, sub in item.items():
                    assign_proto(message, key, sub)
            else:
                field.append(item)
    elif isinstance(value, dict):
        for key, sub in value.items():
            assign_proto(field, key, sub)
    else:
        setattr(proto, name, value)


class Top:
    """One output blob of a layer: output `n` of Function `fn`."""

    def __init__(self, fn, n):
        self.fn = fn
        self.n = n

    def to_proto(self):
        """The NetParameter of every layer this top depends on."""
        return to_proto(self)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)


class Function:
    """One layer: its type, its bottoms (Tops of other layers) and its fields."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for index, bottom in enumerate(inputs):
            if not isinstance(bottom, Top):
                raise TypeError(f"{type_name} input {index} is not a Top (type is {type(bottom)})")
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = f"{top.fn.type_name}{autonames[top.fn.type_name]}"
        return names[top]

    def _name(self, names, autonames):
        if self not in names:
            if self.ntop > 0:
                names[self] = self._top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = f"{self.type_name}{autonames[self.type_name]}"
        return names[self]

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottoms = []
        for bottom in self.inputs:
            bottom._to_proto(layers, names, autonames)
            bottoms.append(layers[bottom.fn].top[bottom.n])
        layer = caffe_pb2.LayerParameter(type=self.type_name, bottom=bottoms)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._top_name(top, names, autonames) for top in self.tops)
        layer.name = self._name(names, autonames)
        own = _PARAM_NAMES.get(self.type_name)
        for key, value in self.params.items():
            if key.endswith("param") or own is None:
                assign_proto(layer, key, value)
                continue
            try:
                assign_proto(getattr(layer, own + "_param"), key, value)
            except AttributeError:
                assign_proto(layer, key, value)
        layers[self] = layer


def _net_of(layers):
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


def to_proto(*tops):
    """The NetParameter of every layer the given tops depend on, with generated names."""
    layers = OrderedDict()
    autonames = Counter()
    for top in tops:
        top.fn._to_proto(layers, {}, autonames)
    return _net_of(layers)


class NetSpec:
    """Tops assigned as attributes (or items) are named after them; to_proto() gives the
    layers needed for all of them, in assignment order."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.__dict__["tops"][name]
        except KeyError:
            raise AttributeError(f"NetSpec has no top named {name!r}") from None

    def __setitem__(self, name, value):
        self.__setattr__(name, value)

    def __getitem__(self, name):
        return self.tops[name]

    def __delattr__(self, name):
        del self.tops[name]

    def to_proto(self):
        names = {value: name for name, value in self.tops.items()}
        autonames = Counter()
        layers = OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        return _net_of(layers)


class Layers:
    """`layers.Convolution(bottom, kernel_size=3)` is a Top: a 3x3 convolution of bottom."""

    def __getattr__(self, type_name):
        if type_name.startswith("__"):
            raise AttributeError(type_name)

        def layer(*bottoms, **fields):
            fn = Function(type_name, bottoms, fields)
            if fn.ntop == 0:
                return fn
            return fn.tops[0] if fn.ntop == 1 else fn.tops
        layer.__name__ = type_name
        return layer


class _EnumValues:
    def __init__(self, message):
        self._message = message

    def __getattr__(self, name):
        try:
            return getattr(self._message, name)
        except AttributeError:
            raise AttributeError(f"{self._message.DESCRIPTOR.name} has no value {name}") from None


class Parameters:
    """`params.Pooling.MAX` is PoolingParameter's MAX: enum values of `<Type>Parameter`."""

    def __getattr__(self, type_name):
        message = getattr(caffe_pb2, type_name + "Parameter", None)
        if message is None or type_name.startswith("__"):
            raise AttributeError(f"caffe.proto has no message {type_name}Parameter")
        return _EnumValues(message)


layers = Layers()
params = Parameters()
