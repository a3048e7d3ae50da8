"""Read a Megatron-Core checkpoint into global, per-parameter numpy arrays (:class:`MegatronState`).

Formats (one iteration directory, ``iter_XXXXXXX/``): ``torch_dist`` (DCP;
:mod:`lwjax.megatron.read_torch_dist`) and legacy ``torch``
(``mp_rank_<tp>/model_optim_rng.pt`` and its optimizer files;
:mod:`lwjax.megatron.read_legacy`). Each reader gives global tables in model keys;
:func:`read_megatron` checks them the same way whatever the format (floating-point
weights, matching shapes, every fp32 master rounding to its model weight, so a wrong
mapping cannot pass silently) and turns every error bad input causes into a
:class:`~lwjax.megatron.errors.DamagedCheckpointError`.
"""

from __future__ import annotations

import dataclasses
import lzma
import pathlib
import pickle
import re
import zipfile
import zlib
from typing import Any

import numpy as np

from lwjax.megatron.budget import DEFAULT_MAX_BYTES, byte_budget
from lwjax.megatron.common_state import READERS as READERS
from lwjax.megatron.common_state import Reader as Reader
from lwjax.megatron.common_state import as_dict, hyperparameters_of
from lwjax.megatron.errors import DamagedCheckpointError
from lwjax.megatron.flat_buffers import rounds_to
from lwjax.megatron.names import STATE_KINDS as STATE_KINDS
from lwjax.megatron.pickle_io import open_checkpoint_file
from lwjax.megatron.read_legacy import LAYER_WISE_OPTIMIZERS as LAYER_WISE_OPTIMIZERS
from lwjax.megatron.read_legacy import read_legacy
from lwjax.megatron.read_torch_dist import read_torch_dist

TABLES = ("masters", "momentum", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class MegatronState:
    """A Megatron GPT checkpoint as global per-parameter arrays, whatever its format and
    parallelism.

    Keys are the ``torch_dist`` model keys (stacked layers, TE names), in
    definition order.

    Attributes:
      iteration: Training iterations done.
      model: Model weights (e.g. bf16), global shapes.
      masters: fp32 master weights (empty when the checkpoint has no optimizer state).
      momentum: Muon ``momentum_buffer`` of the parameters Megatron ran Muon on.
      exp_avg: Adam first moments of the other parameters.
      exp_avg_sq: Adam second moments.
      adam_step: Adam's step count (bias correction), or ``None``.
      hyperparameters: ``{"muon": {...}, "adam": {...}}`` from the param groups.
      args: Megatron's ``args`` as a dict.
      source: Where it came from: format, directory, reader, tp, optimizer sharding.
      scheduler: Megatron-LM's ``opt_param_scheduler`` state (the schedule's
        position in samples and its stored settings), empty when not saved.
    """

    iteration: int
    model: dict[str, np.ndarray]
    masters: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    adam_step: int | None
    hyperparameters: dict[str, Any]
    args: dict[str, Any]
    source: dict[str, Any]
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)


def _is_iteration_dir(path: pathlib.Path) -> bool:
    return (path / ".metadata").exists() or any(
        p.name.startswith("mp_rank_") for p in path.iterdir()
    )


