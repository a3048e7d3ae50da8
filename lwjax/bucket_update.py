r"""Phases 4–5 of the step, bucket by bucket: update this device's shard, cast it, gather it.

Phase 4 reads "for each bucket, update it". A :class:`BucketView` says what one
bucket is to this device: its :class:`~lwjax.plan.BufferPlan`, its rank there,
the slot groups of the Muon matrices it owns and how each is split over the
tensor-parallel axes (a :class:`~lwjax.parallel.exchange.SplitExchange`, built
by the wing). :func:`update_bucket` clips the bucket's gradient shard, then
runs Muon on its matrices, one batched call per slot group
(:func:`muon_directions`, then :func:`apply_muon`), or the elementwise transform
with decoupled weight decay on the flat shard (:func:`update_elementwise`).
:func:`update_and_gather` runs the buckets in the schedule's order and gathers
each updated shard (:func:`gather_shard`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lwjax import muon as muon_lib
from lwjax import shards
from lwjax.parallel.counted import count_once, counted_elements, first_device
from lwjax.parallel.exchange import SplitExchange, split_exchange
from lwjax.parallel.ns_deal import is_joint
from lwjax.plan import BufferPlan, SlotGroup, StepPlan


@dataclasses.dataclass(frozen=True)
class BucketView:
    """One bucket of one buffer, as this device updates it.

    Built once per step (:func:`bucket_views`); every per-rank value is read
    where it is used (:meth:`offsets`), so the program is the same whichever
    function reads it first.

    Attributes:
      buffer_index: The buffer's position in ``plan.buffers``.
      bucket: The bucket's index in the buffer.
      buffer: The buffer's plan.
      rank: This device's shard index in the buffer (traced).
      groups: The slot groups of the Muon matrices in the bucket (none if elementwise).
      exchanges: Per slot group, how its matrices are split over the tensor axes
        (``None``: whole on each device).
      scratch: Zeros a shard needs past its end for spare slots (:func:`lwjax.shards.slot_groups`).
      joint: Per slot group, whether its directions come from the step's joint pass
        (:mod:`lwjax.joint_directions`, :func:`lwjax.parallel.ns_deal.is_joint`), not
        from this bucket's update.
    """

    buffer_index: int
    bucket: int
    buffer: BufferPlan
    rank: Any
    groups: tuple[SlotGroup, ...]
    exchanges: tuple[SplitExchange | None, ...]
    scratch: int
    joint: tuple[bool, ...]

    @property
    def is_layer_wise(self) -> bool:
        """Whether Muon updates the bucket (else the elementwise transform)."""
        return self.buffer.key.is_layer_wise

    @property
    def own_groups(self) -> list[int]:
        """The slot groups whose directions the bucket computes itself (not joint)."""
        return [j for j, joint in enumerate(self.joint) if not joint]

    @property
    def size(self) -> int:
        """Elements in this device's shard of the bucket."""
        return self.buffer.shard_sizes[self.bucket]

    def offsets(self, group: SlotGroup):
        """Where this rank's matrices of ``group`` start in its shard."""
        return shards.rank_row(group.offsets, self.rank)

    def per_element(self, value_of):
        """``value_of[leaf]`` on each element of this device's shard
        (:func:`lwjax.shards.per_element`)."""
        return shards.per_element(self.buffer, self.bucket, self.rank, value_of)


def bucket_views(plan: StepPlan, ranks) -> list[list[BucketView]]:
    """Per buffer and bucket, its :class:`BucketView` (``ranks``: this device's shard index
    in each buffer)."""
    views = []
    for i, (buffer, rank) in enumerate(zip(plan.buffers, ranks)):
        per_buffer = []
        for k in range(buffer.num_buckets):
            groups, scratch = shards.slot_groups(buffer, k)
            exchanges = tuple(
                split_exchange(
                    plan.axes, g, plan.transpose, plan.muon.tp_mode, plan.axes.of(buffer.key)
                )
                for g in groups
            )
            joint = tuple(is_joint(g, buffer) for g in groups)
            per_buffer.append(
                BucketView(i, k, buffer, rank, tuple(groups), exchanges, scratch, joint)
            )
        views.append(per_buffer)
    return views


class Rates(NamedTuple):
    """The step's learning rates and weight decay, the same for every bucket."""

    muon: Any  # Muon learning rate.
    elementwise: Any  # Learning rate of the elementwise parameters.
    weight_decay: Any  # lambda, from weight_decay_at.


