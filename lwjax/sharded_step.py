"""One device's share of the layer-wise step, phase by phase (called inside ``shard_map``).

Rank spaces. The data-parallel devices span the mesh axes ``(dp, ep)`` (just
``dp`` without expert parallelism). A *dense* bucket has one shard per
data-parallel device: shard ``r`` lives on the device with
``lax.axis_index((dp, ep)) == r``, which is the shard a tiled ``psum_scatter``
over ``(dp, ep)`` delivers there and the block a ``P((dp, ep))``-sharded array
puts there (``dp``-major). An *expert* bucket has one shard per ``dp`` rank
inside each expert-parallel group: devices with the same ``ep`` index hold the
same experts, and shard ``r`` lives on ``dp`` rank ``r``. So every element of
every buffer lives on exactly one device, and a ``psum`` over ``(dp, ep)`` of
per-device sums counts each parameter exactly once.

Gradient scale. Every local gradient is divided by ``dp * ep``, Megatron's
``1 / dp_cp_size``, for dense and expert buffers alike. A dense gradient is
then summed over all ``dp * ep`` devices. An expert's local gradient already
sums its expert-parallel group's tokens (the token exchange of an
expert-parallel forward transposes into that sum), so its sum over ``dp`` is
the gradient of the global mean loss too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax import muon as muon_lib
from lwjax.buffers import BufferPlan, ParamPlan, pack
from lwjax.layout import BufferKey

CLIP_EPS = 1e-6
PARAM_SYNCS = ("all_gather", "broadcast")
MAX_SELECT_RUNS = 16  # per_element: at most this many runs per shard become selects, more a repeat


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The data-parallel mesh axes of a step and which buffers live on which.

    Attributes:
      dp: The data-parallel axis (Megatron's expert data-parallel group).
      ep: The expert-parallel axis, or ``None`` without expert parallelism.
      dp_size: Size of ``dp``.
      ep_size: Size of ``ep`` (1 when ``ep`` is ``None``).
    """

    dp: str
    ep: str | None = None
    dp_size: int = 1
    ep_size: int = 1

    @property
    def data(self) -> str | tuple[str, str]:
        """All data-parallel devices: the batch and the dense buffers are split over these axes."""
        return self.dp if self.ep is None else (self.dp, self.ep)

    @property
    def num_data(self) -> int:
        """Number of data-parallel devices, ``dp * ep``."""
        return self.dp_size * self.ep_size

    def of(self, key: BufferKey) -> str | tuple[str, str]:
        """The axes a buffer is reduce-scattered over and gathered from."""
        return self.dp if key.is_expert_parallel else self.data

    def state_axes(self, key: BufferKey) -> str | tuple[str, str]:
        """Axes of a buffer's global state arrays: expert buckets ``ep``-major, one whole bucket per expert group."""
        if key.is_expert_parallel and self.ep is not None:
            return (self.ep, self.dp)
        return self.data

    def rank(self, key: BufferKey) -> jax.Array:
        """This device's shard index in a buffer of this key (traced)."""
        return lax.axis_index(self.of(key))


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
    """Per-element values of this rank's shard of ``bucket``: ``value_of[leaf]`` on each parameter's elements.

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
        pieces, cursor = [], 0  # (length, value) in shard order: the gap before each parameter, then it
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
    row, length = lax.optimization_barrier((rank_table(rows, dtype)[rank], rank_table(lengths)[rank]))
    if width > MAX_SELECT_RUNS:
        return jnp.repeat(row, length, total_repeat_length=size)
    # A few runs: a chain of selects on the element index, which XLA fuses into the
    # consumer, so the vector is never written to memory.
    index, starts = lax.iota(jnp.int32, size), jnp.cumsum(length)
    vector = jnp.broadcast_to(row[0], (size,))
    for w in range(1, width):
        vector = jnp.where(index >= starts[w - 1], row[w], vector)
    return vector


def reduce_scatter(plan: ParamPlan, axes: MeshAxes, grads, dtype, order=None) -> list[list[jax.Array]]:
    """Phases 1–2: pack local gradients divided by ``dp * ep``, reduce-scatter each bucket over its axes.

    ``order`` lists ``(buffer, bucket)`` pairs in program order (default:
    buffer by buffer); XLA's scheduler may still run them in another.
    Returns, per buffer and bucket, this device's summed shard in ``dtype``.
    """
    packed = pack(plan, jax.tree.map(lambda g: g.astype(dtype) / axes.num_data, grads),
                  dtypes=[b.key.grad_dtype for b in plan.buffers])
    if order is None:
        order = [(i, k) for i, b in enumerate(plan.buffers) for k in range(b.num_buckets)]
    shards = [[None] * b.num_buckets for b in plan.buffers]
    for i, k in order:
        shards[i][k] = lax.psum_scatter(packed[i][k], axes.of(plan.buffers[i].key), tiled=True).astype(dtype)
    return shards


def norm_groups(plan: ParamPlan, ranks, group_of: Sequence[int]) -> list[list]:
    """Per buffer and bucket, the norm group of each shard element (:func:`per_element` of ``group_of[leaf]``)."""
    return [
        [per_element(buffer, k, rank, group_of, np.int32) for k in range(buffer.num_buckets)]
        for buffer, rank in zip(plan.buffers, ranks)
    ]


def grad_statistics(plan: ParamPlan, shards, ranks, groups, num_groups: int):
    """Phase 3, this device's part: per norm group the sum of squared gradients, and the zero count.

    .. math:: s_k = \\sum_{i \\in \\text{shard},\\, \\text{group}(i) = k} g_i^2

    ``groups`` comes from :func:`norm_groups` (group 0 is the main norm).
    Padding is excluded from the zero count. A ``psum`` of both over all
    data-parallel devices gives the global values.
    """
    sums = [0] * num_groups
    zeros = 0
    for buffer, buckets, rank, bucket_groups in zip(plan.buffers, shards, ranks, groups):
        for x, group in zip(buckets, bucket_groups):
            square = jnp.square(x)
            if isinstance(group, jax.Array):
                for g in range(num_groups):
                    sums[g] = sums[g] + jnp.sum(jnp.where(group == g, square, 0))
            else:
                sums[group] = sums[group] + jnp.sum(square)
            zeros = zeros + jnp.sum(x == 0, dtype=jnp.int32)
        padding = [[sum(p[r] for p in buffer.padding)] for r in range(buffer.dp)]
        zeros = zeros - rank_row(padding, rank)[0]
    dtype = shards[0][0].dtype if shards and shards[0] else jnp.float32
    return jnp.stack([jnp.asarray(s, dtype) for s in sums]), jnp.asarray(zeros, jnp.int32)


def clip_coefficients(norms: jax.Array, clip_grad: float | None) -> jax.Array:
    """Per group :math:`c_k = \\min(1, \\text{clip} / (\\lVert g_k \\rVert + 10^{-6}))`; ones when clipping is off."""
    if not clip_grad:
        return jnp.ones_like(norms)
    return jnp.minimum(1.0, clip_grad / (norms + CLIP_EPS)).astype(norms.dtype)


def clip_shard(shard: jax.Array, group, coefs: jax.Array) -> jax.Array:
    """Scale a gradient shard by its elements' norm-group clip coefficients (``group``: from :func:`norm_groups`)."""
    return shard * coefs[group]


