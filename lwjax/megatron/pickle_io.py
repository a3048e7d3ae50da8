"""Read pickles and ``torch.save`` archives without torch, admitting only what a checkpoint holds.

Megatron checkpoints are pickles: DCP's ``.metadata``, every chunk of a
``.distcp`` file and the legacy ``*.pt`` files are ``torch.save`` zip archives
whose ``data.pkl`` names torch classes. A plain ``pickle.load`` would run any
callable a file names, so :class:`RestrictedUnpickler` resolves globals through
an allow-list instead:

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

Any other class from ``torch``, ``megatron``, ``transformer_engine`` or ``apex``
(enums in ``args``, say) becomes an inert :class:`Opaque` placeholder that
records its name and arguments and runs nothing. Every other global (``os``,
``builtins.eval``, ``subprocess``, ...) is refused with an error naming it.

Sizes are checked before anything is allocated, so a small file cannot make the
reader allocate much more than its own size:

* a length in the pickle (``BINBYTES8``, ``BINUNICODE8``, ``BYTEARRAY8``,
  ``LONG4``, a frame, ...) may not exceed the bytes left in it;
* values nest at most :data:`MAX_DEPTH` deep without cycles, and written out as
  a tree (shared parts counted each time they appear) hold at most
  ``2**20 + 16 * len(pickle)`` entries; a tuple used as a dict key or set item
  at most :data:`MAX_KEY_ITEMS`;
* a pickle fills only the containers and records it made (APPENDS, SETITEMS,
  ADDITEMS, BUILD); BUILD on a class or function is refused;
* an archive member must lie inside the archive, a storage's size (dtype and
  element count from the pickle) must equal its member's, and members are read
  in bounded steps;
* what is not backed by bytes of the file (inflating a compressed member, what
  an allowed constructor allocates or copies, tensors cut from a storage beyond
  the storage's own size) is taken from a :class:`ByteBudget`.

Every refusal is a :class:`DamagedCheckpointError` naming the file and the rule.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import contextvars
import copy
import functools
import io
import itertools
import math
import os
import pathlib
import pickle
import pickletools
import stat
import struct
import types
import zipfile
import zlib
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
_STORAGE_DTYPES = {
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
_OPAQUE_PREFIXES = ("torch", "megatron", "transformer_engine", "apex")

# Per file, what the readers may allocate beyond the bytes they read from it. Real torch.save
# archives store every byte uncompressed and never overlap tensors in a storage, so they draw
# (almost) nothing from it: kilobytes for args and numpy RNG states. Tensors and storages are
# not limited by it but by the file's real size, whatever the model (a 70B model's 4 GB fp32
# embedding or a 100 GB flat optimizer buffer). 256 MiB caps what a hostile file can add.
DEFAULT_MAX_BYTES = 256 << 20
MAX_DEPTH = 100  # nesting of containers and records; real checkpoints stay under 20
MAX_KEY_ITEMS = 10_000  # elements of a tuple used as a dict key or set item, nested ones too
_TREE_FLOOR, _TREE_PER_BYTE = 1 << 20, 16  # entries of a loaded value written out as a tree
_ITEM_BYTES = 64  # charged per element a constructor makes anew (list(range(n)): n ints)
_REF_BYTES = 16  # charged per element a constructor copies from a container, or a BUILD sets
_CLASS_BYTES = 2048  # charged per placeholder class made for an unknown torch/Megatron global
_BYTES_PER_PICKLE_BYTE = 16  # what a pickle's own bytes back of the objects built from them
_READ_STEP = 16 << 20  # archive members are read (and inflated) this much at a time


class DamagedCheckpointError(ValueError):
    """A checkpoint file that is damaged, hostile or beyond what the readers accept.

    The one error the Megatron readers raise for bad input; its message names
    the file (and key) and what was wrong. ``lwjax convert`` prints it as one
    line and exits with status 2.
    """


# What malformed bytes make pickle, struct, zipfile, zlib and numpy raise while a file is read;
# at each reader's boundary they become a DamagedCheckpointError naming the file.
INPUT_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    OverflowError,
    MemoryError,
    RecursionError,
    struct.error,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    OSError,
)


def _brief(obj) -> str:
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


# --------------------------------------------------------------------------- byte budget


class ByteBudget:
    """What the readers of one file may allocate beyond the bytes they read from it.

    Bytes that lie in the file (a stored archive member) are checked against the
    file's size and add to the allowance; everything else a load allocates is
    taken from it. A file can thus make the reader allocate about its own size
    plus ``max_bytes``, no more.
    """

    def __init__(self, max_bytes: int, where: str):
        self.max_bytes, self.where = int(max_bytes), where
        self.read = self.used = 0

    def add_read(self, n: int) -> None:
        """Count ``n`` bytes read from the file."""
        self.read += n

    def take(self, n: int, what: str) -> None:
        """Allocate ``n`` bytes for ``what``, or refuse naming the limit."""
        left = self.max_bytes + self.read - self.used
        if n > left:
            raise DamagedCheckpointError(
                f"{self.where}: {what} needs {n} bytes, beyond the byte budget "
                f"(max_bytes={self.max_bytes}, {max(left, 0)} left); a trusted file may pass a "
                "larger max_bytes."
            )
        self.used += n


_MAX_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar(
    "lwjax_megatron_max_bytes", default=DEFAULT_MAX_BYTES
)


class byte_budget:  # lower case: used like a function, ``with byte_budget(n):``
    """Within the block, readers not given ``max_bytes`` use this per-file budget."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative int; got {max_bytes=}.")
        self.max_bytes = max_bytes

    def __enter__(self):
        self._token = _MAX_BYTES.set(self.max_bytes)

    def __exit__(self, *_):
        _MAX_BYTES.reset(self._token)


