r"""The layer-wise step, phase by phase: one device's share, called inside ``shard_map``.

Who holds what. Every data-parallel device holds the whole parameter pytree
(with an expert axis, its own experts) and, per bucket, one shard of the
optimizer state: the fp32 masters, Muon momenta and elementwise (Adam) moments
of exactly the parameters it owns (:mod:`lwjax.plan`). A Muon matrix is always
owned whole, so Newton–Schulz runs locally on full matrices and never twice.

One step (:func:`update`):

1. pack the local gradients into flat buckets, divided by ``dp * ep``;
2. ``psum_scatter`` each bucket: every device receives the mean gradient of its shard;
3. one ``psum`` of a few per-device sums gives the gradient norm of each norm
   group (each element lives in one shard, so nothing is counted twice), the
   clip coefficients :math:`c = \min(1, \text{clip} / (\lVert g \rVert + 10^{-6}))`
   and the zero count (a non-finite norm, or a scheduled learning rate or weight decay
   that is not a finite number >= 0, skips the step);
4. update the owned shards: Muon on the owned matrices, one batched call per
   slot group (:func:`~lwjax.muon.muon_polar`, then
   :func:`~lwjax.muon.apply_polar`), the elementwise transform plus decoupled
   weight decay on the flat elementwise shards. A non-finite norm keeps the old
   state, selected inside the update rather than branched on;
5. cast each updated master shard to the parameter dtype and gather it
   (``all_gather``, or Megatron's broadcast);
6. unpack the gathered buckets into the parameter pytree.

With a tensor-parallel axis every device holds its blocks of the split
leaves and runs all of this on them (the same plan on every such device):
phase 3 sums over that axis too, counting leaves held whole on its first
device only, and phase 4 orthogonalises split matrices as
``MuonConfig.tp_mode`` says (:mod:`lwjax.parallel.exchange`).

Matrices split over those axes and dealt to devices (``"duplicated"``) get
their directions first, every bucket's in one exchange, and so, at one
data-parallel rank, does every whole matrix (:mod:`lwjax.joint_directions`,
:func:`lwjax.parallel.ns_deal.is_joint`). Phases 4 and 5 (:mod:`lwjax.bucket_update`)
run bucket by bucket in the order of the plan's
:class:`~lwjax.schedule.BucketSchedule`, which pairs each gather with a later
bucket's update so that it hides behind Newton–Schulz. The speculative variant,
:func:`lwjax.pipelined.update_pipelined`, starts Newton–Schulz before the norm is known.

Gradient scale. Every local gradient is divided by ``dp * ep``, Megatron's
``1 / dp_cp_size``. A dense gradient is then summed over all ``dp * ep``
devices. An expert's local gradient already sums its expert-parallel group's
tokens (the token exchange of an expert-parallel forward transposes into that
sum), so its sum over ``dp`` is the gradient of the global mean loss too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax import shards
from lwjax.bucket_update import (
    bucket_views,
    gather_shard,
    update_and_gather,
    weight_decay_at,
)
from lwjax.buffers import check_tree, pack, unpack
from lwjax.joint_directions import joint_directions
from lwjax.moved import moved_names
from lwjax.parallel.counted import count_once, counted_masks
from lwjax.plan import StepPlan
from lwjax.state import LayerwiseState as LayerwiseState
from lwjax.state import initial_speculation as initial_speculation
from lwjax.state import speculates as speculates

CLIP_EPS = 1e-6

# Phase 4's helpers and the tensor-parallel decisions, moved after 0.4.0: name -> new module.
_MOVED = {
    "apply_muon": "lwjax.bucket_update",
    "clip": "lwjax.bucket_update",
    "muon_directions": "lwjax.bucket_update",
    "update_bucket": "lwjax.bucket_update",
    "update_elementwise": "lwjax.bucket_update",
    "counted_elements": "lwjax.parallel.counted",
    "first_device": "lwjax.parallel.counted",
    "tensor_split": "lwjax.parallel.exchange",
}


__getattr__ = moved_names(__name__, _MOVED)


class GradStats(NamedTuple):
    """Phase 3's results: global gradient statistics and per-element norm groups."""

    norms: jax.Array  # [groups]: L2 norm of each norm group, group 0 the main norm.
    coefs: jax.Array  # [groups]: clip coefficient of each group.
    # shape=(), float32 as Megatron's count_zeros_fp32: zero gradient elements (padding
    # excluded); exact below 2**24, and it never wraps as an int32 sum would past 2**31.
    zeros: jax.Array
    finite: jax.Array  # shape=(), bool: every norm is finite (else the step is skipped).
    groups: list  # [buffer][bucket]: each shard element's norm group (a scalar when uniform).