def _slot_groups(buffer, bucket) -> tuple[list, int]:
    """The slot groups of one bucket, and the zero scratch a shard needs for spare slots.

    Ranks owning fewer matrices of a shape read and write spare slots at the
    shard's end, in a zero scratch area of the returned size (0: none needed).
    """
    groups = [g for g in buffer.slot_groups if g.bucket == bucket]
    size = buffer.shard_sizes[bucket]
    if not any(size in row for g in groups for row in g.offsets):
        return groups, 0
    return groups, max(m * n for m, n in (g.shape for g in groups))


def _with_scratch(flat: jax.Array, scratch: int) -> jax.Array:
    return jnp.concatenate([flat, jnp.zeros(scratch, flat.dtype)]) if scratch else flat


def _block_start(offsets, shape: tuple[int, int]) -> int | None:
    """Where a slot group's matrices start as one back-to-back block of the shard, if they form one.

    Only for offsets that every rank shares (static). The block's matrices
    are then read and written in place order, which may differ from slot
    order; the batch's order does not matter as long as both agree.
    """
    if not isinstance(offsets, np.ndarray):
        return None
    ordered = np.sort(offsets)
    return int(ordered[0]) if np.all(np.diff(ordered) == shape[0] * shape[1]) else None


def _take(flat: jax.Array, offsets, shape: tuple[int, int], transpose: bool) -> jax.Array:
    """The stack ``[w, m, n]`` of matrices starting at ``offsets`` (``[w, n, m]`` when ``transpose``).

    One static slice where :func:`_block_start` finds a block, else a gather.
    """
    m, n = shape
    start = _block_start(offsets, shape)
    if start is not None:
        x = lax.slice(flat, (start,), (start + len(offsets) * m * n,)).reshape(-1, m, n)
    else:
        offsets = jnp.asarray(offsets, jnp.int32)
        x = jax.vmap(lambda start: lax.dynamic_slice(flat, (start,), (m * n,)))(offsets).reshape(-1, m, n)
    return jnp.swapaxes(x, -1, -2) if transpose else x


def _put(flat: jax.Array, offsets, stack: jax.Array) -> jax.Array:
    """Write a ``[w, m, n]`` stack read by :func:`_take` (untransposed) back into ``flat``.

    A block is written by one update, or replaces ``flat`` when it fills it:
    per-matrix updates of one buffer make XLA copy the whole buffer first,
    since each matrix's new value was computed from the buffer before the
    first update.
    """
    start = _block_start(offsets, stack.shape[-2:])
    if start is not None:
        if stack.size == flat.size:
            return stack.reshape(-1)
        return lax.dynamic_update_slice(flat, stack.reshape(-1), (start,))
    for j in range(stack.shape[0]):
        flat = lax.dynamic_update_slice(flat, stack[j].reshape(-1), (offsets[j],))
    return flat


