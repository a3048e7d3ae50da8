"""Routing: which parameters are Muon matrices, tied or expert, by pytree path (pure Python).

Leaves arrive as ``(key_path, shape, dtype)`` records (see
:func:`lwjax.optimizer.route_params`, which flattens any pytree: plain dicts,
flax nnx ``State``, flax linen ``params``). Names come from the key path,
joined with ``/``; a trailing ``value`` attribute (flax nnx variables) is
dropped, so an nnx kernel reads ``blocks/0/mlp/up/kernel``.

Default rule (Megatron's, extended to any rank): a parameter is a Muon matrix
iff its matrix view (:mod:`lwjax.dims`) is 2-D and it is not an embedding or
output head (:func:`lwjax.dims.head_or_embedding_reason`), a bias or a norm
scale. Everything else goes to AdamW. Each route says why
(:attr:`LeafRoute.why`; :func:`routing_table` lists them), and
:func:`route_leaves` warns where a default guess is likely wrong.

A leaf may *stack* independent parameters: a scan-over-layers kernel
``[L, m, n]`` declared with ``stacked={"blocks/*": 1}`` (or found by
:func:`lwjax.dims.detect_stacks`, or named ``layers`` in flax metadata) is
``L`` matrices, named ``"<path>[i]"``, each owned and orthogonalised on its
own. ``dims=`` puts the batch, input and output axes anywhere
(:class:`lwjax.dims.MatrixDims`); the optimizer then reads the leaf transposed
to ``(batch..., rows, columns)`` (:attr:`LeafRoute.axes_order`).

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
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from lwjax import dims as dims_lib
from lwjax.dims import MatrixDims
from lwjax.layout import FrozenDict, ParamSpec

T = TypeVar("T")
Rule = Mapping[str, T] | Callable[[str, tuple[int, ...]], T | None] | None


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


def is_array_like(leaf: Any) -> bool:
    """Whether a pytree leaf is an array or an abstract one (it has a ``shape`` and ``dtype``)."""
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def is_embedding_or_output(name: str) -> bool:
    """Whether a parameter name looks like an embedding table or output projection.

    Name components are split at ``/`` (pytree paths) and ``.`` (torch/Megatron
    names), so ``output_layer.weight`` and ``embed/embedding`` both match
    (:func:`lwjax.dims.head_or_embedding_reason` lists the names).
    """
    return dims_lib.head_or_embedding_reason(name) is not None


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
            if field.name == "model_dim":
                continue
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
      is_tied: A tied embedding (never Muon; not isolated in a bucket: Megatron
        isolates only the pipeline-stage copies of a tied embedding, and lwjax
        has no pipeline stages).
      is_expert: Expert-parallel parameters.
      qkv_split_shapes: For a fused QKV Muon matrix, the output rows of q, k
        and v per query group (e.g. ``(128, 64, 64)``); ``None`` otherwise.
      expert_dim: For expert leaves, the stacked axis that indexes experts
        (split over the expert-parallel mesh axis); ``None`` otherwise.
      expert_parallel: Expert-parallel size: each device holds
        ``shape[expert_dim] / expert_parallel`` experts.
      tensor_dims: Per tensor-parallel mesh axis (in the order the optimizer
        names them), the stored axis it splits, or ``None`` where the leaf is
        whole over it; ``()`` without tensor parallelism. A device holds a
        contiguous block of each split axis; two mesh axes may split one
        stored axis, the first the major one (:func:`with_tensor_parallel`).
      tensor_sizes: The sizes of those mesh axes.
      lr_mult: Learning-rate multiplier (Megatron's ``lr_mult``).
      wd_mult: Weight-decay multiplier (Megatron's ``wd_mult``).
      grad_norm_group: Name of a separate gradient-norm group, or ``None`` for
        the main norm.
      axes_order: The leaf's axes in the order the optimizer reads them
        (batch axes, matrix rows, matrix columns), or ``None`` when that is
        the stored order.
      view: The shape read in that order, the rows and columns of a Muon
        matrix each merged into one axis; ``None`` when it is ``shape``.
      why: Why the leaf routes as it does (shown by :func:`routing_table`).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    stack_dims: int = 0
    is_muon: bool = False
    is_tied: bool = False
    is_expert: bool = False
    qkv_split_shapes: tuple[int, ...] | None = None
    expert_dim: int | None = None
    expert_parallel: int = 1
    tensor_dims: tuple[int | None, ...] = ()
    tensor_sizes: tuple[int, ...] = ()
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    grad_norm_group: str | None = None
    axes_order: tuple[int, ...] | None = None
    view: tuple[int, ...] | None = None
    why: str = ""

    def __post_init__(self):
        if self.is_expert and self.expert_dim is None and self.stack_dims:
            object.__setattr__(self, "expert_dim", self.stack_dims - 1)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of each (device-local) stacked parameter, in the view's order.

        A Muon matrix's ``[rows, cols]``; with tensor parallelism, the block
        one device holds (:attr:`full_param_shape` is the whole matrix).
        """
        return self._merged(self.local_shape)[self.stack_dims :]

    @property
    def full_param_shape(self) -> tuple[int, ...]:
        """Shape of each stacked parameter as the whole tensor-parallel group holds it."""
        return (self.view or self.shape)[self.stack_dims :]

    @property
    def tensor_split(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The tensor-parallel mesh axes (their positions) that split each axis of
        :attr:`param_shape`, ``(rows, cols)``, major first; a mesh axis that splits a
        stacked axis splits no matrix (each device then holds other matrices)."""
        spans, split = self._spans(), ([], [])
        order = []
        for axis, dim in enumerate(self.tensor_dims):
            if dim is None:
                continue
            position = dim if self.axes_order is None else self.axes_order.index(dim)
            view_axis = next(j for j, (a, b) in enumerate(spans) if a <= position < b)
            if view_axis >= self.stack_dims:
                order.append((position, axis, view_axis - self.stack_dims))
        for _, axis, side in sorted(order):
            split[side].append(axis)
        return tuple(split[0]), tuple(split[1])

    @property
    def tensor_whole(self) -> tuple[int, ...]:
        """The tensor-parallel mesh axes (positions) over which every device holds the same
        leaf: its statistics count on the first device of each only."""
        return tuple(axis for axis, dim in enumerate(self.tensor_dims) if dim is None)

    def _spans(self) -> list[tuple[int, int]]:
        """Per axis of the view, the range of transposed stored axes merged into it."""
        ordered = (
            self.shape if self.axes_order is None else tuple(self.shape[a] for a in self.axes_order)
        )
        if self.view is None:
            return [(a, a + 1) for a in range(len(ordered))]
        spans, start = [], 0
        for j, size in enumerate(self.view):
            end, product = start, 1
            last = j == len(self.view) - 1
            while end < len(ordered) and (end == start or product != size or last):
                product *= ordered[end]
                end += 1
            spans.append((start, end))
            start = end
        return spans

    def _merged(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` (stored order) transposed and merged into the view's axes."""
        ordered = shape if self.axes_order is None else tuple(shape[a] for a in self.axes_order)
        return tuple(math.prod(ordered[start:end]) for start, end in self._spans())

    @property
    def local_view(self) -> tuple[int, ...]:
        """The local leaf transposed to :attr:`axes_order` (its flat order in the buffers)."""
        shape = self.local_shape
        return shape if self.axes_order is None else tuple(shape[a] for a in self.axes_order)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The leaf's shape on one device: the expert axis divided by ``expert_parallel``, each
        tensor-parallel split by its mesh axis's size."""
        shape = list(self.shape)
        if self.expert_dim is not None:
            shape[self.expert_dim] //= self.expert_parallel
        for dim, size in zip(self.tensor_dims, self.tensor_sizes):
            if dim is not None:
                shape[dim] //= size
        return tuple(shape)

    @property
    def num_params(self) -> int:
        """How many parameters the leaf stacks on one device."""
        return math.prod(self.local_view[: self.stack_dims])

    def param_names(self) -> tuple[str, ...]:
        """Names of the (device-local) stacked parameters, in row-major stack order."""
        if self.stack_dims == 0:
            return (self.path,)
        names = []
        for flat in range(self.num_params):
            index, rest = [], flat
            for size in reversed(self.local_view[: self.stack_dims]):
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
                is_expert=self.is_expert,
            )
            for name in self.param_names()
        )


