"""The optimizer state per parameter: independent of dp size, layout, policy and buckets.

A :class:`~lwjax.state.LayerwiseState` is packed: per buffer and bucket, one
array whose shards hold the masters and moments of whatever each rank owns.
:func:`to_logical` unpacks it into a :class:`LogicalState` shaped like the
parameters, and :func:`from_logical` packs one into any optimizer over the same
parameters and routing, so checkpoints (:mod:`lwjax.checkpoint`) restore at any
dp size. The two are inverses, bit for bit.

A logical array is split over every mesh axis (:func:`logical_sharding`), and
both conversions move each device's own parts only, a chunk of leaves at a time
(:mod:`lwjax.logical_shards`), so a device holds its packed state and at most
:data:`~lwjax.logical_shards.STAGING_BYTES` of staging (or one leaf's block, where that is
larger) beside the logical arrays that are in its memory. Those can live elsewhere:
:func:`to_logical` can put each chunk in host memory as it is converted (``memory_kind``),
and :func:`from_logical` moves a chunk onto the devices only while it packs it. The
conversion programs are compiled once per optimizer (a job that saves every N steps
reuses them).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import logical_shards as shards
from lwjax.buffers import check_tree
from lwjax.leaf_route import LeafRoute
from lwjax.optimizer import LayerwiseOptimizer
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


def logical_sharding(optimizer: LayerwiseOptimizer, route: LeafRoute) -> NamedSharding:
    """Where a logical (per-parameter) array of ``route``'s leaf lives: over every mesh axis.

    The leaf's own splits first, as the parameter has them (expert axis,
    ``param_axes``: :attr:`~lwjax.optimizer.LayerwiseOptimizer.param_specs`); then each
    other mesh axis, largest first, on the axis of the leaf with the most elements
    per device among those it divides. A mesh axis that divides no axis of the leaf
    leaves it whole over that axis, so a device holds ``1/N`` of every leaf whose axes
    divide the mesh's ``N`` devices.
    """
    return NamedSharding(optimizer.mesh, shards.logical_spec(optimizer, route))


def logical_shardings(optimizer: LayerwiseOptimizer, logical: LogicalState) -> LogicalState:
    """The :func:`logical_sharding` of every array of a (possibly abstract) :class:`LogicalState`;
    the step count and the elementwise state's scalars are replicated."""
    plan = optimizer.plan
    replicated = NamedSharding(optimizer.mesh, P())
    routes = jax.tree_util.tree_unflatten(plan.treedef, plan.routes)

    def placed(tree):
        return jax.tree.map(
            lambda x, r: None if x is None else logical_sharding(optimizer, r),
            tree,
            routes,
            is_leaf=lambda x: x is None,
        )

    elementwise = None
    if logical.elementwise is not None:
        specs, treedef = _elementwise_specs(optimizer)
        leaves = jax.tree.flatten(logical.elementwise, is_leaf=lambda x: x is None)[0]
        positions = _leaves(routes)  # a tree's routes where a parameter is, None elsewhere
        shardings, cursor = [], 0
        for spec in specs:
            if _is_sharded(spec):
                chunk = zip(leaves[cursor : cursor + len(positions)], positions)
                shardings.append(
                    [None if x is None else logical_sharding(optimizer, r) for x, r in chunk]
                )
                cursor += len(positions)
            else:
                shardings.append([replicated])
                cursor += 1
        elementwise = jax.tree.unflatten(
            jax.tree.structure(logical.elementwise, is_leaf=lambda x: x is None),
            [s for group in shardings for s in group],
        )
    return LogicalState(replicated, placed(logical.masters), placed(logical.momenta), elementwise)


def _leaves(tree) -> list:
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is None)[0]


def _elementwise_buffers(optimizer: LayerwiseOptimizer) -> list[int]:
    return [i for i, b in enumerate(optimizer.plan.buffers) if not b.key.is_layer_wise]