def new_budget(max_bytes: int | None, where: str) -> ByteBudget:
    """A :class:`ByteBudget` of ``max_bytes`` (``None``: the one :func:`byte_budget` set)."""
    return ByteBudget(_MAX_BYTES.get() if max_bytes is None else max_bytes, where)


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
            f"{k}={_brief(v)}" for k, v in itertools.islice(self.__dict__.items(), 8) if k != "args"
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
        return f"<{self.global_name}({', '.join(_brief(a) for a in self.args[:8])})>"


class _StorageType:
    """Marker for ``torch.<T>Storage``: the element dtype of an archive storage."""

    def __init__(self, dtype: str):
        self.dtype = dtype


# --------------------------------------------------------------------------- allowed callables


def _ints(values, what: str, max_len: int = 64) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or len(values) > max_len:
        raise pickle.UnpicklingError(f"{what} must be a short tuple of ints; got {_brief(values)}")
    if not all(type(v) is int for v in values):
        raise pickle.UnpicklingError(f"{what} must be a tuple of ints; got {_brief(values)}")
    return tuple(values)


def _tensor_geometry(storage, storage_offset, size, stride) -> tuple[tuple, tuple]:
    """Check that a strided view lies in its storage and repeats no element."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise pickle.UnpicklingError(f"a tensor's storage is {_brief(storage)}, not a storage")
    size, stride = _ints(size, "tensor size"), _ints(stride, "tensor stride")
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


def _numeric_dtype(spec) -> np.dtype:
    """A numpy dtype of plain numbers (bool, int, float, complex): no objects, no fields."""
    if not isinstance(spec, (np.dtype, str, bytes)) or len(str(spec)) > 16:
        raise pickle.UnpicklingError(f"numpy dtype {_brief(spec)} is not a plain number type")
    dtype = spec if isinstance(spec, np.dtype) else np.dtype(spec)
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise pickle.UnpicklingError(f"numpy dtype {dtype} is not a plain number type")
    return dtype


def _numpy_dtype(spec, align=False, copy=True):
    """``numpy.dtype`` for plain number types, always a fresh copy (BUILD cannot alter a
    shared one).
    """
    return np.dtype(_numeric_dtype(spec), bool(align), True)


def _reconstruct_ndarray(cls, shape, dtype):
    if cls is not np.ndarray:
        raise pickle.UnpicklingError(
            f"numpy _reconstruct may only build numpy.ndarray, not {_brief(cls)}"
        )
    return np.ndarray.__new__(np.ndarray, _ints(shape, "array shape"), _numeric_dtype(dtype))


def _numpy_scalar(dtype, data=None):
    dtype = _numeric_dtype(dtype)
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


_ALLOWED: dict[tuple[str, str], Any] = {
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
        _ALLOWED[(_module, _name)] = type(_name, (Record,), {"_name": _name})


# --------------------------------------------------------------------------- what calls cost


def _sized(value, what: str) -> int:
    try:
        return len(value)
    except (TypeError, OverflowError):
        raise pickle.UnpicklingError(f"{what} of {_brief(value)}: not a sized value") from None


def _cost_copy(unpickler, args, what):
    """``list(x)``, ``tuple(x)``, ``set(x)``, ``dict(x)``, ...: one entry per element of x."""
    for arg in args[1:2] if what == "defaultdict" else args[:1]:
        n = _sized(arg, what)
        each = _REF_BYTES if isinstance(arg, (list, tuple, dict, set, frozenset)) else _ITEM_BYTES
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
        raise pickle.UnpicklingError(f"str() of {_brief(args[0])} is not allowed")
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
    shape = _ints(args[0] if isinstance(args[0], (tuple, list)) else (args[0],), "array shape")
    dtype = _numeric_dtype(args[1] if len(args) > 1 else "f8")
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


_CALL_COSTS = {
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


# --------------------------------------------------------------------------- value shape


def _children(obj):
    """The values a loaded value holds, or ``None`` for a leaf."""
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    if isinstance(obj, dict):
        attributes = vars(obj).values() if type(obj) is collections.OrderedDict else ()
        return itertools.chain(itertools.chain.from_iterable(obj.items()), attributes)
    if isinstance(obj, (Record, Opaque, argparse.Namespace)):
        return vars(obj).values()
    return None


def _tuple_children(obj):
    return obj if type(obj) is tuple else None


def measure(root, *, where: str, max_depth: int, max_items: int, children=_children, done=None):
    """Depth and size of ``root`` written out as a tree (shared parts counted each time they
    appear), found without recursion; refuses a cycle or either limit exceeded.

    Returns:
      ``(depth, items)``.
    """
    done = {} if done is None else done  # id -> (depth, items) of finished containers
    path: set[int] = set()
    todo = [(root, False)]
    while todo:
        obj, finish = todo.pop()
        key = id(obj)
        if finish:
            path.discard(key)
            depth = items = 0
            for child in children(obj):
                d, n = done.get(id(child), (0, 1))
                depth, items = max(depth, d), items + n
            depth, items = depth + 1, items + 1
            if depth > max_depth or items > max_items:
                what = f"nests {depth} deep" if depth > max_depth else f"holds {items} entries"
                limit = max_depth if depth > max_depth else max_items
                raise DamagedCheckpointError(
                    f"{where}: a {type(obj).__name__} {what} (written out as a tree); "
                    f"the limit is {limit}"
                )
            done[key] = (depth, items)
            continue
        if key in done or children(obj) is None:
            continue
        if key in path or len(path) >= max_depth:
            raise DamagedCheckpointError(
                f"{where}: a {type(obj).__name__} "
                + ("contains itself" if key in path else f"nests over {max_depth} deep")
            )
        path.add(key)
        todo.append((obj, True))
        todo.extend((c, False) for c in children(obj) if id(c) not in done)
    return done.get(id(root), (0, 1))


# --------------------------------------------------------------------------- the unpickler


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: built-in types refuse new attributes
_Unpickler = pickle._Unpickler  # the Python unpickler: every opcode passes through our code


def _counted(opcode: bytes, length_format: str, convert):
    """A loader for an opcode that carries ``<length><bytes>``: the length is checked against
    the bytes left before anything is read or allocated.
    """
    name, width = pickletools.code2op[opcode.decode("latin1")].name, struct.calcsize(length_format)

    def load(self):
        (n,) = struct.unpack(length_format, self.read(width))
        left = self.left()
        if n < 0 or n > left:
            raise DamagedCheckpointError(
                f"{self._where}: pickle opcode {name} declares {n} bytes; only {left} are left"
            )
        self.append(convert(self, self.read(n)))

    return load


class RestrictedUnpickler(_Unpickler):
    """A pickle reader that resolves globals through an allow-list and checks sizes first
    (see the module docstring).

    Args:
      file: A ``BytesIO`` holding the pickle.
      storages: ``key -> numpy array`` for ``torch.save`` persistent storages,
        or a callable ``(key, dtype name, numel) -> array``; ``None`` when the
        pickle holds no tensors.
      where: The file or archive name used in error messages.
      budget: The :class:`ByteBudget` allocations are taken from (default: a
        new one of the current ``max_bytes``).
    """

    dispatch = dict(_Unpickler.dispatch)

    def __init__(self, file, *, storages=None, where: str = "pickle", budget=None):
        super().__init__(file)
        self._input = file
        self._size = len(file.getbuffer())
        self._storages = storages
        self._where = where
        self._budget = budget if budget is not None else new_budget(None, where)
        self._budget.add_read(_BYTES_PER_PICKLE_BYTE * self._size)
        self._opaque: dict[str, type] = {}
        self._private: dict[tuple[str, str], Any] = {}
        self._canonical: dict[int, Any] = {}
        self._keys: dict[int, tuple[int, int]] = {}  # id -> (depth, items) of checked key tuples
        self._kept: list = []  # keeps checked key tuples alive, so their ids stay theirs

    def load(self):
        value = super().load()
        limit = _TREE_FLOOR + _TREE_PER_BYTE * self._size
        measure(value, where=self._where, max_depth=MAX_DEPTH, max_items=limit)
        return value

    # ---- limits

    def left(self) -> int:
        """Bytes left to read (in the current frame, if one is open)."""
        frame = self._unframer.current_frame
        if frame is not None:
            in_frame = len(frame.getbuffer()) - frame.tell()
            if in_frame:
                return in_frame
        return self._size - self._input.tell()

    def take(self, n: int, what: str) -> None:
        self._budget.take(n, what)

    def check_keys(self, keys, what: str) -> None:
        """Tuples about to be hashed: their hash recurses without limit, so bound them first."""
        for key in keys:
            if type(key) is tuple and id(key) not in self._keys:
                measure(
                    key,
                    where=f"{self._where}: a {what} key",
                    max_depth=MAX_DEPTH,
                    max_items=MAX_KEY_ITEMS,
                    children=_tuple_children,
                    done=self._keys,
                )
                self._kept.append(key)

    def _refuse(self, message: str):
        raise DamagedCheckpointError(f"{self._where}: {message}")

    def _call(self, func, args, kwargs=None, *, new=False):
        """``func(*args)`` (or ``func.__new__``), after checking and charging what it allocates."""
        if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
            self._refuse(f"call arguments must be a tuple; got {_brief(args)}")
        if not callable(func) or (new and not isinstance(func, type)):
            self._refuse(f"cannot call {_brief(func)}")
        cost = _CALL_COSTS.get(self._canonical.get(id(func), func))
        if cost is not None:
            cost[0](self, args, cost[1])
        if new:
            return func.__new__(func, *args, **(kwargs or {}))
        return func(*args)

    # ---- opcodes that call, fill or build

    def load_reduce(self):
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._call(cls, args, new=True))

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._call(cls, args, kwargs, new=True))

    def _instantiate(self, klass, args):  # OBJ and INST
        self.append(self._call(klass, tuple(args)))

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, (Record, Opaque)):
            parts = state if type(state) is tuple else (state,)
            self.take(_REF_BYTES * sum(len(p) if type(p) is dict else 1 for p in parts), "BUILD")
            inst.__setstate__(state)
        elif (
            isinstance(inst, (argparse.Namespace, collections.OrderedDict)) and type(state) is dict
        ):
            # torch's state dicts are OrderedDicts with a _metadata attribute
            self.take(_REF_BYTES * len(state), "BUILD")
            vars(inst).update(state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        elif isinstance(inst, np.dtype):
            if not (
                type(state) is tuple
                and len(state) in (8, 9)
                and all(part is None for part in state[2:5] + state[8:])
            ):
                self._refuse(f"BUILD of a numpy dtype with fields or metadata: {_brief(state)}")
            inst.__setstate__(state)
        else:
            self._refuse(f"BUILD on {_brief(inst)} is not allowed (only on records it made)")

    def _build_array(self, array, state):
        if type(state) is not tuple or len(state) not in (4, 5):
            self._refuse(f"BUILD of a numpy array with state {_brief(state)}")
        shape, dtype, _, data = state[-4:]
        shape, dtype = _ints(shape, "array shape"), _numeric_dtype(dtype)
        if not isinstance(data, (bytes, bytearray)):
            self._refuse(f"BUILD of a numpy array from {_brief(data)}, not bytes")
        self.take(math.prod(shape) * dtype.itemsize, f"numpy array of shape {shape}")
        array.__setstate__(state)

    def load_append(self):
        value = self.stack.pop()
        self._fill_target(list, Opaque).append(value)

    def load_appends(self):
        items = self.pop_mark()
        target = self._fill_target(list, Opaque)
        target.extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self.check_keys((key,), "dict")
        self._fill_target(dict, Opaque)[key] = value

    def load_setitems(self):
        items = self._pairs("SETITEMS")
        target = self._fill_target(dict, Opaque)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_dict(self):
        items = self._pairs("DICT")
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _pairs(self, opcode: str) -> list:
        items = self.pop_mark()
        if len(items) % 2:
            self._refuse(f"pickle opcode {opcode} with an odd number of items")
        self.check_keys(items[::2], "dict")
        return items

    def load_additems(self):
        items = self.pop_mark()
        self.check_keys(items, "set")
        self._fill_target(set).update(items)

    def load_frozenset(self):
        items = self.pop_mark()
        self.check_keys(items, "frozenset")
        self.append(frozenset(items))

    def _fill_target(self, *kinds):
        target = self.stack[-1] if self.stack else None
        if not isinstance(target, kinds):
            self._refuse(f"cannot add items to {_brief(target)}")
        return target

    def load_frame(self):
        (n,) = struct.unpack("<Q", self.read(8))
        if n > self._size - self._input.tell():
            self._refuse(f"pickle opcode FRAME declares {n} bytes; only {self.left()} are left")
        self._unframer.load_frame(n)

    # ---- globals and storages

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return self._private_copy(module, name)
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(_STORAGE_DTYPES.get(name, "uint8"))
        if module == "torch" and name in TORCH_DTYPES:
            return f"torch.{name}"
        if module.split(".")[0] in _OPAQUE_PREFIXES:
            qualified = f"{module}.{name}"
            if qualified not in self._opaque:
                self.take(_CLASS_BYTES, f"a placeholder class for {qualified[:100]}")
                self._opaque[qualified] = type(name, (Opaque,), {"global_name": qualified})
            return self._opaque[qualified]
        raise pickle.UnpicklingError(
            f"{self._where}: refusing to unpickle global {module[:100]}.{name[:100]}; "
            "a Megatron checkpoint holds only tensors, containers, argparse.Namespace and "
            "torch/Megatron classes."
        )

    def _private_copy(self, module: str, name: str):
        """The allow-listed global, or, where a pickle could change it (a Python class such as
        ``argparse.Namespace``, a Python function), a copy private to this load.

        BUILD on a class or function is refused; a private copy is a second guard, so that
        nothing a pickle does to a global reaches beyond this load.
        """
        key = (module, name)
        if key not in self._private:
            target = _ALLOWED[key]
            copy = target
            if isinstance(target, type) and not target.__flags__ & _IMMUTABLE_TYPE:
                copy = type(target.__name__, (target,), {"__module__": target.__module__})
            elif isinstance(target, types.FunctionType):
                copy = functools.partial(target)
            self._private[key] = copy
            self._canonical[id(copy)] = target
        return self._private[key]

    def persistent_load(self, pid):
        if not (type(pid) is tuple and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"{self._where}: unsupported persistent id {_brief(pid)}")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"{self._where}: persistent id names no storage type")
        if type(key) is not str or len(key) > 256 or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(
                f"{self._where}: storage key {_brief(key)} or size {_brief(numel)} is malformed"
            )
        if self._storages is None:
            raise pickle.UnpicklingError(
                f"{self._where}: a tensor storage outside a torch.save archive"
            )
        return self._storages(key, storage_type.dtype, numel)


def _utf8(_, data: bytes) -> str:
    return str(data, "utf-8", "surrogatepass")


for _op, _length, _convert in (
    (pickle.BINSTRING, "<i", RestrictedUnpickler._decode_string),
    (pickle.SHORT_BINSTRING, "<B", RestrictedUnpickler._decode_string),
    (pickle.BINBYTES, "<I", lambda _, data: bytes(data)),
    (pickle.SHORT_BINBYTES, "<B", lambda _, data: bytes(data)),
    (pickle.BINBYTES8, "<Q", lambda _, data: bytes(data)),
    (pickle.BYTEARRAY8, "<Q", lambda _, data: bytearray(data)),
    (pickle.BINUNICODE, "<I", _utf8),
    (pickle.SHORT_BINUNICODE, "<B", _utf8),
    (pickle.BINUNICODE8, "<Q", _utf8),
    (pickle.LONG1, "<B", lambda _, data: pickle.decode_long(data)),
    (pickle.LONG4, "<i", lambda _, data: pickle.decode_long(data)),
):
    RestrictedUnpickler.dispatch[_op[0]] = _counted(_op, _length, _convert)
for _op, _load in (
    (pickle.REDUCE, RestrictedUnpickler.load_reduce),
    (pickle.NEWOBJ, RestrictedUnpickler.load_newobj),
    (pickle.NEWOBJ_EX, RestrictedUnpickler.load_newobj_ex),
    (pickle.BUILD, RestrictedUnpickler.load_build),
    (pickle.APPEND, RestrictedUnpickler.load_append),
    (pickle.APPENDS, RestrictedUnpickler.load_appends),
    (pickle.SETITEM, RestrictedUnpickler.load_setitem),
    (pickle.SETITEMS, RestrictedUnpickler.load_setitems),
    (pickle.DICT, RestrictedUnpickler.load_dict),
    (pickle.ADDITEMS, RestrictedUnpickler.load_additems),
    (pickle.FROZENSET, RestrictedUnpickler.load_frozenset),
    (pickle.FRAME, RestrictedUnpickler.load_frame),
):
    RestrictedUnpickler.dispatch[_op[0]] = _load


def loads(
    data: bytes,
    *,
    where: str = "pickle",
    max_bytes: int | None = None,
    budget: ByteBudget | None = None,
) -> Any:
    """Unpickle ``data`` (no tensor storages) with :class:`RestrictedUnpickler`.

    Args:
      data: The pickle.
      where: The file name used in error messages.
      max_bytes: The :class:`ByteBudget` for this pickle (``None``: the current
        default, :data:`DEFAULT_MAX_BYTES` unless :func:`byte_budget` set another).
      budget: A budget shared with other reads of the same file (overrides ``max_bytes``).

    Raises:
      DamagedCheckpointError: the pickle names a refused global, is malformed or
        exceeds a limit.
    """
    budget = budget if budget is not None else new_budget(max_bytes, where)
    try:
        return RestrictedUnpickler(io.BytesIO(data), where=where, budget=budget).load()
    except DamagedCheckpointError:
        raise
    except INPUT_ERRORS as err:
        raise DamagedCheckpointError(f"{where}: cannot unpickle: {_message(err)}") from None


def _message(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if not isinstance(err, pickle.UnpicklingError) else text


# --------------------------------------------------------------------------- torch.save archives


class _Members:
    """Reads members of one zip archive, each only after its size passed the checks."""

    def __init__(self, archive: zipfile.ZipFile, size: int, where: str, budget: ByteBudget):
        self.archive, self.size, self.where, self.budget = archive, size, where, budget
        self.stored = 0  # bytes of stored members read so far

    def read(self, name: str, expected: int | None = None, what: str = "") -> np.ndarray:
        """The member's bytes as a ``uint8`` array; ``expected`` is the size the pickle says."""
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise DamagedCheckpointError(f"{self.where}: no archive member {name}") from None
        where = f"{self.where}: {what or name}"
        if expected is not None and info.file_size != expected:
            raise DamagedCheckpointError(
                f"{where}: declares {expected} bytes; archive member {name} holds {info.file_size}"
            )
        if info.flag_bits & 0x1:
            raise DamagedCheckpointError(f"{where}: archive member {name} is encrypted")
        if info.header_offset + info.compress_size > self.size:
            raise DamagedCheckpointError(
                f"{where}: archive member {name} of {info.compress_size} bytes lies outside the "
                f"{self.size}-byte archive"
            )
        if info.compress_type == zipfile.ZIP_STORED:
            self.stored += info.compress_size
            if info.file_size != info.compress_size or self.stored > self.size:
                raise DamagedCheckpointError(
                    f"{where}: stored member {name} of {info.file_size} bytes does not fit in "
                    f"the {self.size}-byte archive beside the others (members overlap)"
                )
            self.budget.add_read(info.file_size)
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            self.budget.take(info.file_size, f"deflated member {name}")
        else:
            raise DamagedCheckpointError(
                f"{where}: archive member {name} uses compression {info.compress_type}; "
                "torch.save archives store or deflate"
            )
        out = np.empty(info.file_size, np.uint8)
        # The member's raw bytes, read as if stored; inflated here, never past the size.
        raw = copy.copy(info)
        raw.compress_type, raw.file_size, raw.CRC = zipfile.ZIP_STORED, info.compress_size, None
        inflate = zlib.decompressobj(-zlib.MAX_WBITS) if info.compress_type else None
        got, crc, buffer = 0, 0, memoryview(out)
        with self.archive.open(raw) as f:
            while inflate is None or not inflate.eof:
                data = (inflate and inflate.unconsumed_tail) or f.read(_READ_STEP)
                if not data:
                    break
                if inflate is not None:
                    data = inflate.decompress(data, info.file_size - got + 1)
                if got + len(data) > info.file_size:
                    raise DamagedCheckpointError(
                        f"{where}: archive member {name} inflates past the {info.file_size} "
                        "bytes its header declares"
                    )
                buffer[got : got + len(data)] = data
                got, crc = got + len(data), zlib.crc32(data, crc)
        if got != info.file_size or crc != info.CRC:
            raise DamagedCheckpointError(
                f"{where}: archive member {name} "
                + (
                    f"holds {got} of {info.file_size} bytes"
                    if got != info.file_size
                    else "fails its CRC"
                )
            )
        return out


