"""The layer-wise distributed optimizer: ZeRO-1 communication, Muon on whole matrices.

Who holds what. Parameters (in their compute dtype, e.g. bf16) are replicated
on every device of the data-parallel axis. Everything else lives in Megatron's
buckets (:mod:`lwjax.buffers`), one array per (buffer, bucket) sharded over
dp: device ``r`` holds shard ``r`` of every bucket, i.e. the fp32 master
weights, Muon momentum and elementwise (AdamW) moments of exactly the
parameters rank ``r`` owns. A Muon matrix is always owned whole, so
Newton–Schulz runs locally on full matrices.

One step (:func:`update`, inside ``shard_map`` over the dp axis):

1. pack the device's local gradients into flat buffers (gradient dtype);
2. ``psum_scatter`` per bucket: rank ``r`` receives the dp-mean of its shards;
3. global gradient norm from one ``psum`` of per-shard squared sums (each
   element lives in exactly one shard, so nothing is counted twice); clip with
   :math:`c = \\min(1, \\text{clip} / (\\lVert g \\rVert + 10^{-6}))`; count zeros;
4. update owned state: Muon on the owned matrices, batched per shape group;
   the elementwise transform (Adam by default) plus decoupled weight decay on
   the flat elementwise shards. A non-finite norm keeps the old state;
5. cast masters to the parameter dtype and ``all_gather`` them, bucket by
   bucket, back into the replicated parameter pytree. Each bucket's gather
   depends only on its own updates, so XLA may overlap it with later buckets'
   Newton–Schulz.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import muon as muon_lib
from lwjax.buffers import BufferPlan, ParamPlan, check_tree, make_plan, pack, unpack
from lwjax.policies import DEFAULT_POLICY, LayoutPolicy

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]
CLIP_EPS = 1e-6


class LayerwiseState(NamedTuple):
    """State of :func:`layerwise_muon`; arrays only, sharded over the dp axis."""

    count: jax.Array  # shape=(), int32: applied (not skipped) steps.
    masters: tuple[tuple[jax.Array, ...], ...]  # [buffer][bucket]: fp32 masters, global [dp * S_b].
    momenta: tuple[tuple[jax.Array, ...] | None, ...]  # [buffer][bucket]: Muon momentum; None if elementwise.
    elementwise: tuple[tuple[Any, ...] | None, ...]  # [buffer][bucket]: optax state; None if layer-wise.


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Options of :func:`layerwise_muon` that are not schedules or transforms.

    Attributes:
      weight_decay: Decoupled weight decay for Muon matrices and for
        elementwise parameters with 2+ dims (Megatron's ``--weight-decay``);
        biases, norms and other 1-D parameters get none.
      clip_grad: Clip to this global L2 norm (``--clip-grad``); ``0`` or ``None`` disables.
      grad_reduce_in_fp32: Reduce gradients in fp32 (Megatron's
        ``--accumulate-allreduce-grads-in-fp32``); else in the parameter dtype.
      master_dtype: Dtype of master weights and optimizer state.
      matrix_convention: How 2-D parameters are stored: ``"in_out"`` (flax
        kernels, ``x @ W``) or ``"out_in"`` (Megatron/torch weights). Muon's
        scale modes and QKV split read rows as the output dimension.
    """

    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    grad_reduce_in_fp32: bool = True
    master_dtype: str = "float32"
    matrix_convention: str = "in_out"

    def __post_init__(self):
        if self.matrix_convention not in ("in_out", "out_in"):
            raise ValueError(
                f"OptimizerConfig.matrix_convention must be 'in_out' or 'out_in'; got {self.matrix_convention!r}."
            )
        if self.clip_grad is not None and self.clip_grad < 0:
            raise ValueError(f"OptimizerConfig.clip_grad must be >= 0 or None; got {self.clip_grad!r}.")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0; got {self.weight_decay!r}.")


