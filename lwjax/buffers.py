"""Flat parameter buffers: a pytree packed into Megatron-ordered buckets, one set per :class:`BufferKey`.

A :class:`ParamPlan` is everything static about a model's buffers: how leaves
route (:mod:`lwjax.routing`), where each parameter sits (:mod:`lwjax.policies`)
and, per data-parallel rank, which elements and whole matrices it owns.

A buffer is a sequence of buckets, and bucket ``b`` is a flat array of
``dp * S_b`` elements in Megatron's order: shard ``r`` (rank ``r``'s share) is
the contiguous range ``[r S_b, (r + 1) S_b)``. So a bucket array sharded evenly
over the dp axis puts exactly rank ``r``'s shard on device ``r``, one tiled
``psum_scatter`` per bucket delivers each rank its reduced shard, and one tiled
``all_gather`` per bucket rebuilds it. Optimizer state is stored the same way,
one array per (buffer, bucket). Padding is zero and stays zero.

:func:`pack` and :func:`unpack` are inverses made of static slices, row gathers,
reshapes and a concatenation (or in-place writes) per bucket, so they trace once
under ``jit`` or ``shard_map`` and cost nothing per step in Python.

Expert leaves are planned from their *local* shapes (``E / ep`` experts, see
:attr:`lwjax.routing.LeafRoute.local_shape`): every expert-parallel rank has the
same layout over its own experts, so :func:`pack` and :func:`unpack` work on
device-local pytrees, which equal the global ones when there are no experts.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from lwjax.layout import BufferKey, FullParamLayout, PerBufferParamLayout
from lwjax.policies import DEFAULT_POLICY, LayoutPolicy, compute_full_param_layout
from lwjax.routing import LeafRoute, param_specs, route_leaves

# How :func:`pack` builds a bucket: one concatenate of its pieces (gaps, and runs of
# one stacked leaf's rows) when it has at most this many, else piece by piece into
# a zeroed array, which writes the bucket twice. XLA's concatenate runs near memory
# bandwidth for a few operands and far below it for many (measured on H200:
# docs/benchmarks.md).
MAX_CONCAT_OPERANDS = 8

Buckets = tuple[jax.Array | None, ...]


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
    """

    bucket: int
    shape: tuple[int, int]
    qkv_split_shapes: tuple[int, ...] | None
    offsets: tuple[tuple[int, ...], ...]
    names: tuple[tuple[str, ...], ...]
    lr_mult: float = 1.0
    wd_mult: float = 1.0

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
      no_decay: ``no_decay[b][r]``: ``(shard_offset, numel)`` runs of rank
        ``r``'s shard of bucket ``b`` that weight decay skips (1-D parameters).
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
    no_decay: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    padding: tuple[tuple[int, ...], ...]
    runs: tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...] = ()

    @property
    def numel(self) -> int:
        """Buffer length over all buckets, padding included."""
        return self.layout.numel

    @property
    def num_buckets(self) -> int:
        return len(self.shard_sizes)


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
    def grad_norm_groups(self) -> tuple[str, ...]:
        """Names of the separate gradient-norm groups, sorted (the main norm is not listed)."""
        return tuple(sorted({r.grad_norm_group for r in self.routes if r.grad_norm_group is not None}))

    @property
    def has_experts(self) -> bool:
        """Whether any leaf is expert-parallel."""
        return any(r.is_expert for r in self.routes)


