"""Per-rank tables of a model's buffers, built from its routes and layouts (pure Python).

The producer/consumer split of Megatron's ``param_layout.py``: :mod:`lwjax.routing`
says what each leaf is, :mod:`lwjax.policies` where each parameter lies
(:class:`~lwjax.layout.FullParamLayout`), and :func:`make_plan` turns both into
the tables a data-parallel step reads, knowing nothing of how they were made:

* per bucket and rank, the runs of parameter elements in the rank's shard and
  its padding (:attr:`BufferPlan.runs`, :attr:`BufferPlan.padding`);
* per layer-wise bucket, the whole matrices each rank owns, grouped by shape
  for one batched Newton–Schulz (:class:`SlotGroup`);
* the mesh axes each buffer is reduce-scattered over
  (:class:`~lwjax.parallel.axes.MeshAxes`).

:class:`lwjax.plan.StepPlan` adds what the step needs besides: the bucket
schedule, the options and per-leaf values.

A bucket is a flat array of ``dp * S_b`` elements in Megatron's order: shard
``r`` (rank ``r``'s share) is ``[r S_b, (r + 1) S_b)``. Expert leaves are
planned from their *local* shapes (``E / ep`` experts, see
:attr:`lwjax.routing.LeafRoute.local_shape`): every expert-parallel rank has the
same layout over its own experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lwjax.layout import MAX_BUCKET_ELEMENTS, BufferKey, FullParamLayout, PerBufferParamLayout
from lwjax.parallel.axes import MeshAxes
from lwjax.routing import LeafRoute


@dataclasses.dataclass(frozen=True)
class Segment:
    """One parameter inside a bucket.

    Attributes:
      leaf: Index of the leaf (pytree flatten order).
      leaf_offset: Start of the parameter in the flattened leaf.
      bucket: The bucket holding it.
      offset: Start of the parameter in the bucket's flat array.
      numel: Number of elements.
    """

    leaf: int
    leaf_offset: int
    bucket: int
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class SlotGroup:
    """Same-shape Muon matrices of one bucket, per rank, for one batched Newton–Schulz.

    Attributes:
      bucket: The bucket the matrices live in.
      shape: ``(rows, cols)`` of every matrix in the group, as stored.
      qkv_split_shapes: q/k/v rows per query group for fused QKV matrices.
      offsets: ``offsets[r][j]``: start of rank ``r``'s ``j``-th matrix inside
        its shard. Ranks owning fewer matrices than the group's width point the
        spare slots at the shard size (a zero scratch area past the shard).
      names: ``names[r]``: the parameters behind rank ``r``'s real slots.
      lr_mult, wd_mult: The learning-rate and weight-decay multipliers shared
        by every matrix of the group.
      tensor_split: The tensor-parallel mesh axes (positions in
        ``MeshAxes.tp``) that split the rows and the columns of each matrix,
        major first: ``shape`` is one device's block. ``((), ())``: whole.
      tensor_whole: The tensor-parallel mesh axes over which every device
        holds the same matrices (counted on the first device of each).
      ns_devices: ``ns_devices[r][j]``: the device (its index over the
        splitting axes, as :class:`lwjax.parallel.exchange.TensorSplit` orders
        them) that assembles and orthogonalises rank ``r``'s ``j``-th matrix under
        ``tp_mode="duplicated"`` (:mod:`lwjax.parallel.ns_deal`); ``()``: none dealt.
    """

    bucket: int
    shape: tuple[int, int]
    qkv_split_shapes: tuple[int, ...] | None
    offsets: tuple[tuple[int, ...], ...]
    names: tuple[tuple[str, ...], ...]
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    tensor_split: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    tensor_whole: tuple[int, ...] = ()
    ns_devices: tuple[tuple[int, ...], ...] = ()

    @property
    def width(self) -> int:
        """Matrices per rank in the batched call (the largest count over ranks)."""
        return len(self.offsets[0])


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """One flat buffer: its key, layout and per-bucket geometry.

    Attributes:
      key: The buffer's :class:`BufferKey`.
      layout: Its Megatron-style layout.
      dp: Number of shards per bucket.
      shard_sizes: Elements per shard, per bucket.
      segments: Every parameter, ordered by (bucket, offset).
      slot_groups: For layer-wise buffers, the owned matrices grouped by
        bucket and shape; empty for elementwise buffers.
      padding: ``padding[b][r]``: elements of that shard that belong to no parameter.
      runs: ``runs[b][r]``: ``(shard_offset, numel, leaf)`` of every parameter
        run inside rank ``r``'s shard of bucket ``b``, in shard order; per-leaf
        options (multipliers, norm groups) become per-element vectors from it.
    """

    key: BufferKey
    layout: PerBufferParamLayout
    dp: int
    shard_sizes: tuple[int, ...]
    segments: tuple[Segment, ...]
    slot_groups: tuple[SlotGroup, ...]
    padding: tuple[tuple[int, ...], ...]
    runs: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...] = ()

    @property
    def numel(self) -> int:
        """Buffer length over all buckets, padding included."""
        return self.layout.numel

    @property
    def num_buckets(self) -> int:
        """Number of buckets."""
        return len(self.shard_sizes)


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """Everything static about a model's parameters in lwjax buffers.

    Attributes:
      treedef: The parameter pytree's structure.
      routes: One :class:`~lwjax.routing.LeafRoute` per leaf, flatten order.
      layout: The :class:`~lwjax.layout.FullParamLayout` of all parameters.
      buffers: One :class:`BufferPlan` per buffer, in ``layout`` order.
      axes: The mesh axes the buffers are sharded over.
    """

    treedef: Any  # jax.tree_util.PyTreeDef
    routes: tuple[LeafRoute, ...]
    layout: FullParamLayout
    buffers: tuple[BufferPlan, ...]
    axes: MeshAxes

    @property
    def grad_norm_groups(self) -> tuple[str, ...]:
        """Names of the separate gradient-norm groups, sorted (the main norm is not listed)."""
        return tuple(
            sorted({r.grad_norm_group for r in self.routes if r.grad_norm_group is not None})
        )

    @property
    def has_experts(self) -> bool:
        """Whether any leaf is expert-parallel."""
        return any(r.is_expert for r in self.routes)


def make_plan(
    treedef, routes: Sequence[LeafRoute], layout: FullParamLayout, axes: MeshAxes
) -> ParamPlan:
    """Build the per-rank tables of every buffer of ``layout``.

    Args:
      treedef: The parameter pytree's structure (``routes`` in its flatten order).
      routes: One route per leaf (:func:`lwjax.routing.route_leaves`).
      layout: Where every parameter lies (:func:`lwjax.policies.compute_full_param_layout`
        of the routes' :func:`~lwjax.routing.param_specs`).
      axes: The mesh axes the layout's shards live on.

    Returns:
      The static :class:`ParamPlan`.
    """
    where = {}  # parameter name -> (leaf, index among the leaf's stacked parameters)
    for leaf, route in enumerate(routes):
        for index, name in enumerate(route.param_names()):
            where[name] = (leaf, index)
    buffers = tuple(_plan_buffer(key, lay, routes, where) for key, lay in layout.layouts.items())
    return ParamPlan(
        treedef=treedef, routes=tuple(routes), layout=layout, buffers=buffers, axes=axes
    )


def _plan_buffer(key: BufferKey, layout: PerBufferParamLayout, routes, where) -> BufferPlan:
    """One buffer's segments, per-rank runs and padding, and (layer-wise) slot groups."""
    dp = layout.num_shards
    sizes = tuple(layout.shard_size(b) for b in range(len(layout.bucket_indices)))
    for bucket, size in enumerate(sizes):
        if size > MAX_BUCKET_ELEMENTS:
            numel, name = max(
                (end - start, name)
                for name, (start, end, b) in layout.param_index_map.items()
                if b == bucket
            )
            raise ValueError(
                f"layout: each shard of bucket {bucket} of buffer {key} holds {size:,} elements "
                f"(its largest parameter: {name}, {numel:,}); lwjax indexes a shard with int32 "
                f"offsets, so it must hold at most {MAX_BUCKET_ELEMENTS:,}. Set "
                "LayoutConfig.bucket_size to split the buffer into smaller buckets; a single "
                "parameter that large has to be split over a tensor-parallel axis (param_axes)."
            )
    segments = []
    runs = [[[] for _ in range(dp)] for _ in sizes]
    used = [[0] * dp for _ in sizes]
    owned: dict[
        tuple, list[list[tuple[int, str]]]
    ] = {}  # slot group key -> per rank (shard offset, name)
    for name, (start, end, bucket) in layout.param_index_map.items():
        leaf, index = where[name]
        route = routes[leaf]
        bucket_start, _ = layout.bucket_indices[bucket]
        size = sizes[bucket]
        segments.append(
            Segment(leaf, index * (end - start), bucket, start - bucket_start, end - start)
        )
        cursor = start - bucket_start
        while cursor < end - bucket_start:  # the parameter's runs in each shard it touches
            rank, stop = cursor // size, min(end - bucket_start, (cursor // size + 1) * size)
            used[bucket][rank] += stop - cursor
            runs[bucket][rank].append((cursor - rank * size, stop - cursor, leaf))
            cursor = stop
        if key.is_layer_wise:
            rank = layout.shard_of(name)
            group_key = (
                bucket,
                route.param_shape,
                route.qkv_split_shapes,
                route.lr_mult,
                route.wd_mult,
                route.tensor_split,
                route.tensor_whole,
            )
            per_rank = owned.setdefault(group_key, [[] for _ in range(dp)])
            per_rank[rank].append((start - bucket_start - rank * size, name))
    return BufferPlan(
        key=key,
        layout=layout,
        dp=dp,
        shard_sizes=sizes,
        segments=tuple(sorted(segments, key=lambda s: (s.bucket, s.offset))),
        slot_groups=_slot_groups(owned, sizes),
        padding=tuple(tuple(size - u for u in per_bucket) for size, per_bucket in zip(sizes, used)),
        runs=tuple(tuple(tuple(sorted(r)) for r in per_bucket) for per_bucket in runs),
    )


def _slot_groups(
    owned: dict[tuple, list[list[tuple[int, str]]]], sizes: tuple[int, ...]
) -> tuple[SlotGroup, ...]:
    """Slot groups in a deterministic order (bucket, shape, split, multipliers), spare slots padded.

    A rank that owns fewer matrices of a group than the widest rank points its
    spare slots at the shard size, a zero scratch area past its shard.
    """

    def order(item):
        bucket, shape, split, lr_mult, wd_mult, tensor_split, whole = item[0]
        return bucket, shape, split or (), lr_mult, wd_mult, tensor_split, whole

    groups = []
    for key, per_rank in sorted(owned.items(), key=order):
        bucket, shape, split, lr_mult, wd_mult, tensor_split, whole = key
        width = max(len(slots) for slots in per_rank)
        offsets = tuple(
            tuple(sorted(o for o, _ in s)) + (sizes[bucket],) * (width - len(s)) for s in per_rank
        )
        names = tuple(tuple(n for _, n in sorted(s)) for s in per_rank)
        groups.append(
            SlotGroup(bucket, shape, split, offsets, names, lr_mult, wd_mult, tensor_split, whole)
        )
    return tuple(groups)
