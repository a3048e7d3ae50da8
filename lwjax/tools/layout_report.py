"""Statistics of layouts: per-shard loads, padding and balance (pure Python, no jax).

A layout decides which data-parallel rank owns which parameter; this module
measures what that costs and how even it is:

* **elements**: the real parameter elements a shard owns. In a layer-wise
  buffer a shard owns whole parameters; in an elementwise (distributed-optimizer)
  buffer a shard is the bucket's plain ``1/dp`` slice and owns the parameter
  elements that fall inside it.
* **Newton–Schulz FLOPs**: the work of orthogonalising the Muon matrices a shard
  owns, per optimizer step. For an :math:`m \\times n` matrix with
  :math:`s = \\min(m, n)` and :math:`l = \\max(m, n)`, one iteration
  (:math:`A = XX^\\top`, :math:`B = bA + cA^2`, :math:`X \\leftarrow aX + BX`)
  costs :math:`4 s^2 l + 2 s^3` FLOPs, times ``num_ns_steps`` iterations.
  Only Muon parameters of layer-wise buffers count.
* **padding overhead**: :math:`100 \\cdot (\\text{buffer elements} -
  \\text{real elements}) / \\text{real elements}` percent.
* **balance**: :math:`\\max / \\operatorname{mean}` of the per-shard loads; 1.0
  is perfect, ``None`` when nothing is loaded.

The summaries are small frozen dataclasses. :func:`layout_to_json` and
:func:`full_layout_to_json` write layouts in the layout fixtures' ``expected``
format (``tests/fixtures/layouts/README.md``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from lwjax.cost import DEFAULT_NUM_NS_STEPS, ns_flops
from lwjax.layout import (
    POLICIES,
    BufferKey,
    FullParamLayout,
    LayoutConfig,
    ParamSpec,
    PerBufferParamLayout,
)
from lwjax.policies import compute_full_param_layout


def _balance(loads: Sequence[int]) -> float | None:
    """``max / mean`` of ``loads``, or ``None`` when they are all zero."""
    total = sum(loads)
    if not loads or total == 0:
        return None
    return max(loads) * len(loads) / total


def _padding_pct(numel: int, real_numel: int) -> float:
    return 100.0 * (numel - real_numel) / real_numel if real_numel else 0.0


@dataclasses.dataclass(frozen=True)
class ShardLoad:
    """What one shard (data-parallel rank) owns of a bucket, a buffer or a model.

    Attributes:
      shard: Shard index, i.e. the rank within the buffer's data-parallel group.
      num_params: Parameters the shard holds elements of (whole ones in a
        layer-wise buffer; a parameter straddling two slices of an elementwise
        buffer counts in both).
      numel: Real parameter elements owned (padding excluded).
      ns_flops: Newton–Schulz FLOPs per optimizer step of the owned Muon matrices.
    """

    shard: int
    num_params: int
    numel: int
    ns_flops: int


def _add_loads(loads: Sequence[Sequence[ShardLoad]], num_shards: int) -> tuple[ShardLoad, ...]:
    """Shard-wise sums of several per-shard load lists."""
    return tuple(
        ShardLoad(
            shard=s,
            num_params=sum(group[s].num_params for group in loads),
            numel=sum(group[s].numel for group in loads),
            ns_flops=sum(group[s].ns_flops for group in loads),
        )
        for s in range(num_shards)
    )


class _Balanced:
    """Derived figures shared by every summary that has ``shards``, ``numel`` and ``real_numel``."""

    @property
    def padding_pct(self) -> float:
        """Padding overhead in percent of the real elements."""
        return _padding_pct(self.numel, self.real_numel)

    @property
    def ns_flops(self) -> int:
        """Newton–Schulz FLOPs per optimizer step over all shards."""
        return sum(load.ns_flops for load in self.shards)

    @property
    def numel_balance(self) -> float | None:
        """``max / mean`` of per-shard elements; ``None`` when empty."""
        return _balance([load.numel for load in self.shards])

    @property
    def flops_balance(self) -> float | None:
        """``max / mean`` of per-shard Newton–Schulz FLOPs; ``None`` without Muon work."""
        return _balance([load.ns_flops for load in self.shards])


@dataclasses.dataclass(frozen=True)
class BucketSummary(_Balanced):
    """Loads of one bucket.

    Attributes:
      bucket_id: Index of the bucket in its buffer.
      start: First element of the bucket in the buffer.
      end: One past its last element; ``end - start`` includes all padding.
      num_params: Parameters in the bucket.
      real_numel: Sum of the element counts of its parameters.
      shards: One :class:`ShardLoad` per shard, in shard order.
    """

    bucket_id: int
    start: int
    end: int
    num_params: int
    real_numel: int
    shards: tuple[ShardLoad, ...]

    @property
    def numel(self) -> int:
        """Bucket length in elements, padding included."""
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class BufferSummary(_Balanced):
    """Loads of one flat buffer.

    Attributes:
      key: The buffer's key; ``None`` for a layout summarised on its own.
      is_layer_wise: Shards own whole parameters (Muon buffer); otherwise shards
        are plain ``1/dp`` slices (elementwise buffer).
      num_shards: Shards per bucket (the buffer's data-parallel size).
      num_params: Parameters in the buffer.
      numel: Buffer length in elements, padding included.
      real_numel: Sum of the element counts of its parameters.
      buckets: Per-bucket summaries.
      shards: Per-shard loads summed over all buckets.
    """

    key: BufferKey | None
    is_layer_wise: bool
    num_shards: int
    num_params: int
    numel: int
    real_numel: int
    buckets: tuple[BucketSummary, ...]
    shards: tuple[ShardLoad, ...]


@dataclasses.dataclass(frozen=True)
class RankLoads(_Balanced):
    """Per-rank loads summed over all buffers sharded over groups of one size.

    Shard ``r`` of every such buffer lives on the same rank ``r``. Buffers
    sharded over groups of different sizes (expert buffers with
    ``expert_dp != dp``) form separate :class:`RankLoads`, because which expert
    rank shares a device with which dense rank depends on the device mesh.

    Attributes:
      num_shards: Size of the data-parallel group.
      numel: Elements of these buffers, padding included.
      real_numel: Real elements of these buffers.
      shards: Per-rank loads.
    """

    num_shards: int
    numel: int
    real_numel: int
    shards: tuple[ShardLoad, ...]


@dataclasses.dataclass(frozen=True)
class LayoutSummary:
    """Loads of a whole model's layout.

    Attributes:
      buffers: One summary per buffer, in the layout's buffer order.
      ranks: Per-rank loads, one entry per data-parallel group size (one
        entry unless expert buffers use another size), largest group first.
    """

    buffers: tuple[BufferSummary, ...]
    ranks: tuple[RankLoads, ...]

    @property
    def num_params(self) -> int:
        """Parameters in all buffers."""
        return sum(b.num_params for b in self.buffers)

    @property
    def num_buckets(self) -> int:
        """Buckets in all buffers."""
        return sum(len(b.buckets) for b in self.buffers)

    @property
    def numel(self) -> int:
        """Elements of all buffers, padding included."""
        return sum(b.numel for b in self.buffers)

    @property
    def real_numel(self) -> int:
        """Real parameter elements of all buffers."""
        return sum(b.real_numel for b in self.buffers)

    @property
    def padding_pct(self) -> float:
        """Padding overhead of the whole model in percent of its real elements."""
        return _padding_pct(self.numel, self.real_numel)

    @property
    def ns_flops(self) -> int:
        """Newton–Schulz FLOPs per optimizer step of the whole model."""
        return sum(b.ns_flops for b in self.buffers)

    @property
    def numel_balance(self) -> float | None:
        """Worst per-rank element balance over the rank groups."""
        return _worst(r.numel_balance for r in self.ranks)

    @property
    def flops_balance(self) -> float | None:
        """Worst per-rank Newton–Schulz balance over the rank groups with Muon work."""
        return _worst(r.flops_balance for r in self.ranks)


def _worst(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _bucket_loads(
    layout: PerBufferParamLayout, specs_by_name: Mapping[str, ParamSpec], num_ns_steps: int
) -> tuple[list[list[list[int]]], list[int], list[int]]:
    """Each bucket's per-shard loads, plus its param and element counts.

    ``loads[bucket][shard] = [num_params, numel, ns_flops]``.
    """
    dp = layout.num_shards
    num_buckets = len(layout.bucket_indices)
    loads = [[[0, 0, 0] for _ in range(dp)] for _ in range(num_buckets)]
    params = [0] * num_buckets
    real = [0] * num_buckets
    for name, (start, end, bucket_id) in layout.param_index_map.items():
        spec = specs_by_name.get(name)
        if spec is None:
            raise ValueError(f"{name}: in the layout but not among the given specs.")
        bucket_start, _ = layout.bucket_indices[bucket_id]
        size = layout.shard_size(bucket_id)
        params[bucket_id] += 1
        real[bucket_id] += end - start
        first = (start - bucket_start) // size
        if layout.is_layer_wise:
            load = loads[bucket_id][first]
            load[0] += 1
            load[1] += end - start
            if spec.is_muon:
                load[2] += ns_flops(spec.shape, num_ns_steps)
            continue
        last = (end - 1 - bucket_start) // size
        for shard in range(first, last + 1):
            lo = max(start, bucket_start + shard * size)
            hi = min(end, bucket_start + (shard + 1) * size)
            loads[bucket_id][shard][0] += 1
            loads[bucket_id][shard][1] += hi - lo
    return loads, params, real


def summarize_buffer(
    layout: PerBufferParamLayout,
    specs: Sequence[ParamSpec],
    *,
    key: BufferKey | None = None,
    num_ns_steps: int = DEFAULT_NUM_NS_STEPS,
) -> BufferSummary:
    """Measure the per-bucket and per-shard loads of one buffer's layout.

    Args:
      layout: The buffer's layout.
      specs: Specs of (at least) the layout's parameters; shapes and Muon flags
        come from here.
      key: The buffer's key, recorded in the summary; ``None`` if unknown.
      num_ns_steps: Newton–Schulz iterations per optimizer step.

    Returns:
      A :class:`BufferSummary`.

    Raises:
      ValueError: A parameter of the layout has no spec.
    """
    specs_by_name = {spec.name: spec for spec in specs}
    loads, params, real = _bucket_loads(layout, specs_by_name, num_ns_steps)
    buckets = tuple(
        BucketSummary(
            bucket_id=b,
            start=start,
            end=end,
            num_params=params[b],
            real_numel=real[b],
            shards=tuple(ShardLoad(s, *load) for s, load in enumerate(loads[b])),
        )
        for b, (start, end) in enumerate(layout.bucket_indices)
    )
    return BufferSummary(
        key=key,
        is_layer_wise=layout.is_layer_wise,
        num_shards=layout.num_shards,
        num_params=len(layout.param_index_map),
        numel=layout.numel,
        real_numel=sum(real),
        buckets=buckets,
        shards=_add_loads([b.shards for b in buckets], layout.num_shards),
    )


def summarize_layout(
    full: FullParamLayout, specs: Sequence[ParamSpec], *, num_ns_steps: int = DEFAULT_NUM_NS_STEPS
) -> LayoutSummary:
    """Measure every buffer of a model's layout and the per-rank totals.

    Args:
      full: The model's layout.
      specs: The model's parameter specs.
      num_ns_steps: Newton–Schulz iterations per optimizer step.

    Returns:
      A :class:`LayoutSummary`.

    Examples:
      >>> from lwjax.policies import compute_full_param_layout
      >>> specs = [ParamSpec("w", (256, 256), is_muon=True), ParamSpec("b", (256,))]
      >>> summary = summarize_layout(compute_full_param_layout(specs, 2), specs)
      >>> summary.num_buckets, summary.real_numel, summary.ns_flops
      (2, 65792, 503316480)
    """
    buffers = tuple(
        summarize_buffer(layout, specs, key=key, num_ns_steps=num_ns_steps)
        for key, layout in full.layouts.items()
    )
    groups: dict[int, list[BufferSummary]] = {}
    for buffer in buffers:
        groups.setdefault(buffer.num_shards, []).append(buffer)
    ranks = tuple(
        RankLoads(
            num_shards=size,
            numel=sum(b.numel for b in members),
            real_numel=sum(b.real_numel for b in members),
            shards=_add_loads([b.shards for b in members], size),
        )
        for size, members in sorted(groups.items(), key=lambda kv: -kv[0])
    )
    return LayoutSummary(buffers=buffers, ranks=ranks)


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """A policy's layout of a model, its summary and how long computing it took.

    Attributes:
      policy: The layer-wise policy.
      layout: The model's full layout under it.
      summary: :func:`summarize_layout` of ``layout``.
      layout_ms: Wall time of :func:`~lwjax.policies.compute_full_param_layout`
        in milliseconds.
    """

    policy: str
    layout: FullParamLayout
    summary: LayoutSummary
    layout_ms: float


def evaluate_policy(
    specs: Sequence[ParamSpec],
    dp: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    expert_dp: int | None = None,
    grad_reduce_in_fp32: bool = True,
    num_ns_steps: int = DEFAULT_NUM_NS_STEPS,
) -> PolicyResult:
    """Lay a model out with one policy, timing the layout, and summarise it.

    Args are those of :func:`~lwjax.policies.compute_full_param_layout`, plus
    ``num_ns_steps`` for the Newton–Schulz FLOPs.

    Raises:
      ValueError: As :func:`~lwjax.policies.compute_full_param_layout`, or
        ``num_ns_steps < 1``.
    """
    if isinstance(num_ns_steps, bool) or not isinstance(num_ns_steps, int) or num_ns_steps < 1:
        raise ValueError(
            f"evaluate_policy: num_ns_steps must be a positive integer; got {num_ns_steps=}."
        )
    begin = time.perf_counter()
    full = compute_full_param_layout(
        specs, dp, layout, expert_dp=expert_dp, grad_reduce_in_fp32=grad_reduce_in_fp32
    )
    layout_ms = 1e3 * (time.perf_counter() - begin)
    return PolicyResult(
        layout.policy, full, summarize_layout(full, specs, num_ns_steps=num_ns_steps), layout_ms
    )


def compare_policies(
    specs: Sequence[ParamSpec],
    dp: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    policies: Sequence[str] = POLICIES,
    expert_dp: int | None = None,
    grad_reduce_in_fp32: bool = True,
    num_ns_steps: int = DEFAULT_NUM_NS_STEPS,
) -> tuple[PolicyResult, ...]:
    """Run :func:`evaluate_policy` for each of ``policies`` with ``layout``'s other settings."""
    return tuple(
        evaluate_policy(
            specs,
            dp,
            dataclasses.replace(layout, policy=policy),
            expert_dp=expert_dp,
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            num_ns_steps=num_ns_steps,
        )
        for policy in policies
    )


def layout_to_json(layout: PerBufferParamLayout) -> dict:
    """Write one buffer's layout in the fixtures' ``expected`` format.

    Keys: ``param_index_map`` (``name -> [start, end, bucket_id]``),
    ``bucket_indices``, ``per_bucket_numel_unpadded`` and, for a layer-wise
    layout, ``shard_of`` (``name -> shard``).
    """
    out = {
        "param_index_map": {name: list(entry) for name, entry in layout.param_index_map.items()},
        "bucket_indices": [list(bucket) for bucket in layout.bucket_indices],
        "per_bucket_numel_unpadded": list(layout.per_bucket_numel_unpadded),
    }
    if layout.is_layer_wise:
        out["shard_of"] = {name: layout.shard_of(name) for name in layout.param_index_map}
    return out


def full_layout_to_json(full: FullParamLayout) -> dict:
    """Write a model's layout in the full-layout fixtures' ``expected`` format.

    ``{"buffers": [...]}``, one entry per buffer in key order, each with its
    ``key`` (Megatron's field names), ``dp``, ``layout_kind``, ``params``,
    ``param_indices``, ``num_optimizer_shards`` and the :func:`layout_to_json` fields.
    """
    buffers = []
    for key, layout in full.layouts.items():
        buffers.append(
            {
                "key": {
                    "param_dtype": key.param_dtype,
                    "grad_dtype": key.grad_dtype,
                    "is_expert_parallel": key.is_expert_parallel,
                    "is_managed_by_layer_wise_optimizer": key.is_layer_wise,
                },
                "dp": layout.num_shards,
                "layout_kind": "layer_wise" if layout.is_layer_wise else "distributed_optimizer",
                "params": list(layout.param_index_map),
                "param_indices": list(layout.param_indices),
                "num_optimizer_shards": layout.num_shards,
                **layout_to_json(layout),
            }
        )
    return {"buffers": buffers}