class LayerwiseOptimizer(NamedTuple):
    """A layer-wise distributed Muon optimizer: static plan plus pure functions.

    Attributes:
      plan: The static :class:`~lwjax.buffers.ParamPlan` (routing and layout).
      mesh: The device mesh.
      axis: Name of the data-parallel mesh axis.
      init: ``params -> LayerwiseState`` (jitted; state sharded over ``axis``).
      update: ``(grads, state, params) -> (params, state, metrics)``; call it
        inside ``shard_map`` over ``axis`` with this device's local gradients.
      state_specs: ``PartitionSpec`` pytree of the state, for ``shard_map``.
    """

    plan: ParamPlan
    mesh: Mesh
    axis: str
    init: Callable
    update: Callable
    state_specs: LayerwiseState


def _schedule(value: ScalarOrSchedule) -> Callable[[jax.Array], jax.Array]:
    return value if callable(value) else (lambda count: jnp.asarray(value, jnp.float32))


def _rank_table(rows, dtype=np.int32):
    """A per-rank constant table; the caller indexes it with ``lax.axis_index``."""
    return jnp.asarray(np.asarray(rows, dtype=dtype))


def _rank_row(rows, rank, dtype=np.int32):
    """Row ``rank`` of a per-rank table, static when every rank's row is the same."""
    if all(tuple(r) == tuple(rows[0]) for r in rows):
        return np.asarray(rows[0], dtype=dtype)
    return _rank_table(rows, dtype)[rank]


def _decay_mask(buffer: BufferPlan, bucket: int, rank) -> jax.Array | float:
    """1.0 where weight decay applies in this rank's shard of ``bucket``, 0.0 on no-decay runs."""
    per_rank = buffer.no_decay[bucket]
    size = buffer.shard_sizes[bucket]
    if not any(per_rank):
        return 1.0
    lengths, flags = [], []
    for runs in per_rank:
        row_len, row_flag, cursor = [], [], 0
        for start, numel in sorted(runs):
            row_len += [start - cursor, numel]
            row_flag += [1.0, 0.0]
            cursor = start + numel
        lengths.append(row_len + [size - cursor])
        flags.append(row_flag + [1.0])
    width = max(len(r) for r in lengths)
    lengths = [r + [0] * (width - len(r)) for r in lengths]
    flags = [r + [1.0] * (width - len(r)) for r in flags]
    # Behind an optimization barrier: a constant mask would be constant-folded by XLA
    # at compile time, which is slow for large shards.
    flags, lengths = lax.optimization_barrier((_rank_table(flags, np.float32)[rank], _rank_table(lengths)[rank]))
    return jnp.repeat(flags, lengths, total_repeat_length=size)


def _muon_shard(buffer, bucket, master, momentum, grad, rank, finite, lr, weight_decay, muon_config, transpose):
    """Muon on every whole matrix this rank owns in its shard of one layer-wise bucket.

    Matrices are read with one gather per shape group and written back in
    place. Returns the new master and momentum shards (the old ones where
    ``finite`` is false) and the sum of squared master changes.
    """
    groups = [g for g in buffer.slot_groups if g.bucket == bucket]
    size = buffer.shard_sizes[bucket]
    delta_sq = jnp.zeros([], master.dtype)
    # Ranks owning fewer matrices of a shape read and write spare slots in a zero scratch area.
    spare = any(size in row for g in groups for row in g.offsets)
    if spare:
        scratch = max(m * n for m, n in (g.shape for g in groups))
        extend = lambda x: jnp.concatenate([x, jnp.zeros(scratch, x.dtype)])  # noqa: E731
        master, momentum, grad = extend(master), extend(momentum), extend(grad)
    for group in groups:
        m, n = group.shape
        offsets = jnp.asarray(_rank_row(group.offsets, rank), jnp.int32)

        def take(flat, offsets=offsets, m=m, n=n):
            x = jax.vmap(lambda start: lax.dynamic_slice(flat, (start,), (m * n,)))(offsets)
            x = x.reshape(-1, m, n)
            return jnp.swapaxes(x, -1, -2) if transpose else x

        old_p, old_m = take(master), take(momentum)
        new_p, new_m = muon_lib.muon_update(
            old_p, take(grad), old_m, learning_rate=lr, weight_decay=weight_decay, config=muon_config,
            qkv_split_shapes=group.qkv_split_shapes,
        )
        new_p, new_m = jnp.where(finite, new_p, old_p), jnp.where(finite, new_m, old_m)
        delta_sq += jnp.sum(jnp.square(new_p - old_p))
        if transpose:
            new_p, new_m = jnp.swapaxes(new_p, -1, -2), jnp.swapaxes(new_m, -1, -2)
        for j in range(group.width):
            master = lax.dynamic_update_slice(master, new_p[j].reshape(-1), (offsets[j],))
            momentum = lax.dynamic_update_slice(momentum, new_m[j].reshape(-1), (offsets[j],))
    if spare:
        master, momentum = master[:size], momentum[:size]
    return master, momentum, delta_sq


