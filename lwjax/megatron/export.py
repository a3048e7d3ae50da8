"""lwjax training state -> a Megatron checkpoint: :func:`logical_to_megatron` builds the
:class:`~lwjax.megatron.state.MegatronState`, :func:`save_torch_dist` writes it as a
``torch_dist`` checkpoint with per-parameter optimizer keys (Megatron's
``fully_reshardable`` naming, torch needed) and :func:`save_safetensors` as one file of
global weights plus ``optimizer.state.fp32_param.<key>`` masters,
``optimizer.state.momentum_buffer.<key>`` Muon momenta and
``optimizer.state.exp_avg[_sq].<key>`` Adam moments.

The records stored beside the tensors (args, param groups, scheduler) are built in
:mod:`lwjax.megatron.export_records`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from lwjax.megatron.export_records import common_state, extra_state_objects
from lwjax.megatron.gpt import GPTConfig, keys_from_tree
from lwjax.megatron.state import MegatronState

FP32_PREFIX = "optimizer.state.fp32_param."
MOMENTUM_PREFIX = "optimizer.state.momentum_buffer."
EXP_AVG_PREFIX = "optimizer.state.exp_avg."
EXP_AVG_SQ_PREFIX = "optimizer.state.exp_avg_sq."


def _adam_state(elementwise):
    """The ``ScaleByAdamState`` inside an elementwise optax state
    (a chain's tuple or the state itself).
    """
    if hasattr(elementwise, "mu") and hasattr(elementwise, "nu"):
        return elementwise
    if isinstance(elementwise, tuple):
        for part in elementwise:
            if (found := _adam_state(part)) is not None:
                return found
    return None


def logical_to_megatron(
    params,
    logical,
    *,
    iteration: int | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    args: Mapping[str, Any] | None = None,
    scheduler: Mapping[str, Any] | None = None,
) -> MegatronState:
    """Inverse of :func:`~lwjax.megatron.megatron_import.megatron_to_logical`: a
    :class:`MegatronState` from GPT parameters and logical state.

    Args:
      params: The GPT parameter tree (nested dicts of Megatron key parts).
      logical: Its :class:`~lwjax.logical.LogicalState`, Adam as elementwise state.
      iteration: Iterations done; defaults to ``logical.count``.
      hyperparameters: ``{"muon": {...}, "adam": {...}}`` for the param groups.
      args: Megatron ``args`` to record.
      scheduler: Megatron-LM's ``opt_param_scheduler`` state to record.

    Raises:
      ValueError: an elementwise state without Adam moments.
    """
    to_np = lambda x: None if x is None else np.asarray(x)  # noqa: E731
    model = {k: to_np(v) for k, v in keys_from_tree(params).items()}
    masters = {k: to_np(v) for k, v in keys_from_tree(logical.masters).items()}
    momenta = {k: to_np(v) for k, v in keys_from_tree(logical.momenta).items() if v is not None}
    adam = _adam_state(logical.elementwise)
    if adam is None and len(momenta) < len(model):
        raise ValueError(
            "logical_to_megatron: the elementwise state has no Adam moments (mu, nu); "
            "Megatron's optimizer state cannot be written."
        )
    exp_avg = (
        {k: to_np(v) for k, v in keys_from_tree(adam.mu).items() if v is not None} if adam else {}
    )
    exp_avg_sq = (
        {k: to_np(v) for k, v in keys_from_tree(adam.nu).items() if v is not None} if adam else {}
    )
    count = int(np.asarray(logical.count))
    return MegatronState(
        iteration=count if iteration is None else int(iteration),
        model=model,
        masters=masters,
        momentum=momenta,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        adam_step=int(np.asarray(adam.count)) if adam is not None else None,
        hyperparameters=dict(hyperparameters or {}),
        args=dict(args or {}),
        source={"format": "lwjax"},
        scheduler=dict(scheduler or {}),
    )


def megatron_tensors(state: MegatronState) -> dict[str, np.ndarray]:
    """The ``torch_dist`` tensors of a state: model keys plus per-parameter optimizer keys."""
    tensors = dict(state.model)
    for key in state.model:
        if key in state.momentum:
            tensors[FP32_PREFIX + key] = state.masters[key]
            tensors[MOMENTUM_PREFIX + key] = state.momentum[key]
        elif key in state.masters:
            tensors["optimizer.state.param." + key] = state.masters[key]
            if key in state.exp_avg:
                tensors[EXP_AVG_PREFIX + key] = state.exp_avg[key]
                tensors[EXP_AVG_SQ_PREFIX + key] = state.exp_avg_sq[key]
    return tensors


def save_torch_dist(
    state: MegatronState, directory, *, config: GPTConfig | None = None, overwrite: bool = False
) -> pathlib.Path:
    """Write ``state`` as a Megatron ``torch_dist`` checkpoint (needs torch).

    Layout: ``<directory>/latest_checkpointed_iteration.txt`` and
    ``<directory>/iter_<N>/`` with ``.metadata``, ``__0_0.distcp`` and
    ``metadata.json``. Model weights are global, stacked tensors; optimizer
    state uses per-parameter keys (Megatron's ``fully_reshardable`` naming:
    Muon ``optimizer.state.{fp32_param,momentum_buffer}.<key>``, Adam
    ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``); the common state
    (args, iteration, param groups, content metadata) is the ``common_state``
    object.

    Returns:
      The iteration directory.

    Raises:
      ValueError: ``directory`` holds a checkpoint already (without ``overwrite``).
    """
    from lwjax.megatron.dcp import save_dcp_torch

    directory = pathlib.Path(directory)
    iteration_dir = directory / f"iter_{state.iteration:07d}"
    if iteration_dir.exists():
        if not overwrite:
            raise ValueError(
                f"{iteration_dir}: already exists; pass overwrite=True (--overwrite) to replace it."
            )
        import shutil

        shutil.rmtree(iteration_dir)
    objects = {"common_state/shard_0_1": common_state(state, config), **extra_state_objects(state)}
    directory.mkdir(parents=True, exist_ok=True)
    save_dcp_torch(iteration_dir, megatron_tensors(state), objects)
    (iteration_dir / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    (directory / "latest_checkpointed_iteration.txt").write_text(str(state.iteration))
    return iteration_dir


def safetensors_tensors(state: MegatronState) -> dict[str, np.ndarray]:
    """Model weights under their Megatron keys; fp32 masters, Muon momenta and Adam
    moments under optimizer keys (``optimizer.state.{fp32_param,momentum_buffer,
    exp_avg,exp_avg_sq}.<key>``).
    """
    tensors = dict(state.model)
    tensors.update({FP32_PREFIX + k: v for k, v in state.masters.items()})
    tensors.update({MOMENTUM_PREFIX + k: v for k, v in state.momentum.items()})
    tensors.update({EXP_AVG_PREFIX + k: v for k, v in state.exp_avg.items()})
    tensors.update({EXP_AVG_SQ_PREFIX + k: v for k, v in state.exp_avg_sq.items()})
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def save_safetensors(state: MegatronState, path, *, overwrite: bool = False) -> pathlib.Path:
    """Write global weights, masters, Muon momenta and Adam moments to one ``.safetensors``
    file (:func:`safetensors_tensors`); the metadata holds the iteration, Adam's step and
    the source.

    Raises:
      ValueError: ``path`` exists (without ``overwrite``), or safetensors is not installed.
    """
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ValueError(
            f"{path}: writing safetensors needs the megatron extra: pip install 'lwjax[megatron]'."
        ) from None

    path = pathlib.Path(path)
    if path.exists() and not overwrite:
        raise ValueError(
            f"{path}: already exists; pass overwrite=True (--overwrite) to replace it."
        )
    metadata = {
        "format": "megatron",
        "iteration": str(state.iteration),
        "adam_step": str(state.adam_step),
        "source": json.dumps(
            {k: v for k, v in state.source.items() if isinstance(v, (str, int, bool))}
        ),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(safetensors_tensors(state), str(tmp), metadata=metadata)
    tmp.replace(path)
    return path
