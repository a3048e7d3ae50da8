"""Layout policies: which data-parallel shard owns which whole parameter (pure Python).

Megatron-Core changed its layer-wise layout algorithm several times; each
version is kept here as a named policy and reproduces Megatron's output
exactly (see ``tests/fixtures/layouts``):

* ``size_matching``: the layout as first introduced (Megatron-LM ``c1e938b039``,
  never released). Lockstep rounds: a seed in shard 0, an equal-size peer in
  every other shard, else the slot is filled greedily with what comes next.
* ``lpt``: megatron-core 0.18/0.19. Per bucket, largest-first by element count
  onto the shard whose cursor is lowest.
* ``ns_cost``: Megatron-LM main. Largest-first by Newton–Schulz cost
  :math:`\\max(m, n)\\min(m, n)^2` onto the least-loaded shard among those that
  stay under :math:`1.3\\times` the even element share; buckets close only when
  the next parameter would grow the shard size (a soft minimum).
* ``balanced``: lwjax's, for sharding groups (:mod:`lwjax.groups`), where
  ``dp`` is near the number of matrices and neither elements nor
  Newton–Schulz work may go uneven. Buckets of at least
  :data:`BALANCED_HEADROOM` ``* dp *`` (largest parameter), split evenly; in
  each, costliest Newton–Schulz first onto the shard with the least work so far
  (across buckets) among those that stay under the tightest element cap that
  fits every parameter (:func:`_emit_balanced`).

All policies walk the parameters in backprop order (reverse definition order),
isolate tied embeddings in buckets of their own (whole, in shard 0), start every
parameter on a 64-element boundary and keep shards of a bucket equal-sized.

Elementwise (non-Muon) buffers use Megatron's byte-level layout, whose shards
may split parameters (:mod:`lwjax.elementwise_layout`);
:func:`compute_full_param_layout` groups a model's parameters into buffers and
lays out each with the one it needs.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from lwjax.cost import ns_cost, ns_flops
from lwjax.elementwise_layout import check_size, check_specs, compute_distributed_optimizer_layout
from lwjax.layout import (
    BufferKey,
    FullParamLayout,
    LayoutConfig,
    ParamSpec,
    PerBufferParamLayout,
    pad_param_start,
    pad_to_divisor,
    shard_divisor,
)

NUMEL_CAP_SLACK = 0.3  # ns_cost: a shard may hold up to 1.3x the even element share.
PADDING_FLOOR = 0.9  # a bucket is at least 0.9 * dp * (largest parameter) elements.
BALANCED_HEADROOM = 1  # balanced: a bucket holds at least dp * (largest parameter) elements.
# balanced: the element caps tried, as fractions above the even share of a bucket.
BALANCED_SLACKS = (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5)


class _BucketWriter:
    """Accumulates buckets of one buffer: shard contents in, absolute offsets out."""

    def __init__(self, dp: int, high_busbw: bool):
        self.dp = dp
        self.divisor = shard_divisor(dp, high_busbw)
        self.index_map: dict[str, tuple[int, int, int]] = {}
        self.buckets: list[tuple[int, int]] = []
        self.unpadded: list[int] = []
        self.cursor = 0

    def write(self, shards: Sequence[Sequence[tuple[str | None, int]]], used: int) -> None:
        """Close one bucket; ``shards[s]`` lists ``(name or None for padding, numel)``.

        ``used`` is the largest shard cursor; the shard size is it rounded up
        to the shard divisor.
        """
        shard_size = pad_to_divisor(used, self.divisor)
        bucket_id, start = len(self.buckets), self.cursor
        real = 0
        for s, entries in enumerate(shards):
            offset = start + s * shard_size
            for name, numel in entries:
                offset = pad_param_start(offset)
                if name is not None:
                    self.index_map[name] = (offset, offset + numel, bucket_id)
                    real += numel
                offset += numel
        self.cursor = start + self.dp * shard_size
        self.buckets.append((start, self.cursor))
        self.unpadded.append(real)

    def write_shared(self, spec: ParamSpec) -> None:
        """Close a bucket holding only a tied embedding, whole in shard 0."""
        padding = [(None, spec.numel)] * (self.dp - 1)
        self.write([[(spec.name, spec.numel)], *([p] for p in padding)], spec.numel)

    def finish(self, specs: Sequence[ParamSpec], param_indices) -> PerBufferParamLayout:
        order = {spec.name: i for i, spec in enumerate(specs)}
        index_map = dict(sorted(self.index_map.items(), key=lambda kv: order[kv[0]]))
        return PerBufferParamLayout(
            param_index_map=index_map,
            bucket_indices=tuple(self.buckets),
            per_bucket_numel_unpadded=tuple(self.unpadded),
            param_indices=tuple(param_indices),
            num_shards=self.dp,
            is_layer_wise=True,
        )


def _bucket_threshold(bucket_size: int, dp: int, largest: int) -> int:
    """Soft bucket minimum: ``max(bucket_size, int(dp * largest * 0.9))``."""
    return max(bucket_size, int(dp * largest * PADDING_FLOOR))


def _emit_lpt(writer: _BucketWriter, chunk: list[ParamSpec]) -> None:
    """Largest numel first onto the shard with the lowest cursor."""
    cursors = [0] * writer.dp
    shards: list[list[tuple[str, int]]] = [[] for _ in range(writer.dp)]
    for spec in sorted(chunk, key=lambda p: -p.numel):
        s = cursors.index(min(cursors))
        shards[s].append((spec.name, spec.numel))
        cursors[s] = pad_param_start(cursors[s]) + spec.numel
    writer.write(shards, max(cursors))


def _layout_lpt(specs, dp, bucket_size, writer: _BucketWriter) -> None:
    chunk: list[ParamSpec] = []
    chunk_numel = chunk_max = 0
    for spec in reversed(specs):
        if spec.is_shared_embedding:
            if chunk:
                _emit_lpt(writer, chunk)
            chunk, chunk_numel, chunk_max = [], 0, 0
            writer.write_shared(spec)
            continue
        chunk.append(spec)
        chunk_numel += spec.numel
        chunk_max = max(chunk_max, spec.numel)
        if bucket_size is not None and chunk_numel >= _bucket_threshold(bucket_size, dp, chunk_max):
            _emit_lpt(writer, chunk)
            chunk, chunk_numel, chunk_max = [], 0, 0
    if chunk:
        _emit_lpt(writer, chunk)


def _emit_ns_cost(writer: _BucketWriter, chunk: list[ParamSpec], compute_loads: list[int]) -> None:
    """Costliest first onto the least-loaded shard that stays under the element cap.

    ``compute_loads`` carries Newton–Schulz cost across the buffer's buckets.
    """
    dp = writer.dp
    cursors = [0] * dp
    shards: list[list[tuple[str, int]]] = [[] for _ in range(dp)]
    cap = (sum(p.numel for p in chunk) / dp) * (1 + NUMEL_CAP_SLACK)
    starts = [0] * dp  # pad_param_start(cursors[s]), kept beside the cursors
    for spec in sorted(chunk, key=lambda p: -ns_cost(p)):
        room = cap - spec.numel
        fits = [s for s in range(dp) if starts[s] <= room]
        if fits:
            s = min(fits, key=compute_loads.__getitem__)
        else:
            s = cursors.index(min(cursors))
        shards[s].append((spec.name, spec.numel))
        cursors[s] = starts[s] + spec.numel
        starts[s] = pad_param_start(cursors[s])
        compute_loads[s] += ns_cost(spec)
    writer.write(shards, max(cursors))


def _layout_ns_cost(specs, dp, bucket_size, writer: _BucketWriter) -> None:
    compute_loads = [0] * dp
    chunk: list[ParamSpec] = []
    chunk_numel = chunk_max = 0
    estimate = [0] * dp  # element loads if the chunk were placed in backprop order

    def absorbs(numel: int) -> bool:
        """Whether the next parameter fits without growing the bucket's shard size."""
        return pad_param_start(min(estimate)) + numel <= pad_to_divisor(
            max(estimate), writer.divisor
        )

    for spec in reversed(specs):
        if spec.is_shared_embedding:
            if chunk:
                _emit_ns_cost(writer, chunk, compute_loads)
            chunk, chunk_numel, chunk_max, estimate = [], 0, 0, [0] * dp
            writer.write_shared(spec)
            continue
        if bucket_size is not None and chunk:
            threshold = _bucket_threshold(bucket_size, dp, chunk_max)
            if chunk_numel >= threshold and not absorbs(spec.numel):
                _emit_ns_cost(writer, chunk, compute_loads)
                chunk, chunk_numel, chunk_max, estimate = [], 0, 0, [0] * dp
        s = estimate.index(min(estimate))
        estimate[s] = pad_param_start(estimate[s]) + spec.numel
        chunk.append(spec)
        chunk_numel += spec.numel
        chunk_max = max(chunk_max, spec.numel)
    if chunk:
        _emit_ns_cost(writer, chunk, compute_loads)


