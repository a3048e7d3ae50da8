r"""What Newton–Schulz costs: the estimate layouts balance, the FLOPs benchmarks count, and
how matrices are dealt out to the devices that orthogonalise them.

Newton–Schulz on an ``[m, n]`` matrix works on its small side
:math:`s = \min(m, n)` against its large side :math:`l = \max(m, n)`. Each
step forms :math:`A = X X^\top` (:math:`2 s^2 l` FLOPs), :math:`A^2`
(:math:`2 s^3`) and the update :math:`B X` (:math:`2 s^2 l`). Pure Python, like the
layout layer that uses it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from lwjax.layout import ParamSpec

DEFAULT_NUM_NS_STEPS = 5


def ns_cost(spec: ParamSpec) -> int:
    """Megatron's estimate of a parameter's Newton–Schulz cost: ``max(m, n) * min(m, n)**2``.

    Anything that is not a matrix costs its element count.
    """
    if len(spec.shape) != 2:
        return spec.numel
    m, n = spec.shape
    return max(m, n) * min(m, n) ** 2


def ns_flops(
    shape: Sequence[int],
    num_ns_steps: int = DEFAULT_NUM_NS_STEPS,
    qkv_split_shapes: Sequence[int] | None = None,
    *,
    symmetric_share: Callable[[int, int], float] | None = None,
) -> int:
    r"""Newton–Schulz FLOPs of one optimizer step for a matrix of ``shape``.

    ``num_ns_steps * (4 * small**2 * large + 2 * small**3)`` with ``small =
    min(m, n)``, ``large = max(m, n)``; ``0`` for anything that is not 2-D.
    With a QKV split (rows as stored), each of the q, k and v blocks is
    orthogonalised on its own. ``symmetric_share(small, large)``, if given, is
    the share of the two symmetric products (:math:`X X^\top`:
    ``2 * small**2 * large``, :math:`A^2`: ``2 * small**3``) that is computed,
    for a kernel that skips one triangle.
    """
    if len(shape) != 2:
        return 0
    if qkv_split_shapes:
        groups, rest = divmod(shape[0], sum(qkv_split_shapes))
        if rest:
            raise ValueError(
                f"ns_flops: {shape[0]} rows do not divide into q/k/v groups of "
                f"{sum(qkv_split_shapes)} (qkv_split_shapes={tuple(qkv_split_shapes)})."
            )
        return sum(
            ns_flops((groups * rows, shape[1]), num_ns_steps, symmetric_share=symmetric_share)
            for rows in qkv_split_shapes
        )
    small, large = sorted(shape)
    symmetric, update = 2 * small**2 * large + 2 * small**3, 2 * small**2 * large
    if symmetric_share is not None:
        symmetric = round(symmetric * symmetric_share(small, large))
    return num_ns_steps * (symmetric + update)


def deal(costs: Sequence[int], devices: int) -> tuple[int, ...]:
    """Each item's device when ``costs`` are dealt out to ``devices`` workers, costliest first.

    Longest-processing-time-first: every item in turn, by falling cost (then
    by position), goes to the least-loaded device (the lowest index among
    equals). The busiest device then carries at most ``4/3`` of the least
    achievable load (Graham's bound), and, on two or more devices, exactly
    ``max(costs)`` when one item outweighs all the others together.

    Raises:
      ValueError: ``devices`` below 1, or a negative cost.
    """
    if devices < 1:
        raise ValueError(f"deal: devices must be >= 1; got {devices}.")
    if any(c < 0 for c in costs):
        raise ValueError(f"deal: costs must be >= 0; got {min(costs)}.")
    loads = [(0, d) for d in range(devices)]  # a heap of (load, device)
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, device = heapq.heappop(loads)
        owner[i] = device
        heapq.heappush(loads, (load + costs[i], device))
    return tuple(owner)


def device_loads(costs: Sequence[int], owners: Sequence[int], devices: int) -> list[int]:
    """The summed cost per device of items dealt as ``owners`` says (:func:`deal`)."""
    loads = [0] * devices
    for cost, device in zip(costs, owners):
        loads[device] += cost
    return loads