class BucketShards(NamedTuple):
    """This device's shards of one bucket as phase 4 reads them."""

    master: jax.Array  # fp32 master weights.
    moment: Any  # Muon momentum (layer-wise bucket) or the elementwise optax state.
    grad: jax.Array  # Mean gradient.
    directions: list | None = None  # Muon directions computed before the norm, if any.


class Directions(NamedTuple):
    """Muon directions computed before phase 4 (:mod:`lwjax.joint_directions`,
    :mod:`lwjax.pipelined`)."""

    # (buffer, bucket) -> per slot group :func:`muon_directions`' (polar, momentum), None for
    # a group left to the bucket's update; a momentum None is in ``momenta`` already.
    of: dict
    final: bool  # Whether their momenta passed the finite check (else phase 4 selects).
    # (buffer, bucket) -> the bucket's momentum shard with those groups' new momenta written.
    momenta: dict = {}

    def merged(self, other: Directions | None) -> Directions:
        """These directions with ``other``'s filling the groups left ``None`` (the same
        ``final``)."""
        if other is None:
            return self
        if other.final != self.final:
            raise ValueError(f"directions final={self.final} merged with final={other.final}.")
        if self.momenta.keys() & other.momenta.keys():
            raise ValueError("directions that both wrote a bucket's momenta cannot be merged.")
        of = {key: list(given) for key, given in self.of.items()}
        for key, given in other.of.items():
            mine = of.setdefault(key, [None] * len(given))
            of[key] = [a if b is None else b for a, b in zip(mine, given)]
        return Directions(of, self.final, {**self.momenta, **other.momenta})


def weight_decay_at(plan: StepPlan, count: jax.Array) -> float | jax.Array:
    r"""The step's weight decay :math:`\lambda`: ``OptimizerConfig.weight_decay`` at ``count``.

    A float stays a Python float, a constant of the compiled step; it is
    already in ``plan.decay_of``. A schedule's value is traced, and ``decay_of``
    then holds the per-leaf multipliers it scales.
    """
    decay = plan.config.weight_decay
    return decay(count) if callable(decay) else decay


def clip(grad_shard: jax.Array, group, coefs: jax.Array) -> jax.Array:
    """A gradient shard scaled by its elements' norm-group clip coefficients."""
    return grad_shard * coefs[group]


def update_and_gather(
    plan: StepPlan, views, state, grad_shards, stats, early: Directions | None = None, gather=True
):
    """Phases 4–5, bucket by bucket in the schedule's order: new masters, moments, gathered buckets.

    One optimization barrier per bucket pins the order and makes the gathers
    due by then land first, so each gather runs during the later update the
    schedule chose for it rather than after the last one. ``early``: Muon
    directions computed before the norm (by :mod:`lwjax.pipelined`). Returns
    ``(masters, moments, gathered, delta_sq)``, the last the sum of squared
    master changes; ``gathered`` is ``None`` without ``gather`` (phase 4 alone).
    """
    rates = Rates(
        plan.learning_rate(state.count),
        plan.adam_learning_rate(state.count),
        weight_decay_at(plan, state.count),
    )
    masters = [list(b) for b in state.masters]
    moments = [
        list(m if b.key.is_layer_wise else e)
        for b, m, e in zip(plan.buffers, state.momenta, state.elementwise)
    ]
    gathered = [[None] * b.num_buckets for b in plan.buffers]
    delta_sq, previous = jnp.zeros([], plan.master_dtype), ()
    final = True if early is None else early.final
    steps = plan.schedule.steps
    for t, step in enumerate(steps):
        i, k = step.buffer, step.bucket
        due = [(steps[j].buffer, steps[j].bucket) for j in plan.schedule.lands_before(t)]
        own = None if early is None else early.of.get((i, k))
        if early is not None and (i, k) in early.momenta:  # the early groups' momenta written
            moments[i][k] = early.momenta[(i, k)]
        inputs = BucketShards(masters[i][k], moments[i][k], grad_shards[i][k], own)
        inputs = _in_order(inputs, previous, due if gather else [], gathered)
        masters[i][k], moments[i][k], d = update_bucket(
            plan, views[i][k], inputs, stats, rates, final
        )
        delta_sq += d
        previous = masters[i][k]
        if gather:
            previous = previous.astype(plan.buffers[i].key.param_dtype)
            gathered[i][k] = gather_shard(plan, i, previous, views[i][k].rank)
    return masters, moments, gathered if gather else None, delta_sq