def _archive_prefix(archive: zipfile.ZipFile, where: str) -> str:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise DamagedCheckpointError(
            f"{where}: expected one <name>/data.pkl in a torch.save archive; "
            f"found {pickles[:4]}{'...' if len(pickles) > 4 else ''}."
        )
    return pickles[0][: -len("data.pkl")]


def load_torch_archive(
    data: bytes | io.IOBase,
    *,
    where: str = "archive",
    max_bytes: int | None = None,
    budget: ByteBudget | None = None,
) -> Any:
    """Load a ``torch.save`` zip archive into numpy arrays and plain objects, without torch.

    Tensors become ``numpy`` arrays (``bfloat16`` via ml_dtypes) with the
    tensor's shape; storages shared by several tensors are read once.

    Args:
      data: The archive's bytes or a seekable binary file.
      where: The file name used in error messages.
      max_bytes: The per-file :class:`ByteBudget` (``None``: the current default).
      budget: A budget shared with other archives of the same file (overrides
        ``max_bytes``).

    Returns:
      The unpickled object.

    Raises:
      DamagedCheckpointError: not a readable archive (truncated, bad CRC, legacy
        format), a refused global, a storage of the wrong size, or a limit exceeded.
    """
    fileobj = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    budget = budget if budget is not None else new_budget(max_bytes, where)
    try:
        size = fileobj.seek(0, io.SEEK_END)
        fileobj.seek(0)
        archive = zipfile.ZipFile(fileobj)
    except INPUT_ERRORS as err:
        raise DamagedCheckpointError(
            f"{where}: not a torch.save zip archive ({_message(err)}); "
            "files from torch < 1.6 need reader='torch'."
        ) from None
    with archive:
        try:
            members = _Members(archive, size, where, budget)
            prefix = _archive_prefix(archive, where)
            order = f"{prefix}byteorder"
            big_endian = (
                order in set(archive.namelist())
                and archive.getinfo(order).file_size <= 16
                and members.read(order).tobytes().strip() == b"big"
            )
            pickled = members.read(f"{prefix}data.pkl").tobytes()
        except DamagedCheckpointError:
            raise
        except INPUT_ERRORS as err:
            raise DamagedCheckpointError(
                f"{where}: damaged torch.save archive: {_message(err)}"
            ) from None
        cache: dict[str, np.ndarray] = {}

        def storage(key: str, dtype_name: str, numel: int) -> np.ndarray:
            if key not in cache:
                dtype = TORCH_DTYPES[dtype_name]
                raw = members.read(f"{prefix}data/{key}", numel * dtype.itemsize, f"storage {key}")
                if big_endian and dtype.itemsize > 1:
                    raw.view(f"u{dtype.itemsize}").byteswap(inplace=True)
                cache[key] = raw.view(dtype)
            return cache[key]

        try:
            unpickler = RestrictedUnpickler(
                io.BytesIO(pickled), storages=storage, where=where, budget=budget
            )
            return unpickler.load()
        except DamagedCheckpointError:
            raise
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as err:
            raise DamagedCheckpointError(
                f"{where}: damaged torch.save archive: {_message(err)}"
            ) from None
        except INPUT_ERRORS as err:
            raise DamagedCheckpointError(f"{where}: cannot unpickle: {_message(err)}") from None


