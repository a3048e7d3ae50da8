r"""The optax face of the layer-wise optimizer: global arrays in, updates out, under ``jax.jit``.

:func:`optax_functions` wraps the per-device step (:mod:`lwjax.step`) in
``shard_map`` so that it takes what an optax ``update`` gets in a plain
``jax.jit`` loop: gradients, state and parameters as global arrays, in any
pytree whose array leaves have the routed paths (flax nnx ``State``, linen
boxed params, equinox modules with ``None`` leaves). It returns

.. math:: u = \text{gather}(\text{master}') - p

computed in at least fp32. ``optax.apply_updates`` computes :math:`p + u`,
which need not round back to the gathered masters (in fp32, where :math:`p`
and the master differ in sign or by more than a factor of two, there may be
no :math:`u` that does); where it does not, the master is set to that sum. So the parameters
``apply_updates`` returns are exactly the masters cast to the parameter dtype,
and a skipped step (an update of zeros) leaves them as they are.

Two gradient forms are accepted, told apart by their shapes:

* **reduced** (the leaf's own shape): the gradient of the global mean loss,
  as ``jax.grad`` under GSPMD returns it. GSPMD has already all-reduced it
  where it was produced (the contraction over the sharded batch ends in an
  all-reduce), in the parameters' dtype (``grad_reduce_in_fp32`` cannot act
  on it), so each device just takes its shards;
* **unreduced** (a leading axis of ``dp * ep``, split over the data axes):
  each device's gradient of its local mean loss, from
  :func:`lwjax.train.value_and_grad`; ``update`` divides by ``dp * ep`` and
  reduce-scatters, so the compiled step has a reduce-scatter and no all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwjax import step as step_lib
from lwjax.buffers import checked_leaves, match_routes
from lwjax.param_plan import ParamPlan
from lwjax.plan import StepPlan
from lwjax.routing import is_array_like, path_name
from lwjax.state import LayerwiseState


def optax_functions(
    plan: StepPlan,
    mesh: Mesh,
    leaf_specs: list[P],
    state_specs: LayerwiseState,
    local_update: Callable,
) -> tuple[Callable, Callable]:
    """``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)``.

    Args:
      plan: The optimizer's plan.
      mesh: The device mesh.
      leaf_specs: Per routed leaf, its ``PartitionSpec`` (expert leaves split).
      state_specs: The state's ``PartitionSpec`` pytree.
      local_update: The per-device step, :func:`lwjax.step.update` or
        :func:`lwjax.pipelined.update_pipelined`.
    """
    # Inside shard_map the step sees flat leaf lists, whatever pytree classes carry them outside.
    flat = dataclasses.replace(plan, treedef=jax.tree_util.tree_structure(list(plan.routes)))
    # Unreduced gradients: a leading per-device axis over the data axes, then the leaf's split.
    unreduced_specs = [P(plan.axes.data, *spec) for spec in leaf_specs]
    local_init = jax.jit(
        jax.shard_map(
            functools.partial(step_lib.init, flat),
            mesh=mesh,
            in_specs=(leaf_specs,),
            out_specs=state_specs,
            check_vma=False,
        )
    )

    exact_update = functools.partial(_masters_as_applied, flat, local_update)

    def unreduced(grads, state, params):
        return exact_update([g[0] for g in grads], state, params)

    steps = {
        True: jax.shard_map(
            functools.partial(exact_update, reduced=True),
            mesh=mesh,
            in_specs=(leaf_specs, state_specs, leaf_specs),
            out_specs=(leaf_specs, state_specs, P()),
            check_vma=False,
        ),
        False: jax.shard_map(
            unreduced,
            mesh=mesh,
            in_specs=(unreduced_specs, state_specs, leaf_specs),
            out_specs=(leaf_specs, state_specs, P()),
            check_vma=False,
        ),
    }

    def init(params):
        return local_init(routed_leaves(plan, params, "init(params)")[0])

    def update(grads, state, params=None, **extra_args):
        del extra_args  # accepted as optax.GradientTransformationExtraArgs; none are used
        if params is None:
            raise ValueError(
                "LayerwiseOptimizer.update: params are required (the new parameters are "
                "gathered from the fp32 masters and returned as updates relative to params)."
            )
        reduced = not _is_unreduced(plan, grads)
        grad_leaves, treedef, kept = routed_leaves(
            plan, grads, "update(grads)", lead=() if reduced else (plan.axes.num_data,)
        )
        param_leaves = routed_leaves(plan, params, "update(params)")[0]
        new_leaves, state, _ = steps[reduced](grad_leaves, state, param_leaves)
        deltas = iter(map(_difference, new_leaves, param_leaves))
        updates = [next(deltas) if k else None for k in kept]
        return jax.tree_util.tree_unflatten(treedef, updates), state

    return init, update


def _is_unreduced(plan: StepPlan, grads) -> bool:
    """Whether the first routed gradient leaf carries a leading ``dp * ep`` axis of partials."""
    leaves = [x for x in jax.tree_util.tree_leaves(grads) if is_array_like(x)]
    if not leaves or not plan.routes:
        return False
    first = tuple(leaves[0].shape)
    unreduced = first == (plan.axes.num_data, *plan.routes[0].shape)
    if unreduced and plan.has_experts:
        raise ValueError(
            "update(grads): per-device (unreduced) gradients are not supported with expert "
            "leaves; pass the reduced gradients, or use make_train_step."
        )
    return unreduced


def _masters_as_applied(plan: StepPlan, local_update: Callable, grads, state, params, **kwargs):
    r"""``local_update``, then each master that ``p + u`` would not round back to set to that sum.

    :math:`a = p + (\text{new} - p)` as ``optax.apply_updates`` computes it (in at
    least fp32, before its cast to the parameter dtype). Where
    :math:`\text{cast}(a) \ne \text{cast}(\text{master}')`, the master becomes
    :math:`a`; elsewhere it keeps its own (finer) value.
    """
    new, state, metrics = local_update(plan, grads, state, params, **kwargs)
    applied = [p.astype(d.dtype) + d for p, d in zip(params, map(_difference, new, params))]
    packed = step_lib.master_shards(plan, applied)
    masters = tuple(
        tuple(
            jnp.where(a.astype(b.key.param_dtype) == m.astype(b.key.param_dtype), m, a)
            for m, a in zip(ms, applied_shards)
        )
        for b, ms, applied_shards in zip(plan.buffers, state.masters, packed)
    )
    return new, state._replace(masters=masters), metrics


def _difference(new: jax.Array, old: jax.Array) -> jax.Array:
    """``new - old`` in at least fp32, the update ``optax.apply_updates`` adds to ``old``."""
    dtype = jnp.promote_types(old.dtype, jnp.float32)
    return new.astype(dtype) - old.astype(dtype)


def routed_leaves(
    plan: ParamPlan, tree, what: str, *, lead: tuple[int, ...] = ()
) -> tuple[list, Any, list[bool]]:
    """The leaves of ``tree`` that the plan routes, checked by name, shape and dtype.

    ``lead`` is a leading shape every leaf carries before the parameter's own
    (the per-device axis of unreduced gradients).

    Returns the routed leaves in plan order, the tree's structure (``None``
    leaves and skipped non-array leaves included) and, per leaf of that
    structure, whether it is routed.

    Raises:
      ValueError: naming the first path that differs from the plan's, or a
        leaf whose shape or dtype differs.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    kept = [x is not None and is_array_like(x) for _, x in flat]
    named = [(path_name(p), x) for (p, x), k in zip(flat, kept) if k]
    match_routes(plan, [name for name, _ in named], what)
    leaves = checked_leaves(plan, [x for _, x in named], what, local=False, lead=lead)
    return leaves, treedef, kept
