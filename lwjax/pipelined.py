"""The pipelined step: Newton–Schulz starts as each gradient shard arrives, before the norm.

The serial step (:func:`lwjax.step.update`) needs the global gradient norm
before it can clip, so every Newton–Schulz waits for every reduce-scatter.
:func:`speculative_update` reduce-scatters the layer-wise buckets first and
starts each bucket's Muon directions (momentum and Newton–Schulz) as soon as
its shard is in, overlapping the remaining reduce-scatters. The directions
come from unclipped gradients: a speculation that no Muon matrix's clip
coefficient is below 1. After the norm, :func:`keep_or_redo` keeps them where
the speculation held and computes them again from the clipped gradients where
it did not, so the result is the serial step's up to rounding either way.
Without clipping there is nothing to speculate on and the step is exact.
The joint pass' matrices (dealt to devices; at one data-parallel rank every
whole one: :mod:`lwjax.joint_directions`) are speculated on together, once
every layer-wise shard is in.

A failed speculation runs Newton–Schulz twice. So with clipping,
:func:`update_pipelined` speculates only after a step that needed no Muon
clip (``LayerwiseState.speculate``) and otherwise runs the serial step: one
``lax.cond`` on the whole step, whose predicate is known when the step starts.
Clipping holds for runs of steps (early in training most steps clip, later
few do), so with the conditional only a step whose clip differs from its
predecessor's is guessed wrong (with the host's choice, from the step before
last, the first two such steps are): one that clips after one that did not
runs Newton–Schulz twice, one that does not clip after one that did runs
serially. The conditional itself costs up to a millisecond or so on GPU; a
caller that chooses on the host (:class:`lwjax.speculation.HostSpeculation`)
passes ``speculate`` and compiles each branch as a step of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.bucket_update import Directions, bucket_views, clip, muon_directions, update_and_gather
from lwjax.buffers import check_tree
from lwjax.joint_directions import joint_directions
from lwjax.plan import StepPlan
from lwjax.state import LayerwiseState, speculates
from lwjax.step import (
    GradStats,
    device_ranks,
    finish,
    grad_statistics,
    reduce_scatter,
    update_with_stats,
    with_schedules_checked,
)


def update_pipelined(
    plan: StepPlan,
    grads,
    state: LayerwiseState,
    params,
    *,
    reduced=False,
    gather=True,
    speculate: bool | None = None,
):
    """:func:`lwjax.step.update` with each Muon bucket's directions computed as its shard arrives.

    Same arguments and results. With clipping the step speculates only where
    ``state.speculate`` says so, and runs the serial step otherwise;
    ``metrics["speculated"]`` says which, ``metrics["recomputed"]`` whether
    the speculation failed and the directions were computed again. The new
    state's ``speculate`` is whether this step needed no Muon clip (a skipped
    step keeps the old guess).

    ``speculate`` (a Python bool) overrides the guess: the step is then the
    speculative or the serial step alone, without the conditional, and the
    caller has chosen on the host (:class:`lwjax.speculation.HostSpeculation`).
    Either choice gives the serial step's results up to rounding.
    """
    check_tree(plan, grads, "update(grads)")
    if not speculates(plan):  # no clipping or no Muon: nothing to guess
        return speculative_update(plan, grads, state, params, reduced=reduced, gather=gather)[:3]
    if state.speculate is None:
        raise ValueError(
            "update(state): this pipelined, clipping optimizer's state needs its speculation "
            "flag (LayerwiseState.speculate, a bool scalar); got None. Build the state with "
            "the optimizer's init or lwjax.from_logical."
        )

    def speculative():
        new_params, new_state, metrics, stats = speculative_update(
            plan, grads, state, params, reduced=reduced, gather=gather
        )
        clipped = muon_clipped(plan, stats)
        return new_params, new_state, metrics, clipped, clipped

    def serial():
        new_params, new_state, metrics, stats = update_with_stats(
            plan, grads, state, params, reduced=reduced, gather=gather
        )
        return new_params, new_state, metrics, muon_clipped(plan, stats), jnp.asarray(False)

    if speculate is None:
        speculated = state.speculate
        new_params, new_state, metrics, clipped, failed = lax.cond(speculated, speculative, serial)
    else:
        speculated = jnp.asarray(bool(speculate))
        new_params, new_state, metrics, clipped, failed = speculative() if speculate else serial()
    finite = jnp.logical_not(metrics["skipped"])
    new_state = new_state._replace(
        speculate=jnp.where(finite, jnp.logical_not(clipped), state.speculate)
    )
    metrics = {**metrics, "speculated": speculated, "recomputed": failed}
    return new_params, new_state, metrics


def muon_clipped(plan: StepPlan, stats: GradStats) -> jax.Array:
    """Whether the gradients are finite and some Muon matrix's clip coefficient is below 1."""
    muon_groups = sorted({plan.group_of[leaf] for leaf, r in enumerate(plan.routes) if r.is_muon})
    return stats.finite & jnp.logical_not(jnp.all(stats.coefs[np.asarray(muon_groups, int)] == 1))


