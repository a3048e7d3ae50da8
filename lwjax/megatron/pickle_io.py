"""Read ``torch.save`` files without torch: the zip archive, its storages and its pickle.

Megatron checkpoints are ``torch.save`` zip archives: DCP's ``.metadata``, every
chunk of a ``.distcp`` file and the legacy ``*.pt`` files. Each holds one
``<name>/data.pkl``, read with :class:`~lwjax.megatron.unpickler.RestrictedUnpickler`,
and one member per storage under ``<name>/data/``, from which tensors become
numpy arrays. Before anything is allocated:

* a checkpoint file must be a regular file, and a symlink may not lead out of
  its checkpoint directory;
* an archive member must lie inside the archive, a storage's size (dtype and
  element count from the pickle) must equal its member's, and members are read
  in bounded steps;
* inflating a compressed member is taken from the file's
  :class:`~lwjax.megatron.budget.ByteBudget`, and never goes past the size its
  header declares.

Every refusal is a :class:`~lwjax.megatron.errors.DamagedCheckpointError`
naming the file and the rule.
"""

from __future__ import annotations

import copy
import io
import os
import pathlib
import stat
import zipfile
import zlib
from typing import Any

import numpy as np

from lwjax.megatron.allow_list import TORCH_DTYPES
from lwjax.megatron.budget import ByteBudget, new_budget
from lwjax.megatron.errors import INPUT_ERRORS, DamagedCheckpointError, describe_error
from lwjax.megatron.unpickler import RestrictedUnpickler

_READ_STEP = 16 << 20  # archive members are read (and inflated) this much at a time


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
            f"{where}: not a torch.save zip archive ({describe_error(err)}); "
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
                f"{where}: damaged torch.save archive: {describe_error(err)}"
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
                f"{where}: damaged torch.save archive: {describe_error(err)}"
            ) from None
        except INPUT_ERRORS as err:
            raise DamagedCheckpointError(
                f"{where}: cannot unpickle: {describe_error(err)}"
            ) from None


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
