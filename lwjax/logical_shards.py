"""Packed state to logical arrays and back, each device moving only its own parts, in chunks.

A logical array (:mod:`lwjax.logical`) lives split over every mesh axis
(:func:`~lwjax.logical.logical_sharding`): the leaf's own splits (expert axis,
``param_axes``) as the parameter has them, the other axes on some axis of the leaf
they divide. The packed state holds the same numbers in bucket shards
(:mod:`lwjax.buffers`). Both conversions run in ``shard_map`` over the whole
mesh, one leaf of one state component (masters, momenta, an elementwise moment)
at a time, grouped into chunks of at most :data:`STAGING_BYTES` per device:

* to logical: each device writes the parts of the leaf's block that its bucket
  shards hold into a zero block (as unsigned integers, so that adding zeros is
  exact, ``-0.0`` and NaN payloads included), and one reduce-scatter over the
  axes that split the logical array (a sum over the axes that hold copies)
  leaves each device its part. Copies (another sharding group, a leaf whole over
  a tensor-parallel axis) contribute zeros.
* to packed: each device all-gathers the leaf's block from its parts and
  writes the pieces its shards hold into its buckets, which the chunk updates in
  place (donated).

So a device holds its packed state, one chunk's staging (per leaf of the chunk,
its block as one device of the parameter split holds it, ``4`` bytes per element
at least, and its part) and the logical arrays' parts (``1/N`` of each leaf whose
axes divide the mesh) that are in its memory: none, where they go to or come from
host memory chunk by chunk (:mod:`lwjax.checkpoint`). A leaf larger than
:data:`STAGING_BYTES` is a chunk alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from lwjax.parallel.axes import as_axis_tuple
from lwjax.parallel.shardings import param_spec

# Staging per device a conversion program may use for the blocks of its chunk's leaves.
STAGING_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of a leaf's (device-local, stored-order) flat elements held by one bucket shard.

    Attributes:
      buffer, bucket: Where the run lives.
      rank: The shard (rank in the bucket's layout group) that holds it.
      offset: Its start inside that shard.
      leaf_offset: Its start in the flat leaf block.
      numel: Its length.
    """

    buffer: int
    bucket: int
    rank: int
    offset: int
    leaf_offset: int
    numel: int


def pieces(plan) -> list[list[Piece]]:
    """Per route, its segments cut at shard boundaries, in leaf order."""
    out: list[list[Piece]] = [[] for _ in plan.routes]
    for i, buffer in enumerate(plan.buffers):
        for seg in buffer.segments:
            size = buffer.shard_sizes[seg.bucket]
            start, end = seg.offset, seg.offset + seg.numel
            while start < end:
                rank, inner = divmod(start, size)
                numel = min(end, (rank + 1) * size) - start
                out[seg.leaf].append(
                    Piece(i, seg.bucket, rank, inner, seg.leaf_offset + start - seg.offset, numel)
                )
                start += numel
    return [sorted(p, key=lambda p: p.leaf_offset) for p in out]


def logical_spec(optimizer, route) -> P:
    """The ``PartitionSpec`` of :func:`lwjax.logical.logical_sharding`."""
    mesh = optimizer.mesh
    own = param_spec(route, optimizer.expert_axis, optimizer.plan.axes.tp)
    entries = [list(as_axis_tuple(e)) if e is not None else [] for e in own]
    entries += [[] for _ in range(len(route.shape) - len(entries))]
    used = {name for names in entries for name in names}
    for name in sorted((a for a in mesh.axis_names if a not in used), key=lambda a: -mesh.shape[a]):
        per_device = [
            n // math.prod(mesh.shape[a] for a in names) for n, names in zip(route.shape, entries)
        ]
        fits = [d for d, n in enumerate(per_device) if n % mesh.shape[name] == 0]
        if fits and mesh.shape[name] > 1:
            entries[max(fits, key=lambda d: per_device[d])].append(name)
    return P(*(tuple(e) if len(e) > 1 else (e[0] if e else None) for e in entries))


def _free_axes(optimizer, route, spec: P) -> tuple[list[tuple[int, tuple[str, ...]]], tuple]:
    """The mesh axes the logical spec adds to the leaf's own split, per axis of the leaf,
    and the mesh axes left over (the logical array is whole over them)."""
    own = param_spec(route, optimizer.expert_axis, optimizer.plan.axes.tp)
    added, used = [], set()
    for dim, entry in enumerate(spec):
        names = as_axis_tuple(entry) if entry is not None else ()
        mine = as_axis_tuple(own[dim]) if dim < len(own) and own[dim] is not None else ()
        extra = tuple(n for n in names if n not in mine)
        used |= set(names)
        if extra:
            added.append((dim, extra))
    rest = tuple(a for a in optimizer.mesh.axis_names if a not in used)
    return added, rest