def own_shard(bucket: jax.Array, axis, size: int) -> jax.Array:
    """This device's shard of a whole bucket of ``size``-element shards over ``axis``: a row of
    the bucket viewed ``[-1, size]`` (no element offset, which would pass int32 in a bucket of
    2**31 elements or more)."""
    return lax.dynamic_index_in_dim(bucket.reshape(-1, size), lax.axis_index(axis), keepdims=False)


def master_shards(plan: StepPlan, params) -> tuple[tuple[jax.Array, ...], ...]:
    """``params`` packed in the master dtype, this device's shard of each bucket."""
    packed = pack(plan, params, dtypes=[plan.master_dtype] * len(plan.buffers))
    return tuple(
        tuple(
            own_shard(flat, plan.axes.of(b.key), size) for flat, size in zip(buckets, b.shard_sizes)
        )
        for b, buckets in zip(plan.buffers, packed)
    )


def init(plan: StepPlan, params) -> LayerwiseState:
    """This device's state: its shard of the packed masters, zero momenta, the elementwise state."""
    masters = master_shards(plan, params)
    momenta = tuple(
        tuple(jnp.zeros_like(m) for m in ms) if b.key.is_layer_wise else None
        for b, ms in zip(plan.buffers, masters)
    )
    states = tuple(
        None if b.key.is_layer_wise else tuple(plan.elementwise.init(m) for m in ms)
        for b, ms in zip(plan.buffers, masters)
    )
    return LayerwiseState(
        jnp.zeros([], jnp.int32), masters, momenta, states, initial_speculation(plan)
    )


def update(plan: StepPlan, grads, state: LayerwiseState, params, *, reduced=False, gather=True):
    """One step of this device: ``(grads, state, params) -> (params, state, metrics)``.

    Args:
      plan: The optimizer's :class:`StepPlan`.
      grads: This device's gradients of its local mean loss, shaped like ``params``.
      state: This device's shards of the :class:`LayerwiseState`.
      params: The parameters (their dtypes are kept).
      reduced: ``grads`` are already the gradients of the global mean loss,
        the same on every device (the optax form: GSPMD reduced them); each
        device then takes its shards instead of reduce-scattering.
      gather: Gather the new parameters (phases 5–6). With ``False`` the step
        stops after the update and returns ``None`` for the parameters; the
        next step rebuilds them from the masters (:func:`local_params`) where
        its forward pass needs them, as Megatron's ``--overlap-param-gather``.

    Returns:
      The new parameters (``None`` without ``gather``), state and metrics
      (``grad_norm``, ``clip_coef``, ``num_zeros``, ``update_rms``,
      ``skipped``, and per separate norm group ``grad_norm/<group>``,
      ``clip_coef/<group>``).
    """
    check_tree(plan, grads, "update(grads)")
    return update_with_stats(plan, grads, state, params, reduced=reduced, gather=gather)[:3]


def update_with_stats(
    plan: StepPlan, grads, state: LayerwiseState, params, *, reduced=False, gather=True
):
    """:func:`update`'s phases; returns its results and the step's :class:`GradStats`."""
    ranks = device_ranks(plan)
    # 1-2. Local gradients packed and reduce-scattered: each device holds its shards' mean gradient.
    grad_shards = reduce_scatter(plan, grads, reduced=reduced)
    # 3. Norms, clip coefficients and the zero count, from one psum over a group's devices.
    repack = local_repack(plan, grads, reduced=reduced)
    stats = grad_statistics(plan, grad_shards, ranks, repack)
    stats = with_schedules_checked(plan, stats, state.count)
    # 4. The joint pass' directions (dealt matrices; at one rank every whole one), every
    # bucket's together.
    views = bucket_views(plan, ranks)
    joint = joint_directions(plan, views, state.momenta, grad_shards, stats)
    # 4-5. Each owned shard updated (Muon after the finite check), cast and gathered (with
    # gather), in order.
    new = update_and_gather(plan, views, state, grad_shards, stats, joint, gather=gather)
    # 6. The gathered buckets unpacked into parameters (with gather).
    return *finish(plan, state, params, new, stats), stats


def device_ranks(plan: StepPlan) -> list[jax.Array]:
    """This device's shard index in each buffer."""
    return [lax.axis_index(plan.axes.of(b.key)) for b in plan.buffers]


