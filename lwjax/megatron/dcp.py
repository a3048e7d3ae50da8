"""torch.distributed.checkpoint (DCP) directories: read them with numpy or torch, write them
with torch.

A DCP checkpoint directory (Megatron's ``torch_dist`` format) holds:

* ``.metadata``: a pickled ``Metadata``. ``state_dict_metadata`` maps every key
  to a tensor entry (dtype, global shape, chunks given by offsets and sizes)
  or to a bytes entry (a pickled Python object); ``storage_data`` maps each
  ``(key, chunk offsets)`` to ``(file, byte offset, byte length)``;
* ``__<rank>_<thread>.distcp``: the chunks, each a standalone ``torch.save``
  zip archive;
* ``metadata.json``: Megatron's backend record.

:func:`load_dcp` assembles global arrays from their chunks with numpy only
(through :mod:`lwjax.megatron.pickle_io`); :func:`load_dcp_torch` does the same
through torch's own loader (:mod:`lwjax.megatron.torch_io`), and both return the same
bytes. :func:`save_dcp_torch` writes one chunk per tensor with torch.

Before a byte is read, :func:`read_dcp_index` checks that ``.metadata`` is not
larger than the files it indexes could account for, then what it says against
the files: every storage file is a regular file in the directory, every
byte range lies inside its file and overlaps no other, every chunk lies inside
its tensor, holds at most its range's bytes, and the chunks of a tensor add up to
exactly its elements. A global tensor is therefore never larger than the bytes
that fill it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import pathlib
from typing import Any

import numpy as np

from lwjax.megatron.allow_list import TORCH_DTYPES, Opaque
from lwjax.megatron.budget import new_budget
from lwjax.megatron.errors import INPUT_ERRORS, DamagedCheckpointError
from lwjax.megatron.pickle_io import load_torch_archive, open_checkpoint_file
from lwjax.megatron.torch_io import import_torch, to_numpy, to_torch, torch_load
from lwjax.megatron.unpickler import loads


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor.

    Attributes:
      offsets: Start of the piece in the global tensor, per dimension.
      sizes: Shape of the piece.
      file: The ``.distcp`` file name.
      start: Byte offset of the piece's archive in the file.
      length: Byte length of the archive.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A global tensor of a DCP checkpoint: its dtype name, shape and chunks."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclasses.dataclass(frozen=True)
class DcpIndex:
    """What ``.metadata`` says: tensors and byte objects, and where their bytes lie.

    Attributes:
      directory: The checkpoint directory.
      tensors: ``key -> TensorEntry``, in ``.metadata`` order.
      objects: ``key -> (file, start, length)`` of pickled objects.
      order: Every key, tensors and objects, in ``.metadata`` order.
    """

    directory: pathlib.Path
    tensors: dict[str, TensorEntry]
    objects: dict[str, tuple[str, int, int]]
    order: tuple[str, ...]


def _dtype_name(dtype) -> str:
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in TORCH_DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype[:40] if name else type(dtype).__name__}")
    return name


def _int_tuple(values, what: str) -> tuple[int, ...]:
    if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
        raise ValueError(f"{what} must be a tuple of ints; got a {type(values).__name__}")
    return tuple(values)


def _location(info, what: str) -> tuple[str, int, int]:
    """``(file, start, length)`` of a ``_StorageInfo``, with the file a plain name."""
    name, start, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    if type(name) is not str or type(start) is not int or type(length) is not int:
        raise ValueError(f"{what}: a malformed storage entry")
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"{what}: storage file {name[:100]!r} is outside the checkpoint")
    if start < 0 or length < 0:
        raise ValueError(f"{what}: a negative byte range ({start}, {length})")
    return name, start, length


# What a .metadata may hold beyond the size of the storage files beside it (see below).
INDEX_FLOOR_BYTES = 1 << 20


def _check_index_size(meta_path: pathlib.Path, size: int) -> None:
    """Refuse, before parsing, a ``.metadata`` larger than the files beside it account for.

    Each chunk or object it lists is a ``torch.save`` archive of over 1 KiB in a
    storage file of the directory, and takes a few hundred bytes of the index:
    a real index is a fraction of its storage (the fixtures: 2-10 %). One past
    :data:`INDEX_FLOOR_BYTES` plus the storage's size (e.g. 200,000 overlapping
    chunks over a few kilobytes) is refused at once, not after minutes and
    gigabytes of parsing.
    """
    storage = sum(
        entry.stat(follow_symlinks=False).st_size
        for entry in os.scandir(meta_path.parent)
        if entry.is_file(follow_symlinks=False) and entry.name != meta_path.name
    )
    if size > INDEX_FLOOR_BYTES + storage:
        raise DamagedCheckpointError(
            f"{meta_path}: {size} bytes of DCP metadata, more than the {storage} bytes of the "
            f"files beside it plus {INDEX_FLOOR_BYTES} can account for (each entry indexes an "
            "archive of over 1 KiB); a damaged or hostile index, or storage files are missing."
        )


def read_dcp_index(directory, *, max_bytes: int | None = None) -> DcpIndex:
    """Read and check a DCP ``.metadata`` file without torch (the checks: module docstring).

    Args:
      directory: The checkpoint directory.
      max_bytes: The byte budget of the ``.metadata`` pickle
        (:class:`~lwjax.megatron.budget.ByteBudget`; ``None``: the current default).

    Raises:
      DamagedCheckpointError: no ``.metadata``, an unreadable one, a chunk
        without storage, or sizes and byte ranges the files cannot hold.
    """
    directory = pathlib.Path(directory)
    meta_path = directory / ".metadata"
    with open_checkpoint_file(meta_path, directory, "DCP metadata") as f:
        try:
            _check_index_size(meta_path, os.fstat(f.fileno()).st_size)
            raw = f.read()
        except OSError as err:
            raise DamagedCheckpointError(
                f"{meta_path}: cannot read DCP metadata: {err.strerror or err}"
            ) from None
    budget = new_budget(max_bytes, str(meta_path))
    meta = loads(raw, where=str(meta_path), budget=budget)
    try:
        index = _index(directory, meta, budget)
    except DamagedCheckpointError:
        raise
    except INPUT_ERRORS as err:
        raise DamagedCheckpointError(f"{meta_path}: {err}.") from None
    _check_ranges(index)
    return index


def _index(directory: pathlib.Path, meta, budget) -> DcpIndex:
    entries = getattr(meta, "state_dict_metadata", None)
    storage_data = getattr(meta, "storage_data", None)
    if type(entries) is not dict or type(storage_data) is not dict:
        raise ValueError("not a DCP Metadata record")
    storage = {}
    for idx, info in storage_data.items():
        fqn, offset = getattr(idx, "fqn", None), getattr(idx, "offset", None)
        if type(fqn) is not str:
            raise ValueError("a storage entry without a key")
        storage[(fqn, None if offset is None else _int_tuple(offset, f"{fqn}: offset"))] = info
    tensors, objects = {}, {}
    for key, entry in entries.items():
        if type(key) is not str:
            raise ValueError(f"a key that is a {type(key).__name__}, not a string")
        if type(entry).__name__ == "BytesStorageMetadata":
            info = storage.get((key, None))
            if info is None:
                raise ValueError(f"object {key!r} has no storage entry")
            objects[key] = _location(info, f"object {key!r}")
            continue
        where = f"tensor {key!r}"
        dtype = _dtype_name(getattr(getattr(entry, "properties", None), "dtype", None))
        shape = _int_tuple(getattr(entry, "size", None), f"{where}: size")
        chunks, numel = [], 0
        for chunk in getattr(entry, "chunks", None) or ():
            offsets = _int_tuple(getattr(chunk, "offsets", None), f"{where}: chunk offsets")
            sizes = _int_tuple(getattr(chunk, "sizes", None), f"{where}: chunk sizes")
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape))
            ):
                raise ValueError(f"{where}: chunk {sizes} at {offsets} lies outside {shape}")
            info = storage.get((key, offsets))
            if info is None:
                raise ValueError(f"{where}: chunk at {offsets} has no storage entry")
            if getattr(info, "transform_descriptors", None):
                raise ValueError(f"{where}: chunk at {offsets} uses storage transforms")
            chunk = Chunk(offsets, sizes, *_location(info, f"{where}: chunk at {offsets}"))
            if math.prod(sizes) * TORCH_DTYPES[dtype].itemsize > chunk.length:
                raise ValueError(
                    f"{where}: chunk {sizes} of {dtype} needs more than its {chunk.length} bytes"
                )
            chunks.append(chunk)
            numel += math.prod(sizes)
        if numel == 0:  # no bytes bound its shape: charged as if its zero dimensions were 1
            budget.take(
                math.prod(max(n, 1) for n in shape) * TORCH_DTYPES[dtype].itemsize,
                f"{where}: an empty tensor of shape {shape}",
            )
        if numel != math.prod(shape):
            raise ValueError(
                f"{where}: chunks hold {numel} elements; the tensor {shape} has "
                f"{math.prod(shape)} ("
                + ("chunks overlap" if numel > math.prod(shape) else "a rank's file is missing")
                + ")"
            )
        tensors[key] = TensorEntry(key, dtype, shape, tuple(chunks))
    return DcpIndex(directory, tensors, objects, tuple(entries))


def _check_ranges(index: DcpIndex) -> None:
    """Each storage file is a regular file in the directory and holds its byte ranges, which
    do not overlap.
    """
    ranges = collections.defaultdict(list)
    for key, (name, start, length) in index.objects.items():
        ranges[name].append((start, length, key))
    for key, entry in index.tensors.items():
        for chunk in entry.chunks:
            ranges[chunk.file].append((chunk.start, chunk.length, key))
    for name, spans in ranges.items():
        path = index.directory / name
        with open_checkpoint_file(path, index.directory, spans[0][2]) as f:
            size = os.fstat(f.fileno()).st_size
        end, previous = 0, None
        for start, length, key in sorted(spans):
            if start + length > size:
                raise DamagedCheckpointError(
                    f"{path}: {key}: truncated; expected {length} bytes at offset {start}, "
                    f"but the file has {size}."
                )
            if start < end:
                raise DamagedCheckpointError(
                    f"{path}: {key}: bytes {start}..{start + length} overlap those of {previous}."
                )
            end, previous = start + length, key


class _Files:
    """Open ``.distcp`` files once; read byte ranges with bounds checks."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.handles: dict[str, Any] = {}

    def read(self, name: str, start: int, length: int, what: str) -> bytes:
        if name not in self.handles:
            self.handles[name] = open_checkpoint_file(self.directory / name, self.directory, what)
        f = self.handles[name]
        f.seek(start)
        data = f.read(length)
        if len(data) != length:
            raise DamagedCheckpointError(
                f"{self.directory / name}: {what}: truncated; expected {length} bytes "
                f"at offset {start}, got {len(data)}."
            )
        return data

    def close(self):
        for f in self.handles.values():
            f.close()


