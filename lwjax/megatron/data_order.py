"""A Megatron run's training batches, continued where its checkpoint stopped (numpy only).

Megatron-LM's ``MegatronPretrainingSampler`` (``--dataloader-type single``, the default)
walks the dataset in order from ``consumed_train_samples``: global batch ``b`` is dataset
samples ``[c + b G, c + (b + 1) G)`` for ``G = --global-batch-size``, and a data-parallel
rank ``r`` of ``R`` takes rows ``m M R + r M + [0, M)`` of it for micro-batch ``m`` of
size ``M``. :func:`megatron_batches` reads the settings that fix this order from the
checkpoint's ``args`` (each with where it came from) and yields the global batches as
``(tokens, labels)``, the batch form of :func:`lwjax.megatron.model.gpt_loss`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from lwjax.megatron.gpt_data import GPTSampleOrder, gpt_sample_order
from lwjax.megatron.indexed_data import IndexedData

DEFAULT_SEED = 1234
"""Megatron-LM's ``--seed``."""
DEFAULT_SPLIT = "969, 30, 1"
"""Megatron-LM's ``--split`` when ``--data-path`` is given without one."""
UNSUPPORTED = {
    "rampup_batch_size": "a batch-size ramp changes the global batch size per step",
    "phase_transition_iterations": "phases rebuild the dataset at each transition",
    "train_data_path": "per-split data paths",
    "per_split_data_args_path": "per-split data paths",
    "data_args_path": "data paths from a file",
    "sft": "the SFT dataset",
    "fim_data": "the fill-in-the-middle dataset",
    "hybrid_context_parallel": "the hybrid context-parallel sampler",
}
"""``args`` entries whose truthy value gives another order than :class:`GPTSampleOrder`'s."""
MASKS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
SETTINGS = (
    "seed",
    "seq_length",
    "global_batch_size",
    "split",
    "train_samples",
    "consumed_train_samples",
)
"""The settings the order depends on, read from ``args`` or given as arguments."""
ZERO_MEANS_UNSET = ("consumed_train_samples",)
"""Megatron-LM resumes at ``iteration`` global batches when this is stored as 0."""


@dataclasses.dataclass(frozen=True)
class MegatronBatches:
    """Global batches of a Megatron run's training data from ``consumed_train_samples`` on.

    Iterating yields ``(tokens, labels)``, both ``[global_batch_size, seq_length]`` int32,
    in sample order, up to the last whole global batch of the dataset (as Megatron's
    sampler, which drops a partial one); a run stops sooner, at its ``train_iters``.

    Attributes:
      order: The :class:`~lwjax.megatron.gpt_data.GPTSampleOrder`.
      global_batch_size: Samples per step.
      consumed_train_samples: The first sample.
      settings: ``{name: (value, source)}``: every value the order depends on and
        where it was read (``args.<name>``, ``argument``, ``default`` or how it was
        derived).
    """

    order: GPTSampleOrder
    global_batch_size: int
    consumed_train_samples: int
    settings: Mapping[str, tuple[Any, str]]

    def __len__(self) -> int:
        """Whole global batches left."""
        return (len(self.order) - self.consumed_train_samples) // self.global_batch_size

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        length = self.order.sequence_length
        for b in range(len(self)):
            first = self.consumed_train_samples + b * self.global_batch_size
            rows = [self.order.tokens(i) for i in range(first, first + self.global_batch_size)]
            text = np.stack(rows).astype(np.int32)
            yield text[:, :length], text[:, 1 : length + 1]

    def report(self) -> str:
        """One line per setting: ``name = value  (source)``."""
        width = max(map(len, self.settings))
        return "\n".join(
            f"{name:<{width}} = {value!r}  ({source})"
            for name, (value, source) in self.settings.items()
        )


