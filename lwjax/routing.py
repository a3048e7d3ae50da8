"""Routing: which parameters are Muon matrices, tied or expert, by pytree path (pure Python).

Leaves arrive as ``(key_path, shape, dtype)`` records (see
:func:`lwjax.optimizer.route_params`, which flattens any pytree: plain dicts,
flax nnx ``State``, flax linen ``params``). Names come from the key path,
joined with ``/``; a trailing ``value`` attribute (flax nnx variables) is
dropped, so an nnx kernel reads ``blocks/0/mlp/up/kernel``.

Default rule (Megatron's): a parameter is a Muon matrix iff it is 2-D and not
an embedding or output projection (names matching :data:`EMBEDDING_OR_OUTPUT`).
Everything else (biases, norms, scalars, embeddings, the head) goes to AdamW.

A leaf may *stack* independent parameters along leading axes: a scan-over-layers
kernel ``[L, m, n]`` declared with ``stacked={"blocks/*": 1}`` is ``L``
matrices, named ``"<path>[i]"``, each owned and orthogonalised on its own.

Expert leaves (``expert=...``) stack one parameter per expert: ``[E, m, n]``,
or ``[L, E, m, n]`` with ``stacked=2``. Their *expert axis* (by default the last
stacked axis) is split over the expert-parallel mesh axis, so with
``expert_parallel=ep`` each device holds ``E / ep`` experts and the layout names
the local ones (``"<path>[j]"`` is local expert ``j``; on expert rank ``e`` it
is global expert ``e * E / ep + j``).

Per-parameter options, Megatron's parameter groups: ``lr_mult`` and
``wd_mult`` scale the learning rate and weight decay, and ``grad_norm_group``
puts a parameter into a separately clipped gradient-norm group (e.g. ``"mtp"``).

The rules travel together as one frozen :class:`RoutingRules`. Each is a
``{glob_pattern: value}`` mapping (first match wins, patterns match the whole
name with :func:`fnmatch.fnmatchcase`) or a callable
``rule(name, shape) -> value or None`` (``None`` falls back to the default).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from lwjax.layout import FrozenDict, ParamSpec

T = TypeVar("T")
Rule = Mapping[str, T] | Callable[[str, tuple[int, ...]], T | None] | None

EMBEDDING_OR_OUTPUT = re.compile(
    r"(^|[/.])([^/.]*embed[^/.]*|wte|wpe|lm_head|head|output_layer)([/.]|$)"
)


def path_name(key_path: Iterable[Any]) -> str:
    """Join a pytree key path into a ``/``-separated name.

    Accepts jax key entries (``DictKey``, ``GetAttrKey``, ``SequenceKey``,
    ``FlattenedIndexKey``) or plain strings and ints. A final ``.value``
    attribute (flax nnx variables) is dropped.
    """
    parts = []
    entries = list(key_path)
    for i, entry in enumerate(entries):
        if hasattr(entry, "name") and not isinstance(entry, str):  # attribute access
            if i == len(entries) - 1 and entry.name == "value" and i > 0:
                continue
            parts.append(str(entry.name))
        elif hasattr(entry, "key") and not isinstance(entry, str):
            parts.append(str(entry.key))
        elif hasattr(entry, "idx") and not isinstance(entry, str):
            parts.append(str(entry.idx))
        else:
            parts.append(str(entry))
    return "/".join(parts)


def is_embedding_or_output(name: str) -> bool:
    """Whether a parameter name looks like an embedding table or output projection.

    Name components are split at ``/`` (pytree paths) and ``.`` (torch/Megatron
    names), so ``output_layer.weight`` and ``embed/embedding`` both match.
    """
    return EMBEDDING_OR_OUTPUT.search(name.lower()) is not None


def _apply_rule(rule: Rule, name: str, shape: tuple[int, ...]):
    """Value of ``rule`` for a parameter, or ``None`` when it does not decide."""
    if rule is None:
        return None
    if callable(rule):
        return rule(name, shape)
    for pattern, value in rule.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return None


_FLAG_RULES = ("tied", "expert")  # may also be a pattern or a sequence of patterns (all mean True)


@dataclasses.dataclass(frozen=True, repr=False)
class RoutingRules:
    """How leaves route, overriding the defaults (see the module docstring).

    Each field is ``None`` (the default rule), a ``{glob_pattern: value}``
    mapping or a callable ``rule(name, shape) -> value or None``.

    Attributes:
      is_muon: Overrides the default Muon rule (2-D and not embedding/output);
        a callable gets the shape after the stacked axes.
      stacked: Number of leading stack axes per leaf (default 0; 1 for expert leaves).
      tied: Tied embeddings (isolated bucket, never Muon); also a pattern or a
        sequence of patterns.
      expert: Expert-parallel leaves; also patterns. ``True`` puts the expert
        axis on the last stacked axis; an ``int`` names the stacked axis that
        indexes experts.
      qkv_split: Per fused QKV Muon matrix, the q, k, v output rows of one
        query group; Muon orthogonalises the three blocks separately.
      lr_mult: Learning-rate multiplier (default 1).
      wd_mult: Weight-decay multiplier (default 1).
      grad_norm_group: Name of a separate gradient-norm group (e.g. ``"mtp"``):
        its parameters leave the main norm and are clipped by their own.

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

    def __post_init__(self):
        for field in dataclasses.fields(self):
            rule = getattr(self, field.name)
            if field.name in _FLAG_RULES and isinstance(rule, str):
                rule = {rule: True}
            elif field.name in _FLAG_RULES and isinstance(rule, Sequence):
                rule = dict.fromkeys(rule, True)
            if isinstance(rule, Mapping):
                rule = FrozenDict(rule)
            elif rule is not None and not callable(rule):
                raise TypeError(
                    f"RoutingRules.{field.name} must be a mapping of glob patterns, a callable "
                    "or None, "
                    f"but got {type(rule).__name__}."
                )
            object.__setattr__(self, field.name, rule)

    def __repr__(self) -> str:
        rules = ", ".join(
            f"{f.name}={dict(v) if isinstance(v, Mapping) else v!r}"
            for f in dataclasses.fields(self)
            if (v := getattr(self, f.name)) is not None
        )
        return f"RoutingRules({rules})"