def _unwrap(obj):
    """Megatron stores a ShardedObject as a one-element list; return the element."""
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj


def load_dcp(directory, keys=None, *, max_bytes: int | None = None) -> dict[str, Any]:
    """Load a DCP checkpoint's tensors (global numpy arrays) and objects without torch.

    Args:
      directory: The checkpoint directory (with ``.metadata``).
      keys: Keys to load; ``None`` loads everything.
      max_bytes: The byte budget per file (``.metadata`` and each ``.distcp``;
        :class:`~lwjax.megatron.budget.ByteBudget`); ``None``: the current default.

    Returns:
      ``key -> np.ndarray`` for tensors (chunks from every rank's file merged)
      and ``key -> object`` for byte entries (one-element lists unwrapped), in
      ``.metadata`` order.

    Raises:
      DamagedCheckpointError: a missing or truncated file, a damaged chunk,
        chunks that do not tile the tensor, a refused pickle global or a limit
        exceeded; the message names the file and key.
    """
    index = read_dcp_index(directory, max_bytes=max_bytes)
    wanted = None if keys is None else set(keys)
    files = _Files(index.directory)
    budgets: dict[str, Any] = {}

    def load(name: str, start: int, length: int, key: str, where: str):
        if name not in budgets:
            budgets[name] = new_budget(max_bytes, str(index.directory / name))
        data = files.read(name, start, length, key)
        return load_torch_archive(data, where=where, budget=budgets[name])

    out: dict[str, Any] = {}
    try:
        for key in index.order:
            if wanted is not None and key not in wanted:
                continue
            if key in index.objects:
                name, start, length = index.objects[key]
                out[key] = _unwrap(
                    load(name, start, length, key, f"{index.directory / name}: {key}")
                )
                continue
            entry = index.tensors[key]
            dtype = TORCH_DTYPES[entry.dtype]
            # Both fit: the index checked that the chunks' bytes, which lie in the files, hold
            # every element of the tensor.
            array = np.empty(entry.shape, dtype)
            covered = np.zeros(entry.shape, np.bool_)
            for chunk in entry.chunks:
                where = f"{index.directory / chunk.file}: {key} chunk at {chunk.offsets}"
                piece = load(chunk.file, chunk.start, chunk.length, key, where)
                if (
                    not isinstance(piece, np.ndarray)
                    or piece.shape != chunk.sizes
                    or piece.dtype != dtype
                ):
                    got = (
                        getattr(piece, "shape", type(piece).__name__),
                        getattr(piece, "dtype", None),
                    )
                    raise DamagedCheckpointError(
                        f"{where}: expected a {entry.dtype} array of shape {chunk.sizes}; "
                        f"got {got}."
                    )
                region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                if covered[region].any():
                    raise DamagedCheckpointError(f"{where}: chunks overlap.")
                array[region] = piece
                covered[region] = True
            if not covered.all():
                missing = int(covered.size - covered.sum())
                raise DamagedCheckpointError(
                    f"{index.directory}: {key}: chunks leave {missing} of {math.prod(entry.shape)} "
                    "elements unwritten; a rank's file is missing from the metadata."
                )
            out[key] = array
    finally:
        files.close()
    return out