def _layout_size_matching(specs, dp, bucket_size, writer: _BucketWriter) -> None:
    shared = [p for p in specs if p.is_shared_embedding]
    pool = [p for p in reversed(specs) if not p.is_shared_embedding]
    for spec in reversed(shared):  # tied embeddings first, each in its own bucket
        writer.write_shared(spec)

    by_size: dict[int, list[int]] = {}
    for i, spec in enumerate(pool):
        by_size.setdefault(spec.numel, []).append(i)
    size_cursor = dict.fromkeys(by_size, 0)
    assigned = [False] * len(pool)
    next_free = 0

    def next_unassigned() -> int | None:
        nonlocal next_free
        while next_free < len(pool) and assigned[next_free]:
            next_free += 1
        return next_free if next_free < len(pool) else None

    def next_peer(numel: int) -> int | None:
        group = by_size[numel]
        while size_cursor[numel] < len(group) and assigned[group[size_cursor[numel]]]:
            size_cursor[numel] += 1
        return group[size_cursor[numel]] if size_cursor[numel] < len(group) else None

    def take(i: int, shard: list) -> None:
        assigned[i] = True
        shard.append((pool[i].name, pool[i].numel))

    shards: list[list[tuple[str | None, int]]] = [[] for _ in range(dp)]
    cursor = 0
    while (seed := next_unassigned()) is not None:
        slot_numel = pool[seed].numel
        take(seed, shards[0])
        for k in range(1, dp):
            peer = next_peer(slot_numel)
            if peer is not None:
                take(peer, shards[k])
                continue
            filled = 0  # greedy fill in pool order; stop at the first that does not fit
            while (c := next_unassigned()) is not None:
                if pad_param_start(filled) + pool[c].numel > slot_numel:
                    break
                take(c, shards[k])
                filled = pad_param_start(filled) + pool[c].numel
            if slot_numel - pad_param_start(filled) > 0:
                shards[k].append((None, slot_numel - pad_param_start(filled)))
        cursor = pad_param_start(cursor) + slot_numel
        if bucket_size is not None and dp * pad_to_divisor(cursor, writer.divisor) >= bucket_size:
            writer.write(shards, cursor)
            shards, cursor = [[] for _ in range(dp)], 0
    if cursor:
        writer.write(shards, cursor)