def speculative_update(
    plan: StepPlan, grads, state: LayerwiseState, params, *, reduced=False, gather=True
):
    """The step with every Muon direction started before the norm; returns
    :func:`lwjax.step.update`'s results and the step's :class:`GradStats`."""
    ranks = device_ranks(plan)
    views = bucket_views(plan, ranks)
    # 1-2. Layer-wise buckets reduce-scattered first (nothing elementwise can start before the
    # norm), and each one's Muon directions computed from its unclipped shard as it arrives.
    order = [
        (s.buffer, s.bucket) for s in sorted(plan.schedule.steps, key=lambda s: not s.layer_wise)
    ]
    grad_shards = reduce_scatter(plan, grads, order, reduced=reduced)
    speculation = speculate(plan, state, grad_shards, views)
    # 3. Norms, clip coefficients and the zero count.
    stats = with_schedules_checked(plan, grad_statistics(plan, grad_shards, ranks), state.count)
    if plan.config.clip_grad and speculation.own.of:
        # The speculation kept where it held, else each bucket's directions computed again.
        directions = keep_or_redo(plan, speculation, state, grad_shards, views, stats)
    else:
        directions = speculation.own.merged(speculation.joint)
    # 4-5. Each owned shard updated with its directions, cast, and gathered; 6. unpacked (the
    # last two with gather).
    new = update_and_gather(plan, views, state, grad_shards, stats, directions, gather=gather)
    return *finish(plan, state, params, new, stats), stats


class Speculation(NamedTuple):
    """The speculative directions: each bucket's own slot groups', and the joint pass' ones."""

    own: Directions  # Per bucket, its own groups' (None for the joint ones).
    joint: Directions | None  # The joint groups' (:func:`lwjax.joint_directions.joint_directions`).


def speculate(plan: StepPlan, state: LayerwiseState, grad_shards, views) -> Speculation:
    """Every layer-wise bucket's Muon directions in update order, each as soon as its shard is in,
    then those of the joint pass, every bucket's together.

    The chain of barriers keeps XLA from running them in another order; the
    reduce-scatters of later buckets run meanwhile (the joint pass waits
    for the last layer-wise one). The gradients are taken unclipped, which is
    exact only where the clip coefficients are all 1, and without the finite
    check (their momenta are not final).
    """
    directions, previous = {}, ()
    for s in plan.schedule.steps:
        if not s.layer_wise:
            continue
        i, k = s.buffer, s.bucket
        (moment, grad), _ = lax.optimization_barrier(
            ((state.momenta[i][k], grad_shards[i][k]), previous)
        )
        view = views[i][k]
        directions[i, k] = previous = muon_directions(
            plan, view, moment, grad, groups=view.own_groups
        )
    layer_wise = [g if b.key.is_layer_wise else None for b, g in zip(plan.buffers, grad_shards)]
    (momenta, grads), _ = lax.optimization_barrier(((state.momenta, layer_wise), previous))
    joint = joint_directions(plan, views, momenta, grads)
    return Speculation(Directions(directions, final=False), joint)


def keep_or_redo(
    plan: StepPlan,
    speculation: Speculation,
    state: LayerwiseState,
    grad_shards,
    views,
    stats: GradStats,
) -> Directions:
    """The speculative directions where they hold, else computed again; all of them merged.

    They hold if no Muon matrix's clip coefficient is below 1 and the
    gradients are finite; otherwise they come again from the clipped
    gradients, with the finite check.

    Each bucket's recomputation is the body of its own ``while_loop`` that
    runs at most once, and so is the joint pass: a
    loop's carry is updated in place, where a ``lax.cond`` copies what it
    passes through, and a loop per bucket lets each bucket's update and
    gather start without waiting for every other bucket's Newton–Schulz. (On
    GPU each loop reads its predicate on the host; at dp 4 that cost nothing
    measurable.) A step with non-finite gradients is skipped, but its loops
    run too: with the finite check they hand back the old momentum, so every
    momentum that comes out is final and the update selects none.
    """
    redo = muon_clipped(plan, stats) | jnp.logical_not(stats.finite)
    out = {}
    for (i, k), speculative in speculation.own.of.items():

        def recompute(_, i=i, k=k):
            grad = clip(grad_shards[i][k], stats.groups[i][k], stats.coefs)
            view = views[i][k]
            return False, muon_directions(
                plan, view, state.momenta[i][k], grad, stats.finite, view.own_groups
            )

        _, out[i, k] = lax.while_loop(lambda carry: carry[0], recompute, (redo, speculative))
    own = Directions(out, final=True)
    if speculation.joint is None:
        return own

    def recompute_joint(_):
        # Each group keeps its momentum: the loop's carry is the speculation's structure.
        directions = joint_directions(
            plan, views, state.momenta, grad_shards, stats, write_momenta=False
        )
        return False, directions.of

    _, joint = lax.while_loop(lambda carry: carry[0], recompute_joint, (redo, speculation.joint.of))
    return own.merged(Directions(joint, final=True))
