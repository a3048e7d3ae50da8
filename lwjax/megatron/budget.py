"""The per-file byte budget: what the readers may allocate beyond the bytes they read.

Bytes that lie in a file (a stored archive member, a pickle's own bytes) add to
the allowance; what is not backed by them (inflating a compressed member, what
an allowed constructor allocates or copies, tensors cut from a storage beyond
the storage's own size) is taken from a :class:`ByteBudget`. ``max_bytes`` sets
its size per call, or for a whole block with :class:`byte_budget`.
"""

from __future__ import annotations

import contextvars

from lwjax.megatron.errors import DamagedCheckpointError

# Per file, what the readers may allocate beyond the bytes they read from it. Real torch.save
# archives store every byte uncompressed and never overlap tensors in a storage, so they draw
# (almost) nothing from it: kilobytes for args and numpy RNG states. Tensors and storages are
# not limited by it but by the file's real size, whatever the model (a 70B model's 4 GB fp32
# embedding or a 100 GB flat optimizer buffer). 256 MiB caps what a hostile file can add.
DEFAULT_MAX_BYTES = 256 << 20


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
