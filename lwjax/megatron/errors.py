"""The one error the Megatron readers raise for bad input, and the errors it replaces.

Malformed bytes make pickle, struct, zipfile, zlib and numpy raise many kinds of
error; each reader catches :data:`INPUT_ERRORS` at its boundary and raises a
:class:`DamagedCheckpointError` naming the file instead.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
import zlib


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


def describe_error(err: BaseException) -> str:
    """The first line of ``err``'s message (at most 300 characters), after its type name
    (left out for a pickle error, whose message says enough)."""
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if not isinstance(err, pickle.UnpicklingError) else text