def _balanced_chunks(pool: list[ParamSpec], dp: int, bucket_size) -> list[list[ParamSpec]]:
    """``pool`` (backprop order) cut into ``k`` runs of about equal elements, ``k`` as many as
    keep each at least ``max(bucket_size, BALANCED_HEADROOM * dp * largest)`` (one run with
    ``bucket_size=None``)."""
    total = sum(spec.numel for spec in pool)
    smallest = max(bucket_size or 0, BALANCED_HEADROOM * dp * max(s.numel for s in pool))
    k = 1 if bucket_size is None else max(1, min(len(pool), total // smallest))
    chunks: list[list[ParamSpec]] = [[]]
    seen = 0
    for spec in pool:
        if seen >= len(chunks) * total / k and len(chunks) < k:
            chunks.append([])
        chunks[-1].append(spec)
        seen += spec.numel
    return chunks


def _pack_balanced(chunk: list[ParamSpec], loads: list[int], cap: int | None):
    """Costliest Newton–Schulz first onto the shard with the least work (``loads``), then the
    fewest elements, among those it fits under ``cap``; ``None`` when one fits nowhere."""
    dp = len(loads)
    cursors = [0] * dp
    shards: list[list[tuple[str, int]]] = [[] for _ in range(dp)]
    heap = [(load, 0, s) for s, load in enumerate(loads)]  # (work, elements, shard)
    heapq.heapify(heap)
    costs = {spec.name: ns_flops(spec.shape) or spec.numel for spec in chunk}
    for spec in sorted(chunk, key=lambda p: (-costs[p.name], -p.numel)):
        skipped = []
        while heap and cap is not None and pad_param_start(heap[0][1]) + spec.numel > cap:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, cursor, s = heapq.heappop(heap)
        shards[s].append((spec.name, spec.numel))
        cursors[s] = pad_param_start(cursor) + spec.numel
        heapq.heappush(heap, (load + costs[spec.name], cursors[s], s))
        for entry in skipped:
            heapq.heappush(heap, entry)
    new_loads = [0] * dp
    for load, _, s in heap:
        new_loads[s] = load
    return shards, cursors, new_loads


def _emit_balanced(writer: _BucketWriter, chunk: list[ParamSpec], loads: list[int]) -> None:
    """Pack ``chunk`` under the tightest cap of :data:`BALANCED_SLACKS` above the even share
    (at least the largest parameter) that fits it whole; ``loads`` carries the shards'
    Newton–Schulz FLOPs across buckets."""
    even = max(
        max(pad_param_start(spec.numel) for spec in chunk),
        -(-sum(pad_param_start(spec.numel) for spec in chunk) // writer.dp),
    )
    for slack in (*BALANCED_SLACKS, None):
        cap = None if slack is None else int(even * (1 + slack))
        packed = _pack_balanced(chunk, loads, cap)
        if packed is not None:
            break
    shards, cursors, loads[:] = packed
    writer.write(shards, max(cursors))


def _layout_balanced(specs, dp, bucket_size, writer: _BucketWriter) -> None:
    loads = [0] * dp
    pool: list[ParamSpec] = []
    for spec in [*reversed(specs), None]:
        if spec is None or spec.is_shared_embedding:
            for chunk in _balanced_chunks(pool, dp, bucket_size) if pool else ():
                _emit_balanced(writer, chunk, loads)
            pool = []
            if spec is not None:
                writer.write_shared(spec)
        else:
            pool.append(spec)


_POLICY_FUNCTIONS = {
    "ns_cost": _layout_ns_cost,
    "lpt": _layout_lpt,
    "size_matching": _layout_size_matching,
    "balanced": _layout_balanced,
}


def _check_config(where: str, config) -> None:
    if not isinstance(config, LayoutConfig):
        raise TypeError(f"{where}: config must be a LayoutConfig, but got {type(config).__name__}.")


def compute_layout(
    specs: Sequence[ParamSpec],
    dp: int,
    config: LayoutConfig = LayoutConfig(bucket_size=None),
    *,
    param_indices: Sequence[int] | None = None,
    max_shard_numel: int | None = None,
) -> PerBufferParamLayout:
    """Compute a shard-aligned (layer-wise) layout of one buffer.

    Args:
      specs: The buffer's parameters in definition (forward) order.
      dp: Number of shards per bucket (the data-parallel size of the buffer).
      config: Policy, bucket size (``"auto"`` resolved with ``dp``) and padding;
        by default one bucket (Megatron's layout functions' default), where
        :func:`lwjax.layerwise_muon` defaults to ``LayoutConfig()``.
      param_indices: Stored as the layout's ``param_indices``; defaults to
        ``0..len(specs)-1``.
      max_shard_numel: Optional hard limit on a shard's elements; a parameter
        larger than it can never be placed.

    Returns:
      The layout; every parameter lies wholly inside one shard.

    Raises:
      ValueError: ``dp < 1``, duplicate names, or a parameter larger than
        ``max_shard_numel``.
    """
    _check_config("compute_layout", config)
    check_specs(specs, dp, "compute_layout")
    if max_shard_numel is not None:
        for spec in specs:
            if spec.numel > max_shard_numel:
                raise ValueError(
                    f"{spec.name}: {spec.numel} elements exceed max_shard_numel={max_shard_numel}; "
                    "a parameter must fit whole inside one shard."
                )
    writer = _BucketWriter(dp, config.high_busbw)
    _POLICY_FUNCTIONS[config.policy](list(specs), dp, config.bucket_size_for(dp), writer)
    indices = range(len(specs)) if param_indices is None else param_indices
    return writer.finish(specs, indices)


def buffer_key_of(spec: ParamSpec, *, grad_reduce_in_fp32: bool = True) -> BufferKey:
    """Return the buffer a parameter belongs to (Megatron's buffer grouping)."""
    return BufferKey(
        param_dtype=spec.dtype,
        grad_dtype="float32" if grad_reduce_in_fp32 else spec.dtype,
        is_expert_parallel=spec.is_expert,
        is_layer_wise=spec.is_muon,
    )


def compute_full_param_layout(
    specs: Sequence[ParamSpec],
    dp: int,
    config: LayoutConfig = LayoutConfig(bucket_size=None),
    *,
    expert_dp: int | None = None,
    grad_reduce_in_fp32: bool = True,
) -> FullParamLayout:
    """Group parameters into buffers by :class:`BufferKey` and lay each out.

    Keys appear in first-appearance order over ``specs`` (definition order).
    Muon buffers get the layer-wise ``config.policy``; elementwise buffers the
    distributed-optimizer layout. Expert buffers are laid out over ``expert_dp``
    shards (``dp`` when ``None``). Every buffer gets the same bucket size,
    ``"auto"`` resolved with ``dp``.

    Args:
      specs: All parameters of the model, in definition order.
      dp: Data-parallel size of dense buffers.
      config: Policy, bucket size and padding (:class:`~lwjax.layout.LayoutConfig`);
        by default one bucket per buffer, as :func:`compute_layout`.
      expert_dp: Data-parallel size seen by expert parameters.
      grad_reduce_in_fp32: Gradients are reduced in fp32 (sets ``grad_dtype``).

    Returns:
      A :class:`FullParamLayout`.

    Examples:
      >>> specs = [ParamSpec("w", (256, 256), is_muon=True), ParamSpec("b", (256,))]
      >>> full = compute_full_param_layout(specs, 2, LayoutConfig(policy="lpt"))
      >>> [(key.is_layer_wise, layout.numel) for key, layout in full.layouts.items()]
      [(True, 131072), (False, 256)]
    """
    _check_config("compute_full_param_layout", config)
    check_specs(specs, dp, "compute_full_param_layout")
    if expert_dp is not None:
        check_size("compute_full_param_layout", "expert_dp", expert_dp)
    bucket_size = config.bucket_size_for(dp)
    resolved = dataclasses.replace(config, bucket_size=bucket_size)
    groups: dict[BufferKey, list[ParamSpec]] = {}
    for spec in specs:
        groups.setdefault(buffer_key_of(spec, grad_reduce_in_fp32=grad_reduce_in_fp32), []).append(
            spec
        )
    layouts = {}
    for key, members in groups.items():
        size = expert_dp if key.is_expert_parallel and expert_dp is not None else dp
        if key.is_layer_wise:
            layouts[key] = compute_layout(members, size, resolved)
        else:
            layouts[key] = compute_distributed_optimizer_layout(
                members, size, bucket_size=bucket_size, high_busbw=config.high_busbw
            )
    return FullParamLayout(layouts)