def _vectors_reduced_apart(plan: StepPlan, grads):
    r"""``grads`` in the plan's structure, each vector parameter's gradient behind an
    optimization barrier (a norm scale or a bias: one axis besides its stacked ones).

    Such a gradient is a sum over tokens, e.g. :math:`\partial w_j = \sum_t \hat x_{tj}
    \, \partial y_{tj}` for a norm scale. Left alone, XLA may fuse that sum into the
    concatenation that packs its bucket, whose loop then sums over the tokens serially,
    one element at a time (measured on GPU: ``docs/benchmarks.md``, "norm gradients fused into
    the packing kernels"). Matrix gradients are GEMM outputs, which XLA does not
    fuse into a concatenation; they are left as they are.
    """
    leaves = check_tree(plan, grads, "gradients")
    return jax.tree_util.tree_unflatten(
        plan.treedef,
        [
            lax.optimization_barrier(g) if g is not None and g.ndim - r.stack_dims <= 1 else g
            for g, r in zip(leaves, plan.routes)
        ],
    )


def reduce_scatter(
    plan: StepPlan, grads, order=None, *, reduced: bool = False
) -> list[list[jax.Array]]:
    """Phases 1–2: pack local gradients divided by the number of data-parallel devices;
    reduce-scatter each bucket within the sharding group, then sum across groups.

    ``order`` lists ``(buffer, bucket)`` pairs in program order (default:
    buffer by buffer); XLA's scheduler may still run them in another. With
    ``reduced``, ``grads`` are already global and each device slices out its
    shards. Returns, per buffer and bucket, this device's summed shard in the
    master dtype, or in the gradients' own where nothing sums it (:func:`_kept_as_given`).
    """
    dtype = plan.master_dtype
    grads = _vectors_reduced_apart(plan, grads)
    kept = _kept_as_given(plan, grads, reduced)
    if reduced:
        packed = pack(plan, grads, dtypes=[dtype] * len(plan.buffers))
    else:
        packed = pack(
            plan,
            jax.tree.map(lambda g: g.astype(dtype) / plan.axes.num_data, grads),
            dtypes=[b.key.grad_dtype if k is None else None for b, k in zip(plan.buffers, kept)],
        )
        if any(k is not None for k in kept):
            given = pack(plan, grads, dtypes=kept)
            packed = [g if k is not None else p for p, g, k in zip(packed, given, kept)]
    if order is None:
        order = [(i, k) for i, b in enumerate(plan.buffers) for k in range(b.num_buckets)]
    out = [[None] * b.num_buckets for b in plan.buffers]
    for i, k in order:
        axis, size = plan.axes.of(plan.buffers[i].key), plan.buffers[i].shard_sizes[k]
        shard = packed[i][k]  # no collective over a group of one (dp 1: fully sharded)
        if reduced and plan.buffers[i].dp > 1:
            shard = own_shard(shard, axis, size)
        elif not reduced:
            if plan.buffers[i].dp > 1:
                shard = lax.psum_scatter(shard, axis, tiled=True)
            if plan.axes.replica_size > 1:  # 1/G of the bytes: cheaper after the scatter
                shard = lax.psum(shard, plan.axes.replica)
        out[i][k] = shard if kept[i] is not None else shard.astype(dtype)
    return out


def local_repack(
    plan: StepPlan, grads, *, reduced: bool = False
) -> Callable[[], list[list[jax.Array]]] | None:
    """:func:`reduce_scatter` of ``grads`` as a function to call again, where every buffer has
    one data-parallel device and there are no sharding groups (nothing moves between
    devices); else ``None``."""
    local = plan.axes.replica_size == 1 and all(b.dp == 1 for b in plan.buffers)
    return functools.partial(reduce_scatter, plan, grads, reduced=reduced) if local else None


def _kept_as_given(plan: StepPlan, grads, reduced: bool) -> list:
    """Per buffer, the gradients' own dtype where its shards are this device's gradients as
    they are, else ``None``: a Muon buffer that nothing reduces (one data-parallel device,
    no groups, as with full sharding over FSDP axes) of gradients narrower than the masters.

    Their values are kept in that dtype and promoted exactly where they are read (the
    norms sum them in fp32; momentum arithmetic promotes), and no fp32 copy of every local
    gradient is made (3.5 GB per device at 8B, fsdp 8). The optimizer then reads the
    gradients as their dtype holds them, where packed as fp32 XLA was free to skip their
    rounding (its excess precision). Elementwise buffers keep fp32: an optax transform may
    scale a gradient before mixing it with fp32 state, which would round in the narrow dtype.
    """
    if reduced or plan.axes.num_data != 1:
        return [None] * len(plan.buffers)
    leaves = check_tree(plan, grads, "gradients")
    kept = []
    for buffer in plan.buffers:
        dtypes = {leaves[s.leaf].dtype for s in buffer.segments if leaves[s.leaf] is not None}
        given = dtypes.pop() if len(dtypes) == 1 else None
        narrow = given is not None and jnp.finfo(given).bits < jnp.finfo(plan.master_dtype).bits
        alone = buffer.dp == 1 and plan.axes.replica_size == 1
        kept.append(given if buffer.key.is_layer_wise and alone and narrow else None)
    return kept