def megatron_batches(
    path_prefix: str | os.PathLike | None,
    args: Mapping[str, Any],
    iteration: int = 0,
    **overrides: Any,
) -> MegatronBatches:
    """The global batches a Megatron run reads next from one indexed dataset.

    Args:
      path_prefix: The dataset's ``.bin``/``.idx`` prefix; ``None`` takes
        ``args.data_path`` (one prefix).
      args: The checkpoint's ``args``.
      iteration: Iterations done: when ``args`` store no (or a zero)
        ``consumed_train_samples``, Megatron-LM resumes at ``iteration`` global batches.
      **overrides: Replace what ``args`` say: ``seed``, ``seq_length``,
        ``global_batch_size``, ``split``, ``train_samples``, ``consumed_train_samples``.

    Raises:
      ValueError: a setting missing or malformed, a blend of several datasets (not
        supported), or an ``args`` entry that gives another order (named).
    """
    unknown = set(overrides) - set(SETTINGS)
    if unknown:
        raise TypeError(f"megatron_batches: unknown settings {sorted(unknown)}; got {SETTINGS}.")
    for name, why in UNSUPPORTED.items():
        if args.get(name):
            raise ValueError(
                f"args.{name}={args[name]!r}: lwjax follows one indexed dataset through "
                f"GPTDataset and the single sampler, not {why}."
            )
    if args.get("dataloader_type") not in (None, "single"):
        raise ValueError(
            f"args.dataloader_type={args['dataloader_type']!r}: lwjax follows the 'single' "
            "sampler (samples in order), not the cyclic one."
        )
    settings: dict[str, tuple[Any, str]] = {"data_path": _data_path(path_prefix, args)}

    def read(name: str, default: Any = None, default_source: str = "", minimum: int = 1):
        if overrides.get(name) is not None:
            settings[name] = (overrides[name], "argument")
        elif args.get(name) is not None and not (name in ZERO_MEANS_UNSET and not args[name]):
            settings[name] = (args[name], f"args.{name}")
        elif default is not None:
            settings[name] = (default, default_source)
        else:
            raise ValueError(
                f"{name}: the checkpoint's args do not store it; pass {name}= to give it."
            )
        value, source = settings[name]
        if name != "split" and (
            isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum
        ):
            raise ValueError(
                f"{name} (from {source}): expected an integer >= {minimum}; got {value!r}."
            )
        return value if name == "split" else int(value)

    seed = read("seed", DEFAULT_SEED, "default: Megatron-LM's --seed", minimum=0)
    seq_length = read("seq_length", minimum=2)
    global_batch_size = read("global_batch_size")
    split = read("split", DEFAULT_SPLIT, "default: Megatron-LM's --split with --data-path")
    train_iters = args.get("train_iters")
    derived = train_iters * global_batch_size if train_iters else None
    train_samples = read("train_samples", derived, "args.train_iters x global_batch_size")
    consumed = read(
        "consumed_train_samples",
        iteration * global_batch_size,
        f"iteration {iteration} x global_batch_size",
        minimum=0,
    )
    masks = [name for name in MASKS if args.get(name)]
    if masks:
        warnings.warn(
            f"args {', '.join(f'{m}=True' for m in masks)}: Megatron masks the loss or resets "
            "positions at end-of-document tokens; these batches hold tokens and labels only.",
            stacklevel=2,
        )
    order = gpt_sample_order(
        IndexedData(settings["data_path"][0]),
        seed=seed,
        sequence_length=seq_length,
        num_samples=train_samples,
        split=str(split),
    )
    if consumed >= len(order):
        raise ValueError(
            f"consumed_train_samples={consumed} (from {settings['consumed_train_samples'][1]}): "
            f"the dataset holds {len(order)} samples for this run; none left."
        )
    settings["epochs"] = (order.epochs, f"{len(order)} samples over the train split")
    return MegatronBatches(order, global_batch_size, consumed, settings)


def _data_path(path_prefix, args: Mapping[str, Any]) -> tuple[str, str]:
    """``(prefix, source)`` of the run's one dataset; a blend is an error."""
    stored = args.get("data_path")
    if isinstance(stored, str):
        stored = stored.split()
    if stored and len(stored) != 1:
        raise ValueError(
            f"args.data_path={list(stored)!r}: the run read a blend of datasets; lwjax follows "
            "one indexed dataset (megatron-core's BlendedDataset order is not reproduced). "
            "lwjax.megatron.gpt_data.gpt_sample_order gives one dataset's own order."
        )
    if path_prefix is not None:
        if not isinstance(path_prefix, (str, os.PathLike)):
            raise TypeError(
                f"path_prefix: expected the path prefix of one .bin/.idx pair; got "
                f"{type(path_prefix).__name__}."
            )
        return os.fspath(path_prefix), "argument"
    if not stored:
        raise ValueError(
            "path_prefix: the checkpoint's args store no data_path; pass the dataset's "
            ".bin/.idx path prefix."
        )
    return str(stored[0]), "args.data_path"
