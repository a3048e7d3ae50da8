"""One leaf's route, decided one named step at a time (pure Python).

:func:`route_leaf` turns a leaf's name, shape, dtype and axis names into a
:class:`~lwjax.leaf_route.LeafRoute`, in this order:

1. the dtype is floating point;
2. the ``expert`` and ``tied`` rules mark the leaf;
3. its matrix view (:func:`lwjax.matrix_view.matrix_view`): stacked axes and the
   axis order and shape the optimizer reads;
4. Muon or AdamW: an ``is_muon`` rule, else the default (a 2-D view that is not a
   tied embedding, an embedding or head, a bias or a scale), checked to be a 2-D
   matrix; an AdamW leaf is read in its stored order;
5. the options: ``qkv_split``, the expert axis, ``lr_mult``, ``wd_mult`` and
   ``grad_norm_group``, each checked.

Every error names the leaf and the rule it breaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from lwjax import dims as dims_lib
from lwjax.leaf_route import LeafRoute
from lwjax.matrix_view import MatrixView, matrix_view
from lwjax.routing_rules import RoutingRules, apply_rule, is_finite_nonnegative


@dataclasses.dataclass(frozen=True)
class TreeContext:
    """What routing one leaf needs from the whole tree.

    Attributes:
      rules: The routing rules.
      expert_parallel: Expert-parallel size; an expert axis must divide by it.
      matrix_convention: ``"in_out"`` or ``"out_in"``: which matrix axis is the output.
      model_dim: The model width that splits views of 3+ axes, or ``None``.
      stacks: The scanned stacks found in the tree (:func:`lwjax.dims.detect_stacks`).
    """

    rules: RoutingRules
    expert_parallel: int
    matrix_convention: str
    model_dim: int | None
    stacks: Mapping[str, dims_lib.Axes]


def route_leaf(
    name: str,
    shape: tuple[int, ...],
    dtype_name: str,
    axis_names: tuple[str | None, ...] | None,
    context: TreeContext,
) -> LeafRoute:
    """Apply the rules (else the defaults) to one leaf, in the order of the module docstring."""
    rules = context.rules
    _check_floating(name, dtype_name)
    expert_value = apply_rule(rules.expert, name, shape)
    is_expert = expert_value is not None and expert_value is not False
    is_tied = bool(apply_rule(rules.tied, name, shape))
    found = matrix_view(
        name,
        shape,
        axis_names,
        is_expert,
        rules,
        stacks=context.stacks,
        model_dim=context.model_dim,
        matrix_convention=context.matrix_convention,
    )
    order = view = None
    if found.dims is not None:
        order, view = dims_lib.view_shape(shape, *found.dims, context.matrix_convention)
    param_shape = (view or shape)[found.stack :]
    muon, why = _muon_or_adamw(name, param_shape, is_tied, found, rules)
    _check_muon(name, param_shape, found.stack, muon, is_tied)
    stack, order, view = _read_order(shape, found.stack, order, view, muon)
    split = _qkv_split(name, param_shape, muon, context.matrix_convention, rules)
    expert_dim = (
        _expert_dim(name, shape, stack, expert_value, context.expert_parallel)
        if is_expert
        else None
    )
    if is_expert and is_tied:
        raise ValueError(
            f"{name}: a tied embedding cannot be an expert parameter; drop it from expert=..."
        )
    return LeafRoute(
        path=name,
        shape=shape,
        dtype=dtype_name,
        stack_dims=stack,
        is_muon=muon,
        is_tied=is_tied,
        is_expert=is_expert,
        qkv_split_shapes=split,
        expert_dim=expert_dim,
        expert_parallel=context.expert_parallel if is_expert else 1,
        lr_mult=_multiplier(name, "lr_mult", apply_rule(rules.lr_mult, name, shape)),
        wd_mult=_multiplier(name, "wd_mult", apply_rule(rules.wd_mult, name, shape)),
        grad_norm_group=_group_name(name, apply_rule(rules.grad_norm_group, name, shape)),
        axes_order=order,
        view=view,
        why=why,
    )


def _check_floating(name: str, dtype_name: str) -> None:
    """Parameters are floating point (integer state stays out of the parameter tree)."""
    if not (dtype_name.startswith("float") or dtype_name.startswith("bfloat")):
        raise ValueError(
            f"{name}: parameters must be floating point; got dtype={dtype_name}. "
            "Keep integer state out of the parameter tree."
        )


def _muon_or_adamw(name, param_shape, is_tied: bool, found: MatrixView, rules: RoutingRules):
    """``(is_muon, why)``: the ``is_muon`` rule's answer, else the default rule's."""
    muon = apply_rule(rules.is_muon, name, param_shape)
    if muon is not None:
        return bool(muon), f"is_muon rule; {found.why}" if found.why else "is_muon rule"
    not_muon = _why_not_muon(name, param_shape, is_tied, found)
    return not_muon is None, not_muon or found.why or "2-D"


def _why_not_muon(name, param_shape, is_tied: bool, found: MatrixView) -> str | None:
    """Why the default rule sends a leaf to AdamW, or ``None`` for a Muon matrix."""
    return (
        ("tied embedding" if is_tied else None)
        or found.not_matrix
        or dims_lib.head_or_embedding_reason(name)
        or ("bias or scale" if dims_lib.is_bias_or_scale(name) else None)
        or (None if len(param_shape) == 2 else found.why or f"{len(param_shape)}-D")
    )


def _check_muon(name, param_shape, stack: int, muon: bool, is_tied: bool) -> None:
    """A Muon parameter is a 2-D matrix, and never a tied embedding."""
    if muon and len(param_shape) != 2:
        raise ValueError(
            f"{name}: a Muon parameter must be a 2-D matrix; got {param_shape=} after "
            f"{stack} stacked axes. Declare its axes with dims=MatrixDims(...) or stacked=..., "
            "or route it to AdamW with is_muon=..."
        )
    if muon and is_tied:
        raise ValueError(f"{name}: a tied embedding is never a Muon matrix; route it to AdamW.")


def _read_order(shape, stack: int, order, view, muon: bool):
    """``(stack, axes_order, view)`` as the route keeps them: ``None`` where the stored order
    or shape is read. AdamW (elementwise) reads only its stack axes first, the others in
    stored order and unmerged, so a stack of vectors stays vectors (no weight decay)."""
    if not muon and order is not None:
        order = (*order[:stack], *sorted(order[stack:]))
        view = tuple(shape[a] for a in order)
    if order == tuple(range(len(shape))):
        order = None
    if view == shape:
        view = None
    return stack, order, view


def _qkv_split(name, param_shape, muon: bool, convention: str, rules: RoutingRules):
    """The checked ``qkv_split`` of a leaf: positive rows that divide its output rows."""
    split = apply_rule(rules.qkv_split, name, param_shape)
    if split is None:
        return None
    split = tuple(int(x) for x in split)
    if not muon or not split or any(x < 1 for x in split):
        raise ValueError(
            f"{name}: qkv_split needs a Muon matrix and positive row counts; "
            f"got {split=}, is_muon={muon}."
        )
    rows = param_shape[1] if convention == "in_out" else param_shape[0]
    if rows % sum(split):
        raise ValueError(
            f"{name}: qkv_split={split} ({sum(split)} rows per query group) does not divide the "
            f"{rows} output rows of {param_shape} under matrix_convention={convention!r} "
            f"(outputs are the {'columns' if convention == 'in_out' else 'rows'})."
        )
    return split


def _expert_dim(name: str, shape: tuple[int, ...], stack: int, value, expert_parallel: int) -> int:
    """The stacked axis that indexes an expert leaf's experts; checked to divide by ``ep``."""
    dim = stack - 1 if value is True else value
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < stack:
        raise ValueError(
            f"{name}: the expert axis must be one of the {stack} stacked axes; "
            f"got expert={value!r} for {shape=}. "
            "Stack expert leaves with stacked=... (e.g. 1 for [E, m, n], 2 for [L, E, m, n])."
        )
    if shape[dim] % expert_parallel:
        raise ValueError(
            f"{name}: {shape[dim]} experts (axis {dim} of {shape=}) do not divide by "
            f"expert_parallel={expert_parallel}."
        )
    return dim


def _multiplier(name: str, what: str, value) -> float:
    """A learning-rate or weight-decay multiplier: a finite real number >= 0 (default 1)."""
    if value is None:
        return 1.0
    if not is_finite_nonnegative(value):
        raise ValueError(f"{name}: {what} must be a finite number >= 0; got {what}={value!r}.")
    return float(value)


def _group_name(name: str, value) -> str | None:
    """A gradient-norm group: ``None`` (the main norm) or a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"{name}: grad_norm_group must be a non-empty string or None; got {value!r}."
        )
    return value