def _copy_axes(optimizer, route, buffer_index: int) -> tuple[str, ...]:
    """Mesh axes whose devices hold copies of the leaf's parts: neither the leaf's own split
    nor its buffer's layout group (only their first device contributes)."""
    axes = optimizer.plan.axes
    key = optimizer.plan.buffers[buffer_index].key
    own = {
        n
        for e in param_spec(route, optimizer.expert_axis, axes.tp)
        if e is not None
        for n in as_axis_tuple(e)
    }
    return tuple(
        a for a in optimizer.mesh.axis_names if a not in own | set(as_axis_tuple(axes.of(key)))
    )


def _word(dtype) -> np.dtype:
    """The unsigned integer a value is summed as (at least 32 bits: XLA's reductions)."""
    return np.dtype(np.uint64 if np.dtype(dtype).itemsize == 8 else np.uint32)


def _bits(x: jax.Array) -> jax.Array:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(_word(x.dtype))


def _from_bits(x: jax.Array, dtype) -> jax.Array:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]
    return lax.bitcast_convert_type(x.astype(unsigned), dtype)


def staging_bytes(route, dtype) -> int:
    """Bytes per device of one item's block: the leaf as one device of its split holds it."""
    return math.prod(route.local_shape) * max(4, np.dtype(dtype).itemsize)


def chunks(costs: Sequence[int], budget: int) -> list[list[int]]:
    """Positions ``0 .. len(costs) - 1`` in order, grouped so that each group's costs sum to
    at most ``budget`` (a cost larger than that alone)."""
    out, size = [], budget + 1
    for item, cost in enumerate(costs):
        if size + cost > budget:
            out.append([])
            size = 0
        out[-1].append(item)
        size += cost
    return out


def _rank(optimizer, buffer_index: int) -> jax.Array:
    key = optimizer.plan.buffers[buffer_index].key
    return lax.axis_index(optimizer.plan.axes.of(key))


def _first(axes: tuple[str, ...]) -> jax.Array:
    """Whether this device is the first along every one of ``axes``."""
    ok = jnp.bool_(True)
    for a in axes:
        ok = ok & (lax.axis_index(a) == 0)
    return ok


def _to_stored(block: jax.Array, route) -> jax.Array:
    """A device's leaf block as the buckets hold it: flat, in :attr:`axes_order`."""
    if route.axes_order is not None:
        block = jnp.transpose(block, route.axes_order)
    return block.reshape(-1)


def _from_stored(flat: jax.Array, route) -> jax.Array:
    block = flat.reshape(route.local_view)
    if route.axes_order is not None:
        block = jnp.transpose(block, np.argsort(route.axes_order))
    return block


def read_part(optimizer, runs: list[Piece], route_index: int, arrays, dtype, spec: P) -> jax.Array:
    """Inside ``shard_map``: this device's part of the logical leaf from its bucket shards
    ``arrays[buffer][bucket]``."""
    route = optimizer.plan.routes[route_index]
    buffer_index = runs[0].buffer
    rank = _rank(optimizer, buffer_index)
    source = arrays[buffer_index]
    word = _word(source[0].dtype)
    keep = _first(_copy_axes(optimizer, route, buffer_index))
    parts = [
        jnp.where(
            keep & (rank == p.rank),
            _bits(source[p.bucket][p.offset : p.offset + p.numel]),
            jnp.zeros((p.numel,), word),
        )
        for p in runs
    ]
    block = _from_stored(jnp.concatenate(parts) if len(parts) > 1 else parts[0], route)
    added, rest = _free_axes(optimizer, route, spec)
    for dim, axes in added:
        block = lax.psum_scatter(block, axes, scatter_dimension=dim, tiled=True)
    if rest:
        block = lax.psum(block, rest)
    return _from_bits(block, source[0].dtype).astype(dtype)


def write_part(
    optimizer, runs: list[Piece], route_index: int, part: jax.Array, arrays, spec: P
) -> None:
    """Inside ``shard_map``: write this device's pieces of the logical leaf (its ``part``)
    into its bucket shards ``arrays[buffer][bucket]`` (a list of lists, updated)."""
    route = optimizer.plan.routes[route_index]
    added, _ = _free_axes(optimizer, route, spec)
    for dim, axes in reversed(added):
        part = lax.all_gather(part, axes, axis=dim, tiled=True)
    target = arrays[runs[0].buffer]
    flat = _to_stored(part, route).astype(target[0].dtype)
    rank = _rank(optimizer, runs[0].buffer)
    for p in runs:
        # A dynamic-update-slice, not ``.at[].set``: the scatter that emits for a piece
        # covering its whole shard crashes XLA's GPU compiler (jax 0.11.2, several devices).
        old = target[p.bucket][p.offset : p.offset + p.numel]
        new = flat[p.leaf_offset : p.leaf_offset + p.numel]
        target[p.bucket] = lax.dynamic_update_slice(
            target[p.bucket], jnp.where(rank == p.rank, new, old), (p.offset,)
        )
