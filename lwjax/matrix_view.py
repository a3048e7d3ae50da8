"""A leaf's matrix view under the routing rules: its stacked axes and matrix axes (pure Python).

The optimizer reads a leaf as ``stack`` leading batch axes followed by one matrix
whose input (reduction) and output axes may each be several stored axes
(:mod:`lwjax.dims`). :func:`matrix_view` decides them, the first source that
speaks winning:

1. a ``dims`` rule (:class:`lwjax.dims.MatrixDims`);
2. a ``stacked`` rule, or an expert leaf (one stacked axis);
3. flax logical axis names (:func:`lwjax.dims.dims_from_axis_names`);
4. a scanned stack found in the tree (:func:`lwjax.dims.detect_stacks`), its stack
   axes leading or not (MaxText's ``[embed, layers, mlp]``);
5. the shape alone: an expert-named path of 3+ axes stacks one more axis, a conv
   kernel (:func:`lwjax.dims.is_conv_kernel`) is no matrix without a ``dims`` rule,
   and a view of 3+ axes is split at the model dimension
   (:func:`lwjax.dims.dims_from_model_dim`).

A view whose batch axes do not lead keeps them as ``dims`` (their reduction and output
axes empty where the rest is no matrix), so the optimizer reads the leaf with its stack
first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from lwjax import dims as dims_lib
from lwjax.dims import Axes, MatrixDims
from lwjax.routing_rules import RoutingRules, apply_rule


class MatrixView(NamedTuple):
    """What :func:`matrix_view` decided for one leaf.

    Attributes:
      stack: How many leading axes index independent parameters.
      dims: ``(batch, reduction, output)`` axes of the matrix, or ``None`` when the
        leaf is read as stored (a 2-D matrix after its stack, or no matrix).
      why: Which source decided, for the routing table (``""`` for the shape alone).
      not_matrix: Why the axis names say the leaf is no matrix (a ``vocab`` axis),
        else ``None``.
    """

    stack: int
    dims: tuple[Axes, Axes, Axes] | None
    why: str
    not_matrix: str | None = None


def matrix_view(
    name: str,
    shape: tuple[int, ...],
    axis_names: tuple[str | None, ...] | None,
    is_expert: bool,
    rules: RoutingRules,
    *,
    stacks: Mapping[str, Axes],
    model_dim: int | None,
    matrix_convention: str = "in_out",
) -> MatrixView:
    """Decide a leaf's stacked axes and matrix axes (the precedence of the module docstring).

    Args:
      name: The leaf's ``/``-joined name.
      shape: Its stored shape.
      axis_names: Its flax logical axis names, or ``None``.
      is_expert: Whether an ``expert`` rule marks it (its experts stack on one axis).
      rules: The routing rules (``dims`` and ``stacked`` are read here).
      stacks: The scanned stacks of the tree (:func:`lwjax.dims.detect_stacks`).
      model_dim: The model width that splits views of 3+ axes, or ``None``.
      matrix_convention: ``"in_out"`` or ``"out_in"``, for the ``dims`` rule a conv
        kernel's reason suggests.

    Raises:
      TypeError: A ``dims`` rule that gives no :class:`~lwjax.dims.MatrixDims`.
      ValueError: A ``dims`` rule on an expert leaf, or a stack that leaves no axis.
    """
    from_rule = _view_from_dims_rule(name, shape, is_expert, rules)
    if from_rule is not None:
        return from_rule
    stack, why = _declared_stack(name, shape, is_expert, rules)
    if stack is None:
        named = _view_from_axis_names(name, shape, axis_names)
        if named is not None:
            return named
        detected = _detected_stack(name, shape, stacks, model_dim)
        if isinstance(detected, MatrixView):
            return detected
        stack, why = detected
    stack, why = _experts_by_name(name, shape, stack, why, is_expert)
    stack = _checked_stack(name, shape, stack)
    if len(shape) - stack < 3 or is_expert:
        return MatrixView(stack, None, why)
    if dims_lib.is_conv_kernel(name, shape[stack:]):
        conv = _conv_reason(shape, stack, matrix_convention)
        return MatrixView(stack, None, _joined(why, conv), not_matrix=_joined(why, conv))
    found, split_why = dims_lib.dims_from_model_dim(shape, tuple(range(stack)), model_dim, name)
    return MatrixView(stack, found, _joined(why, split_why))


def _view_from_dims_rule(name, shape, is_expert: bool, rules: RoutingRules) -> MatrixView | None:
    """The view a ``dims`` rule gives, or ``None`` without one."""
    dims = apply_rule(rules.dims, name, shape)
    if dims is None:
        return None
    if not isinstance(dims, MatrixDims):
        raise TypeError(f"{name}: a dims rule must give a MatrixDims; got {dims!r}.")
    if is_expert:
        raise ValueError(
            f"{name}: dims=... cannot be combined with expert=...; put the expert axis "
            "first and use stacked=..."
        )
    batch, reduction, output = dims.resolve(shape, name)
    return MatrixView(len(batch), (batch, reduction, output), "dims rule")


def _declared_stack(name, shape, is_expert: bool, rules: RoutingRules) -> tuple[int | None, str]:
    """The stack a ``stacked`` rule declares (an expert leaf: 1), or ``None`` without one."""
    stack = apply_rule(rules.stacked, name, shape)
    if stack is None and is_expert:
        return 1, "expert"
    return stack, f"stacked={stack}" if stack else ""


def _view_from_axis_names(name, shape, axis_names) -> MatrixView | None:
    """The view flax logical axis names give, or ``None`` where they do not decide."""
    if axis_names is None:
        return None
    decided, found, why = dims_lib.dims_from_axis_names(axis_names, shape, name)
    if not decided:
        return None
    if found is None:  # no matrix; named batch axes still stack (no decay), read first
        batch = tuple(a for a, n in enumerate(axis_names) if dims_lib.is_batch_axis_name(n))
        batch = batch[: len(shape) - 1]
        if batch == tuple(range(len(batch))):
            return MatrixView(len(batch), None, why, not_matrix=why)
        rest = tuple(a for a in range(len(shape)) if a not in batch)
        return MatrixView(len(batch), (batch, (), rest), why, not_matrix=why)
    return MatrixView(len(found[0]), found, why)


def _detected_stack(name, shape, stacks: Mapping[str, Axes], model_dim: int | None):
    """The stack of a scanned module found in the tree: ``(leading stack count, why)``
    (``None`` where none was found), or the whole view where the stack axes do not lead."""
    if name not in stacks:
        return None, ""
    batch = stacks[name]
    why = f"scanned stack of {tuple(shape[a] for a in batch)} on axes {batch} (found in its module)"
    if batch == tuple(range(len(batch))):
        return len(batch), why
    rest = tuple(a for a in range(len(shape)) if a not in batch)
    if len(rest) < 2:
        return MatrixView(len(batch), (batch, (), rest), why, not_matrix=f"{why}; vectors")
    if len(rest) == 2:
        return MatrixView(len(batch), (batch, rest[:1], rest[1:]), why)
    found, split_why = dims_lib.dims_from_model_dim(shape, batch, model_dim, name)
    if found is None:  # no matrix: read with the stack first all the same
        return MatrixView(len(batch), (batch, (), rest), why, not_matrix=_joined(why, split_why))
    return MatrixView(len(batch), found, _joined(why, split_why))


def _conv_reason(shape, stack: int, matrix_convention: str) -> str:
    """Why a conv kernel goes to AdamW, and the ``dims`` rule that makes it one Muon matrix."""
    dims = dims_lib.conv_dims(len(shape) - stack, matrix_convention)
    if stack:
        dims = MatrixDims(
            tuple(a + stack for a in dims.reduction), tuple(a + stack for a in dims.output)
        )
    return f"a conv kernel: for one Muon matrix of it, give dims={dims}"


def _experts_by_name(name, shape, stack: int | None, why: str, is_expert: bool):
    """One more stacked axis for a 3+-axis leaf in an expert-named module, not marked
    ``expert``: one matrix per expert, not all experts in one."""
    if is_expert or len(shape) - (stack or 0) < 3 or not dims_lib.is_expert_path(name):
        return stack, why
    stack = (stack or 0) + 1
    return stack, _joined(why, f"experts on axis {stack - 1} (by name)")


def _checked_stack(name, shape, stack: int | None) -> int:
    """The stack count (``None``: 0), checked to leave at least one axis."""
    stack = 0 if stack is None else stack
    if not 0 <= stack < max(len(shape), 1):
        raise ValueError(f"{name}: stacked={stack} leading axes leaves no parameter; got {shape=}.")
    return stack


def _joined(*whys: str) -> str:
    """The non-empty reasons, joined with ``; ``."""
    return "; ".join(why for why in whys if why)
