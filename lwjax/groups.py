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
buffers.

**What a group size costs.** Two figures move against each other with ``G``:

* *padding*, ``numel / real_numel - 1``: more buffer bytes sent, more state;
* the *busiest device's Newton–Schulz FLOPs*: every group orthogonalises the
  whole model, so a rank owns about ``1/G`` of it, and with ``t`` tensor/FSDP
  devices per data-parallel rank (``devices_per_rank``) the rank's matrices are
  dealt out to them costliest first (:func:`lwjax.cost.deal`). It can never
  fall below :math:`\max(W / (G t), w_{max})` (``W`` all matrices' work,
  ``w_max`` the largest matrix's).

The **least achievable** NS work is the least busiest-device work of all the
options weighed, padding ignored: every policy of :data:`~lwjax.layout.POLICIES`
at every divisor ``G`` of ``dp`` up to the first with ``G t`` at least the
number of matrices (:func:`group_sizes`; past it the busiest device can hold
one matrix, so its work cannot fall further, while the padding floor
``G * largest - numel`` of the largest matrix's bucket only rises).

:func:`choose_groups` holds padding ``<= max_padding`` (5%) *and* NS ``<=
max_ns_ratio`` (1.25) times the least achievable. Among the options that hold
both it takes a group inside one host first (``hosts``), then the least NS, the
least padding, the larger ``G``. When none holds both, the one that misses
least: the least *overshoot* :math:`\max\big(\tfrac{1 + p}{1 + p_{max}},
\tfrac{r}{r_{max}}\big)`, the factor by which buffer bytes or NS time pass what
the bounds allow. Both bounds can be out of any layout's reach, and the
:class:`GroupChoice` says so: Llama-3-8B shapes on plain data parallelism
(``t = 1``, dp >= 64) need ``G >= 64`` for NS (below it a rank does at least
``W / 32`` = twice the largest matrix, ``linear_fc1``), and at ``G = 64`` the
bucket holding ``linear_fc1`` (117M elements) has 64 shards of at least that,
6.6% more than all matrices: the choice is ``G = 64`` at 6.7% padding and the
least NS. The group size is the mesh's shape (:func:`lwjax.optimizer.group_mesh`,
or ``layerwise_muon(..., replica_axis="auto")``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from lwjax.cost import deal, device_loads, ns_flops
from lwjax.layout import POLICIES, FullParamLayout, LayoutConfig, ParamSpec
from lwjax.policies import compute_full_param_layout

MAX_PADDING = 0.05
MAX_NS_RATIO = 1.25


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
      max_device_ns_flops: Newton–Schulz FLOPs of the busiest device per step:
        each rank's matrices dealt out to its ``devices_per_rank`` devices
        (:func:`lwjax.cost.deal`); ``max_rank_ns_flops`` at one device per rank.
      devices_per_rank: Tensor/FSDP devices of one data-parallel rank (``t``).
      hosts: Hosts the widest group spans, or ``None`` when hosts are not known.
    """

    shards: int
    replicas: int
    policy: str
    layout: FullParamLayout
    real_numel: int
    numel: int
    max_rank_ns_flops: int
    max_device_ns_flops: int
    devices_per_rank: int = 1
    hosts: int | None = None

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


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"sharding groups: {name} must be a positive integer; got {name}={value!r}."
        )


def divisors(dp: int) -> tuple[int, ...]:
    """The group sizes ``dp`` allows: its divisors, ascending."""
    _check_size("dp", dp)
    small = [d for d in range(1, math.isqrt(dp) + 1) if dp % d == 0]
    return tuple(sorted(set(small + [dp // d for d in small])))


def _muon_shapes(specs: Sequence[ParamSpec]) -> dict[str, tuple[int, ...]]:
    return {spec.name: spec.shape for spec in specs if spec.is_muon}


def group_sizes(specs: Sequence[ParamSpec], dp: int, devices_per_rank: int = 1) -> tuple[int, ...]:
    """The group sizes worth weighing: the divisors of ``dp`` up to the first ``G`` whose
    ``G * devices_per_rank`` devices can each hold one Muon matrix (all of them, ascending,
    when none can)."""
    _check_size("devices_per_rank", devices_per_rank)
    matrices = len(_muon_shapes(specs))
    sizes = []
    for g in divisors(dp):
        sizes.append(g)
        if g * devices_per_rank >= matrices:
            break
    return tuple(sizes)


def consecutive_hosts(
    dp: int, devices_per_rank: int, devices_per_host: int
) -> Callable[[int], int]:
    """``G -> hosts the widest group of G ranks spans`` when rank ``r`` holds devices
    ``r * t .. r * t + t - 1`` (``t = devices_per_rank``; a mesh with ``dp`` major over the
    tensor/FSDP axes) and hosts hold ``devices_per_host`` consecutive devices."""
    for name, value in (
        ("dp", dp),
        ("devices_per_rank", devices_per_rank),
        ("devices_per_host", devices_per_host),
    ):
        _check_size(name, value)

    def hosts(shards: int) -> int:
        width = shards * devices_per_rank
        starts = range(0, min(dp // shards, devices_per_host) * width, width)
        return max(
            (start + width - 1) // devices_per_host - start // devices_per_host + 1
            for start in starts
        )

    return hosts


def sharding_option(
    specs: Sequence[ParamSpec],
    dp: int,
    shards: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    num_ns_steps: int = 5,
    devices_per_rank: int = 1,
    hosts: Callable[[int], int] | None = None,
) -> ShardingOption:
    """The model laid out over groups of ``shards`` of ``dp`` ranks.

    ``layout.bucket_size="auto"`` resolves with the whole ``dp``, as Megatron's
    DDP sizes its buckets by the data-parallel world. ``hosts(G)``, if given,
    is the number of hosts the widest group of ``G`` ranks spans (e.g.
    :func:`consecutive_hosts`).

    Raises:
      ValueError: ``shards`` does not divide ``dp``, ``devices_per_rank`` is not a
        positive integer, or as :func:`~lwjax.policies.compute_full_param_layout`.
    """
    _check_size("dp", dp)
    _check_size("devices_per_rank", devices_per_rank)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or dp % shards:
        raise ValueError(
            f"sharding groups: the group size must be a divisor of dp={dp}; got {shards!r} "
            f"(divisors: {list(divisors(dp))})."
        )
    config = dataclasses.replace(layout, bucket_size=layout.bucket_size_for(dp))
    full = compute_full_param_layout(specs, shards, config)
    shapes = _muon_shapes(specs)
    work: list[list[int]] = [[] for _ in range(shards)]
    for buffer in full.layouts.values():
        for name in buffer.param_index_map:
            if name in shapes and buffer.is_layer_wise:
                work[buffer.shard_of(name)].append(ns_flops(shapes[name], num_ns_steps))
    return ShardingOption(
        shards=shards,
        replicas=dp // shards,
        policy=layout.policy,
        layout=full,
        real_numel=sum(math.prod(spec.shape) for spec in specs),
        numel=sum(buffer.numel for buffer in full.layouts.values()),
        max_rank_ns_flops=max(sum(costs) for costs in work),
        max_device_ns_flops=max(_busiest_device(costs, devices_per_rank) for costs in work),
        devices_per_rank=devices_per_rank,
        hosts=None if hosts is None else hosts(shards),
    )


def _busiest_device(costs: Sequence[int], devices: int) -> int:
    """The busiest device's work when ``costs`` are dealt out to ``devices`` (LPT)."""
    if devices == 1 or not costs:
        return sum(costs)
    return max(device_loads(costs, deal(costs, devices), devices))


def sharding_options(
    specs: Sequence[ParamSpec],
    dp: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    policies: Sequence[str] | None = None,
    num_ns_steps: int = 5,
    devices_per_rank: int = 1,
    hosts: Callable[[int], int] | None = None,
) -> tuple[ShardingOption, ...]:
    """:func:`sharding_option` for every group size of :func:`group_sizes` (ascending) and
    each of ``policies`` (default: ``layout.policy`` only)."""
    return tuple(
        sharding_option(
            specs,
            dp,
            g,
            dataclasses.replace(layout, policy=policy),
            num_ns_steps=num_ns_steps,
            devices_per_rank=devices_per_rank,
            hosts=hosts,
        )
        for g in group_sizes(specs, dp, devices_per_rank)
        for policy in (policies or (layout.policy,))
    )


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """What :func:`choose_groups` chose, among what, and why.

    Attributes:
      option: The chosen group size, policy and layout.
      options: Every option weighed (ascending group size, then policy).
      least_ns_flops: The least achievable NS work: the least
        ``max_device_ns_flops`` of ``options``, padding ignored.
      max_padding: The padding bound (a fraction).
      max_ns_ratio: The bound on NS work, a multiple of ``least_ns_flops``.
      notes: Why a bound is missed, or why groups span hosts (empty when the
        choice holds both bounds inside one host or hosts are not known).
    """

    option: ShardingOption
    options: tuple[ShardingOption, ...]
    least_ns_flops: int
    max_padding: float
    max_ns_ratio: float
    notes: tuple[str, ...]

    def ns_ratio(self, option: ShardingOption | None = None) -> float:
        """The busiest device's NS work of ``option`` (default: the choice) over the least."""
        option = self.option if option is None else option
        return option.max_device_ns_flops / self.least_ns_flops if self.least_ns_flops else 1.0

    def overshoot(self, option: ShardingOption | None = None) -> float:
        r""":math:`\max\big(\tfrac{1 + p}{1 + p_{max}}, \tfrac{r}{r_{max}}\big)` of ``option``
        (default: the choice): at most 1 when it holds both bounds."""
        option = self.option if option is None else option
        return max(
            (1 + option.padding) / (1 + self.max_padding), self.ns_ratio(option) / self.max_ns_ratio
        )

    @property
    def holds_bounds(self) -> bool:
        """Whether the choice holds both the padding and the NS bound."""
        return self.overshoot() <= 1


@dataclasses.dataclass(frozen=True)
class AutoGroups:
    """Ask :func:`lwjax.layerwise_muon` to choose the sharding groups (``replica_axis=``):
    it splits the mesh's data-parallel axis as :func:`choose_groups` says.

    ``replica_axis="auto"`` is ``AutoGroups()``.

    Attributes:
      devices_per_host: Devices per host, numbered host by host (JAX numbers
        GPUs process by process); ``None``: each process is a host.
      max_padding: The padding bound, a fraction.
      max_ns_ratio: The NS bound, a multiple of the least achievable.
      policies: The layout policies to try (the chosen one replaces
        ``LayoutConfig.policy``).
      name: The name of the new mesh axis across groups.
    """

    devices_per_host: int | None = None
    max_padding: float = MAX_PADDING
    max_ns_ratio: float = MAX_NS_RATIO
    policies: tuple[str, ...] = POLICIES
    name: str = "replica"

    def __post_init__(self):
        if self.devices_per_host is not None:
            _check_size("devices_per_host", self.devices_per_host)
        _check_bound("max_padding", self.max_padding, 0)
        _check_bound("max_ns_ratio", self.max_ns_ratio, 1)
        unknown = [p for p in self.policies if p not in POLICIES]
        if not self.policies or unknown:
            raise ValueError(
                f"AutoGroups.policies must be a non-empty tuple of {POLICIES}; got "
                f"{self.policies!r}."
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"AutoGroups.name must be a non-empty string; got {self.name!r}.")


def _check_bound(name: str, value, least: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= least):
        raise ValueError(f"sharding groups: {name} must be a number >= {least:g}; got {value!r}.")


def weigh_groups(
    options: Sequence[ShardingOption],
    *,
    max_padding: float = MAX_PADDING,
    max_ns_ratio: float = MAX_NS_RATIO,
) -> GroupChoice:
    """The :class:`GroupChoice` among ``options`` (the rule of the module docstring).

    Raises:
      ValueError: no options, ``max_padding`` not a number >= 0 or ``max_ns_ratio``
        not a number >= 1.
    """
    _check_bound("max_padding", max_padding, 0)
    _check_bound("max_ns_ratio", max_ns_ratio, 1)
    if not options:
        raise ValueError("choose_groups: no options to weigh.")
    least = min(o.max_device_ns_flops for o in options)
    weighed = GroupChoice(options[0], tuple(options), least, max_padding, max_ns_ratio, ())

    def rank(o: ShardingOption):
        return (
            max(weighed.overshoot(o), 1.0),
            o.hosts or 0,
            o.max_device_ns_flops,
            o.numel,
            -o.shards,
        )

    chosen = min(options, key=rank)
    choice = dataclasses.replace(weighed, option=chosen)
    return dataclasses.replace(choice, notes=_notes(choice))


def _notes(choice: GroupChoice) -> tuple[str, ...]:
    """Why ``choice`` misses a bound or spans hosts."""
    option, notes = choice.option, []
    if not choice.holds_bounds:
        missed = []
        if option.padding > choice.max_padding:
            missed.append(f"padding {option.padding:.1%} > {choice.max_padding:.0%}")
        if choice.ns_ratio() > choice.max_ns_ratio:
            missed.append(f"NS {choice.ns_ratio():.2f}x > {choice.max_ns_ratio:g}x the least")
        notes.append(f"{' and '.join(missed)}: {_floors(choice)}; chosen as the least overshoot.")
    if option.hosts is not None and option.hosts > 1:
        inside = [o for o in choice.options if o.hosts == 1]
        if not inside:
            notes.append(
                f"groups span {option.hosts} hosts: even one rank's {option.devices_per_rank} "
                "devices span more than one."
            )
        else:
            best = min(inside, key=lambda o: (choice.overshoot(o), o.max_device_ns_flops, o.numel))
            notes.append(
                f"groups of {option.shards} ranks span {option.hosts} hosts: the best inside a "
                f"host, G={best.shards} ({best.policy}), pads {best.padding:.1%} with NS "
                f"{choice.ns_ratio(best):.2f}x the least."
            )
    return tuple(notes)


def _floors(choice: GroupChoice) -> str:
    r"""Which group sizes no layout of whole matrices can hold both bounds at, and why.

    Floors: the busiest device does at least :math:`W / (G t)` (``W`` the work of
    all matrices, the ``G = 1`` option's busiest rank); the bucket holding a
    layer-wise buffer's largest matrix has ``G`` shards at least that large, so
    padding is at least ``G * largest - numel`` summed over those buffers. The NS
    floor falls with ``G`` and the padding floor rises, so each rules out a run.
    """
    option, least = choice.option, choice.least_ns_flops
    sizes = [
        [end - start for start, end, _ in layout.param_index_map.values()]
        for layout in option.layout.layouts.values()
        if layout.is_layer_wise and layout.param_index_map
    ]
    total = min(o.max_rank_ns_flops for o in choice.options if o.shards == 1)
    by_ns, by_padding, open_sizes = [], [], []
    for g in sorted({o.shards for o in choice.options}):
        ns = total / (g * option.devices_per_rank) / least if least else 0.0
        padding = sum(max(0, g * max(s) - sum(s)) for s in sizes) / option.real_numel
        if ns > choice.max_ns_ratio:
            by_ns.append((g, ns))
        elif padding > choice.max_padding:
            by_padding.append((g, padding))
        else:
            open_sizes.append(g)
    ruled = []
    if by_ns:
        ruled.append(f"at G <= {by_ns[-1][0]} NS >= {by_ns[-1][1]:.2f}x the least")
    if by_padding:
        ruled.append(f"at G >= {by_padding[0][0]} padding >= {by_padding[0][1]:.1%}")
    if not open_sizes:
        return "no layout of whole matrices holds both (" + ", ".join(ruled) + ")"
    return f"no policy found a layout that holds both at G in {open_sizes}" + (
        " (" + ", ".join(ruled) + ")" if ruled else ""
    )


def choose_groups(
    specs: Sequence[ParamSpec],
    dp: int,
    layout: LayoutConfig = LayoutConfig(),
    *,
    policies: Sequence[str] = POLICIES,
    devices_per_rank: int = 1,
    hosts: Callable[[int], int] | None = None,
    max_padding: float = MAX_PADDING,
    max_ns_ratio: float = MAX_NS_RATIO,
    num_ns_steps: int = 5,
) -> GroupChoice:
    """The group size and policy for ``dp`` ranks: :func:`weigh_groups` of
    :func:`sharding_options` under ``policies``.

    Args:
      specs: The model's parameters.
      dp: Data-parallel ranks (the groups divide them).
      layout: Bucket size and padding of the layouts (its policy is replaced by each of
        ``policies``).
      policies: The layout policies to try.
      devices_per_rank: Tensor/FSDP devices of one data-parallel rank, over which its
        matrices are orthogonalised.
      hosts: ``G -> hosts the widest group of G ranks spans`` (e.g.
        :func:`consecutive_hosts`); ``None``: hosts are not weighed.
      max_padding: The padding bound, a fraction.
      max_ns_ratio: The NS bound, a multiple of the least achievable.
      num_ns_steps: Newton–Schulz iterations per step (scales every NS figure alike).

    Raises:
      ValueError: ``max_padding`` is not a number >= 0, ``max_ns_ratio`` not a number
        >= 1, or as :func:`sharding_option`.

    Examples:
      >>> specs = [ParamSpec(f"w{i}", (64, 64), is_muon=True) for i in range(4)]
      >>> choose_groups(specs, 8).option.shards  # four matrices: more than 4 shards only pad
      4
    """
    _check_bound("max_padding", max_padding, 0)
    _check_bound("max_ns_ratio", max_ns_ratio, 1)
    options = sharding_options(
        specs,
        dp,
        layout,
        policies=policies,
        num_ns_steps=num_ns_steps,
        devices_per_rank=devices_per_rank,
        hosts=hosts,
    )
    return weigh_groups(options, max_padding=max_padding, max_ns_ratio=max_ns_ratio)
