"""One device's shard of a bucket: per-element values, the whole matrices it owns, and its gather.

Inside ``shard_map`` every device runs the same program on its own shard of
each bucket; the shard's contents differ by rank, so everything rank-dependent
comes from constant per-rank tables indexed with ``lax.axis_index``
(:func:`rank_row`): the runs of per-parameter values (:func:`per_element`) and
the offsets of the matrices a rank owns (:attr:`lwjax.plan.SlotGroup.offsets`),
read as one ``[w, m, n]`` stack per slot group (:func:`take`) and written back
in place (:func:`put`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.config import PARAM_SYNCS as PARAM_SYNCS
from lwjax.param_plan import BufferPlan, SlotGroup

MAX_SELECT_RUNS = 16  # per_element: at most this many runs per shard become selects, more a repeat


def rank_table(rows, dtype=np.int32) -> jax.Array:
    """A per-rank constant table; the caller indexes it with ``lax.axis_index``."""
    return jnp.asarray(np.asarray(rows, dtype=dtype))


def rank_row(rows, rank, dtype=np.int32):
    """Row ``rank`` of a per-rank table, static when every rank's row is the same."""
    if all(tuple(r) == tuple(rows[0]) for r in rows):
        return np.asarray(rows[0], dtype=dtype)
    return rank_table(rows, dtype)[rank]


def _merge_runs(pieces: list[tuple[int, object]]) -> list[list]:
    """Drop empty ``(length, value)`` runs and merge neighbours with equal values."""
    merged: list[list] = []
    for length, value in pieces:
        if length and merged and merged[-1][1] == value:
            merged[-1][0] += length
        elif length:
            merged.append([length, value])
    return merged


def per_element(buffer: BufferPlan, bucket: int, rank, value_of: Sequence, dtype=np.float32):
    """Per-element values of this rank's shard of ``bucket``: ``value_of[leaf]`` on each leaf.

    Padding is zero in every gradient and master, so its value never matters.
    When every parameter of the bucket (on every rank) has the same value, that
    value comes back as a Python scalar; otherwise a vector ``[S_b]`` from a
    per-rank run table: a chain of selects on the element index (fused into
    the consumer) for at most :data:`MAX_SELECT_RUNS` runs, else ``jnp.repeat``.
    """
    per_rank = buffer.runs[bucket]
    values = {value_of[leaf] for runs in per_rank for _, _, leaf in runs}
    if len(values) <= 1:
        return next(iter(values), 0)
    size, fill = buffer.shard_sizes[bucket], min(values)
    lengths, rows = [], []
    for runs in per_rank:
        pieces, cursor = (
            [],
            0,
        )  # (length, value) in shard order: the gap before each parameter, then it
        for start, numel, leaf in runs:
            pieces += [(start - cursor, fill), (numel, value_of[leaf])]
            cursor = start + numel
        merged = _merge_runs([*pieces, (size - cursor, fill)])
        lengths.append([n for n, _ in merged])
        rows.append([v for _, v in merged])
    width = max(len(r) for r in lengths)
    lengths = [r + [0] * (width - len(r)) for r in lengths]
    rows = [r + [fill] * (width - len(r)) for r in rows]
    # Behind an optimization barrier: a constant vector would be constant-folded by XLA
    # at compile time, which is slow for large shards.
    row, length = lax.optimization_barrier(
        (rank_table(rows, dtype)[rank], rank_table(lengths)[rank])
    )
    if width > MAX_SELECT_RUNS:
        return jnp.repeat(row, length, total_repeat_length=size)
    # A few runs: a chain of selects on the element index, which XLA fuses into the
    # consumer, so the vector is never written to memory.
    index, starts = lax.iota(jnp.int32, size), jnp.cumsum(length)
    vector = jnp.broadcast_to(row[0], (size,))
    for w in range(1, width):
        vector = jnp.where(index >= starts[w - 1], row[w], vector)
    return vector


def slot_groups(buffer: BufferPlan, bucket: int) -> tuple[list[SlotGroup], int]:
    """The slot groups of one bucket, and the zero scratch a shard needs for spare slots.

    Ranks owning fewer matrices of a shape read and write spare slots at the
    shard's end, in a zero scratch area of the returned size (0: none needed).
    """
    groups = [g for g in buffer.slot_groups if g.bucket == bucket]
    size = buffer.shard_sizes[bucket]
    if not any(size in row for g in groups for row in g.offsets):
        return groups, 0
    return groups, max(m * n for m, n in (g.shape for g in groups))