def _in_order(inputs: BucketShards, previous, due: list, gathered: list) -> BucketShards:
    """``inputs`` behind one optimization barrier with the previous bucket's update and the
    gathers ``due`` by now: the bucket waits for the one before, and those gathers land
    first (written into ``gathered``).

    Only the gradient and the directions pass through it: every update reads the gradient,
    so that orders the bucket, and the state shards (donated arguments, updated in place)
    stay out of it, where XLA copied each one it passed through."""
    if not due and not jax.tree.leaves(previous):  # nothing to wait for
        return inputs
    (grad, directions), _, arrived = lax.optimization_barrier(
        ((inputs.grad, inputs.directions), previous, [gathered[a][b] for a, b in due])
    )
    for (a, b), x in zip(due, arrived):
        gathered[a][b] = x
    return inputs._replace(grad=grad, directions=directions)


def gather_shard(plan: StepPlan, i: int, shard: jax.Array, rank) -> jax.Array:
    """Phase 5 of one bucket of buffer ``i``: every device's shard of it (already cast to
    the parameter dtype) on every device."""
    buffer = plan.buffers[i]
    return shards.gather_bucket(
        shard, plan.axes.of(buffer.key), rank, buffer.dp, plan.config.param_sync
    )


def update_bucket(
    plan: StepPlan, bucket: BucketView, inputs: BucketShards, stats, rates: Rates, final=True
):
    """Phase 4 of one bucket: clip, then Muon or the elementwise update.

    ``stats`` is the step's :class:`~lwjax.step.GradStats`. Directions
    computed earlier (``inputs.directions``, their momenta ``final`` or not)
    were taken from gradients that needed no clip or were clipped already;
    the slot groups they leave ``None``, or all without them, are computed
    here, after the finite check. Returns the new master and moment and the
    sum of squared master changes.
    """
    grad, given = inputs.grad, inputs.directions
    computes_here = given is None or any(d is None for d in given)
    if plan.config.clip_grad and computes_here:
        grad = clip(grad, stats.groups[bucket.buffer_index][bucket.bucket], stats.coefs)
    if not bucket.is_layer_wise:
        return update_elementwise(plan, bucket, inputs._replace(grad=grad), stats.finite, rates)
    directions = given
    if computes_here:  # after the finite check: a skipped step's momentum is the old one
        missing = None if given is None else [j for j, d in enumerate(given) if d is None]
        computed = muon_directions(plan, bucket, inputs.moment, grad, stats.finite, missing)
        if given is None:
            directions, final = computed, True
        else:
            directions = [c if g is None else g for g, c in zip(given, computed)]
    inputs = inputs._replace(directions=directions)
    return apply_muon(plan, bucket, inputs, stats.finite, rates, final)


def muon_directions(
    plan: StepPlan, bucket: BucketView, momentum, grad, finite=None, groups=None
) -> list:
    """Phase 4a of a layer-wise bucket: :func:`~lwjax.muon.muon_polar` of each slot group.

    Reads this rank's matrices with one slice or gather per slot group; needs
    no master weights, so it can run as soon as the bucket's gradient shard
    has arrived. Given the step's ``finite`` check, a skipped step's momentum
    comes back unchanged (final: :func:`apply_muon` need not select it).
    ``groups``: the slot groups to compute (default: all), ``None`` for the others.
    """
    scratch = bucket.scratch
    momentum, grad = shards.with_scratch(momentum, scratch), shards.with_scratch(grad, scratch)
    skip = None if finite is None else jnp.logical_not(finite)
    todo = range(len(bucket.groups)) if groups is None else set(groups)
    out = []
    for j, (group, exchange) in enumerate(zip(bucket.groups, bucket.exchanges)):
        if j not in todo:
            out.append(None)
            continue
        offsets = bucket.offsets(group)
        out.append(
            muon_lib.muon_polar(
                shards.take(grad, offsets, group.shape, plan.transpose),
                shards.take(momentum, offsets, group.shape, plan.transpose),
                config=plan.muon,
                qkv_split_shapes=group.qkv_split_shapes,
                skip=skip,
                exchange=exchange,
            )
        )
    return out