def over_statistics(reduce, x, plan: StepPlan):
    """``reduce`` (``lax.psum``, ``lax.pmax``) of ``x`` over the statistics axes, or ``x`` where
    they hold one device: no collective over a group of one."""
    if plan.axes.group_size * plan.axes.tp_size == 1:
        return x
    return reduce(x, plan.axes.statistics)


def grad_statistics(plan: StepPlan, grad_shards, ranks, repack=None) -> GradStats:
    r"""Phase 3: per norm group the global gradient norm and clip coefficient; the zero count.

    .. math::

       \lVert g_k \rVert^2 = \sum_{\text{devices}}
       \sum_{i \in \text{shard},\, \text{group}(i) = k} g_i^2

    Squares of finite gradients from about :math:`1.8 \cdot 10^{19}` on overflow fp32.
    When a sum comes out infinite, the norms are computed again scaled by the
    largest magnitude :math:`m_k` (one more pass and two scalar collectives, only
    then): :math:`\lVert g_k \rVert = m_k \sqrt{\sum (g_i / m_k)^2}`, infinite
    only when a gradient is. The zero count leaves out padding and is summed in
    fp32, as Megatron's ``count_zeros_fp32`` does: exact below :math:`2^{24}`,
    and with no int32 sum to wrap past :math:`2^{31}`.

    ``repack`` (:func:`local_repack`), where given, packs the gradients again
    inside that rare pass instead of passing ``grad_shards`` into it: XLA writes a
    conditional's operands to memory, and in :func:`update`'s step at one
    data-parallel device nothing else needs the packed buckets written, as their
    readers fuse the packing in (the 1b optimizer step on one H200: about 1 ms;
    docs/benchmarks.md). The pipelined step passes none: its speculation's barriers
    take the packed buckets anyway.
    """
    groups = [
        [
            shards.per_element(buffer, k, rank, plan.group_of, np.int32)
            for k in range(buffer.num_buckets)
        ]
        for buffer, rank in zip(plan.buffers, ranks)
    ]
    num_groups = len(plan.norm_groups)
    dtype = plan.master_dtype  # gradients kept narrow (reduce_scatter) are summed in it
    counted = counted_masks(plan, ranks)

    def counted_once(xs):
        # Elements counted elsewhere are zeros here: they add nothing to a sum or a maximum.
        return [
            [count_once(x, c) for x, c in zip(buckets, kept)] for buckets, kept in zip(xs, counted)
        ]

    grad_shards = counted_once(grad_shards)

    def per_group(xs, value, reduce, combine) -> jax.Array:
        """``[num_groups]``: ``reduce`` (sum or max) of ``value(x, group)`` over this
        device's elements of each group in the shards ``xs``, shard results joined by
        ``combine`` (the values are >= 0, so 0 stands for the other groups' elements and for
        empty groups)."""
        totals = [0] * num_groups
        for buckets, bucket_groups in zip(xs, groups):
            for x, group in zip(buckets, bucket_groups):
                v = value(x.astype(dtype), group)
                if isinstance(group, jax.Array):
                    for g in range(num_groups):
                        totals[g] = combine(totals[g], reduce(jnp.where(group == g, v, 0)))
                else:
                    totals[group] = combine(totals[group], reduce(v))
        return jnp.stack([jnp.asarray(t, dtype) for t in totals])

    # Counted per bucket shard in int32 (exact: a bucket holds < 2**31 elements), summed in fp32.
    zeros = jnp.zeros([], jnp.float32)
    for buffer, buckets, kept, rank in zip(plan.buffers, grad_shards, counted, ranks):
        for x, c, padding in zip(buckets, kept, buffer.padding):
            count = jnp.sum(x == 0 if c is True else (x == 0) & c, dtype=jnp.int32)
            count = count - shards.rank_row([[p] for p in padding], rank)[0]
            zeros = zeros + count.astype(jnp.float32)
    sums = per_group(grad_shards, lambda x, _: jnp.square(x), jnp.sum, jnp.add)
    sums, zeros = over_statistics(lax.psum, (sums, zeros), plan)

    def scaled_norms():
        xs = grad_shards if repack is None else counted_once(repack())
        peaks = per_group(xs, lambda x, _: jnp.abs(x), jnp.max, jnp.maximum)
        peaks = over_statistics(lax.pmax, peaks, plan)
        scale = jnp.where(peaks > 0, peaks, 1)
        scaled = per_group(xs, lambda x, group: jnp.square(x / scale[group]), jnp.sum, jnp.add)
        return scale * jnp.sqrt(over_statistics(lax.psum, scaled, plan))

    norms = lax.cond(jnp.any(jnp.isinf(sums)), scaled_norms, lambda: jnp.sqrt(sums))
    finite = jnp.all(jnp.isfinite(norms))
    return GradStats(norms, _clip_coefficients(norms, plan.config.clip_grad), zeros, finite, groups)


