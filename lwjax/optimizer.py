"""The layer-wise distributed optimizer: ZeRO-1 communication, Muon on whole matrices.

Who holds what. Dense parameters (in their compute dtype, e.g. bf16) are
replicated on every data-parallel device; with an expert axis ``ep``, expert
parameters are split over ``ep`` on their expert axis and replicated over
``dp``. Everything else lives in Megatron's buckets (:mod:`lwjax.buffers`),
one array per (buffer, bucket): a dense bucket has a shard per data-parallel
device (``dp * ep`` of them), an expert bucket a shard per ``dp`` rank of each
expert group (see :mod:`lwjax.sharded_step`). A device's shards hold the fp32
master weights, Muon momentum and elementwise (AdamW) moments of exactly the
parameters it owns. A Muon matrix (one expert's matrix included) is always
owned whole, so Newton–Schulz runs locally on full matrices.

One step (:func:`update`, inside ``shard_map`` over the data-parallel axes):

1. pack the device's local gradients into flat buffers (gradient dtype);
2. ``psum_scatter`` per bucket: each device receives the mean gradient of its shard;
3. gradient norms from one ``psum`` of a small vector of per-group squared
   sums (each element lives in exactly one shard, so nothing is counted
   twice): the main norm, plus one per separate norm group (``grad_norm_group``);
   clip each group with :math:`c = \\min(1, \\text{clip} / (\\lVert g \\rVert + 10^{-6}))`; count zeros;
4. update owned state: Muon on the owned matrices, batched per shape group;
   the elementwise transform (Adam by default) plus decoupled weight decay on
   the flat elementwise shards, with per-parameter learning-rate and
   weight-decay multipliers. A non-finite norm keeps the old state;
5. cast masters to the parameter dtype and ``all_gather`` them (or broadcast
   them, ``param_sync="broadcast"``), bucket by bucket, back into the
   parameter pytree.

Steps 4 and 5 run bucket by bucket in the order of a
:class:`~lwjax.schedule.BucketSchedule`, which pairs each bucket's gather with
a later bucket's update so the gathers hide behind Newton–Schulz.
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
from lwjax import sharded_step as step_lib
from lwjax.buffers import ParamPlan, check_tree, make_plan, pack, unpack
from lwjax.policies import DEFAULT_POLICY, LayoutPolicy
from lwjax.schedule import schedule_buckets
from lwjax.sharded_step import PARAM_SYNCS, MeshAxes

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


class LayerwiseState(NamedTuple):
    """State of :func:`layerwise_muon`; arrays only, sharded over the dp axis."""

    count: jax.Array  # shape=(), int32: applied (not skipped) steps.
    masters: tuple[tuple[jax.Array, ...], ...]  # [buffer][bucket]: fp32 masters, global [shards * S_b].
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
      param_sync: How updated parameters reach every device: ``"all_gather"``
        (one tiled all-gather per bucket) or ``"broadcast"``, Megatron's
        reference path (each owner's shard broadcast; bitwise equal).
      pipeline_muon: Start each layer-wise bucket's Muon direction (momentum,
        Newton–Schulz) as soon as its gradient shard arrives, so Newton–Schulz
        overlaps the remaining reduce-scatters. Exact without clipping. With
        clipping it speculates that no Muon matrix's clip coefficient is below
        1: after the norm, the directions are kept or computed again from the
        clipped gradients (``metrics["recomputed"]``), so the result is the
        serial step's up to rounding either way, but a step that clips runs
        momentum and Newton–Schulz twice (so does a step with non-finite
        gradients, which is then skipped). The optimizer step alone pays off
        under XLA's profile-guided scheduling (PGLE) while clipping rarely
        binds. A whole training step, whose backward pass already hides the
        serial step's reduce-scatters, measured no faster (``lwjax bench
        --train-step``; see ``docs/benchmarks.md``), and its first few calls
        after compiling ran slower there than the later ones.
    """

    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    grad_reduce_in_fp32: bool = True
    master_dtype: str = "float32"
    matrix_convention: str = "in_out"
    param_sync: str = "all_gather"
    pipeline_muon: bool = False

    def __post_init__(self):
        if self.param_sync not in PARAM_SYNCS:
            raise ValueError(f"OptimizerConfig.param_sync must be one of {PARAM_SYNCS}; got {self.param_sync!r}.")
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
      init: ``params -> LayerwiseState`` (jitted; state sharded over the
        data-parallel axes).
      update: ``(grads, state, params) -> (params, state, metrics)``; call it
        inside ``shard_map`` over :attr:`data_axes` with this device's local
        gradients and parameters (expert leaves local, see ``param_specs``).
      state_specs: ``PartitionSpec`` pytree of the state, for ``shard_map``.
      expert_axis: Name of the expert-parallel mesh axis, or ``None``.
      param_specs: ``PartitionSpec`` pytree (prefix) of the parameters:
        ``P()`` for dense leaves, the expert axis split over ``expert_axis``
        for expert leaves; just ``P()`` when nothing is split.
    """

    plan: ParamPlan
    mesh: Mesh
    axis: str
    init: Callable
    update: Callable
    state_specs: LayerwiseState
    expert_axis: str | None = None
    param_specs: Any = None

    @property
    def mesh_axes(self) -> MeshAxes:
        """The :class:`~lwjax.sharded_step.MeshAxes` of this optimizer."""
        return _mesh_axes(self.mesh, self.axis, self.expert_axis)

    @property
    def data_axes(self) -> str | tuple[str, str]:
        """The axes all data-parallel devices span, ``axis`` or ``(axis, expert_axis)``; the batch is split over them."""
        return self.mesh_axes.data

    @property
    def num_data(self) -> int:
        """Number of data-parallel devices (``dp * ep``)."""
        return self.mesh_axes.num_data


def _schedule(value: ScalarOrSchedule) -> Callable[[jax.Array], jax.Array]:
    return value if callable(value) else (lambda count: jnp.asarray(value, jnp.float32))


def _mesh_axes(mesh: Mesh, axis: str, expert_axis: str | None) -> MeshAxes:
    """Check the axis names against the mesh and return their :class:`MeshAxes`."""
    for name, what in ((axis, "data-parallel"), (expert_axis, "expert-parallel")):
        if name is not None and name not in mesh.axis_names:
            raise ValueError(f"layerwise_muon: mesh has axes {mesh.axis_names}; no {what} axis {name!r}.")
    if expert_axis == axis:
        raise ValueError(f"layerwise_muon: expert_axis must differ from axis; got {axis=!r}, {expert_axis=!r}.")
    return MeshAxes(axis, expert_axis, mesh.shape[axis], 1 if expert_axis is None else mesh.shape[expert_axis])


def default_bucket_size(dp: int) -> int:
    """Megatron's default DDP bucket size in elements: ``max(40M, 1M * dp)``."""
    return max(40_000_000, 1_000_000 * dp)


