"""Built-in training data: the bytes of the Python standard library's own source files.

Every Python installation carries its standard library as ``.py`` files, so this
corpus needs no download. Tokens are bytes (vocabulary 256). Files are read in
sorted order; every ``val_every``-th file goes to validation, the rest to
training, so the split is by file and deterministic for a given Python.

The reference point for a language model on bytes is the unigram baseline:
the cross-entropy, on validation bytes, of the training byte frequencies,

.. math::

   H_1 = -\\frac{1}{N_\\text{val}} \\sum_{t} \\log \\hat p(x_t), \\qquad
   \\hat p(b) = \\frac{n_\\text{train}(b) + 1}{N_\\text{train} + 256},

in nats per byte. A model that learns anything beyond byte frequencies goes below it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
from collections.abc import Iterator

import numpy as np

VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    """Training and validation bytes.

    Attributes:
      train: Training bytes, ``uint8 [N_train]``.
      val: Validation bytes, ``uint8 [N_val]``.
      num_files: Source files read.
      root: The directory they came from.
    """

    train: np.ndarray
    val: np.ndarray
    num_files: int
    root: str

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/byte) of add-one-smoothed training byte frequencies on validation."""
        counts = np.bincount(self.train, minlength=VOCAB_SIZE) + 1.0
        log_p = np.log(counts / counts.sum())
        val_counts = np.bincount(self.val, minlength=VOCAB_SIZE)
        return float(-(val_counts * log_p).sum() / len(self.val))


def stdlib_root() -> pathlib.Path:
    """The standard library's source directory of the running Python."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def load_stdlib_corpus(
    max_bytes: int | None = None, *, val_every: int = 10, root: str | pathlib.Path | None = None
) -> ByteCorpus:
    """Read the top-level ``*.py`` files of the standard library into a byte corpus.

    Args:
      max_bytes: Stop after this many bytes in total (``None``: every file).
      val_every: File ``i`` (sorted by name) is validation when ``i % val_every == 0``.
      root: Directory to read instead of the standard library.

    Returns:
      A :class:`ByteCorpus`.

    Raises:
      ValueError: No ``.py`` files under ``root``, or too few for both splits.
    """
    root = pathlib.Path(root) if root is not None else stdlib_root()
    files = sorted(root.glob("*.py"))
    if len(files) < 2:
        raise ValueError(
            f"load_stdlib_corpus: need Python sources in {root}; found {len(files)} .py files."
        )
    if val_every < 2:
        raise ValueError(f"load_stdlib_corpus: val_every must be >= 2; got {val_every=}.")
    train, val, total, used = [], [], 0, 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        (val if i % val_every == 0 else train).append(data)
        total += len(data)
        used += 1
        if max_bytes is not None and total >= max_bytes:
            break
    if not train or not val:
        raise ValueError(
            f"load_stdlib_corpus: {used} files give no train/validation split; raise max_bytes."
        )
    as_array = lambda parts: np.frombuffer(b"".join(parts), np.uint8)  # noqa: E731
    return ByteCorpus(train=as_array(train), val=as_array(val), num_files=used, root=str(root))


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """The windows at ``starts`` as int32 ``[B, T]`` inputs and next-byte targets.

    ``inputs = data[s : s+T]`` and ``targets = data[s+1 : s+T+1]`` for each start ``s``.
    """
    index = starts[:, None] + np.arange(seq_len + 1)
    tokens = data[index].astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def train_batches(
    data: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of random windows (with replacement), reproducible from ``seed``."""
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"train_batches: need more than seq_len + 1 = {seq_len + 1} bytes; got {len(data)}."
        )
    rng = np.random.default_rng(seed)
    while True:
        yield _windows(data, rng.integers(0, len(data) - seq_len - 1, size=batch_size), seq_len)


def eval_batch(data: np.ndarray, num_windows: int, seq_len: int) -> dict[str, np.ndarray]:
    """``num_windows`` evenly spaced windows over ``data``: a fixed validation batch."""
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"eval_batch: need more than seq_len + 1 = {seq_len + 1} bytes; got {len(data)}."
        )
    starts = np.linspace(0, len(data) - seq_len - 1, num_windows).astype(np.int64)
    return _windows(data, starts, seq_len)
