"""Flat parameter buffers: a pytree packed into one flat array per :class:`BufferKey`.

A :class:`ParamPlan` is everything static about a model's buffers: how leaves
route (:mod:`lwjax.routing`), where each parameter sits (:mod:`lwjax.policies`)
and, per data-parallel rank, which elements and whole matrices it owns.

Buffer order is *rank-major*. A Megatron layout interleaves ranks bucket by
bucket (bucket 0: shard 0, shard 1, ...; bucket 1: ...). Here rank ``r``'s
shards of all buckets are stored next to each other, as one *block* of
``block_numel`` elements, and the blocks follow each other in rank order:

.. math::

   \\text{offset}(b, r, o) = r \\cdot S + \\sum_{b' < b} S_{b'} + o,
   \\qquad S = \\sum_b S_b,

where :math:`S_b` is bucket ``b``'s shard size and ``o`` the offset inside the
shard. So a buffer sharded evenly over the dp axis puts exactly rank ``r``'s
shards on device ``r``, and one tiled ``psum_scatter`` / ``all_gather`` moves
all of them. Padding is zero and stays zero.

:func:`pack` and :func:`unpack` are inverses; both are static slices,
reshapes and one concatenation per buffer, so they trace once under ``jit``
or ``shard_map`` and cost nothing per step in Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lwjax.layout import BufferKey, FullParamLayout, PerBufferParamLayout
from lwjax.policies import DEFAULT_POLICY, LayoutPolicy, compute_full_param_layout
from lwjax.routing import LeafRoute, param_specs, route_leaves


@dataclasses.dataclass(frozen=True)
class Segment:
    """A contiguous run of one parameter inside a buffer.

    Attributes:
      leaf: Index of the leaf (pytree flatten order).
      leaf_offset: Start of the run in the flattened leaf.
      buffer_offset: Start of the run in the rank-major buffer.
      numel: Length of the run.
    """

    leaf: int
    leaf_offset: int
    buffer_offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class SlotGroup:
    """Same-shape Muon matrices owned by each rank, for one batched Newton–Schulz.

    Attributes:
      shape: ``(rows, cols)`` of every matrix in the group, as stored.
      qkv_split_shapes: q/k/v rows per query group for fused QKV matrices.
      offsets: ``offsets[r][j]``: start of rank ``r``'s ``j``-th matrix inside
        its block. Ranks owning fewer matrices than the group's width point the
        spare slots at ``block_numel`` (a zero scratch area past the block).
      names: ``names[r]``: the parameters behind rank ``r``'s real slots.
    """

    shape: tuple[int, int]
    qkv_split_shapes: tuple[int, ...] | None
    offsets: tuple[tuple[int, ...], ...]
    names: tuple[tuple[str, ...], ...]

    @property
    def width(self) -> int:
        """Matrices per rank in the batched call (the largest count over ranks)."""
        return len(self.offsets[0])


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """One flat buffer: its key, layout and rank-major geometry.

    Attributes:
      key: The buffer's :class:`BufferKey`.
      layout: Its Megatron-style layout.
      dp: Number of ranks (blocks).
      block_numel: Elements per rank block (sum of the buckets' shard sizes).
      segments: Every parameter run, ordered by ``buffer_offset``.
      slot_groups: For layer-wise buffers, the owned matrices grouped by
        shape; empty for elementwise buffers.
      no_decay: Per rank, ``(block_offset, numel)`` runs that weight decay skips
        (elementwise buffers: biases and other 1-D parameters).
      padding: Per rank, elements of its block that belong to no parameter.
    """

    key: BufferKey
    layout: PerBufferParamLayout
    dp: int
    block_numel: int
    segments: tuple[Segment, ...]
    slot_groups: tuple[SlotGroup, ...]
    no_decay: tuple[tuple[tuple[int, int], ...], ...]
    padding: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Global buffer length, ``dp * block_numel``."""
        return self.dp * self.block_numel


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """Everything static about a model's parameters in lwjax buffers.

    Attributes:
      treedef: The parameter pytree's structure.
      routes: One :class:`~lwjax.routing.LeafRoute` per leaf, flatten order.
      layout: The :class:`~lwjax.layout.FullParamLayout` of all parameters.
      buffers: One :class:`BufferPlan` per buffer, in ``layout`` order.
    """

    treedef: jax.tree_util.PyTreeDef
    routes: tuple[LeafRoute, ...]
    layout: FullParamLayout
    buffers: tuple[BufferPlan, ...]

    @property
    def dp(self) -> int:
        """Dense data-parallel size."""
        return max(b.dp for b in self.buffers if not b.key.is_expert_parallel)


def leaf_records(tree) -> list[tuple]:
    """``(key_path, shape, dtype)`` of every leaf, in flatten order, for routing."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path, tuple(leaf.shape), leaf.dtype) for path, leaf in flat]


def _rank_major(layout: PerBufferParamLayout):
    """Map a Megatron buffer offset to ``(rank, offset in the rank's block)``."""
    shard_sizes = [layout.shard_size(b) for b in range(len(layout.bucket_indices))]
    column = np.cumsum([0, *shard_sizes]).tolist()
    block_numel = column[-1]

    def runs(start: int, end: int, bucket: int):
        """Split ``[start, end)`` at shard boundaries into ``(rank, block_offset, numel)``."""
        bucket_start, _ = layout.bucket_indices[bucket]
        size = shard_sizes[bucket]
        while start < end:
            rank = (start - bucket_start) // size
            stop = min(end, bucket_start + (rank + 1) * size)
            yield rank, column[bucket] + start - bucket_start - rank * size, stop - start
            start = stop

    return block_numel, runs


def _buffer_plan(key: BufferKey, layout: PerBufferParamLayout, routes, where) -> BufferPlan:
    dp = layout.num_shards
    block_numel, runs = _rank_major(layout)
    segments, no_decay = [], [[] for _ in range(dp)]
    owned: dict[tuple, list[list[tuple[int, str]]]] = {}
    used = [0] * dp
    for name, (start, end, bucket) in layout.param_index_map.items():
        leaf, index = where[name]
        route = routes[leaf]
        param_numel = end - start
        param_offset = 0
        for rank, block_offset, numel in runs(start, end, bucket):
            segments.append(
                Segment(leaf, index * param_numel + param_offset, rank * block_numel + block_offset, numel)
            )
            used[rank] += numel
            if len(route.param_shape) <= 1:
                no_decay[rank].append((block_offset, numel))
            param_offset += numel
        if key.is_layer_wise:
            rank = layout.shard_of(name)
            group = owned.setdefault((route.param_shape, route.qkv_split_shapes), [[] for _ in range(dp)])
            group[rank].append((segments[-1].buffer_offset - rank * block_numel, name))
    groups = []
    for (shape, split), per_rank in sorted(owned.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())):
        width = max(len(slots) for slots in per_rank)
        offsets = tuple(
            tuple(sorted(o for o, _ in slots)) + (block_numel,) * (width - len(slots)) for slots in per_rank
        )
        names = tuple(tuple(n for _, n in sorted(slots)) for slots in per_rank)
        groups.append(SlotGroup(shape, split, offsets, names))
    return BufferPlan(
        key=key,
        layout=layout,
        dp=dp,
        block_numel=block_numel,
        segments=tuple(sorted(segments, key=lambda s: s.buffer_offset)),
        slot_groups=tuple(groups),
        no_decay=tuple(tuple(runs_) for runs_ in no_decay),
        padding=tuple(block_numel - u for u in used),
    )


def make_plan(
    params,
    dp: int,
    *,
    policy: LayoutPolicy = DEFAULT_POLICY,
    bucket_size: int | None = None,
    high_busbw: bool = False,
    expert_dp: int | None = None,
    grad_reduce_in_fp32: bool = True,
    **routing,
) -> ParamPlan:
    """Route a parameter pytree and lay out its buffers for ``dp`` ranks.

    Args:
      params: The parameter pytree; leaves may be arrays or
        ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).
      dp: Data-parallel size.
      policy, bucket_size, high_busbw, expert_dp, grad_reduce_in_fp32: See
        :func:`lwjax.policies.compute_full_param_layout`.
      **routing: Rules for :func:`lwjax.routing.route_leaves` (``muon``,
        ``stacked``, ``tied``, ``expert``, ``qkv_split``).

    Returns:
      The static :class:`ParamPlan`.
    """
    routes = route_leaves(leaf_records(params), **routing)
    treedef = jax.tree_util.tree_structure(params)
    where = {}
    for leaf, route in enumerate(routes):
        for index, name in enumerate(route.param_names()):
            where[name] = (leaf, index)
    layout = compute_full_param_layout(
        param_specs(routes),
        dp,
        policy=policy,
        bucket_size=bucket_size,
        high_busbw=high_busbw,
        expert_dp=expert_dp,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )
    buffers = tuple(_buffer_plan(key, lay, routes, where) for key, lay in layout.layouts.items())
    return ParamPlan(treedef=treedef, routes=routes, layout=layout, buffers=buffers)


def check_tree(plan: ParamPlan, tree, what: str) -> list:
    """Flatten ``tree`` after checking it has the plan's structure, shapes and float dtypes.

    Raises:
      ValueError: naming the first mismatching path and what was expected.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    if treedef != plan.treedef:
        raise ValueError(f"{what}: the tree does not match the parameters; expected {plan.treedef}, got {treedef}.")
    for route, leaf in zip(plan.routes, leaves):
        if leaf is None:
            continue
        if tuple(leaf.shape) != route.shape:
            raise ValueError(f"{what}: {route.path}: expected shape {route.shape}; got {tuple(leaf.shape)}.")
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"{what}: {route.path}: expected a floating dtype; got {leaf.dtype}.")
    return leaves


def pack(plan: ParamPlan, tree, dtypes: Sequence | None = None) -> tuple[jax.Array | None, ...]:
    """Pack a parameter-shaped pytree into its flat rank-major buffers (inverse of :func:`unpack`).

    Args:
      plan: The model's :class:`ParamPlan`.
      tree: A pytree with the parameters' structure and shapes. Leaves may be
        ``None`` where every buffer holding them is skipped.
      dtypes: Per buffer, the dtype to pack into, or ``None`` to skip the
        buffer; defaults to each buffer's parameter dtype.

    Returns:
      One 1-D array of ``buffer.numel`` elements per buffer (``None`` for
      skipped buffers), zero in padding.
    """
    dtypes = [b.key.param_dtype for b in plan.buffers] if dtypes is None else dtypes
    leaves = [None if x is None else jnp.ravel(x) for x in check_tree(plan, tree, "pack")]
    out = []
    for buffer, dtype in zip(plan.buffers, dtypes):
        if dtype is None:
            out.append(None)
            continue
        pieces, cursor = [], 0
        for seg in buffer.segments:
            if seg.buffer_offset > cursor:
                pieces.append(jnp.zeros(seg.buffer_offset - cursor, dtype))
            pieces.append(leaves[seg.leaf][seg.leaf_offset : seg.leaf_offset + seg.numel].astype(dtype))
            cursor = seg.buffer_offset + seg.numel
        if buffer.numel > cursor:
            pieces.append(jnp.zeros(buffer.numel - cursor, dtype))
        out.append(jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0])
    return tuple(out)


def unpack(plan: ParamPlan, buffers: Sequence[jax.Array | None], dtypes: Sequence | None = None):
    """Rebuild the parameter pytree from flat rank-major buffers (inverse of :func:`pack`).

    Args:
      plan: The model's :class:`ParamPlan`.
      buffers: One 1-D array of ``buffer.numel`` elements per buffer, or
        ``None``; leaves held by a ``None`` buffer come back as ``None``.
      dtypes: Per leaf, the dtype to return; defaults to the routed leaf dtype.

    Returns:
      The parameter pytree.
    """
    pieces: list[list[tuple[int, jax.Array]] | None] = [[] for _ in plan.routes]
    for buffer, flat in zip(plan.buffers, buffers):
        for seg in buffer.segments:
            if flat is None:
                pieces[seg.leaf] = None
            elif pieces[seg.leaf] is not None:
                pieces[seg.leaf].append((seg.leaf_offset, flat[seg.buffer_offset : seg.buffer_offset + seg.numel]))
    leaves = []
    for i, route in enumerate(plan.routes):
        if pieces[i] is None:
            leaves.append(None)
            continue
        runs = [x for _, x in sorted(pieces[i], key=lambda p: p[0])]
        flat = jnp.concatenate(runs) if len(runs) > 1 else runs[0]
        dtype = dtypes[i] if dtypes is not None else route.dtype
        leaves.append(flat.reshape(route.shape).astype(dtype))
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
