"""Pack a parameter-shaped pytree into its flat buckets, and unpack them again.

A buffer is a sequence of buckets; bucket ``b`` is a flat array of ``dp * S_b``
elements in Megatron's order, shard ``r`` at ``[r S_b, (r + 1) S_b)``
(:mod:`lwjax.plan`). So a bucket array sharded evenly over the dp axis puts
exactly rank ``r``'s shard on device ``r``, one tiled ``psum_scatter`` per
bucket delivers each rank its reduced shard, and one tiled ``all_gather`` per
bucket rebuilds it. Padding is zero and stays zero. A leaf whose matrix axes are not in stored order
(:attr:`lwjax.routing.LeafRoute.axes_order`) is packed transposed to that order.

:func:`pack` and :func:`unpack` are inverses made of static slices, row gathers,
reshapes and a concatenation (or in-place writes) per bucket, so they trace once
under ``jit`` or ``shard_map`` and cost nothing per step in Python. They work on
device-local pytrees (expert leaves hold this device's experts), which equal
the global ones when there are no experts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.layout import MAX_BUCKET_ELEMENTS
from lwjax.param_plan import ParamPlan, Segment
from lwjax.routing import path_name

# How :func:`pack` builds a bucket: one concatenate of its pieces (gaps, and runs of
# one stacked leaf's rows) when it has at most this many, else in chunks of at most
# this many pieces, each one concatenate written into a zeroed array (which writes
# the bucket twice). XLA's concatenate runs near memory bandwidth for a few operands
# and far below it for many (measured on H200: docs/benchmarks.md). A write per piece
# would be a kernel per leaf, each at its own offset: XLA:CPU compiles every distinct
# kernel apart (some 20 ms each), so a model of many small leaves compiled for minutes.
MAX_CONCAT_OPERANDS = 8

Buckets = tuple[jax.Array | None, ...]


def check_tree(plan: ParamPlan, tree, what: str, *, local: bool = True) -> list:
    """The leaves of ``tree`` in plan order, after checking paths, shapes and float dtypes.

    Leaves are matched to the plan's routes by path name, so any pytree
    classes may carry them. A ``None`` at a routed path is a placeholder
    (kept: pack and unpack skip it where every buffer holding it is skipped);
    a ``None`` elsewhere is no parameter (an equinox filtered tree) and is dropped.

    ``local``: expert leaves have their device-local shapes (inside
    ``shard_map``); else their global shapes.

    Raises:
      ValueError: naming the first mismatching path and what was expected.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)
    if treedef == plan.treedef:  # the plan's own structure: leaves in route order
        return checked_leaves(plan, leaves, what, local=local)
    routed = {route.path for route in plan.routes}
    entries = [
        (name, leaf)
        for name, leaf in (
            (path_name(p), x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
        )
        if leaf is not None or name in routed
    ]
    match_routes(
        plan, [name for name, _ in entries], f"{what}: the tree does not match the parameters"
    )
    return checked_leaves(plan, [leaf for _, leaf in entries], what, local=local)


def match_routes(plan: ParamPlan, names: Sequence[str], what: str) -> None:
    """Check that ``names`` are the plan's leaf paths, in order.

    Raises:
      ValueError: naming the first position where they differ, or the first extra name.
    """
    for i, route in enumerate(plan.routes):
        name = names[i] if i < len(names) else None
        if name != route.path:
            got = repr(name) if name is not None else "no more leaves"
            raise ValueError(
                f"{what}: leaf {i} should be {route.path!r} (the parameters the optimizer was "
                f"built for, in flatten order); got {got}."
            )
    if len(names) > len(plan.routes):
        raise ValueError(
            f"{what}: {names[len(plan.routes)]!r} is not a parameter the optimizer was built "
            f"for ({len(plan.routes)} leaves)."
        )


def checked_leaves(
    plan: ParamPlan, leaves: list, what: str, *, local: bool, lead: tuple[int, ...] = ()
) -> list:
    """``leaves`` (route order), after checking each one's shape and float dtype.

    ``local``: expert leaves have their device-local shapes; ``lead``: a
    leading shape every leaf carries first. ``None`` leaves are not checked.
    """
    for route, leaf in zip(plan.routes, leaves):
        if leaf is None:
            continue
        shape = (*lead, *(route.local_shape if local else route.shape))
        if tuple(leaf.shape) != shape:
            raise ValueError(
                f"{what}: {route.path}: expected shape {shape}; got {tuple(leaf.shape)}."
            )
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
    leaves = [
        None
        if x is None
        else jnp.ravel(x if r.axes_order is None else jnp.transpose(x, r.axes_order))
        for x, r in zip(check_tree(plan, tree, "pack"), plan.routes)
    ]
    out = []
    for buffer, dtype in zip(plan.buffers, dtypes):
        if dtype is None:
            out.append(None)
            continue
        buckets = []
        for k, size in enumerate(buffer.shard_sizes):
            segments = sorted((s for s in buffer.segments if s.bucket == k), key=lambda s: s.offset)
            pieces = _pieces(segments, buffer.dp * size)
            # One concatenate (no offsets) also where an offset would pass int32.
            concat = len(pieces) <= MAX_CONCAT_OPERANDS or buffer.dp * size > MAX_BUCKET_ELEMENTS
            if pieces and concat:
                buckets.append(jnp.concatenate([_written(leaves, p, dtype) for p in pieces]))
                continue
            bucket = jnp.zeros(buffer.dp * size, dtype)
            for chunk in _chunks(pieces, max(MAX_CONCAT_OPERANDS, 1)):
                part = [_written(leaves, p, dtype) for p in chunk]
                bucket = lax.dynamic_update_slice(
                    bucket,
                    jnp.concatenate(part) if len(part) > 1 else part[0],
                    (chunk[0][0].offset,),
                )
            buckets.append(bucket)
        out.append(tuple(buckets))
    return tuple(out)


def _pieces(segments: list[Segment], size: int) -> list[list[Segment] | int]:
    """A bucket of ``size`` elements front to back: gap lengths, and runs of one leaf's segments.

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


def _chunks(pieces: list[list[Segment] | int], most: int) -> list[list[list[Segment] | int]]:
    """``pieces`` cut into back-to-back chunks of at most ``most`` pieces, each starting and
    ending with a run: the gaps between chunks are left out (a zeroed bucket holds them)."""
    chunks: list[list[list[Segment] | int]] = []
    for piece in pieces:
        if isinstance(piece, int) and (not chunks or len(chunks[-1]) >= most):
            continue
        if not chunks or len(chunks[-1]) >= most:
            chunks.append([])
        chunks[-1].append(piece)
    return [chunk[:-1] if isinstance(chunk[-1], int) else chunk for chunk in chunks]


def _written(leaves: list[jax.Array], piece: list[Segment] | int, dtype) -> jax.Array:
    """A piece of a bucket in ``dtype``: a gap's zeros, or a run's elements."""
    return (
        jnp.zeros(piece, dtype)
        if isinstance(piece, int)
        else _read_run(leaves, piece).astype(dtype)
    )


def _read_run(leaves: list[jax.Array], run: list[Segment]) -> jax.Array:
    """The flat elements of a run of one leaf's segments, in bucket order."""
    return _read_rows(leaves[run[0].leaf], [seg.leaf_offset for seg in run], run[0].numel).reshape(
        -1
    )


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
        leaf = _read_leaf(sorted(segments[i], key=lambda p: p[0].leaf_offset), route.local_view)
        if route.axes_order is not None:
            leaf = jnp.transpose(leaf, np.argsort(route.axes_order))
        leaves.append(leaf.astype(dtype))
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
    """Rows ``array[start : start + numel]`` for each start, as ``[len(starts), numel]``.

    Offsets past int32 (jax's index type without x64: a device's block of a
    stacked leaf can hold more elements, e.g. a 70B model's fc1 stack at fsdp 8,
    4.7e9, and so can a whole bucket of many ranks) are read as whole rows of the
    array viewed ``[-1, numel]``, by row index, or else as static slices.
    """
    steps = {b - a for a, b in zip(starts, starts[1:])}
    if steps <= {numel}:
        return array[starts[0] : starts[0] + len(starts) * numel].reshape(len(starts), numel)
    if steps == {-numel}:
        return array[starts[-1] : starts[0] + numel].reshape(len(starts), numel)[::-1]
    if max(starts) + numel <= MAX_BUCKET_ELEMENTS:
        offsets = jnp.asarray(starts, jnp.int32)
        return jax.vmap(lambda start: lax.dynamic_slice(array, (start,), (numel,)))(offsets)
    if array.size % numel or any(start % numel for start in starts):
        return jnp.stack([array[start : start + numel] for start in starts])
    rows = jnp.asarray([start // numel for start in starts], jnp.int32)
    return jnp.take(array.reshape(-1, numel), rows, axis=0)
