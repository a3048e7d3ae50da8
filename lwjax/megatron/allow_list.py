"""What a checkpoint's pickle may name: the allow-list, inert stand-ins, and what calls cost.

A plain ``pickle.load`` would run any callable a file names, so the restricted
unpickler resolves globals through :data:`ALLOWED` instead:

* containers and values: ``collections.OrderedDict``, ``argparse.Namespace``,
  a few builtins (``set``, ``frozenset``, ``slice``, ...), ``_codecs.encode``,
  ``pathlib`` paths (as strings) and numpy's array reconstruction;
* torch tensors: ``torch._utils._rebuild_tensor_v2`` (and the parameter and
  subclass wrappers around it) rebuild a ``numpy`` array from the archive's
  storage; ``torch.<T>Storage`` and ``torch.<dtype>`` become dtype markers and
  ``torch.Size`` a tuple;
* DCP metadata dataclasses (``Metadata``, ``TensorStorageMetadata``,
  ``MetadataIndex``, ...) become inert :class:`Record` objects with the same
  attributes.

Any other class from :data:`OPAQUE_PREFIXES` (enums in ``args``, say) becomes an
inert :class:`Opaque` placeholder that records its name and arguments and runs
nothing. :data:`CALL_COSTS` says, per allowed callable, what a call allocates or
copies, so that it can be checked and charged before the call runs.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import functools
import itertools
import math
import pickle
from typing import Any

import ml_dtypes
import numpy as np

# torch dtype names (the part after "torch.") -> numpy dtype.
TORCH_DTYPES = {
    "float32": np.dtype(np.float32),
    "float": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "double": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "half": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "long": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "ByteStorage": "uint8",
    "CharStorage": "int8",
    "ShortStorage": "int16",
    "IntStorage": "int32",
    "LongStorage": "int64",
    "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}
# Module prefixes whose unknown classes become inert placeholders instead of errors.
OPAQUE_PREFIXES = ("torch", "megatron", "transformer_engine", "apex")
_ITEM_BYTES = 64  # charged per element a constructor makes anew (list(range(n)): n ints)
REF_BYTES = 16  # charged per element a constructor copies from a container, or a BUILD sets


def brief(obj) -> str:
    """A short description of an untrusted value for messages; never a deep ``repr``."""
    if isinstance(obj, (str, bytes)):
        return repr(obj[:60]) + ("..." if len(obj) > 60 else "")
    if isinstance(obj, int) and obj.bit_length() > 64:
        return f"<int of {obj.bit_length()} bits>"
    if obj is None or isinstance(obj, (bool, int, float)):
        return repr(obj)
    if isinstance(obj, (list, tuple, dict, set, frozenset)):
        return f"<{type(obj).__name__} of {len(obj)}>"
    return f"<{type(obj).__name__}>"


# --------------------------------------------------------------------------- inert objects


class Record:
    """An inert stand-in for a pickled dataclass; attributes come from the pickled state."""

    _name = "Record"

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if isinstance(part, dict):
                self.__dict__.update(part)
            elif part is not None:
                self.__dict__["state"] = part

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{k}={brief(v)}" for k, v in itertools.islice(self.__dict__.items(), 8) if k != "args"
        )
        return f"{self._name}({fields})"


class _TensorProperties(Record):
    """DCP's ``TensorProperties``; pickled as
    ``(dtype, layout, requires_grad, memory_format, pin_memory)``.
    """

    _name = "TensorProperties"

    def __setstate__(self, state):
        if isinstance(state, tuple):
            self.dtype = state[0]
        else:
            super().__setstate__(state)


class Opaque:
    """An object of a class this reader does not rebuild: its name, arguments and state, inert."""

    global_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.items = args, kwargs, None, {}
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items[key] = value

    def append(self, value):
        self.items[len(self.items)] = value

    def extend(self, values):
        for value in values:
            self.append(value)

    def __repr__(self) -> str:
        return f"<{self.global_name}({', '.join(brief(a) for a in self.args[:8])})>"


class StorageType:
    """Marker for ``torch.<T>Storage``: the element dtype of an archive storage."""

    def __init__(self, dtype: str):
        self.dtype = dtype


# --------------------------------------------------------------------------- allowed callables


def int_tuple(values, what: str, max_len: int = 64) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or len(values) > max_len:
        raise pickle.UnpicklingError(f"{what} must be a short tuple of ints; got {brief(values)}")
    if not all(type(v) is int for v in values):
        raise pickle.UnpicklingError(f"{what} must be a tuple of ints; got {brief(values)}")
    return tuple(values)


def _tensor_geometry(storage, storage_offset, size, stride) -> tuple[tuple, tuple]:
    """Check that a strided view lies in its storage and repeats no element."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise pickle.UnpicklingError(f"a tensor's storage is {brief(storage)}, not a storage")
    size, stride = int_tuple(size, "tensor size"), int_tuple(stride, "tensor stride")
    if len(size) != len(stride) or type(storage_offset) is not int or storage_offset < 0:
        raise pickle.UnpicklingError(f"bad tensor geometry {size=}, {stride=}, {storage_offset=}")
    if 0 in size:
        return size, stride
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.size or any(n < 0 for n in size) or any(s < 0 for s in stride):
        raise pickle.UnpicklingError(
            f"tensor of {size=}, {stride=} at offset {storage_offset} overruns its storage "
            f"of {storage.size} elements"
        )
    # A saved tensor never repeats an element: an expanded view (a stride of 0, or more elements
    # than its storage holds) would be copied out to far more memory than the file holds.
    if math.prod(size) > storage.size - storage_offset or any(
        s == 0 for n, s in zip(size, stride) if n > 1
    ):
        raise pickle.UnpicklingError(
            f"tensor of {size=}, {stride=} repeats elements of its storage of {storage.size} "
            "(an expanded view); saved tensors do not"
        )
    return size, stride


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    """``torch._utils._rebuild_tensor_v2`` on a numpy storage: a strided view, copied."""
    size, stride = _tensor_geometry(storage, storage_offset, size, stride)
    if 0 in size:
        return np.zeros(size, storage.dtype)
    view = np.lib.stride_tricks.as_strided(
        storage[storage_offset:],
        shape=size,
        strides=[s * storage.itemsize for s in stride],
        writeable=False,
    )
    return np.array(view, copy=True)


