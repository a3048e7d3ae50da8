"""Fully sharded parameters for the training-step bench: each leaf split over ``fsdp``.

The mesh is ``("dp", "fsdp") = (1, n)``: every parameter split over ``fsdp`` on its last axis
(:func:`fsdp_specs`), created split (:func:`fsdp_params`), and gathered layer by layer inside
the forward (:func:`lwjax.gather_params` as ``gpt_logits``'s ``gather``), whose transpose
reduce-scatters each gradient in the backward. The step over such parameters is
:func:`lwjax.make_train_step`'s with ``fsdp_axes="fsdp"``
(:func:`~lwjax.tools.bench.train_steps.lwjax_step` with ``fsdp=True``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwjax.megatron.gpt import GPTConfig, tree_from_keys
from lwjax.megatron.model import init_params
from lwjax.parallel.gather import ParamGather, param_gather
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


def fsdp_param_gather(config: GPTConfig, mesh: Mesh, *, reduce_in_fp32: bool) -> ParamGather:
    """The blocks of :func:`fsdp_specs`'s leaves inside ``shard_map`` over ``("dp", "fsdp")``,
    for :func:`lwjax.gather_params` in a loss that runs outside ``make_train_step`` (the
    forward+backward floor); gradients summed in fp32 with ``reduce_in_fp32``."""
    shapes = config.param_shapes()
    return param_gather(
        list(shapes),
        list(shapes.values()),
        [P(*[None] * (len(shape) - 1), FSDP_AXIS) for shape in shapes.values()],
        dict(mesh.shape),
        mesh.axis_names,
        (FSDP_AXIS,),
        reduce_dtype=jnp.float32 if reduce_in_fp32 else None,
    )


def fsdp_params(config: GPTConfig, key, dtype, mesh: Mesh, specs):
    """:func:`~lwjax.megatron.model.init_params` made split as ``specs`` say (no whole copy)."""
    shardings = named_shardings(mesh, specs)
    return jax.jit(lambda key: init_params(config, key, dtype), out_shardings=shardings)(key)