def default_bucket_size(dp: int) -> int:
    """Megatron's default DDP bucket size in elements: ``max(40M, 1M * dp)``."""
    return max(40_000_000, 1_000_000 * dp)


def layerwise_muon(
    params,
    mesh: Mesh,
    *,
    axis: str = "dp",
    learning_rate: ScalarOrSchedule = 0.02,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon: muon_lib.MuonConfig = muon_lib.MuonConfig(),
    elementwise: optax.GradientTransformation | None = None,
    config: OptimizerConfig = OptimizerConfig(),
    policy: LayoutPolicy = DEFAULT_POLICY,
    bucket_size: int | str | None = "auto",
    high_busbw: bool = False,
    **routing,
) -> LayerwiseOptimizer:
    """Build Megatron's layer-wise distributed Muon for a parameter pytree on a mesh.

    Muon matrices (by default: 2-D, not embedding or output head) are updated
    with Muon (:func:`lwjax.muon.muon_update`); every other parameter with the
    ``elementwise`` direction plus decoupled weight decay:

    .. math::

       p \\leftarrow p - \\eta_a (u + \\lambda\\, \\mathbb{1}_{\\text{decay}}\\, p),
       \\qquad u = \\text{elementwise}(g)

    Args:
      params: The parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
      mesh: A mesh with a data-parallel axis named ``axis``.
      axis: The data-parallel axis.
      learning_rate: Muon learning rate, or a schedule of the step count.
      adam_learning_rate: Learning rate of the elementwise parameters;
        defaults to ``learning_rate`` (Megatron uses one schedule for both).
      muon: Muon settings (:class:`lwjax.muon.MuonConfig`).
      elementwise: Elementwise optax transform giving the update direction of
        non-Muon parameters, without learning rate or weight decay; defaults to
        ``optax.scale_by_adam(0.9, 0.999, 1e-8)`` (Megatron's Adam defaults).
      config: Weight decay, clipping and dtypes (:class:`OptimizerConfig`).
      policy: Layout policy (:data:`lwjax.policies.POLICIES`).
      bucket_size: Bucket size in elements; ``None``: one bucket per buffer;
        ``"auto"``: Megatron's DDP default, ``max(4e7, 1e6 * dp)``. Several
        buckets let XLA overlap one bucket's all-gather with the next
        bucket's Newton–Schulz.
      high_busbw: Pad buckets for high NCCL bus bandwidth.
      **routing: Routing rules (``is_muon``, ``stacked``, ``tied``, ``qkv_split``);
        see :func:`lwjax.routing.route_leaves`.

    Returns:
      A :class:`LayerwiseOptimizer`.

    Raises:
      ValueError: ``axis`` not in the mesh, or a routing/layout rule broken.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"layerwise_muon: mesh has axes {mesh.axis_names}; no data-parallel axis {axis!r}.")
    dp = mesh.shape[axis]
    if bucket_size == "auto":
        bucket_size = default_bucket_size(dp)
    plan = make_plan(
        params,
        dp,
        policy=policy,
        bucket_size=bucket_size,
        high_busbw=high_busbw,
        grad_reduce_in_fp32=config.grad_reduce_in_fp32,
        **routing,
    )
    expert = [r.path for r in plan.routes if r.is_expert]
    if expert:
        raise ValueError(f"{expert[0]}: expert-parallel parameters need an expert mesh axis, which is not supported yet.")
    tx = elementwise if elementwise is not None else optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
    muon_lr = _schedule(learning_rate)
    adam_lr = _schedule(adam_learning_rate if adam_learning_rate is not None else learning_rate)
    master_dtype = jnp.dtype(config.master_dtype)
    transpose = config.matrix_convention == "in_out" and (
        muon.scale_mode != "spectral" or any(r.qkv_split_shapes for r in plan.routes)
    )
    real_numel = sum(int(np.prod(r.shape)) for r in plan.routes)
    padding_per_rank = [sum(p[r] for b in plan.buffers for p in b.padding) for r in range(dp)]

    def local_init(params):
        rank = lax.axis_index(axis)
        packed = pack(plan, params, dtypes=[master_dtype] * len(plan.buffers))
        masters = tuple(
            tuple(lax.dynamic_slice(flat, (rank * size,), (size,)) for flat, size in zip(buckets, b.shard_sizes))
            for b, buckets in zip(plan.buffers, packed)
        )
        momenta = tuple(
            tuple(jnp.zeros_like(m) for m in ms) if b.key.is_layer_wise else None for b, ms in zip(plan.buffers, masters)
        )
        states = tuple(
            None if b.key.is_layer_wise else tuple(tx.init(m) for m in ms) for b, ms in zip(plan.buffers, masters)
        )
        return LayerwiseState(jnp.zeros([], jnp.int32), masters, momenta, states)

    def shard_spec(local):
        """``P(axis)`` for leaves shaped like a shard, ``P()`` for scalars."""
        return jax.tree.map(lambda x: P(axis) if x.shape == local.shape else P(), jax.eval_shape(tx.init, local))

    state_specs = LayerwiseState(
        count=P(),
        masters=tuple(tuple(P(axis) for _ in b.shard_sizes) for b in plan.buffers),
        momenta=tuple(tuple(P(axis) for _ in b.shard_sizes) if b.key.is_layer_wise else None for b in plan.buffers),
        elementwise=tuple(
            None
            if b.key.is_layer_wise
            else tuple(shard_spec(jax.ShapeDtypeStruct((size,), master_dtype)) for size in b.shard_sizes)
            for b in plan.buffers
        ),
    )

    @jax.jit
    def init(params):
        check_tree(plan, params, "init(params)")
        return jax.shard_map(local_init, mesh=mesh, in_specs=(P(),), out_specs=state_specs, check_vma=False)(params)

    def apply_updates(state: LayerwiseState, grads, rank, finite):
        """Phase 4: new masters and optimizer state for this rank's shards.

        Where ``finite`` is false every array keeps its old value; the select is
        fused into each update rather than branched on, so no host round trip
        stalls the all-gathers. Also returns the sum of squared master changes.
        """
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        lr_m, lr_a = muon_lr(state.count), adam_lr(state.count)
        masters, momenta, states, delta_sq = [], [], [], jnp.zeros([], master_dtype)
        for buffer, b_masters, b_momenta, b_states, b_grads in zip(
            plan.buffers, state.masters, state.momenta, state.elementwise, grads
        ):
            if buffer.key.is_layer_wise:
                new = [
                    _muon_shard(buffer, k, master, momentum, grad, rank, finite, lr_m, config.weight_decay, muon,
                                transpose)
                    for k, (master, momentum, grad) in enumerate(zip(b_masters, b_momenta, b_grads))
                ]
                masters.append(tuple(p for p, _, _ in new))
                momenta.append(tuple(m for _, m, _ in new))
                states.append(None)
                delta_sq += sum(d for _, _, d in new)
            else:
                new_masters, new_states = [], []
                for k, (master, tx_state, grad) in enumerate(zip(b_masters, b_states, b_grads)):
                    direction, new_tx_state = tx.update(grad, tx_state, master)
                    decay = config.weight_decay * _decay_mask(buffer, k, rank)
                    new_master = keep(master - lr_a * (direction + decay * master), master)
                    delta_sq += jnp.sum(jnp.square(new_master - master))
                    new_masters.append(new_master)
                    new_states.append(jax.tree.map(keep, new_tx_state, tx_state))
                masters.append(tuple(new_masters))
                momenta.append(None)
                states.append(tuple(new_states))
        count = keep(state.count + 1, state.count)
        return LayerwiseState(count, tuple(masters), tuple(momenta), tuple(states)), delta_sq

    def update(grads, state: LayerwiseState, params):
        check_tree(plan, grads, "update(grads)")
        rank = lax.axis_index(axis)
        # 1. Pack local gradients, scaled for a dp-mean, in the reduction dtype.
        grad_dtypes = [b.key.grad_dtype for b in plan.buffers]
        packed = pack(plan, jax.tree.map(lambda g: g.astype(master_dtype) / dp, grads), dtypes=grad_dtypes)
        # 2. Reduce-scatter each bucket: this rank's shard, summed over dp.
        shards = [tuple(lax.psum_scatter(flat, axis, tiled=True).astype(master_dtype) for flat in b) for b in packed]
        flat_shards = [x for b in shards for x in b]
        # 3. Global norm, clipping and zero count from one psum of per-shard sums.
        padding = _rank_row([[p] for p in padding_per_rank], rank)[0]
        sq_sum = sum(jnp.sum(jnp.square(x)) for x in flat_shards)
        zeros = sum(jnp.sum(x == 0, dtype=jnp.int32) for x in flat_shards) - padding
        sq_sum, zeros = lax.psum((sq_sum, zeros), axis)
        grad_norm = jnp.sqrt(sq_sum)
        finite = jnp.isfinite(grad_norm)
        clip_coef = jnp.ones([], master_dtype)
        if config.clip_grad:
            clip_coef = jnp.minimum(1.0, config.clip_grad / (grad_norm + CLIP_EPS)).astype(master_dtype)
            shards = [tuple(x * clip_coef for x in b) for b in shards]
        # 4. Update owned state; a non-finite norm keeps the old state.
        new_state, delta_sq = apply_updates(state, shards, rank, finite)
        update_rms = jnp.sqrt(lax.psum(delta_sq, axis) / real_numel)
        # 5. Masters in parameter dtype, all-gathered bucket by bucket into the pytree.
        gathered = [
            tuple(lax.all_gather(m.astype(b.key.param_dtype), axis, tiled=True) for m in ms)
            for b, ms in zip(plan.buffers, new_state.masters)
        ]
        leaf_dtypes = [x.dtype for x in jax.tree.leaves(params)]
        new_params = unpack(plan, gathered, dtypes=leaf_dtypes)
        metrics = {
            "grad_norm": grad_norm,
            "clip_coef": clip_coef,
            "num_zeros": zeros,
            "update_rms": update_rms,
            "skipped": jnp.logical_not(finite),
        }
        return new_params, new_state, metrics

    return LayerwiseOptimizer(plan=plan, mesh=mesh, axis=axis, init=init, update=update, state_specs=state_specs)


def state_shardings(optimizer: LayerwiseOptimizer) -> LayerwiseState:
    """``NamedSharding`` pytree of the optimizer state."""
    return jax.tree.map(
        lambda spec: NamedSharding(optimizer.mesh, spec),
        optimizer.state_specs,
        is_leaf=lambda x: isinstance(x, P),
    )


class LogicalState(NamedTuple):
    """:class:`LayerwiseState` per parameter: independent of dp size, layout and policy.

    ``masters`` is shaped like the parameters; ``momenta`` too, with ``None``
    for non-Muon leaves; ``elementwise`` is the elementwise optax state whose
    per-element leaves are parameter-shaped trees (``None`` for Muon leaves).
    """

    count: jax.Array  # shape=(), int32.
    masters: Any
    momenta: Any
    elementwise: Any


def logical_sharding(optimizer: LayerwiseOptimizer, x) -> NamedSharding:
    """Where a logical (per-parameter) array lives: split on axis 0 over dp when it divides, else replicated."""
    dp = optimizer.mesh.shape[optimizer.axis]
    spec = P(optimizer.axis) if x.ndim and x.shape[0] % dp == 0 else P()
    return NamedSharding(optimizer.mesh, spec)


def _elementwise_buffers(optimizer: LayerwiseOptimizer) -> list[int]:
    return [i for i, b in enumerate(optimizer.plan.buffers) if not b.key.is_layer_wise]


def _is_sharded(spec: P) -> bool:
    """Whether an elementwise-state leaf is per element (sharded) rather than a replicated scalar."""
    return spec != P()


def to_logical(optimizer: LayerwiseOptimizer, state: LayerwiseState) -> LogicalState:
    """Unpack a sharded :class:`LayerwiseState` into its per-parameter :class:`LogicalState`.

    Inverse of :func:`from_logical`; the result restores at any dp size.
    """
    plan = optimizer.plan
    owners = _elementwise_buffers(optimizer)

    def convert(state):
        dtype = jax.tree.leaves(state.masters)[0].dtype
        masters = unpack(plan, state.masters, dtypes=[dtype] * len(plan.routes))
        momenta = unpack(plan, state.momenta, dtypes=[dtype] * len(plan.routes))
        elementwise = None
        if owners:
            # Per leaf position of the optax state: its shards of every elementwise bucket.
            specs, treedef = jax.tree.flatten(optimizer.state_specs.elementwise[owners[0]][0],
                                              is_leaf=lambda x: isinstance(x, P))
            per_bucket = {i: [jax.tree.leaves(s) for s in state.elementwise[i]] for i in owners}
            leaves = []
            for k, spec in enumerate(specs):
                if _is_sharded(spec):
                    flats = [tuple(b[k] for b in per_bucket[i]) if i in owners else None
                             for i in range(len(plan.buffers))]
                    leaves.append(unpack(plan, flats, dtypes=[per_bucket[owners[0]][0][k].dtype] * len(plan.routes)))
                else:
                    leaves.append(per_bucket[owners[0]][0][k])
            elementwise = jax.tree.unflatten(treedef, leaves)
        return LogicalState(state.count, masters, momenta, elementwise)

    shapes = jax.eval_shape(convert, state)
    return jax.jit(convert, out_shardings=jax.tree.map(lambda x: logical_sharding(optimizer, x), shapes))(state)


def from_logical(optimizer: LayerwiseOptimizer, logical: LogicalState) -> LayerwiseState:
    """Pack a :class:`LogicalState` into this optimizer's sharded :class:`LayerwiseState`.

    Inverse of :func:`to_logical`. The logical state may come from an
    optimizer with another dp size, layout policy or bucket size.
    """
    plan = optimizer.plan
    lw = [b.key.is_layer_wise for b in plan.buffers]
    owners = _elementwise_buffers(optimizer)

    def convert(logical):
        dtype = jax.tree.leaves(logical.masters)[0].dtype
        masters = pack(plan, logical.masters, dtypes=[dtype] * len(plan.buffers))
        momenta = pack(plan, logical.momenta, dtypes=[dtype if is_lw else None for is_lw in lw])
        elementwise = [None] * len(plan.buffers)
        if owners:
            specs, treedef = jax.tree.flatten(optimizer.state_specs.elementwise[owners[0]][0],
                                              is_leaf=lambda x: isinstance(x, P))
            logical_leaves = jax.tree.flatten(logical.elementwise, is_leaf=lambda x: x is None)[0]
            per_leaf, cursor = [], 0  # per optax-state leaf: {buffer: bucket arrays} or a scalar
            for spec in specs:
                if _is_sharded(spec):
                    n = len(plan.routes)
                    tree = jax.tree.unflatten(plan.treedef, logical_leaves[cursor : cursor + n])
                    cursor += n
                    leaf_dtype = next(x.dtype for x in jax.tree.leaves(tree))
                    per_leaf.append(pack(plan, tree, dtypes=[leaf_dtype if i in owners else None for i in range(len(lw))]))
                else:
                    per_leaf.append(logical_leaves[cursor])
                    cursor += 1
            for i in owners:
                elementwise[i] = tuple(
                    jax.tree.unflatten(treedef, [x[i][k] if _is_sharded(spec) else x for x, spec in zip(per_leaf, specs)])
                    for k in range(plan.buffers[i].num_buckets)
                )
        return LayerwiseState(jnp.asarray(logical.count, jnp.int32), masters, momenta, tuple(elementwise))

    logical = jax.tree.map(lambda x: jax.device_put(x, logical_sharding(optimizer, x)), logical)
    return jax.jit(convert, out_shardings=state_shardings(optimizer))(logical)
