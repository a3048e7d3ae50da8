r"""Each batch device's gradient of a loss over parameters split over FSDP and tensor-parallel axes.

An optimizer with ``param_axes`` holds leaves split over mesh axes of two kinds,
and the step treats them differently:

* **FSDP axes** (:class:`lwjax.TrainStepOptions` ``fsdp_axes``, or
  ``fsdp_axes=`` of :func:`lwjax.value_and_grad`) also split the batch. The
  loss runs per device over them: in ``shard_map`` manual over the data axes
  and the FSDP axes, each device gets its slice of the batch and its blocks of
  the leaves they split, and gathers them where it uses them
  (:func:`lwjax.gather_params`, one layer at a time inside the scan); the
  gather's transpose reduce-scatters each gradient in the backward, in the
  optimizer's reduction dtype (fp32 with ``grad_reduce_in_fp32``).
* **Tensor-parallel axes** (the other ``param_axes``) do not split the batch:
  they stay automatic in that ``shard_map``, the loss sees those leaves as
  global arrays, and XLA partitions the model over them from their shardings
  (as :func:`lwjax.value_and_grad` does for tensor parallelism alone).

With :math:`n` the FSDP devices (the product of their sizes) and :math:`g_e`
device :math:`e`'s gradient of its local mean loss, the gradient of the FSDP
group's mean loss is

.. math:: g = \frac{1}{n} \sum_{e=1}^{n} g_e :

for a leaf split over an FSDP axis the gather's transpose has taken the sum
(each device holds its block of it), a leaf an FSDP axis does not split is
summed over that axis by ``psum`` (an all-reduce of that leaf: split the large
ones), and every gradient is divided by :math:`n`. The mean over the data
axes is the optimizer's, inside its reduce-scatter, so the gradients leave
here unreduced over them: a leading axis over the data axes, as
``optimizer.update`` and ``local_update`` take them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from lwjax.loss_adapter import LossAdapter
from lwjax.parallel.axes import as_axis_tuple
from lwjax.parallel.gather import param_gather
from lwjax.parallel.shardings import param_spec


def batch_axes(optimizer, fsdp_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes the batch is split over: the optimizer's data axes, then ``fsdp_axes``."""
    return (*as_axis_tuple(optimizer.data_axes), *fsdp_axes)


def leaf_specs(optimizer) -> list[P]:
    """Each routed leaf's whole ``PartitionSpec`` (expert and parameter axes), in plan order."""
    plan = optimizer.plan
    return [param_spec(r, optimizer.expert_axis, plan.axes.tp) for r in plan.routes]


def check_fsdp_axes(optimizer, fsdp_axes: tuple[str, ...], caller: str) -> None:
    """Refuse FSDP axes the optimizer does not split parameters over, and leaves split over one
    on a stacked (scanned) axis, whose layers cannot be gathered one at a time.

    Raises:
      ValueError: naming the axis or the leaf.
    """
    param_axes = as_axis_tuple(optimizer.param_axes or ())
    for name in fsdp_axes:
        if name not in param_axes:
            raise ValueError(
                f"{caller}: fsdp_axes names {name!r}, which is not one of the optimizer's "
                f"param_axes={optimizer.param_axes!r}; an FSDP axis splits parameters "
                "(layerwise_muon(..., param_axes=...)) and the batch."
            )
    tp = optimizer.plan.axes.tp
    for route in optimizer.plan.routes:
        for name, dim in zip(tp, route.tensor_dims):
            if name in fsdp_axes and dim is not None and dim < route.stack_dims:
                raise ValueError(
                    f"{caller}: {route.path} is split over the FSDP axis {name!r} on its stacked "
                    f"axis {dim} (shape {route.shape}); a scanned loss gathers one layer at a "
                    "time, so split it over that axis on one of its matrix axes."
                )


def sharded_gradients(
    adapter: LossAdapter, optimizer, fsdp_axes: tuple[str, ...]
) -> tuple[Callable, object]:
    """``(gradients, grad_specs)``: ``gradients(params, model_state, batch, key, count) ->
    (means, model_state, grads)``, to call under ``jax.jit``, and the ``PartitionSpec`` tree of
    ``grads`` (a leading axis over the data axes, then each leaf's own).

    ``means`` holds the mean ``loss`` (and ``aux``) over the batch devices;
    ``key`` is folded with ``count`` (unless ``None``) and the device's index
    over the batch axes; ``batch`` is split over :func:`batch_axes`.
    """
    mesh, plan = optimizer.mesh, optimizer.plan
    data, axes = as_axis_tuple(optimizer.data_axes), batch_axes(optimizer, fsdp_axes)
    specs = leaf_specs(optimizer)
    manual = [_kept(spec, axes) for spec in specs]
    gather = param_gather(
        [r.path for r in plan.routes],
        [r.shape for r in plan.routes],
        specs,
        dict(mesh.shape),
        axes,
        fsdp_axes,
        reduce_dtype=jnp.float32 if plan.config.grad_reduce_in_fp32 else None,
    )
    fsdp_size = math.prod(mesh.shape[a] for a in fsdp_axes)
    split = [leaf.path for leaf in gather.leaves if any(leaf.split)]
    hint = (
        f"loss_fn gets its device's blocks of the leaves split over fsdp_axes={fsdp_axes} "
        f"({', '.join(split)}); gather each where the model uses it with lwjax.gather_params "
        "(each scanned layer's inside the scan's body, the rest once)."
    )
    tree = lambda leaves: jax.tree_util.tree_unflatten(plan.treedef, leaves)  # noqa: E731
    grad_specs = tree([P(data, *spec) for spec in specs])

    def mean(g, spec):
        """The FSDP group's mean gradient of one leaf (the module's docstring)."""
        unsplit = tuple(a for a in fsdp_axes if a not in _names_of(spec))
        if unsplit:
            g = lax.psum(g, unsplit)
        return (g / fsdp_size).astype(g.dtype)

    def local(params, model_state, batch, key, count):
        key = adapter.device_key(key, count, axes)
        with gather.active():
            try:
                loss, grads, model_state, aux = adapter.gradients(params, model_state, batch, key)
            except (TypeError, ValueError) as err:
                if split:
                    err.add_note(f"lwjax: {hint}")
                raise
        if fsdp_axes:
            grads = jax.tree.map(mean, grads, tree(specs), is_leaf=lambda s: isinstance(s, P))
        means, model_state = adapter.device_means(loss, aux, model_state, axes)
        return means, model_state, jax.tree.map(lambda g: g[None], grads)

    gradients = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tree(manual), P(), P(axes), P(), P()),
        out_specs=(P(), P(), tree([P(data, *spec) for spec in manual])),
        axis_names=set(axes),
        check_vma=False,
    )
    return gradients, grad_specs


def _names_of(spec: P) -> set[str]:
    """Every mesh axis a ``PartitionSpec`` names."""
    return {n for entry in spec if entry is not None for n in as_axis_tuple(entry)}


def _kept(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` naming only ``axes``: the part of a leaf's split a ``shard_map`` manual over
    ``axes`` takes (the other axes stay XLA's)."""
    entries = []
    for entry in spec:
        names = tuple(n for n in as_axis_tuple(entry or ()) if n in axes)
        entries.append(None if not names else names if len(names) > 1 else names[0])
    return P(*entries)