def layerwise_muon(
    params,
    mesh: Mesh,
    *,
    axis: str = "dp",
    expert_axis: str | None = None,
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

       p \\leftarrow p - \\eta_a m_\\eta (u + \\lambda m_\\lambda\\, \\mathbb{1}_{\\text{decay}}\\, p),
       \\qquad u = \\text{elementwise}(g)

    with per-parameter multipliers :math:`m_\\eta` (``lr_mult``) and
    :math:`m_\\lambda` (``wd_mult``); Muon matrices use the same multipliers.

    Expert parallelism: with ``expert_axis``, every device of the mesh axes
    ``(axis, expert_axis)`` is data-parallel for dense parameters (the batch is
    split over both), and expert leaves (``expert=...``) are split over
    ``expert_axis`` on their expert axis. Dense buffers are sharded over all
    ``dp * ep`` devices, expert buffers over ``axis`` (Megatron's expert
    data-parallel group); see :mod:`lwjax.sharded_step`. ``params`` are the
    global parameters; the loss function sees the local experts and must
    exchange tokens over ``expert_axis`` itself.

    Args:
      params: The (global) parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
      mesh: A mesh with a data-parallel axis named ``axis``.
      axis: The data-parallel axis.
      expert_axis: The expert-parallel axis, or ``None`` (expert leaves, if
        any, then live in expert buffers sharded over ``axis``).
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
        buckets let one bucket's all-gather run during a later bucket's
        Newton–Schulz (:mod:`lwjax.schedule`).
      high_busbw: Pad buckets for high NCCL bus bandwidth.
      **routing: Routing rules (``is_muon``, ``stacked``, ``tied``, ``expert``,
        ``qkv_split``, ``lr_mult``, ``wd_mult``, ``grad_norm_group``); see
        :func:`lwjax.routing.route_leaves`.

    Returns:
      A :class:`LayerwiseOptimizer`.

    Raises:
      ValueError: ``axis`` or ``expert_axis`` not in the mesh, or a
        routing/layout rule broken.
    """
    axes = _mesh_axes(mesh, axis, expert_axis)
    if bucket_size == "auto":
        bucket_size = default_bucket_size(axes.num_data)
    plan = make_plan(
        params,
        axes.num_data,
        policy=policy,
        bucket_size=bucket_size,
        high_busbw=high_busbw,
        expert_dp=axes.dp_size,
        grad_reduce_in_fp32=config.grad_reduce_in_fp32,
        expert_parallel=axes.ep_size,
        **routing,
    )
    tx = elementwise if elementwise is not None else optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
    muon_lr = _schedule(learning_rate)
    adam_lr = _schedule(adam_learning_rate if adam_learning_rate is not None else learning_rate)
    master_dtype = jnp.dtype(config.master_dtype)
    transpose = config.matrix_convention == "in_out" and (
        muon.scale_mode != "spectral" or any(r.qkv_split_shapes for r in plan.routes)
    )
    schedule = schedule_buckets(plan, num_ns_steps=muon.num_ns_steps, transpose=transpose, split_qkv=muon.split_qkv)
    real_numel = sum(int(np.prod(r.shape)) for r in plan.routes)
    groups = (None, *plan.grad_norm_groups)  # norm group 0 is the main norm
    group_of = [groups.index(r.grad_norm_group) for r in plan.routes]
    lr_mult_of = [r.lr_mult for r in plan.routes]
    decay_of = [config.weight_decay * r.wd_mult if len(r.param_shape) >= 2 else 0.0 for r in plan.routes]
    param_specs = P()  # a prefix of the parameters: replicated, unless expert leaves are split
    if expert_axis is not None and plan.has_experts:
        param_specs = jax.tree_util.tree_unflatten(plan.treedef, [_param_spec(r, expert_axis) for r in plan.routes])

    def local_init(params):
        packed = pack(plan, params, dtypes=[master_dtype] * len(plan.buffers))
        masters = tuple(
            tuple(
                lax.dynamic_slice(flat, (axes.rank(b.key) * size,), (size,))
                for flat, size in zip(buckets, b.shard_sizes)
            )
            for b, buckets in zip(plan.buffers, packed)
        )
        momenta = tuple(
            tuple(jnp.zeros_like(m) for m in ms) if b.key.is_layer_wise else None for b, ms in zip(plan.buffers, masters)
        )
        states = tuple(
            None if b.key.is_layer_wise else tuple(tx.init(m) for m in ms) for b, ms in zip(plan.buffers, masters)
        )
        return LayerwiseState(jnp.zeros([], jnp.int32), masters, momenta, states)

    def shard_spec(local, spec):
        """``spec`` for leaves shaped like a shard, ``P()`` for scalars."""
        return jax.tree.map(lambda x: spec if x.shape == local.shape else P(), jax.eval_shape(tx.init, local))

    bucket_specs = [P(axes.state_axes(b.key)) for b in plan.buffers]
    state_specs = LayerwiseState(
        count=P(),
        masters=tuple(tuple(spec for _ in b.shard_sizes) for b, spec in zip(plan.buffers, bucket_specs)),
        momenta=tuple(
            tuple(spec for _ in b.shard_sizes) if b.key.is_layer_wise else None
            for b, spec in zip(plan.buffers, bucket_specs)
        ),
        elementwise=tuple(
            None
            if b.key.is_layer_wise
            else tuple(shard_spec(jax.ShapeDtypeStruct((size,), master_dtype), spec) for size in b.shard_sizes)
            for b, spec in zip(plan.buffers, bucket_specs)
        ),
    )

    @jax.jit
    def init(params):
        check_tree(plan, params, "init(params)", local=False)
        return jax.shard_map(
            local_init, mesh=mesh, in_specs=(param_specs,), out_specs=state_specs, check_vma=False
        )(params)

    layer_wise_steps = [s for s in schedule.steps if s.layer_wise]
    muon_groups = sorted({group_of[leaf] for leaf, r in enumerate(plan.routes) if r.is_muon})

    def update_bucket(i: int, k: int, master, moments, grad, directions, checked, rank, finite, lr_m, lr_a):
        """Phase 4 for one bucket: this device's new master shard and optimizer state.

        ``moments`` is the Muon momentum of a layer-wise bucket, else the
        elementwise optax state; ``directions`` the bucket's
        :func:`~lwjax.sharded_step.muon_directions` if already computed
        (``checked``: with the finite check, so their momentum is final). Where
        ``finite`` is false everything keeps its old value; the select is fused
        into the update rather than branched on, so no host round trip stalls
        the all-gathers. Also returns the sum of squared master changes.
        """
        buffer = plan.buffers[i]
        if buffer.key.is_layer_wise:
            if directions is None:  # computed after the finite check, so their momentum is final
                directions = step_lib.muon_directions(buffer, k, moments, grad, rank, muon, transpose, finite)
                checked = True
            return step_lib.muon_apply(buffer, k, master, moments, directions, rank, finite, lr_m,
                                       config.weight_decay, muon, transpose, momentum_final=checked)
        lr_mult = step_lib.per_element(buffer, k, rank, lr_mult_of)
        decay = step_lib.per_element(buffer, k, rank, decay_of)
        new_master, new_tx_state = step_lib.elementwise_shard(tx, master, moments, grad, finite, lr_a, lr_mult, decay)
        return new_master, new_tx_state, jnp.sum(jnp.square(new_master - master))

    def update_and_gather(state: LayerwiseState, shards, ranks, norm_groups, coefs, finite, directions=None,
                          checked=False):
        """Phases 4-5 bucket by bucket in the schedule's order: new masters, moments and gathered buckets.

        One optimization barrier per bucket pins the order and makes the
        gathers due by then land first, so each gather runs during the later
        update the schedule chose for it rather than after the last one.
        ``directions`` maps ``(buffer, bucket)`` to precomputed Muon
        directions (``checked``: final after the finite check, see
        :func:`keep_or_redo`). Also returns the sum of squared master changes.
        """
        lr_m, lr_a = muon_lr(state.count), adam_lr(state.count)
        masters = [list(b) for b in state.masters]
        moments = [list(m if b.key.is_layer_wise else e)
                   for b, m, e in zip(plan.buffers, state.momenta, state.elementwise)]
        gathered = [[None] * b.num_buckets for b in plan.buffers]
        delta_sq, previous = jnp.zeros([], master_dtype), ()
        for t, step in enumerate(schedule.steps):
            i, k = step.buffer, step.bucket
            due = [(schedule.steps[j].buffer, schedule.steps[j].bucket) for j in schedule.lands_before(t)]
            own = (directions or {}).get((i, k))
            (master, moment, grad, own), _, arrived = lax.optimization_barrier(
                ((masters[i][k], moments[i][k], shards[i][k], own), previous, [gathered[a][b] for a, b in due]))
            for (a, b), x in zip(due, arrived):
                gathered[a][b] = x
            if config.clip_grad and own is None:
                grad = step_lib.clip_shard(grad, norm_groups[i][k], coefs)
            masters[i][k], moments[i][k], d = update_bucket(i, k, master, moment, grad, own, checked, ranks[i],
                                                            finite, lr_m, lr_a)
            delta_sq += d
            buffer = plan.buffers[i]
            previous = masters[i][k].astype(buffer.key.param_dtype)
            gathered[i][k] = step_lib.gather_bucket(previous, axes.of(buffer.key), ranks[i], buffer.dp,
                                                    config.param_sync)
        return masters, moments, gathered, delta_sq

    def muon_directions_pipelined(state: LayerwiseState, shards, ranks):
        """Every layer-wise bucket's Muon directions in update order, each as soon as its gradient shard is in.

        The chain of barriers keeps XLA from running them in another order; the
        reduce-scatters of later buckets run meanwhile. The gradients are taken
        unclipped, which is exact only where the clip coefficients are all 1.
        """
        directions, previous = {}, ()
        for s in layer_wise_steps:
            i, k = s.buffer, s.bucket
            (moment, grad), _ = lax.optimization_barrier(((state.momenta[i][k], shards[i][k]), previous))
            directions[i, k] = previous = step_lib.muon_directions(plan.buffers[i], k, moment, grad, ranks[i], muon,
                                                                   transpose)
        return directions

    def keep_or_redo(directions, state: LayerwiseState, shards, ranks, norm_groups, coefs, finite):
        """The speculative directions where they hold, else each bucket's directions computed again.

        They hold if no Muon matrix's clip coefficient is below 1 and the
        gradients are finite; otherwise they come again from the clipped
        gradients, with the finite check.

        Each bucket's recomputation is the body of its own ``while_loop`` that
        runs at most once: a loop's carry is updated in place, where a
        ``lax.cond`` copies what it passes through, and a loop per bucket lets
        each bucket's update and gather start without waiting for every other
        bucket's Newton–Schulz. (On GPU each loop reads its predicate on the
        host; at dp 4 that cost nothing measurable.) A step with non-finite
        gradients is skipped, but its loops run too: with the finite check they
        hand back the old momentum (``finite`` of
        :func:`~lwjax.sharded_step.muon_directions`), so every momentum that
        comes out is final and the update selects none. Also returns whether
        the clip made it recompute.
        """
        clipped = finite & jnp.logical_not(jnp.all(coefs[np.asarray(muon_groups)] == 1))
        redo = clipped | jnp.logical_not(finite)
        out = {}
        for (i, k), speculative in directions.items():
            def recompute(_, i=i, k=k):
                grad = step_lib.clip_shard(shards[i][k], norm_groups[i][k], coefs)
                return False, step_lib.muon_directions(plan.buffers[i], k, state.momenta[i][k], grad, ranks[i], muon,
                                                       transpose, finite)

            _, out[i, k] = lax.while_loop(lambda carry: carry[0], recompute, (redo, speculative))
        return out, clipped

    def update(grads, state: LayerwiseState, params):
        check_tree(plan, grads, "update(grads)")
        ranks = [axes.rank(b.key) for b in plan.buffers]
        # 1-2. Pack local gradients (scaled for the mean over dp * ep) and reduce-scatter each bucket. Pipelined:
        # layer-wise buckets first (nothing elementwise can start before the norm), and their Muon directions
        # start as each arrives.
        order = [(s.buffer, s.bucket) for s in sorted(schedule.steps, key=lambda s: not s.layer_wise)] \
            if config.pipeline_muon else None
        shards = step_lib.reduce_scatter(plan, axes, grads, master_dtype, order)
        directions = muon_directions_pipelined(state, shards, ranks) if config.pipeline_muon else None
        # 3. Norm per group, clipping and zero count from one psum over every data-parallel device.
        norm_groups = step_lib.norm_groups(plan, ranks, group_of)
        sq_sums, zeros = step_lib.grad_statistics(plan, shards, ranks, norm_groups, len(groups))
        sq_sums, zeros = lax.psum((sq_sums, zeros), axes.data)
        norms = jnp.sqrt(sq_sums)
        finite = jnp.all(jnp.isfinite(norms))
        coefs = step_lib.clip_coefficients(norms, config.clip_grad)
        speculated = config.pipeline_muon and config.clip_grad and layer_wise_steps
        if speculated:
            directions, recomputed = keep_or_redo(directions, state, shards, ranks, norm_groups, coefs, finite)
        # 4-5. Update each bucket and gather it, in the schedule's order.
        masters, moments, gathered, delta_sq = update_and_gather(state, shards, ranks, norm_groups, coefs, finite,
                                                                 directions, checked=bool(speculated))
        new_state = LayerwiseState(
            jnp.where(finite, state.count + 1, state.count),
            tuple(tuple(m) for m in masters),
            tuple(tuple(m) if b.key.is_layer_wise else None for b, m in zip(plan.buffers, moments)),
            tuple(None if b.key.is_layer_wise else tuple(m) for b, m in zip(plan.buffers, moments)),
        )
        update_rms = jnp.sqrt(lax.psum(delta_sq, axes.data) / real_numel)
        leaf_dtypes = [x.dtype for x in jax.tree.leaves(params)]
        new_params = unpack(plan, [tuple(g) for g in gathered], dtypes=leaf_dtypes)
        metrics = {
            "grad_norm": norms[0],
            "clip_coef": coefs[0],
            "num_zeros": zeros,
            "update_rms": update_rms,
            "skipped": jnp.logical_not(finite),
        }
        for g, name in enumerate(groups[1:], start=1):
            metrics[f"grad_norm/{name}"] = norms[g]
            metrics[f"clip_coef/{name}"] = coefs[g]
        if speculated:
            metrics["recomputed"] = recomputed
        return new_params, new_state, metrics

    return LayerwiseOptimizer(plan=plan, mesh=mesh, axis=axis, init=init, update=update, state_specs=state_specs,
                              expert_axis=expert_axis, param_specs=param_specs)


def _param_spec(route, expert_axis: str | None) -> P:
    """``P()`` for a dense leaf; an expert leaf's expert axis split over ``expert_axis``."""
    if expert_axis is None or route.expert_dim is None:
        return P()
    return P(*([None] * route.expert_dim), expert_axis)


