"""One error family for everything a user can get wrong.

Each error renders as a single compiler-style line, e.g.
``net.prototxt:42: error: layer "conv1" (Convolution): kernel_size must be > 0, got 0``,
so the CLI can print it and exit 1 without a traceback.
"""
from collections.abc import Mapping


class Where(Mapping):
    """Where a layer is written (path, line), passed to errors as keyword arguments: one small
    object per layer (a dict would cost a huge net about 130 bytes more per layer)."""

    __slots__ = ("path", "line")

    def __init__(self, path=None, line=None):
        self.path, self.line = path, line

    def __getitem__(self, key):
        if key not in self.__slots__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self.__slots__)

    def __len__(self):
        return 2


class CaffeparError(Exception):
    """Base of all errors caused by the user's files, flags or data."""

    def __init__(self, message, path=None, line=None, layer=None, layer_type=None, hint=None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.line = line
        self.layer = layer
        self.layer_type = layer_type
        self.hint = hint

    def __str__(self):
        where = ""
        if self.path:
            where = f"{self.path}:{self.line}: " if self.line else f"{self.path}: "
        what = ""
        if self.layer is not None:
            what = f'layer "{self.layer}"'
            if self.layer_type:
                what += f" ({self.layer_type})"
            what += ": "
        text = f"{where}error: {what}{self.message}"
        if self.hint:
            text += f"; {self.hint}"
        return text


class PrototxtError(CaffeparError):
    """A text or binary Caffe file that does not parse or violates the schema."""


class NetError(CaffeparError):
    """A net whose graph is wrong: unknown bottom, duplicate top, unknown layer type."""


class LayerError(CaffeparError):
    """A layer parameter or blob shape that the layer cannot work with."""


class WeightsError(CaffeparError):
    """A caffemodel that is truncated or does not fit the net."""


class SolverError(CaffeparError):
    """A solver setting or solver state that cannot be used."""


class DataError(CaffeparError):
    """A data source (LMDB, list file, HDF5) that is missing or malformed."""


class MissingFileError(CaffeparError):
    """A file named by the user or by a prototxt that does not exist."""

    def __init__(self, path, what="file"):
        super().__init__(f"{what} not found", path=str(path))
