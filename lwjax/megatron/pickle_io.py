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
"""

from __future__ import annotations

import argparse
import codecs
import collections
import functools
import io
import math
import os
import pathlib
import pickle
import stat
import types
import zipfile
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


# What malformed pickle bytes raise inside the unpickler; each becomes a ValueError naming the file.
class DamagedCheckpointError(ValueError):
    """A checkpoint file that is damaged, hostile or beyond what the readers accept.

    The one error the Megatron readers raise for bad input; its message names
    the file (and key) and what was wrong. ``lwjax convert`` prints it as one
    line and exits with status 2.
    """


UNPICKLING_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
)
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
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k != "args")
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
        return f"<{self.global_name}{self.args!r}>"


class _StorageType:
    """Marker for ``torch.<T>Storage``: the element dtype of an archive storage."""

    def __init__(self, dtype: str):
        self.dtype = dtype


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    """``torch._utils._rebuild_tensor_v2`` on a numpy storage: a strided view, copied."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or storage_offset < 0:
        raise pickle.UnpicklingError(f"bad tensor geometry {size=}, {stride=}, {storage_offset=}")
    if 0 in size:
        return np.zeros(size, storage.dtype)
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.size or any(s < 0 for s in stride):
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
    ):
        raise pickle.UnpicklingError("_rebuild_from_type_v2 may only wrap _rebuild_tensor_v2")
    return func(*args)


def _rebuild_parameter(data, *_):
    return data


def _reconstruct_ndarray(cls, shape, dtype):
    if cls is not np.ndarray:
        raise pickle.UnpicklingError(
            f"numpy _reconstruct may only build numpy.ndarray, not {cls!r}"
        )
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _numpy_scalar(dtype, data=None):
    return np.frombuffer(data, dtype=dtype, count=1)[0] if data is not None else dtype.type()


def _get_layout(name):
    return name


def _path_string(*parts):
    """A pickled ``pathlib`` path (DCP records its checkpoint id), as a string."""
    return "/".join(str(p) for p in parts)


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
    ("numpy", "dtype"): np.dtype,
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
for _module, _names in _DCP_CLASSES.items():
    for _name in _names:
        _ALLOWED[(_module, _name)] = type(_name, (Record,), {"_name": _name})


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: built-in types refuse new attributes


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves globals through an allow-list
    (see the module docstring).

    Args:
      file: A binary file object.
      storages: ``key -> numpy array`` for ``torch.save`` persistent storages,
        or a callable ``(key, dtype name, numel) -> array``; ``None`` when the
        pickle holds no tensors.
      where: The file or archive name used in error messages.
    """

    def __init__(self, file, *, storages=None, where: str = "pickle"):
        super().__init__(file)
        self._storages = storages
        self._where = where
        self._opaque: dict[str, type] = {}
        self._private: dict[tuple[str, str], Any] = {}

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
                self._opaque[qualified] = type(name, (Opaque,), {"global_name": qualified})
            return self._opaque[qualified]
        raise pickle.UnpicklingError(
            f"{self._where}: refusing to unpickle global {module}.{name}; "
            "a Megatron checkpoint holds only tensors, containers, argparse.Namespace and "
            "torch/Megatron classes."
        )

    def _private_copy(self, module: str, name: str):
        """The allow-listed global, or, where a pickle could change it (a Python class such as
        ``argparse.Namespace``, a Python function), a copy private to this load.

        BUILD sets attributes on whatever object it is given, the class or function of a
        global included; on a private copy that changes nothing outside this load.
        """
        key = (module, name)
        if key not in self._private:
            target = _ALLOWED[key]
            if isinstance(target, type) and not target.__flags__ & _IMMUTABLE_TYPE:
                target = type(target.__name__, (target,), {"__module__": target.__module__})
            elif isinstance(target, types.FunctionType):
                target = functools.partial(target)
            self._private[key] = target
        return self._private[key]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"{self._where}: unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(
                f"{self._where}: persistent id {pid!r} names no storage type"
            )
        if self._storages is None:
            raise pickle.UnpicklingError(
                f"{self._where}: a tensor storage outside a torch.save archive"
            )
        return self._storages(str(key), storage_type.dtype, int(numel))


def loads(data: bytes, *, where: str = "pickle") -> Any:
    """Unpickle ``data`` (no tensor storages) with :class:`RestrictedUnpickler`.

    Raises:
      ValueError: the pickle names a refused global or is malformed.
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), where=where).load()
    except UNPICKLING_ERRORS as err:
        raise ValueError(f"{where}: cannot unpickle: {err}") from None