def leaf_records(tree) -> list[tuple]:
    """``(key_path, shape, dtype)`` of every leaf, in flatten order, for routing."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path, tuple(leaf.shape), leaf.dtype) for path, leaf in flat]


def _buffer_plan(key: BufferKey, layout: PerBufferParamLayout, routes, where) -> BufferPlan:
    dp = layout.num_shards
    sizes = tuple(layout.shard_size(b) for b in range(len(layout.bucket_indices)))
    segments = []
    no_decay = [[[] for _ in range(dp)] for _ in sizes]
    runs = [[[] for _ in range(dp)] for _ in sizes]
    used = [[0] * dp for _ in sizes]
    owned: dict[tuple, list[list[tuple[int, str]]]] = {}
    for name, (start, end, bucket) in layout.param_index_map.items():
        leaf, index = where[name]
        route = routes[leaf]
        bucket_start, _ = layout.bucket_indices[bucket]
        size = sizes[bucket]
        segments.append(Segment(leaf, index * (end - start), bucket, start - bucket_start, end - start))
        cursor = start - bucket_start
        while cursor < end - bucket_start:  # the parameter's runs in each shard it touches
            rank, stop = cursor // size, min(end - bucket_start, (cursor // size + 1) * size)
            used[bucket][rank] += stop - cursor
            runs[bucket][rank].append((cursor - rank * size, stop - cursor, leaf))
            if len(route.param_shape) <= 1:
                no_decay[bucket][rank].append((cursor - rank * size, stop - cursor))
            cursor = stop
        if key.is_layer_wise:
            rank = layout.shard_of(name)
            group_key = (bucket, route.param_shape, route.qkv_split_shapes, route.lr_mult, route.wd_mult)
            per_rank = owned.setdefault(group_key, [[] for _ in range(dp)])
            per_rank[rank].append((start - bucket_start - rank * size, name))
    groups = []
    order = lambda kv: (kv[0][0], kv[0][1], kv[0][2] or (), kv[0][3], kv[0][4])  # noqa: E731
    for (bucket, shape, split, lr_mult, wd_mult), per_rank in sorted(owned.items(), key=order):
        width = max(len(slots) for slots in per_rank)
        offsets = tuple(tuple(sorted(o for o, _ in s)) + (sizes[bucket],) * (width - len(s)) for s in per_rank)
        names = tuple(tuple(n for _, n in sorted(s)) for s in per_rank)
        groups.append(SlotGroup(bucket, shape, split, offsets, names, lr_mult, wd_mult))
    return BufferPlan(
        key=key,
        layout=layout,
        dp=dp,
        shard_sizes=sizes,
        segments=tuple(sorted(segments, key=lambda s: (s.bucket, s.offset))),
        slot_groups=tuple(groups),
        no_decay=tuple(tuple(tuple(runs) for runs in per_bucket) for per_bucket in no_decay),
        padding=tuple(tuple(size - u for u in per_bucket) for size, per_bucket in zip(sizes, used)),
        runs=tuple(tuple(tuple(sorted(r)) for r in per_bucket) for per_bucket in runs),
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
    expert_parallel: int = 1,
    **routing,
) -> ParamPlan:
    """Route a parameter pytree and lay out its buffers for ``dp`` ranks.

    Args:
      params: The (global) parameter pytree; leaves may be arrays or
        ``jax.ShapeDtypeStruct`` (only shapes and dtypes are read).
      dp: Data-parallel size of dense buffers (all data-parallel devices).
      policy, bucket_size, high_busbw, expert_dp, grad_reduce_in_fp32: See
        :func:`lwjax.policies.compute_full_param_layout`.
      expert_parallel: Expert-parallel size; expert leaves are laid out from
        their local shapes (``E / expert_parallel`` experts).
      **routing: Rules for :func:`lwjax.routing.route_leaves` (``is_muon``,
        ``stacked``, ``tied``, ``expert``, ``qkv_split``, ``lr_mult``,
        ``wd_mult``, ``grad_norm_group``).

    Returns:
      The static :class:`ParamPlan`.
    """
    routes = route_leaves(leaf_records(params), expert_parallel=expert_parallel, **routing)
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


def check_tree(plan: ParamPlan, tree, what: str, *, local: bool = True) -> list:
    """Flatten ``tree`` after checking it has the plan's structure, shapes and float dtypes.

    ``local``: expert leaves have their device-local shapes (inside
    ``shard_map``); else their global shapes.

    Raises:
      ValueError: naming the first mismatching path and what was expected.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    if treedef != plan.treedef:
        raise ValueError(f"{what}: the tree does not match the parameters; expected {plan.treedef}, got {treedef}.")
    for route, leaf in zip(plan.routes, leaves):
        if leaf is None:
            continue
        shape = route.local_shape if local else route.shape
        if tuple(leaf.shape) != shape:
            raise ValueError(f"{what}: {route.path}: expected shape {shape}; got {tuple(leaf.shape)}.")
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(f"{what}: {route.path}: expected a floating dtype; got {leaf.dtype}.")
    return leaves


def pack(plan: ParamPlan, tree, dtypes: Sequence | None = None) -> tuple[Buckets | None, ...]:
    """Pack a parameter-shaped pytree into its buffers' bucket arrays (inverse of :func:`unpack`).

    Args:
      plan: The model's :class:`ParamPlan`.
      tree: A pytree with the parameters' structure and (device-local)
        shapes. Leaves may be ``None`` where every buffer holding them is skipped.
      dtypes: Per buffer, the dtype to pack into, or ``None`` to skip the
        buffer; defaults to each buffer's parameter dtype.

    Returns:
      Per buffer, one 1-D array per bucket (``dp * S_b`` elements, Megatron
      order, zero in padding), or ``None`` for skipped buffers.
    """
    dtypes = [b.key.param_dtype for b in plan.buffers] if dtypes is None else dtypes
    leaves = [None if x is None else jnp.ravel(x) for x in check_tree(plan, tree, "pack")]
    out = []
    for buffer, dtype in zip(plan.buffers, dtypes):
        if dtype is None:
            out.append(None)
            continue
        buckets = []
        for k, size in enumerate(buffer.shard_sizes):
            segments = sorted((s for s in buffer.segments if s.bucket == k), key=lambda s: s.offset)
            pieces = _pieces(segments, buffer.dp * size)
            if 0 < len(pieces) <= MAX_CONCAT_OPERANDS:
                buckets.append(jnp.concatenate([
                    jnp.zeros(p, dtype) if isinstance(p, int) else _read_run(leaves, p).astype(dtype) for p in pieces]))
                continue
            bucket = jnp.zeros(buffer.dp * size, dtype)
            for run in (p for p in pieces if not isinstance(p, int)):
                bucket = lax.dynamic_update_slice(bucket, _read_run(leaves, run).astype(dtype), (run[0].offset,))
            buckets.append(bucket)
        out.append(tuple(buckets))
    return tuple(out)