@dataclasses.dataclass(frozen=True)
class LeafRoute:
    """How one pytree leaf maps onto layout parameters.

    Attributes:
      path: The leaf's name (``/``-joined key path).
      shape: The leaf's full shape.
      dtype: The leaf's dtype name.
      stack_dims: Leading axes that index independent parameters (0: the leaf
        is one parameter; 1: ``[L, ...]`` is ``L`` parameters).
      is_muon: The parameters are Muon matrices.
      is_shared_embedding: A tied embedding (isolated bucket, never Muon).
      is_expert: Expert-parallel parameters.
      qkv_split_shapes: For a fused QKV Muon matrix, the output rows of q, k
        and v per query group (e.g. ``(128, 64, 64)``); ``None`` otherwise.
      expert_dim: For expert leaves, the stacked axis that indexes experts
        (split over the expert-parallel mesh axis); ``None`` otherwise.
      expert_parallel: Expert-parallel size: each device holds
        ``shape[expert_dim] / expert_parallel`` experts.
      lr_mult: Learning-rate multiplier (Megatron's ``lr_mult``).
      wd_mult: Weight-decay multiplier (Megatron's ``wd_mult``).
      grad_norm_group: Name of a separate gradient-norm group, or ``None`` for
        the main norm.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    stack_dims: int = 0
    is_muon: bool = False
    is_shared_embedding: bool = False
    is_expert: bool = False
    qkv_split_shapes: tuple[int, ...] | None = None
    expert_dim: int | None = None
    expert_parallel: int = 1
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    grad_norm_group: str | None = None

    def __post_init__(self):
        if self.is_expert and self.expert_dim is None and self.stack_dims:
            object.__setattr__(self, "expert_dim", self.stack_dims - 1)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of each stacked parameter."""
        return self.shape[self.stack_dims :]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The leaf's shape on one device: the expert axis divided by ``expert_parallel``."""
        if self.expert_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.expert_dim] //= self.expert_parallel
        return tuple(shape)

    @property
    def num_params(self) -> int:
        """How many parameters the leaf stacks on one device."""
        return math.prod(self.local_shape[: self.stack_dims])

    def param_names(self) -> tuple[str, ...]:
        """Names of the (device-local) stacked parameters, in row-major stack order."""
        if self.stack_dims == 0:
            return (self.path,)
        names = []
        for flat in range(self.num_params):
            index, rest = [], flat
            for size in reversed(self.local_shape[: self.stack_dims]):
                index.append(rest % size)
                rest //= size
            names.append(f"{self.path}[{','.join(map(str, reversed(index)))}]")
        return tuple(names)

    def specs(self) -> tuple[ParamSpec, ...]:
        """One :class:`ParamSpec` per (device-local) stacked parameter."""
        return tuple(
            ParamSpec(
                name=name,
                shape=self.param_shape,
                dtype=self.dtype,
                is_muon=self.is_muon,
                is_shared_embedding=self.is_shared_embedding,
                is_expert=self.is_expert,
            )
            for name in self.param_names()
        )