def _elementwise_specs(optimizer: LayerwiseOptimizer) -> tuple[list[P], Any]:
    """The elementwise optax state's leaf specs (a bucket's; every bucket's are alike), treedef."""
    owner = _elementwise_buffers(optimizer)[0]
    return jax.tree.flatten(
        optimizer.state_specs.elementwise[owner][0], is_leaf=lambda x: isinstance(x, P)
    )


def _is_sharded(spec: P) -> bool:
    """Whether an elementwise-state leaf is per element (sharded), not a replicated scalar."""
    return spec != P()


def _components(optimizer: LayerwiseOptimizer, state: LayerwiseState) -> list:
    """The state's per-element arrays as components, each per buffer a tuple of bucket
    arrays or ``None``: masters, momenta, then each per-element leaf of the elementwise state."""
    owners = _elementwise_buffers(optimizer)
    out = [state.masters, state.momenta]
    if owners:
        specs, _ = _elementwise_specs(optimizer)
        for k, spec in enumerate(specs):
            if _is_sharded(spec):
                out.append(
                    tuple(
                        tuple(jax.tree.leaves(s)[k] for s in state.elementwise[i])
                        if i in owners
                        else None
                        for i in range(len(optimizer.plan.buffers))
                    )
                )
    return out


def _component_specs(optimizer: LayerwiseOptimizer, components: list) -> list:
    """Each component's bucket arrays' ``PartitionSpec``s (their buffer's state axes)."""
    axes = [P(optimizer.plan.axes.state_axes(b.key)) for b in optimizer.plan.buffers]
    return [
        tuple(None if x is None else tuple(spec for _ in x) for x, spec in zip(c, axes))
        for c in components
    ]


def _items(optimizer: LayerwiseOptimizer, components: list, runs) -> list[tuple[int, int]]:
    """``(component, route)`` of every logical array: each route of a buffer the component has."""
    return [
        (c, i)
        for c, component in enumerate(components)
        for i, pieces in enumerate(runs)
        if pieces and component[pieces[0].buffer] is not None
    ]


def _chunks(optimizer: LayerwiseOptimizer, items, dtypes, staging_bytes: int | None) -> list:
    """``items`` in chunks of at most ``staging_bytes`` (default
    :data:`~lwjax.logical_shards.STAGING_BYTES`) of blocks per device."""
    budget = shards.STAGING_BYTES if staging_bytes is None else staging_bytes
    costs = [shards.staging_bytes(optimizer.plan.routes[i], dtypes[c]) for c, i in items]
    return [[items[k] for k in group] for group in shards.chunks(costs, budget)]


# The conversion programs of the optimizers used last, by ``id`` (the entry holds the
# optimizer, so its ``id`` is not reused while cached).
_PROGRAMS: OrderedDict[int, tuple[LayerwiseOptimizer, dict]] = OrderedDict()
_CACHED_OPTIMIZERS = 4


def _program(optimizer: LayerwiseOptimizer, key: Hashable, build: Callable[[], Callable]):
    """The jitted program ``key`` of ``optimizer``: ``build()`` the first time, then the same
    one, so that its trace and compilation are reused. The last
    :data:`_CACHED_OPTIMIZERS` optimizers keep theirs."""
    _, programs = _PROGRAMS.pop(id(optimizer), (optimizer, {}))
    _PROGRAMS[id(optimizer)] = (optimizer, programs)
    while len(_PROGRAMS) > _CACHED_OPTIMIZERS:
        _PROGRAMS.popitem(last=False)
    if key not in programs:
        programs[key] = build()
    return programs[key]


