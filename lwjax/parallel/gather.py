r"""Parameters split over FSDP axes, gathered where the model uses them.

A training step over parameters split over an FSDP axis (one that also splits
the batch: :class:`lwjax.TrainStepOptions` ``fsdp_axes``) hands its loss each
device's *blocks* of the split leaves. The model calls :func:`gather_params` on
a tree of them where it needs them whole: once on each scanned layer's
parameters inside the scan's body (inside ``jax.checkpoint`` with
rematerialisation, so the backward gathers the layer again instead of keeping
it), and once on the parameters outside the scan. One layer is then whole at a
time. (An embedding table split on its width axis need not be gathered at all:
:func:`gather_rows` looks up each device's columns of the group's tokens.)
The gather's transpose reduce-scatters each gradient in the backward:
device :math:`d` of the :math:`n` devices of the axis receives

.. math:: \bar g_d = \sum_{e=1}^{n} g_e[\text{block } d],

the sum over the devices of their gradients of its block, reduced in
``reduce_dtype`` (fp32 with ``grad_reduce_in_fp32``) and rounded to the
block's dtype once. The step divides by :math:`n` (the mean loss over the
devices' batches), as it averages the leaves no FSDP axis splits.

Which axes of a block to gather comes from the step's table of its leaves
(:class:`ParamGather`, active while the step traces the loss): a block of
local shape :math:`s` is a leaf, or a trailing slice of a stacked leaf
(a scanned layer), whose local shape ends in :math:`s`; every such leaf must
split those trailing axes over the same FSDP axes, or the call asks for
``specs``. Outside ``shard_map`` (model initialisation, evaluation on global
arrays) the arrays are whole and the tree is returned as it is; so is any
tree when the step has no FSDP axes (data or tensor parallelism alone).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

Split = tuple[tuple[str, ...], ...]  # per axis of a block, the mesh axes it is gathered over


@dataclasses.dataclass(frozen=True)
class LeafBlock:
    """One parameter leaf as each device holds it inside the step's loss.

    Attributes:
      path: The leaf's name (``/``-joined key path).
      shape: The device's block: the leaf's shape, each axis divided by the
        sizes of the manual (batch-splitting) mesh axes that split it.
      split: Per axis, the FSDP axes that split it (``()``: whole).
    """

    path: str
    shape: tuple[int, ...]
    split: Split

    def trailing(self, ndim: int) -> Split | None:
        """The split of a block of this leaf's last ``ndim`` axes (a scanned slice), or
        ``None`` where this leaf has no such block: too few axes, or a leading axis split."""
        if ndim > len(self.shape) or any(self.split[: len(self.shape) - ndim]):
            return None
        return self.split[len(self.shape) - ndim :]


_ACTIVE: contextvars.ContextVar[ParamGather | None] = contextvars.ContextVar(
    "lwjax_param_gather", default=None
)


@dataclasses.dataclass(frozen=True)
class ParamGather:
    """A step's parameter blocks and how their gradients are reduced: what
    :func:`gather_params` reads while the step traces its loss (:meth:`active`).

    Attributes:
      leaves: Every parameter leaf, as its loss sees it.
      axes: The FSDP axes (manual in the loss's ``shard_map``); ``()``: none,
        :func:`gather_params` returns its tree as it is.
      reduce_dtype: The dtype a gathered block's gradient is summed in
        (``None``: the block's own).
    """

    leaves: tuple[LeafBlock, ...]
    axes: tuple[str, ...]
    reduce_dtype: Any = None

    @contextlib.contextmanager
    def active(self) -> Iterator[ParamGather]:
        """Make this the table :func:`gather_params` reads, for the ``with`` block."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def split_of(self, shape: tuple[int, ...]) -> Split:
        """The split of a block of local ``shape``, from the leaves that can hold it.

        Raises:
          ValueError: no leaf's block ends in ``shape``, or leaves that do split
            it differently.
        """
        found: dict[Split, list[str]] = {}
        for leaf in self.leaves:
            split = leaf.trailing(len(shape))
            if split is not None and leaf.shape[len(leaf.shape) - len(shape) :] == shape:
                found.setdefault(split, []).append(leaf.path)
        if len(found) == 1:
            return next(iter(found))
        if not found:
            raise ValueError(
                f"gather_params: no parameter of the step has a block of local shape {shape} "
                f"(the shapes inside the step: {sorted({leaf.shape for leaf in self.leaves})}); "
                "pass it the parameters (or one scanned layer of them) as the step hands them in."
            )
        raise ValueError(
            f"gather_params: a block of local shape {shape} may be "
            + "; or ".join(f"{_split_text(s)} ({', '.join(paths)})" for s, paths in found.items())
            + ". Pass specs=, the PartitionSpecs of the tree's leaves as they are here."
        )

    def gather(self, tree, specs=None):
        """``tree``'s leaves gathered over :attr:`axes` (see :func:`gather_params`)."""
        if not self.axes:
            return tree
        if specs is None:
            return jax.tree.map(
                lambda x: _gathered(x, self.split_of(x.shape), self.reduce_dtype), tree
            )
        return jax.tree.map(
            lambda spec, x: _gathered(x, _spec_split(spec, x.ndim, self.axes), self.reduce_dtype),
            specs,
            tree,
            is_leaf=lambda s: isinstance(s, P),
        )


WHOLE = ParamGather((), ())
"""The table of a step whose loss sees whole parameters: :func:`gather_params` passes them."""


def param_gather(
    paths: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    specs: Sequence[P],
    mesh_shape: dict[str, int],
    manual: Sequence[str],
    axes: Sequence[str],
    *,
    reduce_dtype=None,
) -> ParamGather:
    """The :class:`ParamGather` of leaves of global ``shapes`` split as ``specs`` say, inside a
    ``shard_map`` manual over ``manual`` (the batch axes), gathering over ``axes`` (among them)."""
    manual, axes = set(manual), tuple(axes)
    leaves = []
    for path, shape, spec in zip(paths, shapes, specs):
        names = [_names(spec[i]) if i < len(spec) else () for i in range(len(shape))]
        local = tuple(
            size // math.prod(mesh_shape[a] for a in n if a in manual)
            for size, n in zip(shape, names)
        )
        split = tuple(tuple(a for a in n if a in axes) for n in names)
        leaves.append(LeafBlock(path, local, split))
    return ParamGather(tuple(leaves), axes, reduce_dtype)


def active_gather() -> ParamGather | None:
    """The table of the step now tracing its loss, or ``None``."""
    return _ACTIVE.get()


def gather_params(tree, specs=None):
    """``tree`` with each leaf whole over the step's FSDP axes: inside the loss of a step over
    parameters split over them, call it on each scanned layer's parameters in the scan's body,
    and on the rest of the parameters once.

    Each leaf is all-gathered over the FSDP axes that split it (tiled, on the
    axis they split); its gradient is reduce-scattered back in the backward,
    summed in the step's reduction dtype. Leaves no FSDP axis splits pass
    through. The blocks are told apart by their local shapes (see
    :mod:`lwjax.parallel.gather`); ``specs`` says instead.

    Works with any pytree of arrays: a dict, a flax nnx ``State`` (merge the
    gathered state into the layer's graph), linen's variables (as
    ``nn.map_variables(..., trans_in_fn=lwjax.gather_params)`` of the scanned
    module).

    Args:
      tree: Parameters as the step hands them to the loss, or a scanned slice
        of them (one layer's).
      specs: ``None``, or the ``PartitionSpec`` of each leaf of ``tree`` as it
        is here (a scanned layer's: without the scanned axis), a pytree prefix
        of ``tree``.

    Returns:
      ``tree`` with its leaves gathered; unchanged outside ``shard_map``, or
      when the step has no FSDP axes.

    Raises:
      ValueError: inside a ``shard_map`` that is not a training step's loss
        (:func:`lwjax.make_train_step`, :func:`lwjax.value_and_grad`) and
        without ``specs``; a block no parameter has, or one whose leaves split
        it differently (pass ``specs``).
    """
    gather = _ACTIVE.get()
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    if gather is None and not manual:
        return tree  # outside shard_map every array is whole
    if gather is None:
        if specs is None:
            raise ValueError(
                f"gather_params: called inside shard_map over {manual} but not in the loss of "
                "lwjax.make_train_step or lwjax.value_and_grad; pass specs= (the leaves' "
                "PartitionSpecs as they are here), or activate a ParamGather."
            )
        gather = ParamGather((), manual)
    return gather.gather(tree, specs)


def gather_rows(table, ids):
    r"""``gather_params(table)[ids]`` without gathering ``table``: an embedding lookup inside
    the loss of a step that splits the table over an FSDP axis on its last (width) axis.

    Device :math:`e` of the :math:`n` devices of the axis holds columns :math:`C_e` of
    the table. The ids are all-gathered over the axis (:math:`n` times the device's
    integers), each device looks up its columns of every device's tokens, and an
    all-to-all hands device :math:`d` its own tokens' rows, whole:

    .. math:: x_d[t] = \big(T[\mathrm{ids}_d[t], C_1], \ldots, T[\mathrm{ids}_d[t], C_n]\big).

    Its transpose sends each token's gradient back to the devices that hold its columns,
    each of which adds them into its block in the step's reduction dtype: the table and
    its gradient never exist whole (at Llama-3-70B on fsdp 8, 2.1 GB of table and 4.2 GB
    of fp32 gradient per device), and the bytes moved are the tokens' rows, not the
    table's. The values are those of ``gather_params(table)[ids]``; the gradient is the
    same sum, added in the reduction dtype in another order.

    Where :func:`gather_params` would return ``table`` as it is (outside a step, no FSDP
    axes, a table no FSDP axis splits) this is ``table[ids]``; a table split otherwise (on
    its rows, or over several axes) is gathered with :func:`gather_params` first.
    """
    gather = _ACTIVE.get()
    if gather is None or not gather.axes:
        return gather_params(table)[ids]
    split = gather.split_of(table.shape)
    if len(split) != 2 or split[0] or len(split[1]) != 1:
        return gather.gather(table)[ids]
    axis = split[1][0]
    everyone = lax.all_gather(ids, axis, axis=0, tiled=True)
    return _rows(table, everyone, axis, gather.reduce_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rows(table, everyone, axis, reduce_dtype):
    """Each token's row of ``table``'s columns, sent to the device whose token it is."""
    return lax.all_to_all(table[everyone], axis, 0, everyone.ndim, tiled=True)


def _rows_forward(table, everyone, axis, reduce_dtype):
    return _rows(table, everyone, axis, reduce_dtype), (everyone, table)


def _rows_backward(axis, reduce_dtype, residual, g):
    """Each token's gradient sent back to the devices holding its columns and added into
    the block in ``reduce_dtype`` (a copy of the block's size, never of the table)."""
    everyone, table = residual
    g = g.astype(reduce_dtype or g.dtype)
    columns = lax.all_to_all(g, axis, everyone.ndim, 0, tiled=True)
    block = jnp.zeros(table.shape, columns.dtype).at[everyone].add(columns)
    return block.astype(table.dtype), None


_rows.defvjp(_rows_forward, _rows_backward)


def _names(entry) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_split(spec: P, ndim: int, axes: tuple[str, ...]) -> Split:
    """A block's split from its ``PartitionSpec``: per axis, the names among ``axes``."""
    if len(spec) > ndim:
        raise ValueError(
            f"gather_params: spec {spec} has more entries than its leaf's {ndim} axes."
        )
    return tuple(
        tuple(a for a in _names(spec[i]) if a in axes) if i < len(spec) else () for i in range(ndim)
    )


def _split_text(split: Split) -> str:
    """``split over 'fsdp' on axis 1``, or ``whole``."""
    parts = [f"{n if len(n) > 1 else n[0]!r} on axis {i}" for i, n in enumerate(split) if n]
    return "split over " + ", ".join(parts) if parts else "whole"


def _gathered(x: jax.Array, split: Split, reduce_dtype) -> jax.Array:
    """``x`` all-gathered as ``split`` says; ``x`` itself when it is whole."""
    return _gather_reducing(x, split, reduce_dtype) if any(split) else x


def _all_gather(x, split: Split):
    for dim, names in enumerate(split):
        if names:
            x = lax.all_gather(x, names if len(names) > 1 else names[0], axis=dim, tiled=True)
    return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_reducing(x, split: Split, reduce_dtype):
    return _all_gather(x, split)


def _gather_forward(x, split, reduce_dtype):
    return _all_gather(x, split), None


def _scatter_backward(split, reduce_dtype, _, g):
    """The transpose of the gather: each block's gradient summed over the devices (in
    ``reduce_dtype``) and scattered, rounded to the block's dtype once."""
    dtype = g.dtype
    g = g.astype(reduce_dtype or dtype)
    for dim in reversed(range(len(split))):
        if split[dim]:
            names = split[dim]
            g = lax.psum_scatter(
                g, names if len(names) > 1 else names[0], scatter_dimension=dim, tiled=True
            )
    return (g.astype(dtype),)


_gather_reducing.defvjp(_gather_forward, _scatter_backward)
