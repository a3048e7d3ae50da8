"""Megatron's legacy ownership of whole parameters, used when no layout is given (pure Python).

Before the shard-aligned layout, Megatron's layer-wise optimizer all-reduced
gradients and dealt whole parameters out to ranks in a ping-pong order. Reading
a checkpoint written that way needs the same assignment.
"""

from __future__ import annotations

from collections.abc import Sequence

from lwjax.layout import ParamSpec


def ping_pong_ownership(
    groups: Sequence[tuple[bool, Sequence[ParamSpec]]], dp: int, expert_dp: int = 1
) -> tuple[list[list[str]], list[list[str]] | None]:
    """Megatron's legacy ownership when no layout is used (gradients all-reduced).

    All parameters of all optimizer groups are stable-sorted by element count
    and dealt out along ``0, 1, ..., dp-1, dp-1, ..., 0`` (repeating); dense and
    expert parameters use separate cursors and rank spaces.

    Args:
      groups: ``(is_expert_parallel, params)`` per optimizer parameter group, in
        optimizer order.
      dp: Dense data-parallel size.
      expert_dp: Expert data-parallel size.

    Returns:
      ``(dense, expert)``: parameter names per rank; ``expert`` is ``None``
      when ``expert_dp == 1`` or expert rank 0 owns nothing.
    """
    for name, value in (("dp", dp), ("expert_dp", expert_dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"ping_pong_ownership: {name} must be a positive integer; got {name}={value!r}."
            )
    items = [(spec, is_expert) for is_expert, params in groups for spec in params]
    items.sort(key=lambda item: item[0].numel)
    dense: list[list[str]] = [[] for _ in range(dp)]
    expert: list[list[str]] = [[] for _ in range(expert_dp)]
    counts = {False: 0, True: 0}
    for spec, is_expert in items:
        ranks = expert if is_expert else dense
        size = len(ranks)
        i = counts[is_expert] % (2 * size)
        ranks[i if i < size else 2 * size - 1 - i].append(spec.name)
        counts[is_expert] += 1
    if expert_dp == 1 or not expert[0]:
        return dense, None
    return dense, expert