def load_dcp_torch(directory, keys=None) -> dict[str, Any]:
    """Load a DCP checkpoint through torch (``dcp.load``); same output as :func:`load_dcp`.

    Torch reads ``.metadata`` with a plain ``pickle.load``, which runs whatever
    code a crafted file names; so the file is first read with lwjax's
    restricted unpickler (:func:`read_dcp_index`), which refuses anything but
    the metadata's own classes, and torch only reads a file that passed. Byte
    entries are read with ``torch.load(weights_only=True)``.
    """
    import io
    import warnings

    import_torch("reader='torch'", reading=True)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = pathlib.Path(directory)
    read_dcp_index(directory)  # refuses a .metadata that would run code in torch's pickle.load
    reader = FileSystemReader(str(directory))
    meta = reader.read_metadata()
    wanted = None if keys is None else set(keys)
    tensors, out = {}, {}
    for key, entry in meta.state_dict_metadata.items():
        if wanted is not None and key not in wanted or isinstance(entry, BytesStorageMetadata):
            continue
        tensors[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    for key, entry in meta.state_dict_metadata.items():
        if wanted is not None and key not in wanted:
            continue
        if isinstance(entry, BytesStorageMetadata):
            info = next(v for k, v in meta.storage_data.items() if k.fqn == key)
            with open(directory / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            out[key] = _unwrap(
                torch_load(io.BytesIO(data), where=f"{directory / info.relative_path}: {key}")
            )
        else:
            out[key] = to_numpy(tensors[key])
    return out


def save_dcp_torch(directory, tensors: dict[str, np.ndarray], objects: dict[str, Any]) -> None:
    """Write a DCP checkpoint with torch: one chunk per tensor, objects as byte entries.

    Args:
      directory: Target directory (created; must be empty or absent).
      tensors: ``key -> numpy array`` (global).
      objects: ``key -> picklable object``; stored the way Megatron stores a
        ShardedObject (as a one-element list).
    """
    import warnings

    import_torch("writing torch_dist")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    for key, value in objects.items():
        if isinstance(value, Opaque):
            raise ValueError(
                f"{key}: cannot write an object this reader could not rebuild ({value!r})."
            )
    state: dict[str, Any] = {key: to_torch(value) for key, value in tensors.items()}
    state.update({key: [value] for key, value in objects.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            state,
            storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True),
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
