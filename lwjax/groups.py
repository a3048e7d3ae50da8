r"""Sharding groups: a layout over ``G`` of the ``dp`` data-parallel ranks (pure Python, no jax).

With every rank owning whole matrices, a layout over ``dp`` ranks pads each
bucket until its shards are equal; once ``dp`` nears the number of matrices the
padding grows past the model itself (Llama-3-8B shapes with 32 layers: 6.7% at
dp 64, 100% at 128, 1,411% at 1,024), and so do the gradient and optimizer
buffers. Megatron's ``num_optimizer_shards`` (megatron-core 0.19) lays the
model out over groups of ``G`` ranks instead and replicates the optimizer
state across the ``dp / G`` groups: gradients are reduce-scattered within a
group and summed across groups, parameters all-gathered within a group.

Per device and step, with :math:`S` the buffer bytes:

.. math::

   \text{reduce-scatter in the group: } \tfrac{G - 1}{G} S, \qquad
   \text{all-reduce across groups: } 2\,\tfrac{R - 1}{R}\,\tfrac{S}{G}, \qquad R = dp / G,

which is less than all-reducing first (:math:`2 \tfrac{R-1}{R} S`) and then
reduce-scattering. Optimizer state per device is :math:`1/G` of the padded
buffers; the busiest rank's Newton–Schulz work stops falling once ``G`` passes
the number of matrices of the largest shape.

Padding does not grow steadily with ``G`` and differs by policy (Llama-3-8B
shapes, 32 layers, dp 1,024: ``ns_cost`` pads 2.5% at ``G`` = 4, 10.9% at 8,
6.7% at 32 and 64; ``size_matching`` pads nothing up to 32, 53% at 64).
:func:`choose_groups` therefore tries every divisor of ``dp`` under every
policy and takes, among the layouts padded by at most ``max_padding`` (5%),
the one whose busiest rank does the least Newton–Schulz work, then the larger
``G`` (less optimizer state per device). The group size is the mesh's shape
(:func:`lwjax.optimizer.group_mesh`); nothing chooses it silently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from lwjax.cost import ns_flops
from lwjax.layout import POLICIES, FullParamLayout, LayoutConfig, ParamSpec
from lwjax.policies import compute_full_param_layout

MAX_PADDING = 0.05


@dataclasses.dataclass(frozen=True)
class ShardingOption:
    """A model laid out over groups of ``shards`` ranks.

    Attributes:
      shards: Ranks a layout spans (``G``).
      replicas: Groups holding copies of the optimizer state (``dp / G``).
      policy: The layer-wise layout policy.
      layout: The model's layout over ``G`` ranks.
      real_numel: Parameter elements.
      numel: Buffer elements, padding included.
      max_rank_ns_flops: Newton–Schulz FLOPs of the busiest rank per step.
    """

    shards: int
    replicas: int
    policy: str
    layout: FullParamLayout
    real_numel: int
    numel: int
    max_rank_ns_flops: int

    @property
    def padding(self) -> float:
        """Padding as a fraction of the parameters: ``numel / real_numel - 1``."""
        return self.numel / self.real_numel - 1 if self.real_numel else 0.0

    @property
    def state_numel_per_device(self) -> int:
        """Buffer elements one device owns (each optimizer state holds that many)."""
        return -(-self.numel // self.shards)

    @property
    def reduced_numel_per_device(self) -> float:
        r"""Gradient elements one device sends per step: the reduce-scatter in its group
        and the all-reduce of its shard across groups,
        :math:`\tfrac{G-1}{G} N + 2 \tfrac{R-1}{R} \tfrac{N}{G}`."""
        g, r, n = self.shards, self.replicas, self.numel
        return (g - 1) / g * n + 2 * (r - 1) / r * n / g


def _check_dp(dp) -> None:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"sharding groups: dp must be a positive integer; got {dp=!r}.")


def divisors(dp: int) -> tuple[int, ...]:
    """The group sizes ``dp`` allows: its divisors, ascending."""
    _check_dp(dp)
    small = [d for d in range(1, math.isqrt(dp) + 1) if dp % d == 0]
    return tuple(sorted(set(small + [dp // d for d in small])))


def sharding_option(
    specs: Sequence[ParamSpec],
    dp: int,
    shards: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    num_ns_steps: int = 5,
) -> ShardingOption:
    """The model laid out over groups of ``shards`` of ``dp`` ranks.

    ``layout.bucket_size="auto"`` resolves with the whole ``dp``, as Megatron's
    DDP sizes its buckets by the data-parallel world.

    Raises:
      ValueError: ``shards`` does not divide ``dp``, or as
        :func:`~lwjax.policies.compute_full_param_layout`.
    """
    _check_dp(dp)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or dp % shards:
        raise ValueError(
            f"sharding groups: the group size must be a divisor of dp={dp}; got {shards!r} "
            f"(divisors: {list(divisors(dp))})."
        )
    config = dataclasses.replace(layout, bucket_size=layout.bucket_size_for(dp))
    full = compute_full_param_layout(specs, shards, config)
    shapes = {spec.name: spec.shape for spec in specs if spec.is_muon}
    work = [0] * shards
    for buffer in full.layouts.values():
        for name in buffer.param_index_map:
            if name in shapes and buffer.is_layer_wise:
                work[buffer.shard_of(name)] += ns_flops(shapes[name], num_ns_steps)
    return ShardingOption(
        shards=shards,
        replicas=dp // shards,
        policy=layout.policy,
        layout=full,
        real_numel=sum(math.prod(spec.shape) for spec in specs),
        numel=sum(buffer.numel for buffer in full.layouts.values()),
        max_rank_ns_flops=max(work),
    )


def sharding_options(
    specs: Sequence[ParamSpec],
    dp: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    policies: Sequence[str] | None = None,
    num_ns_steps: int = 5,
) -> tuple[ShardingOption, ...]:
    """:func:`sharding_option` for every group size ``dp`` allows (ascending) and each of
    ``policies`` (default: ``layout.policy`` only)."""
    return tuple(
        sharding_option(
            specs, dp, g, dataclasses.replace(layout, policy=policy), num_ns_steps=num_ns_steps
        )
        for g in divisors(dp)
        for policy in (policies or (layout.policy,))
    )


def best_option(
    options: Sequence[ShardingOption], max_padding: float = MAX_PADDING
) -> ShardingOption:
    """Among ``options`` padded by at most ``max_padding``, the least Newton–Schulz work on
    the busiest rank, then the larger group (the first option when none fits).

    Raises:
      ValueError: ``max_padding`` is not a number >= 0.
    """
    if isinstance(max_padding, bool) or not (
        isinstance(max_padding, (int, float)) and max_padding >= 0
    ):
        raise ValueError(f"choose_groups: max_padding must be a number >= 0; got {max_padding!r}.")
    fitting = [o for o in options if o.padding <= max_padding] or [options[0]]
    return min(fitting, key=lambda o: (o.max_rank_ns_flops, -o.shards))


def choose_groups(
    specs: Sequence[ParamSpec],
    dp: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    policies: Sequence[str] = POLICIES,
    max_padding: float = MAX_PADDING,
) -> ShardingOption:
    """The group size and policy for ``dp`` ranks: :func:`best_option` of
    :func:`sharding_options` under ``policies``.

    Raises:
      ValueError: ``max_padding`` is not a number >= 0, or as :func:`sharding_option`.

    Examples:
      >>> specs = [ParamSpec(f"w{i}", (64, 64), is_muon=True) for i in range(4)]
      >>> choose_groups(specs, 8).shards  # four matrices: more than 4 shards only pad
      4
    """
    return best_option(sharding_options(specs, dp, layout, policies=policies), max_padding)
