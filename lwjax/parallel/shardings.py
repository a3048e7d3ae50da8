"""Where arrays live on a mesh: parameter and state ``PartitionSpec``s, read and made.

:func:`tensor_dims` reads from the parameters' ``NamedSharding``s which of
their axes are split over the parameter axes (``MeshAxes.tp``: tensor
parallelism, FSDP); :func:`param_spec` and :func:`state_specs` give the specs
of each leaf and of each state array for ``shard_map``, and
:func:`named_shardings` places any spec pytree on a mesh.
"""

from __future__ import annotations

import warnings

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.parallel.axes import MeshAxes, as_axis_tuple
from lwjax.param_tree import unboxed_leaves
from lwjax.plan import StepPlan
from lwjax.routing import LeafRoute, is_array_like, path_name
from lwjax.state import LayerwiseState, speculates


def tensor_dims(params, axes: MeshAxes) -> list[tuple[int | None, ...]]:
    """Per array leaf (flatten order), per tensor-parallel axis of ``axes.tp``, the stored axis
    the leaf's sharding splits over it, or ``None``.

    Leaves without a ``NamedSharding`` (numpy arrays, abstract leaves given
    none) are whole on every tensor-parallel device.

    Raises:
      ValueError: naming the leaf, when its sharding splits it over a mesh axis
        other than the tensor-parallel and expert axes, over one of them on two
        axes, or over two of them on one axis in an order other than ``tp``'s.
    """
    known = {*axes.tp, axes.ep} - {None}
    leaves = []
    for path, value, _ in unboxed_leaves(params):
        if not is_array_like(value):
            continue
        sharding = getattr(value, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        dims: list[int | None] = [None] * len(axes.tp)
        for dim, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            other = [n for n in names if n is not None and n not in known]
            if other:
                raise ValueError(
                    f"layerwise_muon: {path_name(path)} is sharded over mesh axis "
                    f"{other[0]!r} on axis {dim} ({spec}); parameters may be split only over "
                    f"param_axes={axes.tp!r} (and the expert axis). Replicate it over "
                    f"{other[0]!r}."
                )
            split = [n for n in names if n in axes.tp]
            if split != sorted(split, key=axes.tp.index):
                raise ValueError(
                    f"layerwise_muon: {path_name(path)} splits axis {dim} over {tuple(split)} "
                    f"({spec}); name them in param_axes's order {axes.tp}."
                )
            for name in split:
                a = axes.tp.index(name)
                if dims[a] is not None:
                    raise ValueError(
                        f"layerwise_muon: {path_name(path)} is split over {name!r} on axes "
                        f"{dims[a]} and {dim} ({spec}); split it on one axis."
                    )
                dims[a] = dim
        leaves.append(tuple(dims))
    if axes.tp_size > 1 and all(d is None for dims in leaves for d in dims):
        warnings.warn(
            f"layerwise_muon: param_axes={axes.tp!r} is given but no parameter's sharding "
            "splits over it; every leaf is held whole by each tensor-parallel device. Pass "
            "parameters (or jax.ShapeDtypeStruct) with their NamedShardings.",
            stacklevel=3,
        )
    return leaves


def param_spec(route: LeafRoute, expert_axis: str | None, tensor_axes: tuple[str, ...]) -> P:
    """A leaf's ``PartitionSpec``: its expert axis over ``expert_axis`` (when given), its
    tensor-parallel splits over ``tensor_axes``; ``P()`` for a leaf whole on every device."""
    entries: list = [None] * len(route.shape)
    if route.expert_dim is not None and expert_axis is not None:
        entries[route.expert_dim] = expert_axis
    for name, dim in zip(tensor_axes, route.tensor_dims):
        if dim is not None:
            entries[dim] = name if entries[dim] is None else (*as_axis_tuple(entries[dim]), name)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def state_specs(plan: StepPlan) -> LayerwiseState:
    """Each state array's ``PartitionSpec``: split over its buffer's axes, scalars replicated."""

    def elementwise_specs(size, spec):
        local = jax.ShapeDtypeStruct((size,), plan.master_dtype)
        return jax.tree.map(
            lambda x: spec if x.shape == local.shape else P(),
            jax.eval_shape(plan.elementwise.init, local),
        )

    specs = [P(plan.axes.state_axes(b.key)) for b in plan.buffers]
    return LayerwiseState(
        count=P(),
        masters=tuple(tuple(spec for _ in b.shard_sizes) for b, spec in zip(plan.buffers, specs)),
        momenta=tuple(
            tuple(spec for _ in b.shard_sizes) if b.key.is_layer_wise else None
            for b, spec in zip(plan.buffers, specs)
        ),
        elementwise=tuple(
            None
            if b.key.is_layer_wise
            else tuple(elementwise_specs(size, spec) for size in b.shard_sizes)
            for b, spec in zip(plan.buffers, specs)
        ),
        speculate=P() if speculates(plan) else None,
    )


def named_shardings(mesh: Mesh, specs):
    """The ``NamedSharding`` on ``mesh`` of every ``PartitionSpec`` in the pytree ``specs``."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )
