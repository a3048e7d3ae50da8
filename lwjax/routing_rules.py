"""The routing rules: per-leaf overrides of the defaults, by name pattern or callable (pure Python).

Each rule is ``None`` (the default), a ``{glob_pattern: value}`` mapping (first match
wins; a pattern matches the whole ``/``-joined name, :func:`fnmatch.fnmatchcase`) or a
callable ``rule(name, shape) -> value or None`` (``None`` falls back to the default).
:class:`RoutingRules` carries them together, frozen; :func:`apply_rule` reads one for
a leaf. What each rule decides is in :mod:`lwjax.routing`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from lwjax.dims import MatrixDims
from lwjax.layout import FrozenDict

T = TypeVar("T")
Rule = Mapping[str, T] | Callable[[str, tuple[int, ...]], T | None] | None

_FLAG_RULES = ("tied", "expert")  # may also be a pattern or a sequence of patterns (all mean True)


def apply_rule(rule: Rule, name: str, shape: tuple[int, ...]):
    """Value of ``rule`` for a parameter, or ``None`` when it does not decide."""
    if rule is None:
        return None
    if callable(rule):
        return rule(name, shape)
    for pattern, value in rule.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return None


def is_finite_nonnegative(value) -> bool:
    """A real number (not a bool), finite and >= 0."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


@dataclasses.dataclass(frozen=True, repr=False)
class RoutingRules:
    """How leaves route, overriding the defaults (see :mod:`lwjax.routing`).

    Each field is ``None`` (the default rule), a ``{glob_pattern: value}``
    mapping or a callable ``rule(name, shape) -> value or None``.

    Attributes:
      is_muon: Overrides the default Muon rule (2-D view, not embedding, head,
        bias or scale); a callable gets the view's shape after the batch axes.
      stacked: Number of leading stack axes per leaf (default 0; 1 for expert
        leaves; found for scanned modules by :func:`lwjax.dims.detect_stacks`).
      dims: The leaf's batch, input and output axes at any position, a
        :class:`~lwjax.dims.MatrixDims`; overrides ``stacked`` and axis names.
      tied: Tied embeddings (never Muon); also a pattern or a sequence of
        patterns. They are laid out like any other parameter, as Megatron lays
        them out at pipeline size 1.
      expert: Expert-parallel leaves; also patterns. ``True`` puts the expert
        axis on the last stacked axis; an ``int`` names the stacked axis that
        indexes experts.
      qkv_split: Per fused QKV Muon matrix, the q, k, v output rows of one
        query group; Muon orthogonalises the three blocks separately.
      lr_mult: Learning-rate multiplier (default 1).
      wd_mult: Weight-decay multiplier (default 1).
      grad_norm_group: Name of a separate gradient-norm group (e.g. ``"mtp"``):
        its parameters leave the main norm and are clipped by their own.
      model_dim: The model width that splits 3+-axis leaves into input and
        output axes (:func:`lwjax.dims.dims_from_model_dim`); default: the
        embedding table's width.

    Raises:
      TypeError: A rule that is neither ``None``, a mapping nor a callable.
    """

    is_muon: Rule[bool] = None
    stacked: Rule[int] = None
    tied: Rule[bool] | str | Sequence[str] = None
    expert: Rule[bool | int] | str | Sequence[str] = None
    qkv_split: Rule[tuple[int, ...]] = None
    lr_mult: Rule[float] = None
    wd_mult: Rule[float] = None
    grad_norm_group: Rule[str] = None
    dims: Rule[MatrixDims] = None
    model_dim: int | None = None

    def __post_init__(self):
        if self.model_dim is not None and (
            isinstance(self.model_dim, bool) or not isinstance(self.model_dim, int)
        ):
            raise TypeError(
                f"RoutingRules.model_dim must be an int or None; got {self.model_dim!r}."
            )
        for field in dataclasses.fields(self):
            if field.name != "model_dim":
                rule = _frozen_rule(field.name, getattr(self, field.name))
                object.__setattr__(self, field.name, rule)

    def __repr__(self) -> str:
        rules = ", ".join(
            f"{f.name}={dict(v) if isinstance(v, Mapping) else v!r}"
            for f in dataclasses.fields(self)
            if (v := getattr(self, f.name)) is not None
        )
        return f"RoutingRules({rules})"


def _frozen_rule(field: str, rule):
    """A rule as :class:`RoutingRules` keeps it: a mapping frozen, a flag's patterns a mapping."""
    if field in _FLAG_RULES and isinstance(rule, str):
        rule = {rule: True}
    elif field in _FLAG_RULES and isinstance(rule, Sequence):
        rule = dict.fromkeys(rule, True)
    if isinstance(rule, Mapping):
        return FrozenDict(rule)
    if rule is not None and not callable(rule):
        raise TypeError(
            f"RoutingRules.{field} must be a mapping of glob patterns, a callable or None, "
            f"but got {type(rule).__name__}."
        )
    return rule
