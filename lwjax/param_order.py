"""The order of the layout's parameters: Muon matrices grouped by role and shape (pure Python).

The layout places parameters in the order it receives them (:mod:`lwjax.policies`).
:func:`param_specs` gives it the routed leaves' parameters in definition order, but
for the Muon matrices, which :func:`by_role` regroups so that same-shape matrices of
one role share buckets.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from lwjax.layout import ParamSpec
from lwjax.leaf_route import LeafRoute


def param_specs(routes: Iterable[LeafRoute]) -> tuple[ParamSpec, ...]:
    """All layout parameters of the routed leaves, in definition order but for the Muon
    matrices, which :func:`by_role` keeps together by role and shape."""
    return by_role(tuple(spec for route in routes for spec in route.specs()))


def role(name: str) -> str:
    """A parameter's role in its layer: ``name`` with every number in it replaced by ``#``.

    ``decoder/layers/3/mlp/fc1/kernel`` (a list of layers), ``layers_3/mlp/fc1/kernel``
    (flax linen) and ``mlp/fc1/kernel[3]`` (a stacked leaf) all name layer 3's ``fc1``;
    the role is the same for every layer.
    """
    return re.sub(r"[0-9]+", "#", name)


def by_role(specs: Sequence[ParamSpec]) -> tuple[ParamSpec, ...]:
    """``specs`` with the Muon matrices regrouped and every other parameter where it was.

    The Muon matrices fill the places Muon matrices had, ordered by the first
    appearance of their (:func:`role`, shape), and within one by the numbers in
    their names (``layers_2`` before ``layers_10``, which flattening a dict
    puts first), then in definition order. A model whose layers are leaves of
    their own (a list of layers, flax linen's ``layers_0``, ...) is then laid
    out as the same model with stacked layers is: matrices of one shape share
    buckets, so each rank's Newton–Schulz runs a few wide batched calls rather
    than one per matrix (docs/benchmarks.md, "One leaf per layer made
    Newton–Schulz run one matrix at a time"). Megatron walks its parameters
    layer by layer; only the order differs, not what the layout guarantees.
    """
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    keys = []
    for index, spec in enumerate(specs):
        if spec.is_muon:
            key = first.setdefault((role(spec.name), tuple(spec.shape)), len(first))
            numbers = tuple(int(n) for n in re.findall(r"[0-9]+", spec.name))
            keys.append((key, numbers, index))
    regrouped = iter(specs[index] for *_, index in sorted(keys))
    return tuple(next(regrouped) if spec.is_muon else spec for spec in specs)