def locate_iteration(path, iteration: int | None = None) -> pathlib.Path:
    """The iteration directory of a Megatron checkpoint
    (``latest_checkpointed_iteration.txt`` unless given).

    Raises:
      ValueError: no such directory, or nothing that looks like a Megatron checkpoint.
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such checkpoint directory.")
    if iteration is not None:
        found = path / f"iter_{int(iteration):07d}"
        if not found.is_dir():
            have = sorted(p.name for p in path.glob("iter_*"))
            raise ValueError(
                f"{path}: no iteration {iteration} (iter_{int(iteration):07d}); found {have}."
            )
        return found
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.exists():
        with open_checkpoint_file(tracker, path) as f:
            text = f.read(64).decode("ascii", "replace").strip()
        if text and text != "release" and not text.isdigit():
            raise ValueError(
                f"{tracker}: expected an iteration number or 'release'; got {text[:32]!r}."
            )
        found = (
            path / ("release" if text == "release" else f"iter_{int(text):07d}") if text else None
        )
        if found is None or not found.is_dir():
            raise ValueError(f"{tracker}: names iteration {text!r}, whose directory is missing.")
        return found
    if _is_iteration_dir(path):
        return path
    candidates = sorted(p for p in path.glob("iter_*") if p.is_dir())
    if not candidates:
        raise ValueError(
            f"{path}: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, iter_*/, "
            ".metadata or mp_rank_*/)."
        )
    return candidates[-1]


# What damaged or hostile bytes make numpy, zipfile, zlib, lzma and pickle raise, besides
# ValueError: each becomes a DamagedCheckpointError at read_megatron's boundary.
INPUT_ERRORS = (
    MemoryError,  # numpy's _ArrayMemoryError too
    OverflowError,
    OSError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    RecursionError,
    NotImplementedError,
    RuntimeError,
    EOFError,
    UnicodeError,
    zipfile.BadZipFile,
    zlib.error,
    lzma.LZMAError,
    pickle.UnpicklingError,
)


def read_megatron(
    path,
    *,
    iteration: int | None = None,
    reader: Reader = "numpy",
    verify: bool = True,
    weights_only: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> MegatronState:
    """Read a Megatron-Core GPT checkpoint into a :class:`MegatronState`.

    Args:
      path: The checkpoint directory (with ``latest_checkpointed_iteration.txt``)
        or one iteration directory.
      iteration: Which iteration; defaults to the latest.
      reader: ``"numpy"`` (no torch; restricted unpickler) or ``"torch"``
        (torch's loaders, after ``.metadata`` passed the restricted unpickler
        and with ``torch.load(weights_only=True)``). Both give identical arrays.
      verify: Check that every fp32 master rounds to its stored model weight.
      weights_only: Read the model weights alone, without optimizer state.
        Otherwise a legacy checkpoint whose optimizer file is missing or empty
        although its args or files say it was saved with one is an error.
      max_bytes: Per file, what the reader may allocate beyond the bytes it
        reads from the file (256 MiB; see
        :class:`~lwjax.megatron.budget.ByteBudget`). Tensors are bounded by
        the file's real size instead, so real checkpoints of any size fit.

    Returns:
      The global per-parameter state.

    Raises:
      DamagedCheckpointError: (a ``ValueError``) an unreadable, incomplete,
        inconsistent or hostile checkpoint; the message names the file or key
        and what was expected. No other exception escapes for bad input.
    """
    if reader not in READERS:
        raise ValueError(f"read_megatron: reader must be one of {READERS}; got {reader=}.")
    budget = byte_budget(max_bytes)
    try:
        with budget:
            return _read_megatron(path, iteration, reader, verify, weights_only)
    except DamagedCheckpointError:
        raise
    except ValueError as err:
        raise DamagedCheckpointError(str(err)) from None
    except INPUT_ERRORS as err:
        raise DamagedCheckpointError(
            f"{path}: damaged or hostile checkpoint ({type(err).__name__}: {err})"
        ) from None
    except BaseException as err:  # torch's DCP CheckpointException is a BaseException
        if type(err).__name__ != "CheckpointException":
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DamagedCheckpointError(f"{path}: torch could not read it: {first}") from None


def _read_megatron(
    path, iteration: int | None, reader: Reader, verify: bool, weights_only: bool
) -> MegatronState:
    """:func:`read_megatron` without its error boundary."""
    directory = locate_iteration(path, iteration)
    if (directory / ".metadata").exists():
        state = read_torch_dist(directory, reader)
        if weights_only:
            state.update(masters={}, momentum={}, exp_avg={}, exp_avg_sq={}, groups=[], steps=[])
    else:
        state = read_legacy(directory, reader, weights_only)
    _check_tables(state, directory)
    if verify:
        _check_masters(state, str(directory))
    for kind in TABLES:  # every table in model (definition) order
        state[kind] = {k: state[kind][k] for k in state["model"] if k in state[kind]}
    hyper, adam_step = hyperparameters_of(state["groups"])
    if adam_step is None and state.get("steps"):
        adam_step = max(state["steps"])
    return MegatronState(
        iteration=_iteration_done(state, directory),
        model=state["model"],
        masters=state["masters"],
        momentum=state["momentum"],
        exp_avg=state["exp_avg"],
        exp_avg_sq=state["exp_avg_sq"],
        adam_step=adam_step,
        hyperparameters=hyper,
        args=state["args"],
        source={**state["source"], "directory": str(directory), "reader": reader},
        scheduler=as_dict(state["common"].get("opt_param_scheduler")),
    )


def _check_tables(state: dict, directory: pathlib.Path) -> None:
    """Model weights exist and are floating point; every table matches their shapes."""
    if not state["model"]:
        raise ValueError(f"{directory}: the checkpoint holds no model weights.")
    for key, weight in state["model"].items():
        if not np.issubdtype(weight.dtype, np.floating) and weight.dtype.name != "bfloat16":
            raise ValueError(
                f"{directory}: {key}: model weights must be floating point; got {weight.dtype}."
            )
    for kind in TABLES:
        for key, value in state[kind].items():
            if value.shape != state["model"][key].shape:
                raise ValueError(
                    f"{directory}: {key}: {kind} shape {value.shape} differs from the model's "
                    f"{state['model'][key].shape}."
                )


def _check_masters(state: dict, where: str) -> None:
    """Every fp32 master rounds to its stored model weight."""
    bad = [
        k
        for k, m in state["masters"].items()
        if k in state["model"] and not rounds_to(m, state["model"][k])
    ]
    if bad:
        raise ValueError(
            f"{where}: fp32 masters do not round to the stored model weights for {bad}; "
            "the optimizer state does not belong to these weights."
        )


def _iteration_done(state: dict, directory: pathlib.Path) -> int:
    """The stored iteration, else the one in the directory's name, else 0."""
    iteration_done = state["iteration"]
    if iteration_done is None:
        match = re.match(r"iter_(\d+)$", directory.name)
        iteration_done = int(match.group(1)) if match else 0
    return int(iteration_done)