def route_leaves(
    leaves: Iterable[tuple[Any, Sequence[int], Any]],
    rules: RoutingRules = RoutingRules(),
    *,
    expert_parallel: int = 1,
) -> tuple[LeafRoute, ...]:
    """Decide, per leaf, its name, stacking, optimizer and parameter-group options.

    Args:
      leaves: ``(key_path, shape, dtype)`` per leaf in pytree flatten order;
        ``key_path`` is a jax key path, a tuple of strings/ints, or a name.
      rules: The :class:`RoutingRules` overriding the defaults.
      expert_parallel: Expert-parallel size; every expert axis must divide by it.

    Returns:
      One :class:`LeafRoute` per leaf, in input order.

    Raises:
      ValueError: duplicate names, non-floating dtypes, a Muon parameter that
        is not 2-D, a stack count out of range, an expert axis that is not
        stacked or does not divide by ``expert_parallel``, or a bad multiplier
        or group name.

    Examples:
      >>> routes = route_leaves([("blocks/w", (4, 8, 8), "float32"), ("head", (8, 16), "float32")],
      ...                       RoutingRules(stacked={"blocks/*": 1}))
      >>> [(r.path, r.num_params, r.is_muon) for r in routes]
      [('blocks/w', 4, True), ('head', 1, False)]
    """
    if not isinstance(rules, RoutingRules):
        raise TypeError(
            f"route_leaves: rules must be a RoutingRules, but got {type(rules).__name__}."
        )
    if (
        isinstance(expert_parallel, bool)
        or not isinstance(expert_parallel, int)
        or expert_parallel < 1
    ):
        raise ValueError(
            f"route_leaves: expert_parallel must be a positive integer; got {expert_parallel=}."
        )
    routes, seen = [], set()
    for key_path, shape, dtype in leaves:
        name = key_path if isinstance(key_path, str) else path_name(key_path)
        if name in seen:
            raise ValueError(f"{name}: two leaves share this name; leaf names must be unique.")
        seen.add(name)
        routes.append(
            _route_leaf(
                name,
                tuple(int(d) for d in shape),
                str(getattr(dtype, "name", dtype)),
                rules,
                expert_parallel,
            )
        )
    return tuple(routes)