def to_logical(
    optimizer: LayerwiseOptimizer,
    state: LayerwiseState,
    *,
    staging_bytes: int | None = None,
    memory_kind: str | None = None,
) -> LogicalState:
    """Unpack a sharded :class:`LayerwiseState` into its per-parameter :class:`LogicalState`.

    Inverse of :func:`from_logical`; the result restores at any dp size. Each
    array comes back in its :func:`logical_sharding`, converted a chunk of
    leaves at a time (at most ``staging_bytes``, default
    :data:`~lwjax.logical_shards.STAGING_BYTES`, of blocks per device and program:
    :mod:`lwjax.logical_shards`).

    With ``memory_kind`` (e.g. ``"pinned_host"``: :func:`host_memory_kind`) each chunk's
    arrays are written to that memory of their devices by the program that converts them,
    so the devices hold the packed state and one chunk's staging, never the logical state
    (the step count and the elementwise state's scalars stay on the devices).
    """
    plan = optimizer.plan
    runs = shards.pieces(plan)
    components = _components(optimizer, state)
    in_specs = _component_specs(optimizer, components)
    dtype = jax.tree.leaves(state.masters)[0].dtype
    dtypes = [dtype, dtype] + [jax.tree.leaves(c)[0].dtype for c in components[2:]]
    parts = {}
    items = _items(optimizer, components, runs)
    structure = jax.tree.structure(components)
    for chunk in _chunks(optimizer, items, dtypes, staging_bytes):
        out_specs = [shards.logical_spec(optimizer, plan.routes[i]) for _, i in chunk]

        def read(arrays, chunk=chunk, out_specs=out_specs):
            return [
                shards.read_part(optimizer, runs[i], i, arrays[c], dtypes[c], spec)
                for (c, i), spec in zip(chunk, out_specs)
            ]

        out = [NamedSharding(optimizer.mesh, spec, memory_kind=memory_kind) for spec in out_specs]
        key = ("read", structure, tuple(chunk), tuple(dtypes), memory_kind)
        program = _program(
            optimizer,
            key,
            lambda read=read, out_specs=out_specs, out=out: _sharded(
                optimizer, read, (in_specs,), out_specs, out_shardings=out
            ),
        )
        parts.update(zip(chunk, program(components)))
    trees = [
        jax.tree_util.tree_unflatten(plan.treedef, [parts.get((c, i)) for i in range(len(runs))])
        for c in range(len(components))
    ]
    elementwise = None
    owners = _elementwise_buffers(optimizer)
    if owners:
        specs, treedef = _elementwise_specs(optimizer)
        scalars = jax.tree.leaves(state.elementwise[owners[0]][0])
        sharded = iter(trees[2:])
        elementwise = jax.tree.unflatten(
            treedef,
            [next(sharded) if _is_sharded(spec) else scalars[k] for k, spec in enumerate(specs)],
        )
    return LogicalState(state.count, trees[0], trees[1], elementwise)


def host_memory_kind(optimizer: LayerwiseOptimizer) -> str | None:
    """``"pinned_host"`` where every device of the optimizer's mesh has that memory (CPU,
    GPU and TPU in current jax), else ``None``: where :func:`lwjax.save` puts the
    logical state while it writes it."""
    kinds = [{m.kind for m in d.addressable_memories()} for d in optimizer.mesh.devices.flat]
    return "pinned_host" if all("pinned_host" in k for k in kinds) else None


def _sharded(optimizer: LayerwiseOptimizer, fn, in_specs, out_specs, **options):
    """``fn`` in ``shard_map`` over the whole mesh, jitted."""
    return jax.jit(
        jax.shard_map(
            fn, mesh=optimizer.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        ),
        **options,
    )