def route_leaves(
    leaves: Iterable[tuple[Any, ...]],
    rules: RoutingRules = RoutingRules(),
    *,
    expert_parallel: int = 1,
    matrix_convention: str = "in_out",
) -> tuple[LeafRoute, ...]:
    """Decide, per leaf, its name, matrix view, optimizer and parameter-group options.

    Warns (one warning per kind, naming the leaves) where a guess is likely
    wrong: a leaf of 3+ axes going to AdamW, and a bias, scale, embedding or
    head going to Muon.

    Args:
      leaves: ``(key_path, shape, dtype)`` or ``(key_path, shape, dtype,
        axis_names)`` per leaf in pytree flatten order; ``key_path`` is a jax
        key path, a tuple of strings/ints, or a name; ``axis_names`` are flax
        logical axis names (``None`` when the leaf has none).
      rules: The :class:`RoutingRules` overriding the defaults.
      expert_parallel: Expert-parallel size; every expert axis must divide by it.
      matrix_convention: ``"in_out"`` (rows are a matrix's inputs, as flax
        stores kernels) or ``"out_in"`` (torch, Megatron); orders the view of
        leaves whose axes are reordered and checks ``qkv_split``.

    Returns:
      One :class:`LeafRoute` per leaf, in input order.

    Raises:
      ValueError: duplicate names, non-floating dtypes, a Muon parameter whose
        view is not 2-D, a stack count out of range, an expert axis that is
        not stacked or does not divide by ``expert_parallel``, a ``qkv_split``
        that does not divide the output rows, or a bad multiplier or group name.

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
    if matrix_convention not in ("in_out", "out_in"):
        raise ValueError(
            "route_leaves: matrix_convention must be 'in_out' or 'out_in'; "
            f"got {matrix_convention!r}."
        )
    records, seen = [], set()
    for key_path, shape, dtype, *names in leaves:
        name = key_path if isinstance(key_path, str) else path_name(key_path)
        if name in seen:
            raise ValueError(f"{name}: two leaves share this name; leaf names must be unique.")
        seen.add(name)
        axis_names = tuple(names[0]) if names and names[0] is not None else None
        records.append((name, tuple(int(d) for d in shape), dtype, axis_names))
    shapes = [(name, shape) for name, shape, _, _ in records]
    context = _Context(
        rules,
        expert_parallel,
        matrix_convention,
        rules.model_dim if rules.model_dim is not None else dims_lib.infer_model_dim(shapes),
        dims_lib.detect_stacks(shapes),
    )
    routes = tuple(
        _route_leaf(name, shape, str(getattr(dtype, "name", dtype)), axis_names, context)
        for name, shape, dtype, axis_names in records
    )
    _warn_doubtful(routes)
    return routes


@dataclasses.dataclass(frozen=True)
class _Context:
    """What routing one leaf needs from the whole tree."""

    rules: RoutingRules
    expert_parallel: int
    matrix_convention: str
    model_dim: int | None
    stacks: Mapping[str, int]


def _route_leaf(
    name: str,
    shape: tuple[int, ...],
    dtype_name: str,
    axis_names: tuple[str | None, ...] | None,
    context: _Context,
) -> LeafRoute:
    """Apply the rules (else the defaults) to one leaf."""
    rules = context.rules
    if not (dtype_name.startswith("float") or dtype_name.startswith("bfloat")):
        raise ValueError(
            f"{name}: parameters must be floating point; got dtype={dtype_name}. "
            "Keep integer state out of the parameter tree."
        )
    expert_value = _apply_rule(rules.expert, name, shape)
    is_expert = expert_value is not None and expert_value is not False
    is_tied = bool(_apply_rule(rules.tied, name, shape))
    stack, view_dims, why, not_matrix = _view_dims(name, shape, axis_names, is_expert, context)
    order = view = None
    if view_dims is not None:
        order, view = dims_lib.view_shape(shape, *view_dims, context.matrix_convention)
    param_shape = (view or shape)[stack:]
    muon = _apply_rule(rules.is_muon, name, param_shape)
    if muon is not None:
        why = f"is_muon rule; {why}" if why else "is_muon rule"
    else:
        not_muon = (
            ("tied embedding" if is_tied else None)
            or not_matrix
            or dims_lib.head_or_embedding_reason(name)
            or ("bias or scale" if dims_lib.is_bias_or_scale(name) else None)
            or (None if len(param_shape) == 2 else why or f"{len(param_shape)}-D")
        )
        muon = not_muon is None
        why = not_muon if not_muon else (why or "2-D")
    if muon and len(param_shape) != 2:
        raise ValueError(
            f"{name}: a Muon parameter must be a 2-D matrix; got {param_shape=} after "
            f"{stack} stacked axes. Declare its axes with dims=MatrixDims(...) or stacked=..., "
            "or route it to AdamW with is_muon=..."
        )
    if muon and is_tied:
        raise ValueError(f"{name}: a tied embedding is never a Muon matrix; route it to AdamW.")
    if not muon and order is not None:  # elementwise updates need no view; keep leading stacks
        stack = stack if order[:stack] == tuple(range(stack)) else 0
        order = view = None
    if order == tuple(range(len(shape))):
        order = None
    if view == shape:
        view = None
    split = _qkv_split(name, param_shape, bool(muon), context.matrix_convention, rules)
    expert_dim = (
        _expert_dim(name, shape, stack, expert_value, context.expert_parallel)
        if is_expert
        else None
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
        is_tied=is_tied,
        is_expert=is_expert,
        qkv_split_shapes=split,
        expert_dim=expert_dim,
        expert_parallel=context.expert_parallel if is_expert else 1,
        lr_mult=_multiplier(name, "lr_mult", _apply_rule(rules.lr_mult, name, shape)),
        wd_mult=_multiplier(name, "wd_mult", _apply_rule(rules.wd_mult, name, shape)),
        grad_norm_group=_group_name(name, _apply_rule(rules.grad_norm_group, name, shape)),
        axes_order=order,
        view=view,
        why=why,
    )


def _view_dims(name, shape, axis_names, is_expert, context: _Context):
    """``(stack, (batch, reduction, output) or None, why, not_matrix)`` for one leaf.

    Precedence: a ``dims`` rule, a ``stacked`` rule (or an expert leaf), flax
    axis names, a detected scanned stack, then the shape alone. ``not_matrix``
    is the reason the axis names give for a leaf that is no matrix (a
    ``vocab`` axis), else ``None``.
    """
    rules = context.rules
    dims = _apply_rule(rules.dims, name, shape)
    if dims is not None:
        if not isinstance(dims, MatrixDims):
            raise TypeError(f"{name}: a dims rule must give a MatrixDims; got {dims!r}.")
        if is_expert:
            raise ValueError(
                f"{name}: dims=... cannot be combined with expert=...; put the expert axis "
                "first and use stacked=..."
            )
        batch, reduction, output = dims.resolve(shape, name)
        return len(batch), (batch, reduction, output), "dims rule", None
    stack = _apply_rule(rules.stacked, name, shape)
    why = f"stacked={stack}" if stack else ""
    if stack is None and is_expert:
        stack, why = 1, "expert"
    if stack is None and axis_names is not None:
        decided, found, names_why = dims_lib.dims_from_axis_names(axis_names, shape, name)
        if decided:
            if found is None:  # no matrix; named batch axes in front still stack (no decay)
                lead = 0
                while lead < len(shape) - 1 and dims_lib.is_batch_axis_name(axis_names[lead]):
                    lead += 1
                return lead, None, names_why, names_why
            return len(found[0]), found, names_why, None
    if stack is None and name in context.stacks:
        stack = context.stacks[name]
        why = f"scanned stack of {shape[:stack]} (a stacked bias or scale in its module)"
    if not is_expert and len(shape) - (stack or 0) >= 3 and dims_lib.is_expert_path(name):
        stack = (stack or 0) + 1  # one matrix per expert, not all experts in one
        why = "; ".join(w for w in (why, f"experts on axis {stack - 1} (by name)") if w)
    stack = 0 if stack is None else stack
    if not 0 <= stack < max(len(shape), 1):
        raise ValueError(f"{name}: stacked={stack} leading axes leaves no parameter; got {shape=}.")
    if len(shape) - stack < 3 or is_expert:
        return stack, None, why, None
    batch = tuple(range(stack))
    found, einsum_why = dims_lib.dims_from_model_dim(shape, batch, context.model_dim, name)
    return stack, found, "; ".join(w for w in (why, einsum_why) if w), None


def _qkv_split(name, param_shape, muon: bool, convention: str, rules: RoutingRules):
    """The checked ``qkv_split`` of a leaf: positive rows that divide its output rows."""
    split = _apply_rule(rules.qkv_split, name, param_shape)
    if split is None:
        return None
    split = tuple(int(x) for x in split)
    if not muon or not split or any(x < 1 for x in split):
        raise ValueError(
            f"{name}: qkv_split needs a Muon matrix and positive row counts; "
            f"got {split=}, is_muon={muon}."
        )
    rows = param_shape[1] if convention == "in_out" else param_shape[0]
    if rows % sum(split):
        raise ValueError(
            f"{name}: qkv_split={split} ({sum(split)} rows per query group) does not divide the "
            f"{rows} output rows of {param_shape} under matrix_convention={convention!r} "
            f"(outputs are the {'columns' if convention == 'in_out' else 'rows'})."
        )
    return split


def _warn_doubtful(routes: Sequence[LeafRoute]) -> None:
    """One warning per kind of likely-wrong route, naming the leaves."""
    guessed = [r for r in routes if not r.why.startswith("is_muon rule")]
    kinds = {
        "leaves of 3+ axes go to AdamW (give their matrix axes with dims=MatrixDims(...), "
        "or an is_muon rule to confirm)": [
            r for r in guessed if not r.is_muon and len(r.shape) >= 3
        ],
        "leaves of 3+ axes are split at the model dimension by position only, no name telling "
        "which side it is on (check their view, or give dims=MatrixDims(...))": [
            r for r in guessed if r.is_muon and "(by position)" in r.why and r.view is not None
        ],
        "biases or scales go to Muon": [
            r for r in routes if r.is_muon and dims_lib.is_bias_or_scale(r.path)
        ],
        "embedding- or head-like names go to Muon": [
            r for r in routes if r.is_muon and dims_lib.head_or_embedding_reason(r.path)
        ],
    }
    for what, found in kinds.items():
        if found:
            listed = ", ".join(f"{r.path} {list(r.shape)} ({r.why})" for r in found[:6])
            more = f" and {len(found) - 6} more" if len(found) > 6 else ""
            warnings.warn(f"lwjax routing: {what}: {listed}{more}.", stacklevel=3)


def routing_table(routes: Iterable[LeafRoute]) -> list[tuple[str, str, str, str, str]]:
    """Per leaf: path, shape, matrix view, optimizer and why, as strings.

    The view is the batch of matrices Muon sees, e.g. ``8 × [64, 128]``.
    """
    rows = []
    for r in routes:
        batch = (r.view or r.shape)[: r.stack_dims]
        count = f"{math.prod(batch)} × " if batch else ""
        view = f"{count}{list(r.full_param_shape)}" if r.is_muon else "-"
        if r.is_muon:
            for side, axes in zip(("rows", "cols"), r.tensor_split):
                if axes:
                    view += f" ({side} / {math.prod(r.tensor_sizes[a] for a in axes)})"
        optimizer = "Muon" if r.is_muon else ("AdamW (tied)" if r.is_tied else "AdamW")
        rows.append((r.path, str(list(r.shape)), view, optimizer, r.why))
    return rows


def format_routing_table(routes: Iterable[LeafRoute]) -> str:
    """:func:`routing_table` as aligned plain text with a header."""
    rows = [("path", "shape", "matrix view", "optimizer", "why"), *routing_table(routes)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows
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


def with_tensor_parallel(
    routes: Sequence[LeafRoute],
    tensor_dims: Sequence[Sequence[int | None]],
    tensor_sizes: Sequence[int],
    *,
    matrix_convention: str = "in_out",
) -> tuple[LeafRoute, ...]:
    """``routes`` with each leaf's tensor-parallel axes set, checked for what the step needs.

    Args:
      routes: The routes of :func:`route_leaves`, global shapes.
      tensor_dims: Per route, per tensor-parallel mesh axis, the stored axis it
        splits (read from the leaf's sharding), or ``None``.
      tensor_sizes: The tensor-parallel mesh axes' sizes.
      matrix_convention: As for :func:`route_leaves` (which matrix axis is the output).

    Raises:
      ValueError: naming the leaf, for an axis out of range, one that does not
        divide by its mesh axes' sizes, the expert axis, or a fused QKV matrix
        whose local rows are not whole query groups.
    """
    if len(tensor_dims) != len(routes):
        raise ValueError(
            f"with_tensor_parallel: {len(tensor_dims)} tensor dims for {len(routes)} routes."
        )
    sizes = tuple(tensor_sizes)
    out = []
    for route, dims in zip(routes, tensor_dims):
        dims = tuple(dims)
        name, shape = route.path, route.shape
        if len(dims) != len(sizes):
            raise ValueError(f"{name}: {len(dims)} tensor dims for {len(sizes)} mesh axes.")
        for dim in dims:
            if dim is None:
                continue
            if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(shape):
                raise ValueError(
                    f"{name}: tensor-parallel axis {dim!r} is not an axis of {shape=}."
                )
            if dim == route.expert_dim:
                raise ValueError(
                    f"{name}: axis {dim} is the expert axis; it cannot also be split over a "
                    "tensor-parallel axis."
                )
            ways = math.prod(size for d, size in zip(dims, sizes) if d == dim)
            if shape[dim] % ways:
                raise ValueError(
                    f"{name}: axis {dim} of {shape=} does not divide into the {ways} blocks "
                    "its tensor-parallel mesh axes split it into."
                )
        split = dataclasses.replace(route, tensor_dims=dims, tensor_sizes=sizes)
        if route.qkv_split_shapes is not None:
            rows = split.param_shape[1 if matrix_convention == "in_out" else 0]
            if rows % sum(route.qkv_split_shapes):
                raise ValueError(
                    f"{name}: split over tensor parallelism on axes {dims}, a device's block "
                    f"{list(split.param_shape)} does not hold whole query groups of "
                    f"qkv_split={route.qkv_split_shapes} (split a fused QKV matrix by its "
                    "query groups, on the output axis)."
                )
        out.append(split)
    return tuple(out)


def is_finite_nonnegative(value) -> bool:
    """A real number (not a bool), finite and >= 0."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _multiplier(name: str, what: str, value) -> float:
    """A learning-rate or weight-decay multiplier: a finite real number >= 0 (default 1)."""
    if value is None:
        return 1.0
    if not is_finite_nonnegative(value):
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
    than one per matrix. (1b workload at dp 2 on H200: 93.3 ms per optimizer
    step with its 16 layers' matrices in layer order, 57.7 ms stacked.)
    Megatron walks its parameters layer by layer; only the order differs, not
    what the layout guarantees.
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