def with_schedules_checked(plan: StepPlan, stats: GradStats, count: jax.Array) -> GradStats:
    r"""``stats`` with the step also skipped where a schedule gives an unusable value.

    A NaN or infinite learning rate would make every updated master
    non-finite, and a negative one would ascend the loss; like a non-finite
    gradient, either keeps the old state instead. So does a scheduled weight
    decay that is not finite or is negative (:math:`p \leftarrow p - \eta\lambda p`
    with :math:`\lambda < 0` grows the weights); neither is clipped to a valid
    value. Constant rates were checked when the optimizer was built.
    """
    lrs = jnp.stack([plan.learning_rate(count), plan.adam_learning_rate(count)])
    usable = jnp.all(jnp.isfinite(lrs) & (lrs >= 0))
    if callable(plan.config.weight_decay):
        decay = weight_decay_at(plan, count)
        usable = usable & jnp.isfinite(decay) & (decay >= 0)
    return stats._replace(finite=stats.finite & usable)


def _clip_coefficients(norms: jax.Array, clip_grad: float | None) -> jax.Array:
    r"""Per group :math:`c_k = \min(1, \text{clip} / (\lVert g_k \rVert + 10^{-6}))`, or ones."""
    if not clip_grad:
        return jnp.ones_like(norms)
    return jnp.minimum(1.0, clip_grad / (norms + CLIP_EPS)).astype(norms.dtype)


def local_params(plan: StepPlan, state: LayerwiseState):
    """Phases 5–6 alone: this device's parameters as the state's masters hold them.

    Every bucket is cast, gathered and unpacked, with no order imposed: inside
    a training step XLA may run each gather under the forward pass of the
    layers before the first one that reads it. The result equals what
    :func:`update` returned with the step that wrote these masters, and the
    initial parameters too where the masters hold them exactly (fp32 masters
    of fp32, bf16 or fp16 parameters do).
    """
    ranks = device_ranks(plan)
    gathered = [
        tuple(gather_shard(plan, i, m.astype(b.key.param_dtype), ranks[i]) for m in masters)
        for i, (b, masters) in enumerate(zip(plan.buffers, state.masters))
    ]
    return unpack(plan, gathered)


def finish(plan: StepPlan, state: LayerwiseState, params, new, stats: GradStats):
    """Phase 6: the new state, the gathered buckets unpacked into parameters (``None``
    where nothing was gathered), and the metrics."""
    masters, moments, gathered, delta_sq = new
    new_state = LayerwiseState(
        jnp.where(stats.finite, state.count + 1, state.count),
        tuple(tuple(m) for m in masters),
        tuple(tuple(m) if b.key.is_layer_wise else None for b, m in zip(plan.buffers, moments)),
        tuple(None if b.key.is_layer_wise else tuple(m) for b, m in zip(plan.buffers, moments)),
        state.speculate,
    )
    # A float: a model of 2**31 elements or more overflows a traced int32.
    real_numel = float(sum(math.prod(r.shape) for r in plan.routes))
    update_rms = jnp.sqrt(over_statistics(lax.psum, delta_sq, plan) / real_numel)
    new_params = None
    if gathered is not None:
        new_params = unpack(
            plan, [tuple(g) for g in gathered], dtypes=[x.dtype for x in jax.tree.leaves(params)]
        )
    metrics = {
        "grad_norm": stats.norms[0],
        "clip_coef": stats.coefs[0],
        "num_zeros": stats.zeros,
        "update_rms": update_rms,
        "skipped": jnp.logical_not(stats.finite),
    }
    for g, name in enumerate(plan.norm_groups[1:], start=1):
        metrics[f"grad_norm/{name}"] = stats.norms[g]
        metrics[f"clip_coef/{name}"] = stats.coefs[g]
    return new_params, new_state, metrics
