"""The Muon directions of a step's joint pass: every bucket's, before any bucket's update.

Two kinds of slot group run here (:func:`lwjax.parallel.ns_deal.is_joint`): split
matrices dealt to devices, and, in a buffer of one data-parallel rank, whole matrices.

Under ``tp_mode="duplicated"`` each split matrix is assembled whole on the
device the plan dealt it to (:mod:`lwjax.parallel.ns_deal`), which balances the
devices' Newton–Schulz over the whole step. Bucket by bucket, each bucket would
wait for its own busiest device: with buckets of about one large matrix per
rank, that is one device working while the others wait, bucket after bucket.
:func:`joint_directions` computes every dealt slot group of every bucket
together instead, once the gradient shards are reduced: the momentum of each,
one ``all_to_all`` out and one back per shape of block (same-shape matrices of
all buckets in one batch, :func:`lwjax.parallel.exchange.assembled_together`),
Newton–Schulz on each device's dealt matrices. The buckets' updates then apply
them (:func:`lwjax.bucket_update.update_and_gather`); other slot groups (whole
matrices at several data-parallel ranks, other modes) are computed bucket by bucket.

With one data-parallel rank no bucket's gather waits to overlap a later bucket's
Newton–Schulz, so every whole matrix of the step runs in one
:func:`~lwjax.newton_schulz.newton_schulz_many`: the matrices of one shape from all
buckets as one batch, each step's upper-tile kernels for all of them (of one Gram edge)
in one launch.
Launched bucket by bucket, each stack's last round of tiles left most of the GPU
idle: the 1b workload's Newton–Schulz took 57.6 ms together against 61.5 ms apart
(one H200, docs/benchmarks.md, thirty-fifth session). Every whole matrix's iterates
are then alive together: at 1b, XLA's estimate of the optimizer step's temporaries
grew from 3.4 to 4.2 GB.

Memory: the directions (bf16 under ``"medium"``) and momenta of every dealt
matrix are alive together, but each shape's exchange buffers hold the most
matrices any device assembles of that shape over the step (about its share),
where a bucket at a time held a whole matrix per slot group on every device:
XLA's estimate of the optimizer step's temporaries falls (``docs/scaling.md``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lwjax import muon as muon_lib
from lwjax import shards
from lwjax.bucket_update import BucketView, Directions, clip
from lwjax.parallel.exchange import SplitExchange, assembled_together
from lwjax.plan import StepPlan


class _Pending(NamedTuple):
    """One joint slot group of one bucket, its Newton–Schulz pending."""

    bucket: BucketView
    group: int  # Its index among the bucket's slot groups.
    exchange: SplitExchange | None  # None: whole matrices.
    momentum: jax.Array | None  # The new momentum (None: written into the bucket's already).
    stacks: list  # What Newton–Schulz runs on (lwjax.muon.polar_pieces).
    join: Any  # Newton–Schulz of each stack -> the direction.
    ns: Any  # Newton–Schulz with the step's options.


def joint_directions(
    plan: StepPlan, views, momenta, grad_shards, stats=None, *, write_momenta: bool = True
) -> Directions | None:
    """The Muon directions of every joint slot group of the step, ``None`` if it has none.

    Args:
      plan: The step's plan.
      views: Per buffer and bucket, its :class:`~lwjax.bucket_update.BucketView`.
      momenta: Per buffer and bucket, this device's Muon momentum shard.
      grad_shards: Per buffer and bucket, this device's reduced gradient shard.
      stats: The step's :class:`~lwjax.step.GradStats`: the gradients are
        clipped and a skipped step keeps its momenta (final). Without it, the
        gradients are taken as they are (a speculation, :mod:`lwjax.pipelined`).
      write_momenta: With ``stats``, write the new momenta into the buckets'
        (below); else each group keeps its own, as a speculation's.

    Returns:
      :class:`~lwjax.bucket_update.Directions` holding, per bucket with joint
      slot groups, their ``(polar, momentum)`` and ``None`` for its other groups.
      With ``stats`` and ``write_momenta`` the new momenta are written into the
      (donated) state as they are computed (:func:`_updates`), where keeping each
      until its bucket's update held a second copy of every dealt momentum (3.5 GB
      per device at 8B, fsdp 8): the groups' momenta are then ``None`` and the
      buckets' are in ``momenta``.
    """
    skip = None if stats is None else jnp.logical_not(stats.finite)
    write = stats is not None and write_momenta
    pending, written = [], {}
    for view in (v for per_buffer in views for v in per_buffer):
        if not any(view.joint):
            continue
        i, k = view.buffer_index, view.bucket
        grad = grad_shards[i][k]
        if stats is not None and plan.config.clip_grad:
            grad = clip(grad, stats.groups[i][k], stats.coefs)
        grad = shards.with_scratch(grad, view.scratch)
        momentum = shards.with_scratch(momenta[i][k], view.scratch)
        updates, momentum = _updates(plan, view, grad, momentum, skip, write)
        if write:
            written[(i, k)] = momentum[: view.size]
        for j, (update, new_momentum) in updates.items():
            stacks, join, ns = muon_lib.polar_pieces(
                update, config=plan.muon, qkv_split_shapes=view.groups[j].qkv_split_shapes
            )
            pending.append(_Pending(view, j, view.exchanges[j], new_momentum, stacks, join, ns))
    if not pending:
        return None
    return Directions(_orthogonalized(pending, plan.muon), final=stats is not None, momenta=written)


def _updates(plan: StepPlan, view: BucketView, grad, momentum, skip, write: bool):
    """``({group: (update, new momentum)}, momentum)`` for a bucket's dealt slot groups: the
    matrix Newton–Schulz orthogonalises and the new momentum of each (its scratch-padded
    shards ``grad`` and ``momentum``). With ``write`` each new momentum is written into
    ``momentum`` (returned) instead, group after group, each group read from the bucket as
    written so far, and each update is read back from it (behind a barrier, so that XLA
    cannot forward the new momenta themselves): the exchange then reads the state and the
    gradients, and no new momentum is kept until it runs."""
    out = {}
    for j in (j for j, joint in enumerate(view.joint) if joint):
        group, offsets = view.groups[j], view.offsets(view.groups[j])
        update, new = muon_lib.muon_momentum(  # with write, the update is read back below
            shards.take(grad, offsets, group.shape, plan.transpose),
            shards.take(momentum, offsets, group.shape, plan.transpose),
            config=plan.muon,
            skip=skip,
        )
        if write:
            momentum = shards.put(
                momentum, offsets, jnp.swapaxes(new, -1, -2) if plan.transpose else new
            )
            new = None
        out[j] = (update, new)
    if not write:
        return out, momentum
    momentum = lax.optimization_barrier(momentum)
    for j in out:
        group, offsets = view.groups[j], view.offsets(view.groups[j])
        look_ahead = muon_lib.muon_look_ahead(
            shards.take(grad, offsets, group.shape, plan.transpose),
            shards.take(momentum, offsets, group.shape, plan.transpose),
            config=plan.muon,
        )
        out[j] = (look_ahead, None)
    return out, momentum


def _orthogonalized(pending: list[_Pending], config) -> dict:
    """Newton–Schulz of every pending stack: the whole matrices' in one
    :func:`~lwjax.newton_schulz.newton_schulz_many` (with ``config``, the step's
    :class:`~lwjax.muon.MuonConfig`), the dealt ones' in one exchange per
    split, rank axes and block shape; per bucket the directions of its joint groups, ``None``
    for the others."""
    done = [[None] * len(entry.stacks) for entry in pending]
    whole = [
        (p, s)
        for p, entry in enumerate(pending)
        if entry.exchange is None
        for s in range(len(entry.stacks))
    ]
    if whole:
        stacks = [pending[p].stacks[s] for p, s in whole]
        outs = muon_lib.orthogonalize_together(stacks, config=config)
        for (p, s), out in zip(whole, outs):
            done[p][s] = out
    batches: dict[tuple, list[tuple[int, int]]] = {}  # batch -> (pending index, stack index)
    for p, entry in enumerate(pending):
        if entry.exchange is None:
            continue
        for s, stack in enumerate(entry.stacks):
            key = (entry.exchange.split, entry.exchange.deal.rank_axes, stack.shape[-2:])
            batches.setdefault((*key, stack.dtype), []).append((p, s))
    for members in batches.values():
        first = pending[members[0][0]]
        outs = assembled_together(
            first.ns,
            first.exchange.split,
            [pending[p].stacks[s] for p, s in members],
            [pending[p].exchange.deal for p, _ in members],
        )
        for (p, s), out in zip(members, outs):
            done[p][s] = out
    of: dict = {}
    for entry, outs in zip(pending, done):
        key = (entry.bucket.buffer_index, entry.bucket.bucket)
        of.setdefault(key, [None] * len(entry.bucket.groups))
        of[key][entry.group] = (entry.join(outs), entry.momentum)
    return of
