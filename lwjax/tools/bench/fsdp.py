"""Fully sharded parameters for the training-step bench: each leaf split over ``fsdp``.

The mesh is ``("dp", "fsdp") = (1, n)``: every parameter split over ``fsdp`` on its last axis
(:func:`fsdp_specs`), created split (:func:`fsdp_params`), and gathered layer by layer inside
the forward (:func:`fsdp_gather`), whose transpose reduce-scatters each gradient in the
backward. The step over such parameters is
:func:`~lwjax.tools.bench.train_steps.lwjax_step` with ``fsdp=True``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwjax.megatron.gpt import GPTConfig, tree_from_keys
from lwjax.megatron.model import init_params
from lwjax.parallel.shardings import named_shardings

FSDP_AXIS = "fsdp"


def fsdp_specs(config: GPTConfig, devices: int) -> dict:
    """Every parameter of ``config`` split over ``fsdp`` on its last axis, as a
    ``PartitionSpec`` tree (layer-stacked leaves keep their layer axis whole).

    Raises:
      ValueError: a leaf whose last axis does not divide by ``devices``.
    """
    shapes = config.param_shapes()
    uneven = {key: shape for key, shape in shapes.items() if shape[-1] % devices}
    if uneven:
        raise ValueError(
            f"TrainBenchConfig.fsdp: {devices} devices do not divide the last axis of "
            f"{', '.join(f'{k} {s}' for k, s in uneven.items())}."
        )
    return tree_from_keys(
        {key: P(*[None] * (len(shape) - 1), FSDP_AXIS) for key, shape in shapes.items()}
    )


def fsdp_gather(tree, *, reduce_in_fp32: bool = False):
    """Inside ``shard_map``: each leaf's blocks all-gathered over ``fsdp`` on its last axis.

    The transpose of the all-gather is a reduce-scatter: the gradient of each
    block is the sum over the ``fsdp`` devices of their gradients of it, taken
    in the leaf's dtype, or with ``reduce_in_fp32`` in fp32 and rounded to the
    leaf's dtype once (``TrainBenchConfig.grad_reduce_in_fp32``: where the
    gradients are reduced in the fully sharded step).
    """
    return jax.tree.map(_gather_reduced_in_fp32 if reduce_in_fp32 else _gather, tree)


def _gather(x: jax.Array) -> jax.Array:
    return lax.all_gather(x, FSDP_AXIS, axis=x.ndim - 1, tiled=True)


@jax.custom_vjp
def _gather_reduced_in_fp32(x: jax.Array) -> jax.Array:
    return _gather(x)


def _scatter_in_fp32(_, g):
    summed = lax.psum_scatter(
        g.astype(jnp.float32), FSDP_AXIS, scatter_dimension=g.ndim - 1, tiled=True
    )
    return (summed.astype(g.dtype),)


_gather_reduced_in_fp32.defvjp(lambda x: (_gather(x), None), _scatter_in_fp32)


def fsdp_params(config: GPTConfig, key, dtype, mesh: Mesh, specs):
    """:func:`~lwjax.megatron.model.init_params` made split as ``specs`` say (no whole copy)."""
    shardings = named_shardings(mesh, specs)
    return jax.jit(lambda key: init_params(config, key, dtype), out_shardings=shardings)(key)