def _rebuild_from_type(func, new_type, args, state):
    if not (  # the unpickler hands out a private partial of each allow-listed function
        isinstance(func, functools.partial)
        and func.func is _rebuild_tensor
        and not func.args
        and not func.keywords
        and type(args) is tuple
    ):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 may only wrap _rebuild_tensor_v2")
    return func(*args)


def _rebuild_parameter(data, *_):
    return data


def numeric_dtype(spec) -> np.dtype:
    """A numpy dtype of plain numbers (bool, int, float, complex): no objects, no fields."""
    if not isinstance(spec, (np.dtype, str, bytes)) or len(str(spec)) > 16:
        raise pickle.UnpicklingError(f"numpy dtype {brief(spec)} is not a plain number type")
    dtype = spec if isinstance(spec, np.dtype) else np.dtype(spec)
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise pickle.UnpicklingError(f"numpy dtype {dtype} is not a plain number type")
    return dtype


def _numpy_dtype(spec, align=False, copy=True):
    """``numpy.dtype`` for plain number types, always a fresh copy (BUILD cannot alter a
    shared one).
    """
    return np.dtype(numeric_dtype(spec), bool(align), True)


def _reconstruct_ndarray(cls, shape, dtype):
    if cls is not np.ndarray:
        raise pickle.UnpicklingError(
            f"numpy _reconstruct may only build numpy.ndarray, not {brief(cls)}"
        )
    return np.ndarray.__new__(np.ndarray, int_tuple(shape, "array shape"), numeric_dtype(dtype))


def _numpy_scalar(dtype, data=None):
    dtype = numeric_dtype(dtype)
    return np.frombuffer(data, dtype=dtype, count=1)[0] if data is not None else dtype.type()


def _get_layout(name):
    return name


def _path_string(*parts):
    """A pickled ``pathlib`` path (DCP records its checkpoint id), as a string."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a pickled path must be made of strings")
    return "/".join(parts)


def _enum_value(value):
    return value


ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "range"): range,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): tuple,
    ("builtins", "int"): int,
    ("builtins", "float"): float,
    ("builtins", "str"): str,
    ("builtins", "bool"): bool,
    ("_codecs", "encode"): codecs.encode,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _numpy_dtype,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct_ndarray,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct_ndarray,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("pathlib", "PosixPath"): _path_string,
    ("pathlib", "PurePosixPath"): _path_string,
    ("pathlib", "WindowsPath"): _path_string,
    ("pathlib", "PureWindowsPath"): _path_string,
    ("torch", "Size"): tuple,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _enum_value,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): _enum_value,
    ("torch.distributed.checkpoint.planner", "LoadItemType"): _enum_value,
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): _TensorProperties,
}
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": (
        "SavePlan",
        "WriteItem",
        "TensorWriteData",
        "ReadItem",
        "LoadPlan",
    ),
}
for _module, _names in _DCP_CLASSES.items():
    for _name in _names:
        ALLOWED[(_module, _name)] = type(_name, (Record,), {"_name": _name})


# --------------------------------------------------------------------------- what calls cost


def _sized(value, what: str) -> int:
    try:
        return len(value)
    except (TypeError, OverflowError):
        raise pickle.UnpicklingError(f"{what} of {brief(value)}: not a sized value") from None


def _cost_copy(unpickler, args, what):
    """``list(x)``, ``tuple(x)``, ``set(x)``, ``dict(x)``, ...: one entry per element of x."""
    for arg in args[1:2] if what == "defaultdict" else args[:1]:
        n = _sized(arg, what)
        each = REF_BYTES if isinstance(arg, (list, tuple, dict, set, frozenset)) else _ITEM_BYTES
        unpickler.take(n * each, f"{what}() of {n} elements")
        if what in ("set", "frozenset") and isinstance(arg, (list, tuple)):
            unpickler.check_keys(arg, what)
        elif what in ("dict", "OrderedDict", "defaultdict") and isinstance(arg, (list, tuple)):
            unpickler.check_keys([p[0] for p in arg if isinstance(p, (tuple, list)) and p], what)


def _cost_bytearray(unpickler, args, what):
    if args and isinstance(args[0], int):
        unpickler.take(args[0], f"bytearray({args[0]})")
    elif args:
        n = _sized(args[0], what)
        each = {bytes: 1, bytearray: 1, str: 4}.get(type(args[0]), _ITEM_BYTES)
        unpickler.take(n * each, f"bytearray() of {n} elements")


def _cost_str(unpickler, args, what):
    if args and not isinstance(args[0], (str, bytes, bytearray, int, float, bool, type(None))):
        raise pickle.UnpicklingError(f"str() of {brief(args[0])} is not allowed")
    if args and isinstance(args[0], (str, bytes, bytearray)):
        unpickler.take(4 * len(args[0]), f"str() of {len(args[0])} characters")


def _cost_encode(unpickler, args, what):
    if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only as (str, 'latin1')")
    unpickler.take(len(args[0]), f"_codecs.encode of {len(args[0])} characters")


def _cost_ndarray(unpickler, args, what):
    if what == "_reconstruct":
        args = args[1:]
    if not 1 <= len(args) <= 2:
        raise pickle.UnpicklingError(f"numpy {what} takes a shape and a dtype only")
    shape = int_tuple(args[0] if isinstance(args[0], (tuple, list)) else (args[0],), "array shape")
    dtype = numeric_dtype(args[1] if len(args) > 1 else "f8")
    unpickler.take(math.prod(max(n, 0) for n in shape) * dtype.itemsize, f"numpy {what}{shape}")


def _cost_tensor(unpickler, args, what):
    if what == "_rebuild_from_type_v2":
        if len(args) != 4 or type(args[2]) is not tuple:
            raise pickle.UnpicklingError("_rebuild_from_type_v2 takes (func, type, args, state)")
        args = args[2]
    if len(args) < 4:
        raise pickle.UnpicklingError(f"{what} needs (storage, offset, size, stride)")
    size, _ = _tensor_geometry(*args[:4])
    unpickler.take(_elements(size) * args[0].itemsize, f"tensor of size {size}")


def _elements(shape: tuple[int, ...]) -> int:
    """Elements of a tensor; for an empty one, as if its zero dimensions were 1 (code that
    walks its other dimensions, layer by layer say, must not find 2**40 of them)."""
    return math.prod(max(n, 1) for n in shape) if 0 in shape else math.prod(shape)


def _cost_path(unpickler, args, what):
    unpickler.take(sum(len(a) for a in args if isinstance(a, str)), "a pickled path")


CALL_COSTS = {
    list: (_cost_copy, "list"),
    tuple: (_cost_copy, "tuple"),
    set: (_cost_copy, "set"),
    frozenset: (_cost_copy, "frozenset"),
    dict: (_cost_copy, "dict"),
    collections.OrderedDict: (_cost_copy, "OrderedDict"),
    collections.defaultdict: (_cost_copy, "defaultdict"),
    bytearray: (_cost_bytearray, "bytearray"),
    str: (_cost_str, "str"),
    codecs.encode: (_cost_encode, "_codecs.encode"),
    np.ndarray: (_cost_ndarray, "ndarray"),
    _reconstruct_ndarray: (_cost_ndarray, "_reconstruct"),
    _rebuild_tensor: (_cost_tensor, "_rebuild_tensor_v2"),
    _rebuild_from_type: (_cost_tensor, "_rebuild_from_type_v2"),
    _path_string: (_cost_path, "pathlib path"),
}
