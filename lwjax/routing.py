"""Routing: which parameters are Muon matrices, tied or expert, by pytree path (pure Python).

Leaves arrive as ``(key_path, shape, dtype)`` records (see
:func:`lwjax.optimizer.route_params`, which flattens any pytree: plain dicts,
flax nnx ``State``, flax linen ``params``). Names come from the key path,
joined with ``/``; a trailing ``value`` attribute (flax nnx variables) is
dropped, so an nnx kernel reads ``blocks/0/mlp/up/kernel``.

Default rule (Megatron's, extended to any rank): a parameter is a Muon matrix
iff its matrix view (:mod:`lwjax.dims`) is 2-D and it is not an embedding or
output head (:func:`lwjax.dims.head_or_embedding_reason`), a bias or a norm
scale. Everything else goes to AdamW. Each route says why
(:attr:`LeafRoute.why`; :func:`routing_table` lists them), and
:func:`route_leaves` warns where a default guess is likely wrong.

A leaf may *stack* independent parameters: a scan-over-layers kernel
``[L, m, n]`` declared with ``stacked={"blocks/*": 1}`` (or found by
:func:`lwjax.dims.detect_stacks`, or named ``layers`` in flax metadata) is
``L`` matrices, named ``"<path>[i]"``, each owned and orthogonalised on its
own. ``dims=`` puts the batch, input and output axes anywhere
(:class:`lwjax.dims.MatrixDims`); the optimizer then reads the leaf transposed
to ``(batch..., rows, columns)`` (:attr:`LeafRoute.axes_order`).

Expert leaves (``expert=...``) stack one parameter per expert: ``[E, m, n]``,
or ``[L, E, m, n]`` with ``stacked=2``. Their *expert axis* (by default the last
stacked axis) is split over the expert-parallel mesh axis, so with
``expert_parallel=ep`` each device holds ``E / ep`` experts and the layout names
the local ones (``"<path>[j]"`` is local expert ``j``; on expert rank ``e`` it
is global expert ``e * E / ep + j``).

Per-parameter options, Megatron's parameter groups: ``lr_mult`` and
``wd_mult`` scale the learning rate and weight decay, and ``grad_norm_group``
puts a parameter into a separately clipped gradient-norm group (e.g. ``"mtp"``).

The rules travel together as one frozen :class:`RoutingRules`. Each is a
``{glob_pattern: value}`` mapping (first match wins, patterns match the whole
name with :func:`fnmatch.fnmatchcase`) or a callable
``rule(name, shape) -> value or None`` (``None`` falls back to the default).

The pieces live in modules of their own, and this module re-exports their public
names: the rules in :mod:`lwjax.routing_rules`, one leaf's decisions in
:mod:`lwjax.route_decisions` (its matrix view in :mod:`lwjax.matrix_view`), the
route in :mod:`lwjax.leaf_route`, what a device holds of it in
:mod:`lwjax.parallel.geometry`, the table in :mod:`lwjax.routing_table` and the
layout order in :mod:`lwjax.param_order`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from lwjax import dims as dims_lib
from lwjax.dims import is_embedding_or_output as is_embedding_or_output
from lwjax.leaf_route import LeafRoute as LeafRoute
from lwjax.parallel.geometry import with_tensor_parallel as with_tensor_parallel
from lwjax.param_order import by_role as by_role
from lwjax.param_order import param_specs as param_specs
from lwjax.param_order import role as role
from lwjax.route_decisions import TreeContext, route_leaf
from lwjax.routing_rules import RoutingRules as RoutingRules
from lwjax.routing_rules import is_finite_nonnegative as is_finite_nonnegative
from lwjax.routing_table import format_routing_table as format_routing_table
from lwjax.routing_table import routing_table as routing_table


def path_name(key_path: Iterable[Any]) -> str:
    """Join a pytree key path into a ``/``-separated name.

    Accepts jax key entries (``DictKey``, ``GetAttrKey``, ``SequenceKey``,
    ``FlattenedIndexKey``) or plain strings and ints. A final ``.value``
    attribute (flax nnx variables) is dropped.
    """
    parts = []
    entries = list(key_path)
    for i, entry in enumerate(entries):
        if hasattr(entry, "name") and not isinstance(entry, str):  # attribute access
            if i == len(entries) - 1 and entry.name == "value" and i > 0:
                continue
            parts.append(str(entry.name))
        elif hasattr(entry, "key") and not isinstance(entry, str):
            parts.append(str(entry.key))
        elif hasattr(entry, "idx") and not isinstance(entry, str):
            parts.append(str(entry.idx))
        else:
            parts.append(str(entry))
    return "/".join(parts)


def is_array_like(leaf: Any) -> bool:
    """Whether a pytree leaf is an array or an abstract one (it has a ``shape`` and ``dtype``)."""
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def route_leaves(
    leaves: Iterable[tuple[Any, ...]],
    rules: RoutingRules = RoutingRules(),
    *,
    expert_parallel: int = 1,
    matrix_convention: str = "in_out",
) -> tuple[LeafRoute, ...]:
    """Decide, per leaf, its name, matrix view, optimizer and parameter-group options.

    Warns (one warning per kind, naming the leaves) where a guess is likely
    wrong: a leaf of 3+ axes going to AdamW, and a bias, scale, embedding or
    head going to Muon.

    Args:
      leaves: ``(key_path, shape, dtype)`` or ``(key_path, shape, dtype,
        axis_names)`` per leaf in pytree flatten order; ``key_path`` is a jax
        key path, a tuple of strings/ints, or a name; ``axis_names`` are flax
        logical axis names (``None`` when the leaf has none).
      rules: The :class:`RoutingRules` overriding the defaults.
      expert_parallel: Expert-parallel size; every expert axis must divide by it.
      matrix_convention: ``"in_out"`` (rows are a matrix's inputs, as flax
        stores kernels) or ``"out_in"`` (torch, Megatron); orders the view of
        leaves whose axes are reordered and checks ``qkv_split``.

    Returns:
      One :class:`LeafRoute` per leaf, in input order.

    Raises:
      ValueError: duplicate names, non-floating dtypes, a Muon parameter whose
        view is not 2-D, a stack count out of range, an expert axis that is
        not stacked or does not divide by ``expert_parallel``, a ``qkv_split``
        that does not divide the output rows, or a bad multiplier or group name.

    Examples:
      >>> routes = route_leaves([("blocks/w", (4, 8, 8), "float32"), ("head", (8, 16), "float32")],
      ...                       RoutingRules(stacked={"blocks/*": 1}))
      >>> [(r.path, r.num_params, r.is_muon) for r in routes]
      [('blocks/w', 4, True), ('head', 1, False)]
    """
    _check_options(rules, expert_parallel, matrix_convention)
    records = _leaf_records(leaves)
    shapes = [(name, shape) for name, shape, _, _ in records]
    model_dim = rules.model_dim if rules.model_dim is not None else dims_lib.infer_model_dim(shapes)
    context = TreeContext(
        rules,
        expert_parallel,
        matrix_convention,
        model_dim,
        dims_lib.detect_stacks(shapes, model_dim),
    )
    routes = tuple(
        route_leaf(name, shape, str(getattr(dtype, "name", dtype)), axis_names, context)
        for name, shape, dtype, axis_names in records
    )
    _warn_doubtful(routes, shapes, model_dim, matrix_convention)
    return routes


def _check_options(rules: RoutingRules, expert_parallel: int, matrix_convention: str) -> None:
    """The options of :func:`route_leaves` have the types and values it accepts."""
    if not isinstance(rules, RoutingRules):
        raise TypeError(
            f"route_leaves: rules must be a RoutingRules, but got {type(rules).__name__}."
        )
    if (
        isinstance(expert_parallel, bool)
        or not isinstance(expert_parallel, int)
        or expert_parallel < 1
    ):
        raise ValueError(
            f"route_leaves: expert_parallel must be a positive integer; got {expert_parallel=}."
        )
    if matrix_convention not in ("in_out", "out_in"):
        raise ValueError(
            "route_leaves: matrix_convention must be 'in_out' or 'out_in'; "
            f"got {matrix_convention!r}."
        )


def _leaf_records(
    leaves: Iterable[tuple[Any, ...]],
) -> list[tuple[str, tuple[int, ...], Any, tuple | None]]:
    """``(name, shape, dtype, axis_names)`` per leaf, names checked to be unique."""
    records, seen = [], set()
    for key_path, shape, dtype, *names in leaves:
        name = key_path if isinstance(key_path, str) else path_name(key_path)
        if name in seen:
            raise ValueError(f"{name}: two leaves share this name; leaf names must be unique.")
        seen.add(name)
        axis_names = tuple(names[0]) if names and names[0] is not None else None
        records.append((name, tuple(int(d) for d in shape), dtype, axis_names))
    return records


def _warn_doubtful(
    routes: Sequence[LeafRoute],
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    model_dim: int | None,
    convention: str,
) -> None:
    """One warning per kind of likely-wrong route, naming the leaves."""
    guessed = [r for r in routes if not r.why.startswith(("is_muon rule", "dims rule"))]
    adamw = [r for r in guessed if not r.is_muon and len(r.shape) >= 3 and not _by_name(r)]
    conv = [r for r in adamw if dims_lib.is_conv_kernel(r.path, r.shape)]
    stacks = {r.path: found for r in guessed if (found := _suspected_stack(r, shapes, model_dim))}
    kinds = {
        "leaves of 3+ axes go to AdamW (give their matrix axes with dims=MatrixDims(...), "
        "or an is_muon rule to confirm)": [
            (r, r.why) for r in adamw if r not in conv and sum(d > 1 for d in r.shape) >= 2
        ],
        f"conv kernels go to AdamW (for Muon, give their matrix axes, e.g. {_conv_rule(convention)}"
        "; docs/routing.md, Conv nets)": [(r, "") for r in conv],
        "leaves of 3+ axes are read as one matrix, but every leaf of their module has the same "
        "size on one axis, as a stack of layers would (if it is one, make that axis a batch "
        "axis: dims=MatrixDims(...), or stacked=... where it leads)": [
            (r, stacks[r.path]) for r in guessed if r.path in stacks
        ],
        "leaves of 3+ axes are split at the model dimension by position only, no name telling "
        "which side it is on (check their view, or give dims=MatrixDims(...))": [
            (r, r.why)
            for r in guessed
            if r.is_muon and "(by position)" in r.why and r.view is not None
        ],
        "biases or scales go to Muon": [
            (r, r.why) for r in routes if r.is_muon and dims_lib.is_bias_or_scale(r.path)
        ],
        "embedding- or head-like names go to Muon": [
            (r, r.why) for r in routes if r.is_muon and dims_lib.head_or_embedding_reason(r.path)
        ],
    }
    for what, found in kinds.items():
        if found:
            listed = ", ".join(
                f"{r.path} {list(r.shape)}" + (f" ({why})" if why else "") for r, why in found[:6]
            )
            more = f" and {len(found) - 6} more" if len(found) > 6 else ""
            warnings.warn(f"lwjax routing: {what}: {listed}{more}.", stacklevel=3)


def _conv_rule(convention: str) -> str:
    """The ``dims`` rule that makes 2-D conv kernels Muon matrices, as flax or torch store them."""
    dims = dims_lib.conv_dims(4, convention)
    if convention == "in_out":
        return f'dims={{"*[Cc]onv*/kernel": {dims}}} for flax\'s [height, width, in, out]'
    return f'dims={{"*[Cc]onv*weight": {dims}}} for torch\'s [out, in, height, width]'


def _by_name(route: LeafRoute) -> bool:
    """Whether a name, not a shape, sent the leaf to AdamW: a tied embedding, an embedding or
    head, a bias or scale, or a vocab axis."""
    return bool(
        route.is_tied
        or dims_lib.head_or_embedding_reason(route.path)
        or dims_lib.is_bias_or_scale(route.path)
        or "a vocab axis" in route.why
    )


def _suspected_stack(route: LeafRoute, shapes, model_dim) -> str | None:
    """For a Muon leaf whose matrix merges several stored axes, why one of them looks like a
    stack of layers (:func:`lwjax.dims.shared_axis`), or ``None``."""
    if not route.is_muon or len(route.shape) - route.stack_dims < 3:
        return None
    batch = (route.axes_order or tuple(range(len(route.shape))))[: route.stack_dims]
    found = dims_lib.shared_axis(route.path, route.shape, shapes, batch, model_dim)
    if found is None:
        return None
    axis, module = found
    return f"axis {axis} of size {route.shape[axis]}, as every leaf of {module or 'the tree'}"
