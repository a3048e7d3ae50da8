"""The sample order of megatron-core's ``GPTDataset`` (numpy only).

Megatron concatenates the train split's sequences, ``E`` times over (epochs, each in its
own random order), and cuts the token stream into samples of ``sequence_length`` tokens,
each with one more token for the labels (``add_extra_token_to_sequence``): sample ``k``
is stream tokens ``[k L, (k + 1) L + 1)``. Three indices describe it, built from one
``numpy.random.RandomState(seed)`` in this order:

* the document index: the train sequences repeated ``E`` times and shuffled; when the
  last epoch is needed for fewer than 80% of an epoch's samples, the first ``E - 1``
  epochs are shuffled together and the last on its own;
* the sample index: ``[N + 1, 2]``, where sample ``k`` starts, as (position in the
  document index, token offset in that sequence) (megatron-core's C++
  ``build_sample_idx``; here a ``searchsorted`` over the stream's sequence ends);
* the shuffle index: a permutation of the ``N`` samples, with the samples of a separate
  last epoch shuffled after, among themselves.

``N = (E T - 1) // L`` for ``T`` tokens per epoch; ``E`` is the fewest epochs with
``E T >= num_samples L + 1``. Sample ``i`` of the dataset is sample ``shuffle[i]`` of the
stream.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from lwjax.megatron.indexed_data import IndexedData

FINAL_EPOCH_THRESHOLD = 0.80
"""A last epoch needed for fewer than this fraction of an epoch's samples is shuffled apart."""


def train_split(split: str, num_sequences: int) -> tuple[int, int]:
    """The train split's sequences ``[begin, end)`` for a ``--split`` string like
    ``"969, 30, 1"`` (weights, normalised; missing ones are 0).

    Raises:
      ValueError: a malformed split, or one that leaves the train split empty.
    """
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(weights) <= 3 or sum(weights) <= 0:
        raise ValueError(
            f"split={split!r}: expected up to three non-negative weights (train, valid, "
            "test), e.g. '969, 30, 1'."
        )
    normalised = (np.asarray(weights, np.float64) / np.sum(weights)).tolist()
    end = int(round(normalised[0] * float(num_sequences)))
    if end == 0:
        raise ValueError(f"split={split!r}: the train split of {num_sequences} sequences is empty.")
    return 0, end


