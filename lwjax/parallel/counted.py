"""Which elements a device counts in the step's statistics, beside tensor-parallel devices.

A leaf split over the tensor-parallel axes is counted on every device of them (each holds
its own block). A leaf that every device of some of those axes holds whole (``tensor_whole``)
is counted on the first device of each only, as Megatron counts a replicated parameter
once: in the gradient norm, the zero count and the update RMS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax import shards
from lwjax.parallel.axes import MeshAxes
from lwjax.param_plan import ParamPlan


def first_device(axes: MeshAxes, tensor_axes: tuple[int, ...]) -> jax.Array:
    """Whether this device is the first along each of the tensor-parallel mesh axes
    ``tensor_axes`` (positions in ``axes.tp``)."""
    first = jnp.asarray(True)
    for a in tensor_axes:
        first = first & (lax.axis_index(axes.tp[a]) == 0)
    return first


def counted_elements(plan: ParamPlan, i: int, k: int, rank):
    """Which elements of this device's shard of bucket ``k`` of buffer ``i`` the statistics
    count: ``True`` for all, else a boolean scalar or vector."""
    wholes = [r.tensor_whole for r in plan.routes]
    counted = True
    for kind in sorted(set(wholes) - {()}):
        member = shards.per_element(plan.buffers[i], k, rank, [w == kind for w in wholes], np.bool_)
        if member is False:
            continue
        keep = first_device(plan.axes, kind) | jnp.logical_not(member)
        counted = keep if counted is True else counted & keep
    return counted


def counted_masks(plan: ParamPlan, ranks) -> list[list]:
    """:func:`counted_elements` of every bucket, per buffer (``ranks``: this device's shard
    index in each buffer)."""
    return [
        [counted_elements(plan, i, k, rank) for k in range(buffer.num_buckets)]
        for i, (buffer, rank) in enumerate(zip(plan.buffers, ranks))
    ]


def count_once(value: jax.Array, counted) -> jax.Array:
    """``value`` where :func:`counted_elements` counts it, else zero."""
    return value if counted is True else jnp.where(counted, value, 0)
