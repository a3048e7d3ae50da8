"""A whole data-parallel train step from a loss function and a layer-wise optimizer."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from lwjax.optimizer import LayerwiseOptimizer


def make_train_step(
    loss_fn: Callable,
    optimizer: LayerwiseOptimizer,
    *,
    donate: bool = True,
) -> Callable:
    """Build ``train_step(params, state, batch) -> (params, state, metrics)``, jitted.

    Every device computes ``loss_fn(params, local_batch)`` and its gradients
    on its slice of the batch (leading axis sharded over the dp axis); the
    optimizer then reduce-scatters the gradients, updates the rank's own
    state and all-gathers the new parameters (see :mod:`lwjax.optimizer`).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss over ``batch``.
      optimizer: A :class:`~lwjax.optimizer.LayerwiseOptimizer`.
      donate: Donate ``params`` and ``state`` buffers to the step.

    Returns:
      The train step. ``metrics`` holds the dp-mean ``loss`` and the
      optimizer's metrics (``grad_norm``, ``clip_coef``, ``num_zeros``,
      ``update_rms``, ``skipped``).

    Raises:
      ValueError: (at call time) a batch leaf whose leading axis does not
        divide by the dp size.
    """
    mesh, axis = optimizer.mesh, optimizer.axis
    dp = mesh.shape[axis]

    def local_step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, state, metrics = optimizer.update(grads, state, params)
        return params, state, {"loss": lax.pmean(loss, axis), **metrics}

    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), optimizer.state_specs, P(axis)),
            out_specs=(P(), optimizer.state_specs, P()),
            check_vma=False,
        ),
        donate_argnums=(0, 1) if donate else (),
    )

    def train_step(params, state, batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if not leaf.shape or leaf.shape[0] % dp:
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)}: leading axis must divide by dp={dp}; "
                    f"got shape {tuple(leaf.shape)}."
                )
        return step(params, state, batch)

    return train_step