def num_epochs(tokens_per_epoch: int, num_samples: int, sequence_length: int, extra: int) -> int:
    """The fewest epochs whose tokens cover ``num_samples`` samples."""
    needed = num_samples * sequence_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def document_index(
    documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """``documents`` repeated ``epochs`` times and shuffled in place by ``rng`` (int32); the last
    epoch shuffled on its own after the others when ``separate_final_epoch``."""
    if separate_final_epoch and epochs > 1:
        first = document_index(documents, epochs - 1, rng, False)
        return np.concatenate([first, document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents, np.int32), epochs)
    rng.shuffle(index)
    return index


def sample_index(
    sequence_lengths: np.ndarray, documents: np.ndarray, sequence_length: int, extra: int
) -> np.ndarray:
    """``[N + 1, 2]``: where each sample starts in the stream of ``documents`` (sequence ids in
    order), as (position in ``documents``, token offset), and where the last one ends.

    Sample ``k >= 1`` starts at token ``p = k L``; megatron-core's loop records the sequence
    holding token ``p + extra - 1`` and the offset ``p - start`` of ``p`` in it (so with
    ``extra = 0`` a sample ending a sequence is marked at that sequence's end, not at the
    next one's start). Integer dtype as megatron-core's: int32 when it fits.
    """
    lengths = np.asarray(sequence_lengths, np.int64)[documents]
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    count = (total - extra) // sequence_length
    token = np.arange(1, count + 1, dtype=np.int64) * sequence_length + (extra - 1)
    position = np.searchsorted(ends, token, side="right")
    offset = token - (ends[position] - lengths[position]) + (1 - extra)
    largest = max(len(documents), int(np.max(sequence_lengths, initial=0)))
    dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64
    index = np.zeros((count + 1, 2), dtype)
    index[1:, 0], index[1:, 1] = position, offset
    return index


def shuffle_index(count: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """``[0, count)`` shuffled, then ``[count, total)`` shuffled on its own (uint32, or int64
    for sizes near 2**32)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(count, dtype=dtype)
    rng.shuffle(first)
    if count == total:
        return first
    last = np.arange(count, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


@dataclasses.dataclass(frozen=True)
class GPTSampleOrder:
    """megatron-core's ``GPTDataset`` over one indexed dataset's train split.

    Attributes:
      data: The :class:`~lwjax.megatron.indexed_data.IndexedData`.
      sequence_length: Tokens per sample (``--seq-length``).
      extra: 1 when a sample carries one more token for the labels (Megatron's default).
      epochs: Epochs of the train split the samples span.
      document_index: ``[E * sequences]`` int32 sequence ids in stream order.
      sample_index: ``[N + 1, 2]`` (position in ``document_index``, offset).
      shuffle_index: ``[N]``: dataset sample ``i`` is stream sample ``shuffle_index[i]``.
    """

    data: IndexedData
    sequence_length: int
    extra: int
    epochs: int
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def __len__(self) -> int:
        return self.shuffle_index.shape[0]

    def tokens(self, i: int) -> np.ndarray:
        """Dataset sample ``i``: ``sequence_length + extra`` token ids (int64)."""
        k = int(self.shuffle_index[i])
        (first, start), (last, stop) = self.sample_index[k], self.sample_index[k + 1]
        ids = self.document_index[first : last + 1]
        if first == last:
            return self.data.get(ids[0], int(start), int(stop - start) + self.extra).astype(
                np.int64
            )
        parts = [self.data.get(ids[0], int(start))]
        parts += [self.data.get(s) for s in ids[1:-1]]
        parts.append(self.data.get(ids[-1], 0, int(stop) + self.extra))
        return np.concatenate(parts).astype(np.int64)


def gpt_sample_order(
    data: IndexedData,
    *,
    seed: int,
    sequence_length: int,
    num_samples: int,
    split: str = "969, 30, 1",
    add_extra_token_to_sequence: bool = True,
) -> GPTSampleOrder:
    """The train samples megatron-core's ``GPTDataset`` draws from ``data``.

    Args:
      data: The indexed dataset.
      seed: ``--seed`` (the dataset's ``random_seed``).
      sequence_length: ``--seq-length``.
      num_samples: Train samples the run asks for (``--train-samples``, or
        ``--train-iters`` times the global batch size): they fix the number of epochs
        and so the whole order.
      split: ``--split``.
      add_extra_token_to_sequence: As megatron-core's ``GPTDatasetConfig`` (Megatron-LM
        leaves it ``True``).
    """
    if sequence_length < 2 or num_samples < 1:
        raise ValueError(
            f"gpt_sample_order: expected sequence_length >= 2 and num_samples >= 1; got "
            f"{sequence_length=}, {num_samples=}."
        )
    extra = int(bool(add_extra_token_to_sequence))
    begin, end = train_split(split, len(data))
    documents = np.arange(begin, end, dtype=np.int32)
    tokens_per_epoch = int(np.sum(data.sequence_lengths[documents], dtype=np.int64))
    if tokens_per_epoch <= extra:
        raise ValueError(
            f"{data.path_prefix}: the train split holds {tokens_per_epoch} tokens, too few "
            "for one sample."
        )
    epochs = num_epochs(tokens_per_epoch, num_samples, sequence_length, extra)
    separate, before_final = False, 0
    if epochs > 1:
        before_final = ((epochs - 1) * tokens_per_epoch - extra) // sequence_length
        per_epoch = (tokens_per_epoch - extra) // sequence_length
        separate = num_samples - before_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    documents = document_index(documents, epochs, rng, separate)
    samples = sample_index(data.sequence_lengths, documents, sequence_length, extra)
    count = samples.shape[0] - 1
    shuffle = shuffle_index(before_final if separate else count, count, rng)
    return GPTSampleOrder(data, sequence_length, extra, epochs, documents, samples, shuffle)
