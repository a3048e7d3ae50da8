"""The optimizer state of :func:`lwjax.layerwise_muon`: arrays only, one shard per device.

The state is a ``NamedTuple`` as optax's are; its field names are the
checkpoint format (:mod:`lwjax.checkpoint` saves it as logical arrays). The
plan, options and mesh stay in the optimizer's closure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from lwjax.plan import StepPlan


class LayerwiseState(NamedTuple):
    """State of :func:`lwjax.layerwise_muon`; arrays only, sharded over the data-parallel axes.

    Per buffer and bucket, one global array of ``shards * S_b`` elements whose
    shard ``r`` lives on the device of rank ``r`` (:mod:`lwjax.plan`).
    """

    count: jax.Array  # shape=(), int32: applied (not skipped) steps.
    masters: tuple[tuple[jax.Array, ...], ...]  # [buffer][bucket]: fp32 master weights.
    momenta: tuple[tuple[jax.Array, ...] | None, ...]  # Muon momentum; None if elementwise.
    elementwise: tuple[tuple[Any, ...] | None, ...]  # optax state; None if layer-wise.
    # shape=(), bool, only where the step speculates (:func:`speculates`): whether the last
    # applied step needed no Muon clip, so the next step (or, as the host chooses in
    # lwjax.speculation, the step after it) starts Newton–Schulz before the norm.
    speculate: jax.Array | None = None


def speculates(plan: StepPlan) -> bool:
    """Whether the state carries a speculation flag: the step is pipelined, clips and has
    Muon matrices.

    Without clipping the pipelined step is exact, and without Muon it starts
    nothing early: it has nothing to guess.
    """
    has_muon = any(b.key.is_layer_wise for b in plan.buffers)
    return bool(plan.config.pipeline_muon and plan.config.clip_grad and has_muon)


def initial_speculation(plan: StepPlan) -> jax.Array | None:
    """``LayerwiseState.speculate`` of a fresh or restored state: ``False`` (the first step,
    or two as the host chooses, waits for the norm, as early training mostly clips), or
    ``None`` where nothing speculates."""
    return jnp.zeros([], jnp.bool_) if speculates(plan) else None
