"""The optimizer state per parameter: independent of dp size, layout, policy and buckets.

A :class:`~lwjax.state.LayerwiseState` is packed: per buffer and bucket, one
array whose shards hold the masters and moments of whatever each rank owns.
:func:`to_logical` unpacks it into a :class:`LogicalState` shaped like the
parameters, and :func:`from_logical` packs one into any optimizer over the same
parameters and routing, so checkpoints (:mod:`lwjax.checkpoint`) restore at any
dp size. The two are inverses.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.buffers import pack, unpack
from lwjax.optimizer import LayerwiseOptimizer, state_shardings
from lwjax.state import LayerwiseState, initial_speculation


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
    """Where a logical (per-parameter) array lives: split over dp on axis 0 if it divides."""
    dp = optimizer.mesh.shape[optimizer.axis]
    spec = P(optimizer.axis) if x.ndim and x.shape[0] % dp == 0 else P()
    return NamedSharding(optimizer.mesh, spec)


def _leaves(tree) -> list:
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)[0]


def _merge_blocks(x: jax.Array, dim: int) -> jax.Array:
    """``[n, *block]`` to the blocks joined on axis ``dim``, block ``j`` at ``j * block[dim]``."""
    n, *block = x.shape
    block[dim] *= n
    return jnp.moveaxis(x, 0, dim).reshape(block)


def _split_blocks(x: jax.Array, dim: int, n: int) -> jax.Array:
    """Inverse of :func:`_merge_blocks`: ``x`` cut into ``n`` blocks on axis ``dim``, stacked."""
    shape = x.shape
    return jnp.moveaxis(x.reshape(*shape[:dim], n, -1, *shape[dim + 1 :]), dim, 0)


def _unpack_global(optimizer: LayerwiseOptimizer, buffers, dtypes):
    """:func:`~lwjax.buffers.unpack` of global state arrays into global (logical) leaves.

    With tensor parallelism a bucket's global array is one per tensor-parallel
    device (``tp``-major): each unpacks into that device's blocks, joined on the
    leaf's split axes (a leaf whole over a mesh axis is taken from its first device).
    """
    plan = optimizer.plan
    sizes = plan.axes.tp_sizes
    if not sizes or all(x is None for x in buffers):  # nothing to map over (no Muon momenta)
        return _unpack_group(optimizer, buffers, dtypes)
    per_device = [None if x is None else tuple(b.reshape(*sizes, -1) for b in x) for x in buffers]
    blocks = _over_devices(lambda bufs: _unpack_group(optimizer, bufs, dtypes), len(sizes))(
        per_device
    )
    leaves = [None if y is None else _joined(y, r) for y, r in zip(_leaves(blocks), plan.routes)]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def _pack_global(optimizer: LayerwiseOptimizer, tree, dtypes):
    """Inverse of :func:`_unpack_global`: global (logical) leaves into each bucket's state array."""
    plan = optimizer.plan
    sizes = plan.axes.tp_sizes
    if not sizes or all(x is None for x in _leaves(tree)):
        return _pack_group(optimizer, tree, dtypes)
    blocks = [None if x is None else _cut(x, r, sizes) for x, r in zip(_leaves(tree), plan.routes)]
    per_device = _over_devices(lambda t: _pack_group(optimizer, t, dtypes), len(sizes))(
        jax.tree_util.tree_unflatten(plan.treedef, blocks)
    )
    return tuple(None if x is None else tuple(b.reshape(-1) for b in x) for x in per_device)


def _over_devices(fn, depth: int):
    """``fn`` mapped over ``depth`` leading axes (one per tensor-parallel mesh axis)."""
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


def _joined(blocks: jax.Array, route) -> jax.Array:
    """``[*tp sizes, *block]`` to the global leaf: the minor mesh axis's blocks joined first."""
    for a in reversed(range(len(route.tensor_dims))):
        dim = route.tensor_dims[a]
        if dim is None:
            blocks = jnp.take(blocks, 0, axis=a)
        else:
            blocks = _over_devices(lambda z, dim=dim: _merge_blocks(z, dim), a)(blocks)
    return blocks


def _cut(leaf: jax.Array, route, sizes) -> jax.Array:
    """Inverse of :func:`_joined`: a global leaf to each device's block, ``[*tp sizes, *block]``
    (a leaf whole over a mesh axis repeated along it)."""
    for a, (dim, size) in enumerate(zip(route.tensor_dims, sizes)):
        if dim is None:
            cut = lambda z, size=size: jnp.broadcast_to(z, (size, *z.shape))  # noqa: E731
        else:
            cut = lambda z, dim=dim, size=size: _split_blocks(z, dim, size)  # noqa: E731
        leaf = _over_devices(cut, a)(leaf)
    return leaf