def named_shardings(mesh: Mesh, specs):
    """The ``NamedSharding`` on ``mesh`` of every ``PartitionSpec`` in the pytree ``specs``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def state_shardings(optimizer: LayerwiseOptimizer) -> LayerwiseState:
    """``NamedSharding`` pytree of the optimizer state."""
    return named_shardings(optimizer.mesh, optimizer.state_specs)


class LogicalState(NamedTuple):
    """:class:`LayerwiseState` per parameter: independent of dp size, layout and policy.

    ``masters`` is shaped like the (global) parameters, expert leaves with
    all their experts; ``momenta`` too, with ``None`` for non-Muon leaves;
    ``elementwise`` is the elementwise optax state whose per-element leaves are
    parameter-shaped trees (``None`` for Muon leaves).
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


def _leaves(tree) -> list:
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)[0]


def _merge_experts(x: jax.Array, route) -> jax.Array:
    """``[ep, *local_shape]`` (one slice per expert group) to the global leaf: experts ``e * E/ep + j``."""
    return jnp.moveaxis(x, 0, route.expert_dim).reshape(route.shape)


def _split_experts(x: jax.Array, route, ep: int) -> jax.Array:
    """Inverse of :func:`_merge_experts`: a global expert leaf to ``[ep, *local_shape]``."""
    d = route.expert_dim
    return jnp.moveaxis(x.reshape(*route.shape[:d], ep, -1, *route.shape[d + 1:]), d, 0)


