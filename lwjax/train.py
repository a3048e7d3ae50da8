"""A whole data-parallel train step from a loss function and a layer-wise optimizer."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwjax.optimizer import LayerwiseOptimizer, named_shardings


def jit_shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs, *, donate_argnums=()) -> Callable:
    """``jax.jit(jax.shard_map(fn, ..., check_vma=False))``, donated arguments paired with outputs.

    The jit is given ``out_shardings`` (``out_specs`` on ``mesh``), so JAX
    aliases each donated argument to the output of the same shape and
    sharding. Without them JAX leaves the pairing to XLA, which matches
    donated buffers with outputs of the same byte size in output order: one
    output of a coincident size (a bf16 parameter block as large as an fp32
    state bucket) shifts every later pair, and XLA then copies the buffers it
    crossed (0.9 GB a step for the 1b benchmark workload at dp 4).

    Args:
      fn: The per-device function, as for ``shard_map``.
      mesh: The device mesh.
      in_specs, out_specs: ``PartitionSpec`` pytrees (prefixes) of the
        arguments and results, as for ``shard_map``.
      donate_argnums: Arguments whose buffers the call may reuse, as for ``jax.jit``.

    Returns:
      The jitted function.
    """
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False),
        out_shardings=named_shardings(mesh, out_specs),
        donate_argnums=donate_argnums,
    )


def make_train_step(
    loss_fn: Callable, optimizer: LayerwiseOptimizer, *, donate: bool = True
) -> Callable:
    """Build ``train_step(params, state, batch) -> (params, state, metrics)``, jitted.

    Every data-parallel device computes ``loss_fn(params, local_batch)`` and
    its gradients on its slice of the batch (leading axis split over
    ``optimizer.data_axes``: ``dp``, or ``(dp, ep)`` with expert parallelism);
    the optimizer then reduce-scatters the gradients, updates the device's own
    state and gathers the new parameters (see :mod:`lwjax.optimizer`).

    With an expert axis, ``loss_fn`` sees the device's local experts (expert
    leaves split over ``ep`` on their expert axis, ``optimizer.param_specs``)
    and exchanges tokens over ``ep`` itself, e.g. ``all_gather`` of the tokens,
    the local experts, ``psum_scatter`` of their outputs.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss over ``batch``.
      optimizer: A :class:`~lwjax.optimizer.LayerwiseOptimizer`.
      donate: Donate ``params`` and ``state`` buffers to the step.

    Returns:
      The train step. ``metrics`` holds the mean ``loss`` and the
      optimizer's metrics (``grad_norm``, ``clip_coef``, ``num_zeros``,
      ``update_rms``, ``skipped``, and ``grad_norm/<group>``,
      ``clip_coef/<group>`` per separate norm group).

    Raises:
      ValueError: (at call time) a batch leaf whose leading axis does not
        divide by the number of data-parallel devices.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh
      >>> import lwjax
      >>> params = {"w": jnp.eye(4), "b": jnp.zeros(4)}
      >>> opt = lwjax.layerwise_muon(params, Mesh(np.array(jax.devices()[:1]), ("dp",)))
      >>> def loss_fn(params, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
      >>> step = make_train_step(loss_fn, opt)
      >>> batch = (jnp.ones((8, 4)), jnp.zeros((8, 4)))
      >>> params, state, metrics = step(params, opt.init(params), batch)
      >>> int(state.count), bool(metrics["skipped"])
      (1, False)
    """
    mesh, axes = optimizer.mesh, optimizer.data_axes
    num_data = optimizer.num_data
    param_specs = optimizer.param_specs if optimizer.param_specs is not None else P()
    dp = mesh.shape[optimizer.axis]
    size_text = (
        f"dp={dp}"
        if optimizer.expert_axis is None
        else f"dp*ep={num_data} (dp={dp}, ep={num_data // dp})"
    )

    def local_step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, state, metrics = optimizer.update(grads, state, params)
        return params, state, {"loss": lax.pmean(loss, axes), **metrics}

    step = jit_shard_map(
        local_step,
        mesh,
        (param_specs, optimizer.state_specs, P(axes)),
        (param_specs, optimizer.state_specs, P()),
        donate_argnums=(0, 1) if donate else (),
    )
    param_shardings = named_shardings(mesh, param_specs)

    def train_step(params, state, batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if not leaf.shape or leaf.shape[0] % num_data:
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)}: leading axis must divide by {size_text}; "
                    f"got shape {tuple(leaf.shape)}."
                )
        # Parameters handed in on one device are placed on the mesh first (a no-op for the
        # step's own outputs), so the step compiles once, not again for its own outputs.
        return step(jax.device_put(params, param_shardings), state, batch)

    return train_step