def with_scratch(flat: jax.Array, scratch: int) -> jax.Array:
    """``flat`` followed by ``scratch`` zeros (see :func:`slot_groups`)."""
    return jnp.concatenate([flat, jnp.zeros(scratch, flat.dtype)]) if scratch else flat


def block_start(offsets, shape: tuple[int, int]) -> int | None:
    """Where a slot group's matrices start as one back-to-back block of the shard, if they form one.

    Only for offsets that every rank shares (static). The block's matrices
    are then read and written in place order, which may differ from slot
    order; the batch's order does not matter as long as both agree.
    """
    if not isinstance(offsets, np.ndarray):
        return None
    ordered = np.sort(offsets)
    return int(ordered[0]) if np.all(np.diff(ordered) == shape[0] * shape[1]) else None


def take(flat: jax.Array, offsets, shape: tuple[int, int], transpose: bool) -> jax.Array:
    """The stack ``[w, m, n]`` of matrices at ``offsets``, or ``[w, n, m]`` with ``transpose``.

    One static slice where :func:`block_start` finds a block, else a gather.
    """
    m, n = shape
    start = block_start(offsets, shape)
    if start is not None:
        x = lax.slice(flat, (start,), (start + len(offsets) * m * n,)).reshape(-1, m, n)
    else:
        offsets = jnp.asarray(offsets, jnp.int32)
        x = jax.vmap(lambda start: lax.dynamic_slice(flat, (start,), (m * n,)))(offsets).reshape(
            -1, m, n
        )
    return jnp.swapaxes(x, -1, -2) if transpose else x


def put(flat: jax.Array, offsets, stack: jax.Array) -> jax.Array:
    """Write a ``[w, m, n]`` stack read by :func:`take` (untransposed) back into ``flat``.

    A block is written by one update, or replaces ``flat`` when it fills it:
    per-matrix updates of one buffer make XLA copy the whole buffer first,
    since each matrix's new value was computed from the buffer before the
    first update.
    """
    start = block_start(offsets, stack.shape[-2:])
    if start is not None:
        if stack.size == flat.size:
            return stack.reshape(-1)
        return lax.dynamic_update_slice(flat, stack.reshape(-1), (start,))
    for j in range(stack.shape[0]):
        flat = lax.dynamic_update_slice(flat, stack[j].reshape(-1), (offsets[j],))
    return flat


def _broadcast(shard: jax.Array, axes, rank, num_shards: int) -> jax.Array:
    """Every owner's shard on every device, as Megatron's ``broadcast_params`` does.

    Each device writes its shard's bit pattern at its offset into a zero
    bucket of unsigned integers and the buckets are summed: only the owner's
    term is non-zero at any element, so the sum is the owner's bits exactly
    (``-0.0`` and NaN payloads included).
    """
    size = shard.shape[0]
    bits = lax.bitcast_convert_type(shard, jnp.dtype(f"uint{8 * shard.dtype.itemsize}"))
    wide = jnp.promote_types(bits.dtype, jnp.uint32)
    bucket = lax.dynamic_update_slice(
        jnp.zeros(num_shards * size, wide), bits.astype(wide), (rank * size,)
    )
    return lax.bitcast_convert_type(lax.psum(bucket, axes).astype(bits.dtype), shard.dtype)


def gather_bucket(
    shard: jax.Array, axis_names, rank, num_shards: int, param_sync: str = "all_gather"
) -> jax.Array:
    """Every device's updated shard (in parameter dtype) on every device.

    ``param_sync="all_gather"``: one tiled ``all_gather``; ``"broadcast"``:
    the reference path, bitwise equal (see :func:`_broadcast`). A bucket of one
    shard is the shard (nothing to gather: dp 1, e.g. fully sharded parameters).
    """
    if num_shards == 1:
        return shard
    if param_sync == "broadcast":
        return _broadcast(shard, axis_names, rank, num_shards)
    return lax.all_gather(shard, axis_names, tiled=True)
