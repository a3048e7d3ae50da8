"""A pickle reader for checkpoints: allow-listed globals only, sizes checked before allocating.

:class:`RestrictedUnpickler` resolves globals through
:data:`~lwjax.megatron.allow_list.ALLOWED` and passes every opcode that reads a
length, calls, fills or builds through checks of its own, so a small pickle
cannot make the reader allocate much more than its own size:

* a length in the pickle (``BINBYTES8``, ``BINUNICODE8``, ``BYTEARRAY8``,
  ``LONG4``, a frame, ...) may not exceed the bytes left in it;
* values nest at most :data:`MAX_DEPTH` deep without cycles, and written out as
  a tree (shared parts counted each time they appear) hold at most
  ``2**20 + 16 * len(pickle)`` entries; a tuple used as a dict key or set item
  at most :data:`MAX_KEY_ITEMS`;
* a pickle fills only the containers and records it made (APPENDS, SETITEMS,
  ADDITEMS, BUILD); BUILD on a class or function is refused;
* what an allowed call allocates or copies is taken from a
  :class:`~lwjax.megatron.budget.ByteBudget`.

Every other global (``os``, ``builtins.eval``, ``subprocess``, ...) is refused,
and every refusal is a :class:`~lwjax.megatron.errors.DamagedCheckpointError`
naming the file and the rule.
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import itertools
import math
import pickle
import pickletools
import struct
import types
from typing import Any

import numpy as np

from lwjax.megatron.allow_list import (
    ALLOWED,
    CALL_COSTS,
    OPAQUE_PREFIXES,
    REF_BYTES,
    STORAGE_DTYPES,
    TORCH_DTYPES,
    Opaque,
    Record,
    StorageType,
    brief,
    int_tuple,
    numeric_dtype,
)
from lwjax.megatron.budget import ByteBudget, new_budget
from lwjax.megatron.errors import INPUT_ERRORS, DamagedCheckpointError, describe_error

MAX_DEPTH = 100  # nesting of containers and records; real checkpoints stay under 20
MAX_KEY_ITEMS = 10_000  # elements of a tuple used as a dict key or set item, nested ones too
_TREE_FLOOR, _TREE_PER_BYTE = 1 << 20, 16  # entries of a loaded value written out as a tree
_CLASS_BYTES = 2048  # charged per placeholder class made for an unknown torch/Megatron global
_BYTES_PER_PICKLE_BYTE = 16  # what a pickle's own bytes back of the objects built from them


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
            self._refuse(f"call arguments must be a tuple; got {brief(args)}")
        if not callable(func) or (new and not isinstance(func, type)):
            self._refuse(f"cannot call {brief(func)}")
        cost = CALL_COSTS.get(self._canonical.get(id(func), func))
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
            self.take(REF_BYTES * sum(len(p) if type(p) is dict else 1 for p in parts), "BUILD")
            inst.__setstate__(state)
        elif (
            isinstance(inst, (argparse.Namespace, collections.OrderedDict)) and type(state) is dict
        ):
            # torch's state dicts are OrderedDicts with a _metadata attribute
            self.take(REF_BYTES * len(state), "BUILD")
            vars(inst).update(state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        elif isinstance(inst, np.dtype):
            if not (
                type(state) is tuple
                and len(state) in (8, 9)
                and all(part is None for part in state[2:5] + state[8:])
            ):
                self._refuse(f"BUILD of a numpy dtype with fields or metadata: {brief(state)}")
            inst.__setstate__(state)
        else:
            self._refuse(f"BUILD on {brief(inst)} is not allowed (only on records it made)")

    def _build_array(self, array, state):
        if type(state) is not tuple or len(state) not in (4, 5):
            self._refuse(f"BUILD of a numpy array with state {brief(state)}")
        shape, dtype, _, data = state[-4:]
        shape, dtype = int_tuple(shape, "array shape"), numeric_dtype(dtype)
        if not isinstance(data, (bytes, bytearray)):
            self._refuse(f"BUILD of a numpy array from {brief(data)}, not bytes")
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
            self._refuse(f"cannot add items to {brief(target)}")
        return target

    def load_frame(self):
        (n,) = struct.unpack("<Q", self.read(8))
        if n > self._size - self._input.tell():
            self._refuse(f"pickle opcode FRAME declares {n} bytes; only {self.left()} are left")
        self._unframer.load_frame(n)

    # ---- globals and storages

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return self._private_copy(module, name)
        if module == "torch" and name.endswith("Storage"):
            return StorageType(STORAGE_DTYPES.get(name, "uint8"))
        if module == "torch" and name in TORCH_DTYPES:
            return f"torch.{name}"
        if module.split(".")[0] in OPAQUE_PREFIXES:
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
            target = ALLOWED[key]
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
            raise pickle.UnpicklingError(f"{self._where}: unsupported persistent id {brief(pid)}")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, StorageType):
            raise pickle.UnpicklingError(f"{self._where}: persistent id names no storage type")
        if type(key) is not str or len(key) > 256 or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(
                f"{self._where}: storage key {brief(key)} or size {brief(numel)} is malformed"
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
        raise DamagedCheckpointError(f"{where}: cannot unpickle: {describe_error(err)}") from None