def _unpack_group(optimizer: LayerwiseOptimizer, buffers, dtypes):
    """:func:`_unpack_global` for one tensor-parallel device's state arrays (its blocks).

    A dense bucket's global array is the bucket itself. An expert bucket's is
    ``ep`` whole buckets, one per expert group (``ep``-major): each unpacks
    into its group's local experts, concatenated on the expert axis.
    """
    plan = optimizer.plan
    expert = [b.key.is_expert_parallel for b in plan.buffers]
    dense = unpack(plan, [None if e else x for e, x in zip(expert, buffers)], dtypes=dtypes)
    if not any(e and x is not None for e, x in zip(expert, buffers)):
        return dense
    ep = optimizer.plan.axes.ep_size
    groups = [
        tuple(b.reshape(ep, -1) for b in x) if e and x is not None else None
        for e, x in zip(expert, buffers)
    ]
    local = _leaves(jax.vmap(lambda bufs: unpack(plan, bufs, dtypes=dtypes))(groups))
    leaves = [
        x if not r.is_expert or y is None else _merge_blocks(y, r.expert_dim)
        for x, y, r in zip(_leaves(dense), local, plan.routes)
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def _pack_group(optimizer: LayerwiseOptimizer, tree, dtypes):
    """Inverse of :func:`_unpack_group`."""
    plan = optimizer.plan
    expert = [b.key.is_expert_parallel for b in plan.buffers]
    leaves = _leaves(tree)
    dense_tree = jax.tree_util.tree_unflatten(
        plan.treedef, [None if r.is_expert else x for x, r in zip(leaves, plan.routes)]
    )
    dense = pack(plan, dense_tree, dtypes=[None if e else d for e, d in zip(expert, dtypes)])
    if not any(e and d is not None for e, d in zip(expert, dtypes)):
        return dense
    ep = optimizer.plan.axes.ep_size
    local_tree = jax.tree_util.tree_unflatten(
        plan.treedef,
        [
            _split_blocks(x, r.expert_dim, ep) if r.is_expert and x is not None else None
            for x, r in zip(leaves, plan.routes)
        ],
    )
    local = jax.vmap(
        lambda t: pack(plan, t, dtypes=[d if e else None for e, d in zip(expert, dtypes)])
    )(local_tree)
    return tuple(
        tuple(b.reshape(-1) for b in y) if e and y is not None else x
        for e, x, y in zip(expert, dense, local)
    )


def _elementwise_buffers(optimizer: LayerwiseOptimizer) -> list[int]:
    return [i for i, b in enumerate(optimizer.plan.buffers) if not b.key.is_layer_wise]


def _is_sharded(spec: P) -> bool:
    """Whether an elementwise-state leaf is per element (sharded), not a replicated scalar."""
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
            specs, treedef = jax.tree.flatten(
                optimizer.state_specs.elementwise[owners[0]][0], is_leaf=lambda x: isinstance(x, P)
            )
            per_bucket = {i: [jax.tree.leaves(s) for s in state.elementwise[i]] for i in owners}
            leaves = []
            for k, spec in enumerate(specs):
                if _is_sharded(spec):
                    flats = [
                        tuple(b[k] for b in per_bucket[i]) if i in owners else None
                        for i in range(len(plan.buffers))
                    ]
                    leaves.append(
                        _unpack_global(
                            optimizer, flats, [per_bucket[owners[0]][0][k].dtype] * len(plan.routes)
                        )
                    )
                else:
                    leaves.append(per_bucket[owners[0]][0][k])
            elementwise = jax.tree.unflatten(treedef, leaves)
        return LogicalState(state.count, masters, momenta, elementwise)

    shapes = jax.eval_shape(convert, state)
    return jax.jit(
        convert, out_shardings=jax.tree.map(lambda x: logical_sharding(optimizer, x), shapes)
    )(state)


def from_logical(optimizer: LayerwiseOptimizer, logical: LogicalState) -> LayerwiseState:
    """Pack a :class:`LogicalState` into this optimizer's sharded :class:`LayerwiseState`.

    Inverse of :func:`to_logical`. The logical state may come from an
    optimizer with another dp size, layout policy or bucket size. A pipelined
    optimizer's speculation flag, a scheduling guess that never changes a
    result, is not part of it and starts again at ``False``.
    """
    plan = optimizer.plan
    lw = [b.key.is_layer_wise for b in plan.buffers]
    owners = _elementwise_buffers(optimizer)

    def convert(logical):
        dtype = jax.tree.leaves(logical.masters)[0].dtype
        masters = _pack_global(optimizer, logical.masters, [dtype] * len(plan.buffers))
        momenta = _pack_global(
            optimizer, logical.momenta, [dtype if is_lw else None for is_lw in lw]
        )
        elementwise = [None] * len(plan.buffers)
        if owners:
            specs, treedef = jax.tree.flatten(
                optimizer.state_specs.elementwise[owners[0]][0], is_leaf=lambda x: isinstance(x, P)
            )
            logical_leaves = jax.tree.flatten(logical.elementwise, is_leaf=lambda x: x is None)[0]
            # A parameter-shaped tree flattens to its routed leaves and the Nones of leaves that
            # are no parameters (an equinox tree); only the routed ones are packed.
            routed = jax.tree.flatten(
                jax.tree.unflatten(plan.treedef, [True] * len(plan.routes)),
                is_leaf=lambda x: x is None,
            )[0]
            per_leaf, cursor = [], 0  # per optax-state leaf: {buffer: bucket arrays} or a scalar
            for spec in specs:
                if _is_sharded(spec):
                    chunk = logical_leaves[cursor : cursor + len(routed)]
                    tree = jax.tree.unflatten(
                        plan.treedef, [x for x, keep in zip(chunk, routed) if keep]
                    )
                    cursor += len(routed)
                    leaf_dtype = next(x.dtype for x in jax.tree.leaves(tree))
                    per_leaf.append(
                        _pack_global(
                            optimizer,
                            tree,
                            [leaf_dtype if i in owners else None for i in range(len(lw))],
                        )
                    )
                else:
                    per_leaf.append(logical_leaves[cursor])
                    cursor += 1
            for i in owners:
                elementwise[i] = tuple(
                    jax.tree.unflatten(
                        treedef,
                        [x[i][k] if _is_sharded(spec) else x for x, spec in zip(per_leaf, specs)],
                    )
                    for k in range(plan.buffers[i].num_buckets)
                )
        return LayerwiseState(
            jnp.asarray(logical.count, jnp.int32),
            masters,
            momenta,
            tuple(elementwise),
            initial_speculation(plan),
        )

    logical = jax.tree.map(lambda x: jax.device_put(x, logical_sharding(optimizer, x)), logical)
    return jax.jit(convert, out_shardings=state_shardings(optimizer))(logical)