def _archive_prefix(archive: zipfile.ZipFile, where: str) -> str:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError(
            f"{where}: expected one <name>/data.pkl in a torch.save archive; found {pickles}."
        )
    return pickles[0][: -len("data.pkl")]


def load_torch_archive(data: bytes | io.IOBase, *, where: str = "archive") -> Any:
    """Load a ``torch.save`` zip archive into numpy arrays and plain objects, without torch.

    Tensors become ``numpy`` arrays (``bfloat16`` via ml_dtypes) with the
    tensor's shape; storages shared by several tensors are read once.

    Args:
      data: The archive's bytes or a seekable binary file.
      where: The file name used in error messages.

    Returns:
      The unpickled object.

    Raises:
      ValueError: not a readable archive (truncated, bad CRC, legacy format),
        a refused global, or a storage of the wrong size.
    """
    fileobj = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        archive = zipfile.ZipFile(fileobj)
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise ValueError(
            f"{where}: not a torch.save zip archive ({err}); "
            "files from torch < 1.6 need reader='torch'."
        ) from None
    with archive:
        prefix = _archive_prefix(archive, where)
        names = set(archive.namelist())
        big_endian = (
            f"{prefix}byteorder" in names and archive.read(f"{prefix}byteorder").strip() == b"big"
        )
        cache: dict[str, np.ndarray] = {}

        def storage(key: str, dtype_name: str, numel: int) -> np.ndarray:
            if key not in cache:
                dtype = TORCH_DTYPES[dtype_name]
                raw = archive.read(f"{prefix}data/{key}")
                if len(raw) != numel * dtype.itemsize:
                    raise pickle.UnpicklingError(
                        f"storage {key} holds {len(raw)} bytes; expected {numel} x {dtype.itemsize}"
                    )
                array = np.frombuffer(raw, dtype=dtype)
                if big_endian and dtype.itemsize > 1:
                    swapped = array.view(f"u{dtype.itemsize}").byteswap()
                    array = swapped.view(dtype)
                cache[key] = array
            return cache[key]

        try:
            pickled = io.BytesIO(archive.read(f"{prefix}data.pkl"))
            return RestrictedUnpickler(pickled, storages=storage, where=where).load()
        except (zipfile.BadZipFile, KeyError, OSError) as err:
            raise ValueError(f"{where}: damaged torch.save archive: {err}") from None
        except UNPICKLING_ERRORS as err:  # (KeyError: a damaged archive, above)
            raise ValueError(f"{where}: cannot unpickle: {err}") from None


def open_checkpoint_file(path, root=None, what: str = ""):
    """Open a checkpoint file for reading, after checking it is a regular file inside ``root``.

    A FIFO would block the reader forever and a device (``/dev/zero``) read
    without end, so anything but a regular file is refused before it is
    opened; so is a symlink that leads out of the checkpoint directory ``root``.

    Raises:
      ValueError: naming the file (and ``what`` needed it) and the rule it
        breaks, or why it cannot be opened.
    """
    path = pathlib.Path(path)
    where = f"{path}: {what}: " if what else f"{path}: "
    try:
        if root is not None and path.is_symlink():
            target, inside = path.resolve(), pathlib.Path(root).resolve()
            if not target.is_relative_to(inside):
                raise ValueError(f"{where}a symlink out of the checkpoint directory ({target}).")
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError(f"{where}not a regular file (a directory, FIFO or device).")
        return open(path, "rb")
    except OSError as err:
        raise ValueError(f"{where}cannot open: {err.strerror or err}") from None


def load_torch_file(path, root=None) -> Any:
    """Load a ``torch.save`` file (e.g. ``model_optim_rng.pt``) without torch;
    see :func:`load_torch_archive` and :func:`open_checkpoint_file` (``root``).
    """
    with open_checkpoint_file(path, root) as f:
        try:
            return load_torch_archive(f, where=str(path))
        except OSError as err:
            raise ValueError(f"{path}: cannot read: {err.strerror or err}") from None