def apply_muon(
    plan: StepPlan, bucket: BucketView, inputs: BucketShards, finite, rates: Rates, final=True
):
    """Phase 4b of a layer-wise bucket: :func:`~lwjax.muon.apply_polar` of each slot group.

    Group ``j`` steps with learning rate ``rates.muon * lr_mult_j`` and weight
    decay ``rates.weight_decay * wd_mult_j`` with ``inputs.directions``;
    matrices are written back in place. Returns the new master and momentum
    shards (the old ones where ``finite`` is false; ``final``: the directions'
    momentum already is) and the sum of squared master changes.
    """
    lr, wd = rates.muon, rates.weight_decay
    master = shards.with_scratch(inputs.master, bucket.scratch)
    momentum = shards.with_scratch(inputs.moment, bucket.scratch)
    delta_sq = jnp.zeros([], master.dtype)
    for group, exchange, (polar, new_m) in zip(bucket.groups, bucket.exchanges, inputs.directions):
        offsets = bucket.offsets(group)
        old_p = shards.take(master, offsets, group.shape, plan.transpose)
        new_p = muon_lib.apply_polar(
            old_p,
            polar,
            learning_rate=lr * group.lr_mult if group.lr_mult != 1 else lr,
            weight_decay=wd * group.wd_mult,
            config=plan.muon,
            qkv_split_shapes=group.qkv_split_shapes,
            exchange=exchange,
        )
        new_p = jnp.where(finite, new_p, old_p)
        if not final and new_m is not None:
            new_m = jnp.where(
                finite, new_m, shards.take(momentum, offsets, group.shape, plan.transpose)
            )
        change = jnp.sum(jnp.square(new_p - old_p))
        if group.tensor_whole:  # the same matrices on every device of those axes
            change = jnp.where(first_device(plan.axes, group.tensor_whole), change, 0)
        delta_sq += change
        if plan.transpose:
            new_p = jnp.swapaxes(new_p, -1, -2)
            new_m = None if new_m is None else jnp.swapaxes(new_m, -1, -2)
        master = shards.put(master, offsets, new_p)
        if new_m is not None:  # else written with its direction (lwjax.joint_directions)
            momentum = shards.put(momentum, offsets, new_m)
    return master[: bucket.size], momentum[: bucket.size], delta_sq


def update_elementwise(plan: StepPlan, bucket: BucketView, inputs: BucketShards, finite, rates):
    r"""Phase 4 of an elementwise bucket: the elementwise transform plus decoupled weight decay.

    .. math:: p \leftarrow p - \eta\, m_\eta (u + \lambda m_\lambda p), \qquad u = \text{tx}(g)

    ``m_η`` and ``λ m_λ`` (zero on 1-D parameters) are per element
    (:func:`~lwjax.shards.per_element`); a scheduled weight decay
    (:func:`weight_decay_at`) multiplies ``m_λ`` here, a float one is already
    in ``plan.decay_of``. Returns the new master and optax state (the old ones
    where ``finite`` is false) and the sum of squared master changes.
    """
    master, tx_state, lr = inputs.master, inputs.moment, rates.elementwise
    lr_mult = bucket.per_element(plan.lr_mult_of)
    decay = bucket.per_element(plan.decay_of)
    if callable(plan.config.weight_decay) and not _is_zero(decay):
        decay = decay * rates.weight_decay
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    direction, new_tx_state = plan.elementwise.update(inputs.grad, tx_state, master)
    new_tx_state = jax.tree.map(keep, new_tx_state, tx_state)
    # Materialised before the master's update reads them: else XLA computes the new state
    # again there from the old one, which it must then copy to keep it readable while the
    # new state is written over it (the state is donated and updated in place).
    direction, new_tx_state = lax.optimization_barrier((direction, new_tx_state))
    step = lr * lr_mult if not (isinstance(lr_mult, (int, float)) and lr_mult == 1) else lr
    new_master = keep(master - step * (direction + decay * master), master)
    change = jnp.square(new_master - master)
    counted = counted_elements(plan, bucket.buffer_index, bucket.bucket, bucket.rank)
    return (
        new_master,
        new_tx_state,
        jnp.sum(count_once(change, counted)),
    )


def _is_zero(value) -> bool:
    """A Python number equal to 0 (a traced or per-element value never is)."""
    return isinstance(value, (int, float)) and value == 0