def _pieces(segments: list[Segment], size: int) -> list[list[Segment] | int]:
    """A bucket of ``size`` elements front to back: gap lengths, and runs of back-to-back segments of one leaf.

    ``segments`` are the bucket's, sorted by offset. The segments of a run have
    the same size (rows of a stacked leaf), so :func:`_read_run` reads a run as one block.
    """
    pieces, cursor = [], 0
    for seg in segments:
        if seg.offset > cursor:
            pieces.append(seg.offset - cursor)
        last = pieces[-1] if pieces and cursor == seg.offset else None
        if isinstance(last, list) and last[-1].leaf == seg.leaf and last[-1].numel == seg.numel:
            last.append(seg)
        else:
            pieces.append([seg])
        cursor = seg.offset + seg.numel
    return pieces + [size - cursor] if size > cursor else pieces


def _read_run(leaves: list[jax.Array], run: list[Segment]) -> jax.Array:
    """The flat elements of a run of one leaf's segments, in bucket order."""
    return _read_rows(leaves[run[0].leaf], [seg.leaf_offset for seg in run], run[0].numel).reshape(-1)


def unpack(plan: ParamPlan, buffers: Sequence[Buckets | None], dtypes: Sequence | None = None):
    """Rebuild the parameter pytree from bucket arrays (inverse of :func:`pack`).

    Args:
      plan: The model's :class:`ParamPlan`.
      buffers: Per buffer, its bucket arrays, or ``None``; leaves held by a
        ``None`` buffer come back as ``None``.
      dtypes: Per leaf, the dtype to return; defaults to the routed leaf dtype.

    Returns:
      The (device-local) parameter pytree.
    """
    segments: list[list[tuple[Segment, jax.Array]] | None] = [[] for _ in plan.routes]
    for buffer, buckets in zip(plan.buffers, buffers):
        for seg in buffer.segments:
            if buckets is None:
                segments[seg.leaf] = None
            elif segments[seg.leaf] is not None:
                segments[seg.leaf].append((seg, buckets[seg.bucket]))
    leaves = []
    for i, route in enumerate(plan.routes):
        if segments[i] is None:
            leaves.append(None)
            continue
        dtype = dtypes[i] if dtypes is not None else route.dtype
        leaves.append(_read_leaf(sorted(segments[i], key=lambda p: p[0].leaf_offset), route.local_shape).astype(dtype))
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def _read_leaf(runs: list[tuple[Segment, jax.Array]], shape: tuple[int, ...]) -> jax.Array:
    """Read one leaf's parameters (in leaf order) out of their bucket arrays.

    Stacked parameters of one bucket are read as one block of whole rows: a
    static slice when they sit back to back (in either order: Megatron fills
    buffers back to front), else one gather (a many-operand concatenate runs far
    below memory bandwidth on GPU). The blocks of several buckets are
    concatenated, which XLA does in one pass.
    """
    if len(runs) == 1:
        seg, bucket = runs[0]
        return bucket[seg.offset : seg.offset + seg.numel].reshape(shape)
    numel = runs[0][0].numel
    parts = []
    for _, group in itertools.groupby(runs, key=lambda r: id(r[1])):
        group = list(group)
        parts.append(_read_rows(group[0][1], [seg.offset for seg, _ in group], numel))
    rows = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return rows.reshape(shape)


def _read_rows(array: jax.Array, starts: list[int], numel: int) -> jax.Array:
    """Rows ``array[start : start + numel]`` for each start, as ``[len(starts), numel]``."""
    steps = {b - a for a, b in zip(starts, starts[1:])}
    if steps <= {numel}:
        return array[starts[0] : starts[0] + len(starts) * numel].reshape(len(starts), numel)
    if steps == {-numel}:
        return array[starts[-1] : starts[0] + numel].reshape(len(starts), numel)[::-1]
    offsets = jnp.asarray(starts, jnp.int32)
    return jax.vmap(lambda start: lax.dynamic_slice(array, (start,), (numel,)))(offsets)