def _route_leaf(
    name: str, shape: tuple[int, ...], dtype_name: str, rules: RoutingRules, expert_parallel: int
) -> LeafRoute:
    """Apply ``rules`` (else the defaults) to one leaf."""
    if not (dtype_name.startswith("float") or dtype_name.startswith("bfloat")):
        raise ValueError(
            f"{name}: parameters must be floating point; got dtype={dtype_name}. "
            "Keep integer state out of the parameter tree."
        )
    expert_value = _apply_rule(rules.expert, name, shape)
    is_expert = expert_value is not None and expert_value is not False
    stack = _apply_rule(rules.stacked, name, shape)
    stack = (1 if is_expert else 0) if stack is None else stack
    if not 0 <= stack < max(len(shape), 1):
        raise ValueError(f"{name}: stacked={stack} leading axes leaves no parameter; got {shape=}.")
    param_shape = shape[stack:]
    is_tied = bool(_apply_rule(rules.tied, name, shape))
    muon = _apply_rule(rules.is_muon, name, param_shape)
    if muon is None:
        muon = len(param_shape) == 2 and not is_tied and not is_embedding_or_output(name)
    if muon and len(param_shape) != 2:
        raise ValueError(
            f"{name}: a Muon parameter must be a 2-D matrix; got {param_shape=} after "
            f"{stack} stacked axes. Declare stacking with stacked=... or route it to AdamW "
            "with is_muon=..."
        )
    if muon and is_tied:
        raise ValueError(f"{name}: a tied embedding is never a Muon matrix; route it to AdamW.")
    split = _apply_rule(rules.qkv_split, name, param_shape)
    if split is not None:
        split = tuple(int(x) for x in split)
        if not muon or not split or any(x < 1 for x in split):
            raise ValueError(
                f"{name}: qkv_split needs a Muon matrix and positive row counts; "
                f"got {split=}, is_muon={muon}."
            )
    expert_dim = (
        _expert_dim(name, shape, stack, expert_value, expert_parallel) if is_expert else None
    )
    if is_expert and is_tied:
        raise ValueError(
            f"{name}: a tied embedding cannot be an expert parameter; drop it from expert=..."
        )
    return LeafRoute(
        path=name,
        shape=shape,
        dtype=dtype_name,
        stack_dims=stack,
        is_muon=bool(muon),
        is_shared_embedding=is_tied,
        is_expert=is_expert,
        qkv_split_shapes=split,
        expert_dim=expert_dim,
        expert_parallel=expert_parallel if is_expert else 1,
        lr_mult=_multiplier(name, "lr_mult", _apply_rule(rules.lr_mult, name, shape)),
        wd_mult=_multiplier(name, "wd_mult", _apply_rule(rules.wd_mult, name, shape)),
        grad_norm_group=_group_name(name, _apply_rule(rules.grad_norm_group, name, shape)),
    )


def _expert_dim(name: str, shape: tuple[int, ...], stack: int, value, expert_parallel: int) -> int:
    """The stacked axis that indexes an expert leaf's experts; checked to divide by ``ep``."""
    dim = stack - 1 if value is True else value
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < stack:
        raise ValueError(
            f"{name}: the expert axis must be one of the {stack} stacked axes; "
            f"got expert={value!r} for {shape=}. "
            "Stack expert leaves with stacked=... (e.g. 1 for [E, m, n], 2 for [L, E, m, n])."
        )
    if shape[dim] % expert_parallel:
        raise ValueError(
            f"{name}: {shape[dim]} experts (axis {dim} of {shape=}) do not divide by "
            f"expert_parallel={expert_parallel}."
        )
    return dim


def _multiplier(name: str, what: str, value) -> float:
    """A learning-rate or weight-decay multiplier: a finite real number >= 0 (default 1)."""
    if value is None:
        return 1.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name}: {what} must be a finite number >= 0; got {what}={value!r}.")
    return float(value)


def _group_name(name: str, value) -> str | None:
    """A gradient-norm group: ``None`` (the main norm) or a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"{name}: grad_norm_group must be a non-empty string or None; got {value!r}."
        )
    return value


def param_specs(routes: Iterable[LeafRoute]) -> tuple[ParamSpec, ...]:
    """All layout parameters of the routed leaves, in definition order."""
    return tuple(spec for route in routes for spec in route.specs())