def from_logical(
    optimizer: LayerwiseOptimizer,
    logical: LogicalState,
    *,
    staging_bytes: int | None = None,
) -> LayerwiseState:
    """Pack a :class:`LogicalState` into this optimizer's sharded :class:`LayerwiseState`.

    Inverse of :func:`to_logical`. The logical state may come from an
    optimizer with another dp size, layout policy or bucket size. A pipelined
    optimizer's speculation flag, a scheduling guess that never changes a
    result, is not part of it and starts again at ``False``. The packed buckets
    are written in place a chunk of leaves at a time (as :func:`to_logical`):
    each chunk's arrays are placed in their :func:`logical_sharding` on the devices
    (from host memory, numpy or another sharding), packed, and freed before the
    next, so the devices hold the packed state and one chunk's staging beside
    whatever of ``logical`` already was on them.
    """
    plan = optimizer.plan
    mesh = optimizer.mesh
    replicated = NamedSharding(mesh, P())
    runs = shards.pieces(plan)
    owners = _elementwise_buffers(optimizer)
    specs, treedef = _elementwise_specs(optimizer) if owners else ([], None)
    # The logical arrays as components (route order), like the packed state's.
    trees = [logical.masters, logical.momenta]
    scalars = {}
    if owners:
        leaves = jax.tree.flatten(logical.elementwise, is_leaf=lambda x: x is None)[0]
        positions = _leaves(jax.tree_util.tree_unflatten(plan.treedef, [True] * len(runs)))
        cursor = 0
        for k, spec in enumerate(specs):
            if _is_sharded(spec):
                chunk = leaves[cursor : cursor + len(positions)]
                trees.append(
                    jax.tree_util.tree_unflatten(
                        plan.treedef, [x for x, keep in zip(chunk, positions) if keep]
                    )
                )
                cursor += len(positions)
            else:
                scalars[k] = leaves[cursor]
                cursor += 1
    logical_leaves = [check_tree(plan, tree, "from_logical", local=False) for tree in trees]
    dtype = next(x for x in logical_leaves[0] if x is not None).dtype
    dtypes = [dtype, dtype] + [
        next(x for x in leaves if x is not None).dtype for leaves in logical_leaves[2:]
    ]
    lw = [b.key.is_layer_wise for b in plan.buffers]
    has = [[True] * len(lw), lw] + [[i in owners for i in range(len(lw))]] * (len(trees) - 2)
    zeros = [
        tuple(
            tuple(
                jax.ShapeDtypeStruct(
                    (size * math.prod(mesh.shape[a] for a in _axes(plan, b)),), dtypes[c]
                )
                for size in b.shard_sizes
            )
            if keep
            else None
            for b, keep in zip(plan.buffers, present)
        )
        for c, present in enumerate(has)
    ]
    in_specs = _component_specs(optimizer, zeros)
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), in_specs, is_leaf=lambda x: isinstance(x, P)
    )
    components = _program(
        optimizer,
        ("zeros", tuple(dtypes)),
        lambda: jax.jit(
            lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zeros),
            out_shardings=shardings,
        ),
    )()
    items = _items(optimizer, components, runs)
    for chunk in _chunks(optimizer, items, dtypes, staging_bytes):
        part_specs = [shards.logical_spec(optimizer, plan.routes[i]) for _, i in chunk]
        parts = [
            jax.device_put(logical_leaves[c][i], NamedSharding(mesh, spec))
            for (c, i), spec in zip(chunk, part_specs)
        ]

        def write(arrays, parts, chunk=chunk, part_specs=part_specs):
            arrays = [[None if b is None else list(b) for b in c] for c in arrays]
            for (c, i), part, spec in zip(chunk, parts, part_specs):
                shards.write_part(optimizer, runs[i], i, part, arrays[c], spec)
            return [tuple(None if b is None else tuple(b) for b in c) for c in arrays]

        program = _program(
            optimizer,
            ("write", tuple(chunk)),
            lambda write=write, part_specs=part_specs: _sharded(
                optimizer, write, (in_specs, part_specs), in_specs, donate_argnums=0
            ),
        )
        components = program(components, parts)
        # This chunk's parts leave the devices before the next chunk's arrive.
        del parts
        jax.block_until_ready(components)
    count = jax.device_put(logical.count, replicated).astype(jnp.int32)
    scalars = jax.device_put(scalars, replicated)
    elementwise = [None] * len(plan.buffers)
    for i in owners:
        sharded = [k for k, spec in enumerate(specs) if _is_sharded(spec)]
        elementwise[i] = tuple(
            jax.tree.unflatten(
                treedef,
                [
                    components[2 + sharded.index(k)][i][bucket] if k in sharded else scalars[k]
                    for k in range(len(specs))
                ],
            )
            for bucket in range(plan.buffers[i].num_buckets)
        )
    return LayerwiseState(
        count,
        components[0],
        components[1],
        tuple(elementwise),
        initial_speculation(plan),
    )


def _axes(plan, buffer) -> tuple[str, ...]:
    axes = plan.axes.state_axes(buffer.key)
    return axes if isinstance(axes, tuple) else (axes,)