def muon_directions(buffer, bucket, momentum, grad, rank, muon_config, transpose, finite=None
                    ) -> list[tuple[jax.Array, jax.Array]]:
    """Phase 4a of one layer-wise bucket: per slot group, the unscaled Muon direction and new momentum of its matrices.

    Reads this rank's matrices with one slice or gather per slot group (same
    shape and multipliers); needs no master weights, so it can run as soon as
    the bucket's gradient shard has arrived. Each direction is
    :func:`~lwjax.muon.muon_polar`'s, bf16 under ``"medium"``: it waits for
    :func:`muon_apply` in half the bytes, and is scaled there. Given the
    step's ``finite`` check, a skipped step's momentum comes back unchanged, so
    :func:`muon_apply` need not select it (``momentum_final=True``).
    """
    groups, scratch = _slot_groups(buffer, bucket)
    momentum, grad = _with_scratch(momentum, scratch), _with_scratch(grad, scratch)
    skip = None if finite is None else jnp.logical_not(finite)
    out = []
    for group in groups:
        offsets = rank_row(group.offsets, rank)
        out.append(muon_lib.muon_polar(
            _take(grad, offsets, group.shape, transpose), _take(momentum, offsets, group.shape, transpose),
            config=muon_config, qkv_split_shapes=group.qkv_split_shapes, skip=skip))
    return out


def muon_apply(buffer, bucket, master, momentum, directions, rank, finite, lr, weight_decay, muon_config, transpose,
               momentum_final=False):
    """Phase 4b of one layer-wise bucket: apply :func:`muon_directions`' output to the master shard.

    Group ``j`` steps with learning rate ``lr * lr_mult_j`` and weight decay
    ``weight_decay * wd_mult_j``; matrices are written back in place. Returns
    the new master and momentum shards (the old ones where ``finite`` is
    false; ``momentum_final``: the directions' momentum already is) and the
    sum of squared master changes.
    """
    groups, scratch = _slot_groups(buffer, bucket)
    size = buffer.shard_sizes[bucket]
    master, momentum = _with_scratch(master, scratch), _with_scratch(momentum, scratch)
    delta_sq = jnp.zeros([], master.dtype)
    for group, (polar, new_m) in zip(groups, directions):
        offsets = rank_row(group.offsets, rank)
        old_p = _take(master, offsets, group.shape, transpose)
        direction = muon_lib.scale_polar(polar, config=muon_config, qkv_split_shapes=group.qkv_split_shapes,
                                         dtype=master.dtype)
        new_p = muon_lib.apply_direction(old_p, direction, learning_rate=lr * group.lr_mult if group.lr_mult != 1 else lr,
                                         weight_decay=weight_decay * group.wd_mult)
        new_p = jnp.where(finite, new_p, old_p)
        if not momentum_final:
            new_m = jnp.where(finite, new_m, _take(momentum, offsets, group.shape, transpose))
        delta_sq += jnp.sum(jnp.square(new_p - old_p))
        if transpose:
            new_p, new_m = jnp.swapaxes(new_p, -1, -2), jnp.swapaxes(new_m, -1, -2)
        master, momentum = _put(master, offsets, new_p), _put(momentum, offsets, new_m)
    return master[:size], momentum[:size], delta_sq


def elementwise_shard(tx, master, tx_state, grad, finite, lr, lr_mult, decay):
    """The elementwise transform plus decoupled weight decay on one flat shard.

    .. math:: p \\leftarrow p - \\eta\\, m_\\eta (u + \\lambda m_\\lambda p), \\qquad u = \\text{tx}(g)

    ``lr_mult`` (:math:`m_\\eta`) and ``decay`` (:math:`\\lambda m_\\lambda`, zero
    on 1-D parameters) are scalars or per-element vectors (:func:`per_element`).
    Returns the new master and optax state (the old ones where ``finite`` is false).
    """
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    direction, new_tx_state = tx.update(grad, tx_state, master)
    step = lr * lr_mult if not (isinstance(lr_mult, (int, float)) and lr_mult == 1) else lr
    new_master = keep(master - step * (direction + decay * master), master)
    return new_master, jax.tree.map(keep, new_tx_state, tx_state)


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
    bucket = lax.dynamic_update_slice(jnp.zeros(num_shards * size, wide), bits.astype(wide), (rank * size,))
    return lax.bitcast_convert_type(lax.psum(bucket, axes).astype(bits.dtype), shard.dtype)


def gather_bucket(shard: jax.Array, axis_names, rank, num_shards: int, param_sync: str = "all_gather") -> jax.Array:
    """Phase 5 for one bucket: every device's updated shard (in parameter dtype) on every device.

    ``param_sync="all_gather"``: one tiled ``all_gather``; ``"broadcast"``:
    the reference path, bitwise equal (see :func:`_broadcast`).
    """
    if param_sync == "broadcast":
        return _broadcast(shard, axis_names, rank, num_shards)
    return lax.all_gather(shard, axis_names, tiled=True)
