"""The Muon directions of every dealt split matrix of a step, in one exchange across buckets.

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
matrices, other modes) are computed bucket by bucket as before.

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

from lwjax import muon as muon_lib
from lwjax import shards
from lwjax.bucket_update import BucketView, Directions, clip
from lwjax.parallel.exchange import SplitExchange, assembled_together
from lwjax.plan import StepPlan


class _Dealt(NamedTuple):
    """One dealt slot group of one bucket, its Newton–Schulz pending."""

    bucket: BucketView
    group: int  # Its index among the bucket's slot groups.
    exchange: SplitExchange
    momentum: jax.Array  # The new momentum.
    stacks: list  # What Newton–Schulz runs on (lwjax.muon.polar_pieces).
    join: Any  # Newton–Schulz of each stack -> the direction.
    ns: Any  # Newton–Schulz with the step's options.


def joint_directions(plan: StepPlan, views, momenta, grad_shards, stats=None) -> Directions | None:
    """The Muon directions of every dealt slot group of the step, ``None`` if it has none.

    Args:
      plan: The step's plan.
      views: Per buffer and bucket, its :class:`~lwjax.bucket_update.BucketView`.
      momenta: Per buffer and bucket, this device's Muon momentum shard.
      grad_shards: Per buffer and bucket, this device's reduced gradient shard.
      stats: The step's :class:`~lwjax.step.GradStats`: the gradients are
        clipped and a skipped step keeps its momenta (final). Without it, the
        gradients are taken as they are (a speculation, :mod:`lwjax.pipelined`).

    Returns:
      :class:`~lwjax.bucket_update.Directions` holding, per bucket with dealt
      slot groups, their ``(polar, momentum)`` and ``None`` for its other groups.
    """
    skip = None if stats is None else jnp.logical_not(stats.finite)
    pending = []
    for view in (v for per_buffer in views for v in per_buffer):
        if not any(view.dealt):
            continue
        i, k = view.buffer_index, view.bucket
        grad = grad_shards[i][k]
        if stats is not None and plan.config.clip_grad:
            grad = clip(grad, stats.groups[i][k], stats.coefs)
        grad = shards.with_scratch(grad, view.scratch)
        momentum = shards.with_scratch(momenta[i][k], view.scratch)
        for j in (j for j, dealt in enumerate(view.dealt) if dealt):
            group, offsets = view.groups[j], view.offsets(view.groups[j])
            update, new_momentum = muon_lib.muon_momentum(
                shards.take(grad, offsets, group.shape, plan.transpose),
                shards.take(momentum, offsets, group.shape, plan.transpose),
                config=plan.muon,
                skip=skip,
            )
            stacks, join, ns = muon_lib.polar_pieces(
                update, config=plan.muon, qkv_split_shapes=group.qkv_split_shapes
            )
            pending.append(_Dealt(view, j, view.exchanges[j], new_momentum, stacks, join, ns))
    if not pending:
        return None
    return Directions(_orthogonalized(pending), final=stats is not None)


def _orthogonalized(pending: list[_Dealt]) -> dict:
    """Newton–Schulz of every pending stack, one exchange per split, rank axes and block shape;
    per bucket the directions of its dealt groups, ``None`` for the others."""
    batches: dict[tuple, list[tuple[int, int]]] = {}  # batch -> (pending index, stack index)
    for p, dealt in enumerate(pending):
        for s, stack in enumerate(dealt.stacks):
            key = (dealt.exchange.split, dealt.exchange.deal.rank_axes, stack.shape[-2:])
            batches.setdefault((*key, stack.dtype), []).append((p, s))
    done = [[None] * len(dealt.stacks) for dealt in pending]
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
    for dealt, outs in zip(pending, done):
        key = (dealt.bucket.buffer_index, dealt.bucket.bucket)
        of.setdefault(key, [None] * len(dealt.bucket.groups))
        of[key][dealt.group] = (dealt.join(outs), dealt.momentum)
    return of