def _unpack_global(optimizer: LayerwiseOptimizer, buffers, dtypes):
    """:func:`~lwjax.buffers.unpack` of global state arrays into global (logical) leaves.

    A dense bucket's global array is the bucket itself. An expert bucket's is
    ``ep`` whole buckets, one per expert group (``ep``-major): each unpacks
    into its group's local experts, concatenated on the expert axis.
    """
    plan = optimizer.plan
    expert = [b.key.is_expert_parallel for b in plan.buffers]
    dense = unpack(plan, [None if e else x for e, x in zip(expert, buffers)], dtypes=dtypes)
    if not any(e and x is not None for e, x in zip(expert, buffers)):
        return dense
    ep = optimizer.mesh_axes.ep_size
    groups = [tuple(b.reshape(ep, -1) for b in x) if e and x is not None else None for e, x in zip(expert, buffers)]
    local = _leaves(jax.vmap(lambda bufs: unpack(plan, bufs, dtypes=dtypes))(groups))
    leaves = [x if not r.is_expert or y is None else _merge_experts(y, r)
              for x, y, r in zip(_leaves(dense), local, plan.routes)]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def _pack_global(optimizer: LayerwiseOptimizer, tree, dtypes):
    """Inverse of :func:`_unpack_global`: global (logical) leaves into global state arrays per bucket."""
    plan = optimizer.plan
    expert = [b.key.is_expert_parallel for b in plan.buffers]
    leaves = _leaves(tree)
    dense_tree = jax.tree_util.tree_unflatten(plan.treedef, [None if r.is_expert else x
                                                             for x, r in zip(leaves, plan.routes)])
    dense = pack(plan, dense_tree, dtypes=[None if e else d for e, d in zip(expert, dtypes)])
    if not any(e and d is not None for e, d in zip(expert, dtypes)):
        return dense
    ep = optimizer.mesh_axes.ep_size
    local_tree = jax.tree_util.tree_unflatten(plan.treedef, [
        _split_experts(x, r, ep) if r.is_expert and x is not None else None for x, r in zip(leaves, plan.routes)])
    local = jax.vmap(lambda t: pack(plan, t, dtypes=[d if e else None for e, d in zip(expert, dtypes)]))(local_tree)
    return tuple(
        tuple(b.reshape(-1) for b in y) if e and y is not None else x for e, x, y in zip(expert, dense, local)
    )


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
        masters = _unpack_global(optimizer, state.masters, [dtype] * len(plan.routes))
        momenta = _unpack_global(optimizer, state.momenta, [dtype] * len(plan.routes))
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
                    leaves.append(_unpack_global(optimizer, flats, [per_bucket[owners[0]][0][k].dtype] * len(plan.routes)))
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
        masters = _pack_global(optimizer, logical.masters, [dtype] * len(plan.buffers))
        momenta = _pack_global(optimizer, logical.momenta, [dtype if is_lw else None for is_lw in lw])
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
                    per_leaf.append(_pack_global(optimizer, tree, [leaf_dtype if i in owners else None
                                                                   for i in range(len(lw))]))
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
