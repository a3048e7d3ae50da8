"""A leaf's device geometry: the block one device holds, how its matrices split (pure Python).

A route (:class:`lwjax.routing.LeafRoute`) stores a leaf's global ``shape``. One
device holds a block of it:

* the expert axis ``expert_dim`` divided by ``expert_parallel``;
* each tensor-parallel (or FSDP) mesh axis ``a`` that splits stored axis
  ``tensor_dims[a]`` divides it by ``tensor_sizes[a]``; two mesh axes on one
  stored axis split it major-first, in mesh-axis order.

The optimizer reads a leaf transposed to ``axes_order`` and merged into ``view``:
``stack_dims`` batch axes, then a Muon matrix's rows and columns. Each axis of the
view *spans* a run of consecutive transposed stored axes, whose product is its size
(the last view axis takes what is left). A mesh axis that splits a stored axis in the
span of the rows (columns) splits each device's matrix by rows (columns); one that
splits a stacked axis gives each device other matrices and splits none.

:class:`LeafGeometry` computes this from a route's fields; :func:`with_tensor_parallel`
marks routes with the mesh axes that split them and checks the split is one the step
can run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypeVar


class LeafGeometry:
    """What a device holds of a leaf, read from the fields of a route (a mixin).

    :class:`lwjax.routing.LeafRoute` is the dataclass that carries the fields below
    (see it for their meaning); this class adds only the properties derived from them.
    :func:`with_tensor_parallel` also reads ``path`` (for its errors) and
    ``qkv_split_shapes`` (a split must keep a fused QKV matrix's query groups whole).
    """

    path: str
    shape: tuple[int, ...]
    stack_dims: int
    axes_order: tuple[int, ...] | None
    view: tuple[int, ...] | None
    expert_dim: int | None
    expert_parallel: int
    tensor_dims: tuple[int | None, ...]
    tensor_sizes: tuple[int, ...]
    qkv_split_shapes: tuple[int, ...] | None

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of each (device-local) stacked parameter, in the view's order.

        A Muon matrix's ``[rows, cols]``; with tensor parallelism, the block
        one device holds (:attr:`full_param_shape` is the whole matrix).
        """
        return self._merged(self.local_shape)[self.stack_dims :]

    @property
    def full_param_shape(self) -> tuple[int, ...]:
        """Shape of each stacked parameter as the whole tensor-parallel group holds it."""
        return (self.view or self.shape)[self.stack_dims :]

    @property
    def tensor_split(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The tensor-parallel mesh axes (their positions) that split each axis of
        :attr:`param_shape`, ``(rows, cols)``, major first; a mesh axis that splits a
        stacked axis splits no matrix (each device then holds other matrices)."""
        spans, split = self._spans(), ([], [])
        order = []
        for axis, dim in enumerate(self.tensor_dims):
            if dim is None:
                continue
            position = dim if self.axes_order is None else self.axes_order.index(dim)
            view_axis = next(j for j, (a, b) in enumerate(spans) if a <= position < b)
            if view_axis >= self.stack_dims:
                order.append((position, axis, view_axis - self.stack_dims))
        for _, axis, side in sorted(order):
            split[side].append(axis)
        return tuple(split[0]), tuple(split[1])

    @property
    def tensor_whole(self) -> tuple[int, ...]:
        """The tensor-parallel mesh axes (positions) over which every device holds the same
        leaf: its statistics count on the first device of each only."""
        return tuple(axis for axis, dim in enumerate(self.tensor_dims) if dim is None)

    def _spans(self) -> list[tuple[int, int]]:
        """Per axis of the view, the range of transposed stored axes merged into it."""
        ordered = (
            self.shape if self.axes_order is None else tuple(self.shape[a] for a in self.axes_order)
        )
        if self.view is None:
            return [(a, a + 1) for a in range(len(ordered))]
        spans, start = [], 0
        for j, size in enumerate(self.view):
            end, product = start, 1
            last = j == len(self.view) - 1
            while end < len(ordered) and (end == start or product != size or last):
                product *= ordered[end]
                end += 1
            spans.append((start, end))
            start = end
        return spans

    def _merged(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` (stored order) transposed and merged into the view's axes."""
        ordered = shape if self.axes_order is None else tuple(shape[a] for a in self.axes_order)
        return tuple(math.prod(ordered[start:end]) for start, end in self._spans())

    @property
    def local_view(self) -> tuple[int, ...]:
        """The local leaf transposed to :attr:`axes_order` (its flat order in the buffers)."""
        shape = self.local_shape
        return shape if self.axes_order is None else tuple(shape[a] for a in self.axes_order)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The leaf's shape on one device: the expert axis divided by ``expert_parallel``, each
        tensor-parallel split by its mesh axis's size."""
        shape = list(self.shape)
        if self.expert_dim is not None:
            shape[self.expert_dim] //= self.expert_parallel
        for dim, size in zip(self.tensor_dims, self.tensor_sizes):
            if dim is not None:
                shape[dim] //= size
        return tuple(shape)

    @property
    def num_params(self) -> int:
        """How many parameters the leaf stacks on one device."""
        return math.prod(self.local_view[: self.stack_dims])


Route = TypeVar("Route", bound=LeafGeometry)


def with_tensor_parallel(
    routes: Sequence[Route],
    tensor_dims: Sequence[Sequence[int | None]],
    tensor_sizes: Sequence[int],
    *,
    matrix_convention: str = "in_out",
) -> tuple[Route, ...]:
    """``routes`` with each leaf's tensor-parallel axes set, checked for what the step needs.

    Args:
      routes: The routes of :func:`lwjax.routing.route_leaves`, global shapes.
      tensor_dims: Per route, per tensor-parallel mesh axis, the stored axis it
        splits (read from the leaf's sharding), or ``None``.
      tensor_sizes: The tensor-parallel mesh axes' sizes.
      matrix_convention: As for :func:`lwjax.routing.route_leaves` (which matrix
        axis is the output).

    Raises:
      ValueError: naming the leaf, for an axis out of range, one that does not
        divide by its mesh axes' sizes, the expert axis, or a fused QKV matrix
        whose local rows are not whole query groups.
    """
    if len(tensor_dims) != len(routes):
        raise ValueError(
            f"with_tensor_parallel: {len(tensor_dims)} tensor dims for {len(routes)} routes."
        )
    sizes = tuple(tensor_sizes)
    return tuple(
        _split_route(route, tuple(dims), sizes, matrix_convention)
        for route, dims in zip(routes, tensor_dims)
    )


def _split_route(route: Route, dims, sizes: tuple[int, ...], convention: str) -> Route:
    """One route split over the mesh axes of ``sizes`` on its stored axes ``dims``, checked."""
    if len(dims) != len(sizes):
        raise ValueError(f"{route.path}: {len(dims)} tensor dims for {len(sizes)} mesh axes.")
    for dim in dims:
        if dim is not None:
            _check_split_axis(route, dim, dims, sizes)
    split = dataclasses.replace(route, tensor_dims=dims, tensor_sizes=sizes)
    _check_whole_query_groups(split, convention)
    return split


def _check_split_axis(route: LeafGeometry, dim, dims, sizes: tuple[int, ...]) -> None:
    """A stored axis ``dim`` can be split: in range, not the expert axis, and divisible."""
    name, shape = route.path, route.shape
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(shape):
        raise ValueError(f"{name}: tensor-parallel axis {dim!r} is not an axis of {shape=}.")
    if dim == route.expert_dim:
        raise ValueError(
            f"{name}: axis {dim} is the expert axis; it cannot also be split over a "
            "tensor-parallel axis."
        )
    ways = math.prod(size for d, size in zip(dims, sizes) if d == dim)
    if shape[dim] % ways:
        raise ValueError(
            f"{name}: axis {dim} of {shape=} does not divide into the {ways} blocks "
            "its tensor-parallel mesh axes split it into."
        )


def _check_whole_query_groups(split: LeafGeometry, convention: str) -> None:
    """A split fused QKV matrix keeps whole query groups on every device (its output rows)."""
    groups = split.qkv_split_shapes
    if groups is None:
        return
    rows = split.param_shape[1 if convention == "in_out" else 0]
    if rows % sum(groups):
        raise ValueError(
            f"{split.path}: split over tensor parallelism on axes {split.tensor_dims}, a "
            f"device's block {list(split.param_shape)} does not hold whole query groups of "
            f"qkv_split={groups} (split a fused QKV matrix by its query groups, on the output "
            "axis)."
        )
