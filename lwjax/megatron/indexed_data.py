"""Megatron's indexed datasets (``.bin``/``.idx``, as ``preprocess_data.py`` writes them),
read with numpy memory maps.

The ``.bin`` file is every sequence's tokens back to back. The ``.idx`` file, little-endian:

====================  ==========================================================
bytes                 field
====================  ==========================================================
9                     magic ``b"MMIDIDX\\x00\\x00"``
8 (uint64)            version, 1
1 (uint8)             token dtype code (:data:`TOKEN_DTYPES`)
8 (uint64)            ``S``, the number of sequences
8 (uint64)            ``D``, the number of document boundaries (documents + 1)
4 S (int32)           each sequence's length in tokens
8 S (int64)           each sequence's byte offset in ``.bin``
8 D (int64)           document boundaries: document ``d`` is sequences
                      ``[boundaries[d], boundaries[d + 1])``
====================  ==========================================================

A document is one sequence unless the text was split into sentences. Megatron's
``GPTDataset`` draws samples from sequences (:mod:`lwjax.megatron.gpt_data`).
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 9 + 8 + 1 + 8 + 8
TOKEN_DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron's dtype codes in the ``.idx`` header."""


class IndexedData:
    """One Megatron indexed dataset, memory-mapped.

    Attributes:
      path_prefix: The path without ``.bin``/``.idx``.
      dtype: The tokens' dtype.
      sequence_lengths: ``[S]`` int32, tokens per sequence.
      sequence_pointers: ``[S]`` int64, byte offset of each sequence in ``.bin``.
      document_boundaries: ``[D]`` int64, the first sequence of each document and, last,
        ``S``.
      tokens: The ``.bin`` file as one flat array of ``dtype``.
    """

    def __init__(self, path_prefix: str | os.PathLike):
        self.path_prefix = os.fspath(path_prefix)
        idx_path, bin_path = f"{self.path_prefix}.idx", f"{self.path_prefix}.bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(
                    f"{path}: no such file; a Megatron indexed dataset is a .bin and an .idx "
                    "file with the same path prefix."
                )
        with open(idx_path, "rb") as f:
            self.dtype, sequences, boundaries = _read_header(idx_path, f.read(HEADER_BYTES))
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        need = HEADER_BYTES + 12 * sequences + 8 * boundaries
        if index.size < need:
            raise ValueError(
                f"{idx_path}: truncated: the header announces {sequences} sequences and "
                f"{boundaries} document boundaries ({need} bytes), the file has {index.size}."
            )
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, np.int32, sequences, offset)
        offset += 4 * sequences
        self.sequence_pointers = np.frombuffer(index, np.int64, sequences, offset)
        offset += 8 * sequences
        self.document_boundaries = np.frombuffer(index, np.int64, boundaries, offset)
        if boundaries == 0 or self.document_boundaries[-1] != sequences:
            last = self.document_boundaries[-1] if boundaries else None
            raise ValueError(
                f"{idx_path}: the document boundaries end at {last}, not at the number of "
                f"sequences ({sequences})."
            )
        size = os.path.getsize(bin_path)
        if size % self.dtype.itemsize:
            raise ValueError(
                f"{bin_path}: {size} bytes is not a whole number of {self.dtype.name} tokens."
            )
        self.tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)
        )
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
        if sequences and (int(ends.max()) > size or int(self.sequence_pointers.min()) < 0):
            raise ValueError(
                f"{bin_path}: {size} bytes, but {idx_path} places a sequence up to byte "
                f"{int(ends.max())}."
            )

    def __len__(self) -> int:
        """The number of sequences."""
        return self.sequence_lengths.shape[0]

    def get(self, sequence: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of one sequence (to its end when ``length`` is
        ``None``), a read-only view of the memory map."""
        start = int(self.sequence_pointers[sequence]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[sequence]) - offset
        return self.tokens[start : start + length]


def _read_header(idx_path: str, header: bytes) -> tuple[np.dtype, int, int]:
    """``(token dtype, sequences, document boundaries)`` from the ``.idx`` header."""
    if len(header) < HEADER_BYTES or header[:9] != MAGIC:
        raise ValueError(
            f"{idx_path}: not a Megatron index file (expected the magic bytes {MAGIC!r} of "
            f"preprocess_data.py's .idx; got {header[:9]!r})."
        )
    version, code, sequences, boundaries = struct.unpack("<QBQQ", header[9:])
    if version != VERSION:
        raise ValueError(f"{idx_path}: index version {version}; lwjax reads version {VERSION}.")
    if code not in TOKEN_DTYPES:
        raise ValueError(
            f"{idx_path}: unknown token dtype code {code}; Megatron's codes are "
            + ", ".join(f"{c} ({d.name})" for c, d in TOKEN_DTYPES.items())
            + "."
        )
    return TOKEN_DTYPES[code], sequences, boundaries
