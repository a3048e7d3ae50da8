"""A parameter pytree as lwjax reads it: array leaves, their paths and flax axis names, routes.

:func:`route_params` is :func:`lwjax.routing.route_leaves` for any pytree:
plain dicts, flax linen and nnx parameters (boxed ones unboxed, their logical
axis names kept), equinox modules. Only paths, shapes, dtypes and names are
read, so ``jax.ShapeDtypeStruct`` leaves serve as well as arrays.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from lwjax.config import MatrixConvention
from lwjax.routing import LeafRoute, RoutingRules, is_array_like, path_name, route_leaves


def route_params(
    params,
    rules: RoutingRules = RoutingRules(),
    *,
    expert_parallel: int = 1,
    matrix_convention: MatrixConvention = "in_out",
) -> tuple[LeafRoute, ...]:
    """:func:`lwjax.routing.route_leaves` of a pytree's array leaves, in flatten order.

    Leaves may be arrays or ``jax.ShapeDtypeStruct``; only paths, shapes and
    dtypes are read, and flax logical axis names where the tree carries them
    (boxed linen params from ``nn.with_logical_partitioning``, nnx variables
    from ``nnx.with_partitioning``). ``None`` leaves are not parameters; other
    leaves without a shape and dtype (Python numbers, strings, functions in
    an equinox module) are skipped with a warning naming their paths.
    """
    records, skipped = [], []
    for path, value, names in unboxed_leaves(params):
        if is_array_like(value):
            records.append((path, tuple(value.shape), value.dtype, names))
        else:
            skipped.append(path_name(path))
    if skipped:
        warnings.warn(
            f"layerwise_muon: {len(skipped)} leaves are not arrays and are not optimized: "
            f"{', '.join(skipped[:8])}{', ...' if len(skipped) > 8 else ''}. Filter them out "
            "(e.g. eqx.partition(model, eqx.is_inexact_array)) to silence this.",
            stacklevel=3,
        )
    return route_leaves(
        records, rules, expert_parallel=expert_parallel, matrix_convention=matrix_convention
    )


def unboxed_leaves(params) -> list[tuple[Any, Any, tuple[str | None, ...] | None]]:
    """``(key path, value, flax axis names or None)`` per leaf, boxed parameters unboxed."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: axis_names(x) is not None
    )
    out = []
    for path, leaf in flat:
        names = axis_names(leaf)
        out.append((path, getattr(leaf, "value", leaf) if names is not None else leaf, names))
    return out


def axis_names(leaf) -> tuple[str | None, ...] | None:
    """The flax logical axis names a boxed parameter carries, or ``None``.

    Reads ``names`` (linen ``nn.Partitioned`` / ``nn.LogicallyPartitioned``)
    or the ``out_sharding`` metadata of an nnx variable.
    """
    for attribute in ("names", "out_sharding"):
        names = getattr(leaf, attribute, None)
        if isinstance(names, (tuple, list)) and hasattr(leaf, "value"):
            return tuple(names)
    return None