def open_checkpoint_file(path, root=None, what: str = ""):
    """Open a checkpoint file for reading, after checking it is a regular file inside ``root``.

    A FIFO would block the reader forever and a device (``/dev/zero``) read
    without end, so anything but a regular file is refused before it is
    opened; so is a symlink that leads out of the checkpoint directory ``root``.

    Raises:
      DamagedCheckpointError: naming the file (and ``what`` needed it) and the
        rule it breaks, or why it cannot be opened.
    """
    path = pathlib.Path(path)
    where = f"{path}: {what}: " if what else f"{path}: "
    try:
        if root is not None and path.is_symlink():
            target, inside = path.resolve(), pathlib.Path(root).resolve()
            if not target.is_relative_to(inside):
                raise DamagedCheckpointError(
                    f"{where}a symlink out of the checkpoint directory ({target})."
                )
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise DamagedCheckpointError(
                f"{where}not a regular file (a directory, FIFO or device)."
            )
        return open(path, "rb")
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop, before Python 3.13
        message = getattr(err, "strerror", None) or err
        raise DamagedCheckpointError(f"{where}cannot open: {message}") from None


def load_torch_file(path, root=None, *, max_bytes: int | None = None) -> Any:
    """Load a ``torch.save`` file (e.g. ``model_optim_rng.pt``) without torch;
    see :func:`load_torch_archive` (``max_bytes``) and :func:`open_checkpoint_file` (``root``).
    """
    with open_checkpoint_file(path, root) as f:
        try:
            return load_torch_archive(f, where=str(path), max_bytes=max_bytes)
        except OSError as err:
            raise DamagedCheckpointError(f"{path}: cannot read: {err.strerror or err}") from None
