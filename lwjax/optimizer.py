"""Megatron-Core's layer-wise distributed Muon for a parameter pytree on a mesh.

:func:`layerwise_muon` builds everything static once: it routes the leaves
(:mod:`lwjax.routing`), lays them out over the data-parallel ranks
(:mod:`lwjax.policies`), turns the layout into per-rank tables
(:mod:`lwjax.plan`) and orders the bucket updates (:mod:`lwjax.schedule`). The
result, a frozen :class:`~lwjax.plan.StepPlan`, is closed over by pure
functions: ``init`` builds the sharded state, ``local_update`` is the step of
:mod:`lwjax.step` (or :mod:`lwjax.pipelined`), called inside ``shard_map``,
and ``init``/``update`` are also optax's, on global arrays (:mod:`lwjax.transform`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import pipelined, transform
from lwjax import step as step_lib
from lwjax.groups import MAX_PADDING, choose_groups
from lwjax.layout import LayoutConfig
from lwjax.muon import MuonConfig
from lwjax.plan import MeshAxes, ParamPlan, StepPlan, as_axis_tuple, make_plan
from lwjax.policies import compute_full_param_layout
from lwjax.routing import (
    LeafRoute,
    RoutingRules,
    format_routing_table,
    is_array_like,
    is_finite_nonnegative,
    param_specs,
    path_name,
    route_leaves,
    with_tensor_parallel,
)
from lwjax.schedule import schedule_buckets
from lwjax.shards import PARAM_SYNCS
from lwjax.step import LayerwiseState, speculates

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]
ParamSync = Literal["all_gather", "broadcast"]
MatrixConvention = Literal["in_out", "out_in"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Options of :func:`layerwise_muon` that are not learning rates, transforms, layout or routing.

    Attributes:
      weight_decay: Decoupled weight decay for Muon matrices and for
        elementwise parameters with 2+ dims (Megatron's ``--weight-decay``);
        biases, norms and other 1-D parameters get none. A float, or a
        schedule ``count -> value`` evaluated at the state's count like the
        learning rate (Megatron's ``--weight-decay-incr-style``; see
        :mod:`lwjax.megatron.schedules`). A float is a constant of the
        compiled step; a step whose scheduled value is not a finite number
        >= 0 is skipped, like one with a non-finite learning rate.
      clip_grad: Clip to this global L2 norm (``--clip-grad``); ``0`` or ``None`` disables.
      grad_reduce_in_fp32: Reduce gradients in fp32 (Megatron's
        ``--accumulate-allreduce-grads-in-fp32``); else in the parameter dtype.
      master_dtype: Dtype of master weights and optimizer state.
      matrix_convention: How 2-D parameters are stored: ``"in_out"`` (flax
        kernels, ``x @ W``) or ``"out_in"`` (Megatron/torch weights). Muon's
        scale modes and QKV split read rows as the output dimension.
      param_sync: How updated parameters reach every device: ``"all_gather"``
        (one tiled all-gather per bucket) or ``"broadcast"``, Megatron's
        reference path (each owner's shard broadcast; bitwise equal).
      pipeline_muon: Start each layer-wise bucket's Muon direction (momentum,
        Newton–Schulz) as soon as its gradient shard arrives
        (:mod:`lwjax.pipelined`). Exact without clipping. With clipping it
        speculates that no Muon matrix's clip coefficient is below 1, and only
        after a step that needed no Muon clip (``LayerwiseState.speculate``;
        otherwise the step is the serial one): it computes the directions
        again where the speculation fails (``metrics["recomputed"]``), so a
        step that clips right after one that did not runs momentum and
        Newton–Schulz twice. ``make_train_step`` makes the choice on the host
        (:mod:`lwjax.speculation`), from the step before last: there the first
        two steps that clip after steps that did not run it twice. It pays off
        for the optimizer step alone under XLA's profile-guided scheduling;
        see ``docs/configuration.md`` for what was measured.
    """

    weight_decay: ScalarOrSchedule = 0.01
    clip_grad: float | None = 1.0
    grad_reduce_in_fp32: bool = True
    master_dtype: str = "float32"
    matrix_convention: MatrixConvention = "in_out"
    param_sync: ParamSync = "all_gather"
    pipeline_muon: bool = False

    def __post_init__(self):
        if self.param_sync not in PARAM_SYNCS:
            raise ValueError(
                f"OptimizerConfig.param_sync must be one of {PARAM_SYNCS}; got {self.param_sync!r}."
            )
        if self.matrix_convention not in ("in_out", "out_in"):
            raise ValueError(
                "OptimizerConfig.matrix_convention must be 'in_out' or 'out_in'; "
                f"got {self.matrix_convention!r}."
            )
        if self.clip_grad is not None and not is_finite_nonnegative(self.clip_grad):
            raise ValueError(
                f"OptimizerConfig.clip_grad must be a finite number >= 0 or None; "
                f"got {self.clip_grad!r}."
            )
        if not callable(self.weight_decay) and not is_finite_nonnegative(self.weight_decay):
            raise ValueError(
                f"OptimizerConfig.weight_decay must be a finite number >= 0 or a schedule "
                f"count -> value; got {self.weight_decay!r}."
            )
        try:
            floating = jnp.issubdtype(jnp.dtype(self.master_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(
                "OptimizerConfig.master_dtype must be a floating dtype such as 'float32'; "
                f"got {self.master_dtype!r}."
            )


class LayerwiseOptimizer(optax.GradientTransformationExtraArgs):
    """A layer-wise distributed Muon optimizer: an optax transformation plus its static plan.

    ``init`` and ``update`` are optax's and take global arrays under
    ``jax.jit``: ``init(params) -> state`` and ``update(grads, state, params)
    -> (updates, state)``, so ``optax.apply_updates``, ``optax.chain`` and
    ``flax.nnx.Optimizer`` work unchanged. Inside, ``update`` runs
    :attr:`local_update` in ``shard_map`` on the gradients as they arrive
    (already reduced over the batch by the caller's ``jax.grad``; see
    ``docs/optax.md``). :func:`lwjax.make_train_step` instead computes the
    gradients per device and reduce-scatters them.

    Attributes:
      init: ``params -> LayerwiseState`` (jitted; state sharded over the
        data-parallel axes). ``params`` may be any pytree whose array leaves
        have the paths, shapes and dtypes the optimizer was built for.
      update: ``(grads, state, params) -> (updates, state)`` on global arrays.
        The updates are at least fp32, and ``optax.apply_updates`` returns
        exactly the masters cast to the parameter dtype (a master that
        ``p + u`` does not round back to is set to that sum: :mod:`lwjax.transform`).
      plan: The :class:`~lwjax.plan.StepPlan`: routes, layout, per-rank
        tables, bucket schedule and options.
      mesh: The device mesh.
      axis: Name of the data-parallel mesh axis.
      local_update: ``(grads, state, params, *, gather=True) -> (params, state,
        metrics)`` (and ``speculate`` with ``pipeline_muon``:
        :func:`lwjax.pipelined.update_pipelined`); call it inside ``shard_map``
        over :attr:`data_axes` with this device's local gradients and
        parameters (expert leaves local, see ``param_specs``).
        With ``gather=False`` it returns ``None`` for the parameters and leaves
        their gather to the next step's :attr:`local_params`.
      local_params: ``state -> params``, inside ``shard_map`` as
        :attr:`local_update`: the parameters the state's masters hold, every
        bucket cast to the parameter dtype and all-gathered.
      gather_params: ``state -> params`` on global arrays (jitted): the
        parameter pytree of a state, e.g. for evaluation or a checkpoint when
        the training step keeps only the state
        (``make_train_step(..., overlap_param_gather=True)``).
      state_specs: ``PartitionSpec`` pytree of the state, for ``shard_map``.
      expert_axis: Name of the expert-parallel mesh axis, or ``None``.
      tensor_axis: Name of the tensor-parallel mesh axis (or a tuple of them), or ``None``.
      param_specs: ``PartitionSpec`` pytree (prefix) of the parameters:
        ``P()`` for dense leaves, the expert axis split over ``expert_axis``
        for expert leaves, the tensor-parallel axis over ``tensor_axis`` for
        split leaves; just ``P()`` when nothing is split.
    """

    plan: StepPlan
    mesh: Mesh
    axis: str
    local_update: Callable
    local_params: Callable
    gather_params: Callable
    state_specs: LayerwiseState
    expert_axis: str | None
    tensor_axis: str | tuple[str, ...] | None
    param_specs: Any

    def __new__(
        cls,
        init: Callable,
        update: Callable,
        *,
        plan: StepPlan,
        mesh: Mesh,
        axis: str,
        local_update: Callable,
        local_params: Callable,
        gather_params: Callable,
        state_specs: LayerwiseState,
        expert_axis: str | None = None,
        tensor_axis: str | tuple[str, ...] | None = None,
        param_specs: Any = None,
    ):
        self = super().__new__(cls, init, update)
        self.plan, self.mesh, self.axis = plan, mesh, axis
        self.local_update, self.state_specs = local_update, state_specs
        self.local_params, self.gather_params = local_params, gather_params
        self.expert_axis, self.tensor_axis = expert_axis, tensor_axis
        self.param_specs = param_specs
        return self

    def __copy__(self) -> LayerwiseOptimizer:
        return self  # immutable: a copy is the same optimizer

    def __deepcopy__(self, memo) -> LayerwiseOptimizer:
        return self

    def _replace(self, **changes) -> LayerwiseOptimizer:
        """A copy with fields or attributes replaced, like ``NamedTuple._replace``."""
        unknown = set(changes) - set(self._fields) - set(vars(self))
        if unknown:
            raise ValueError(
                f"LayerwiseOptimizer._replace: no field or attribute {sorted(unknown)}."
            )
        values = {**dict(zip(self._fields, self)), **vars(self), **changes}
        return type(self)(**values)

    def routing_table(self) -> str:
        """Per leaf: path, shape, matrix view, Muon or AdamW, and why (aligned text)."""
        return format_routing_table(self.plan.routes)

    @property
    def mesh_axes(self) -> MeshAxes:
        """The :class:`~lwjax.plan.MeshAxes` of this optimizer."""
        return self.plan.axes

    @property
    def data_axes(self) -> str | tuple[str, str]:
        """The data-parallel axes the batch is split over: ``axis``, with ``replica_axis``
        before it and ``expert_axis`` after it when given."""
        return self.plan.axes.data

    def leaf_shardings(self) -> dict[str, NamedSharding]:
        """Per routed leaf path, where its global array lives: whole on every device, or
        split over ``expert_axis`` / ``tensor_axis`` as :attr:`param_specs` says."""
        return {
            r.path: NamedSharding(self.mesh, _param_spec(r, self.expert_axis, self.plan.axes.tp))
            for r in self.plan.routes
        }

    @property
    def num_data(self) -> int:
        """Number of data-parallel devices (``replica * dp * ep``)."""
        return self.plan.axes.num_data


def _static_optimizer(optimizer: LayerwiseOptimizer):
    return (), optimizer


# A pytree without leaves (it holds functions and a plan, no arrays): jax.tree.map, equinox
# modules and nnx objects that hold one keep it as it is.
jax.tree_util.register_pytree_node(
    LayerwiseOptimizer, _static_optimizer, lambda optimizer, _: optimizer
)


def layerwise_muon(
    params,
    mesh: Mesh,
    *,
    axis: str = "dp",
    expert_axis: str | None = None,
    replica_axis: str | None = None,
    tensor_axis: str | tuple[str, ...] | None = None,
    learning_rate: ScalarOrSchedule = 0.02,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon: MuonConfig = MuonConfig(),
    elementwise: optax.GradientTransformation | None = None,
    config: OptimizerConfig = OptimizerConfig(),
    layout: LayoutConfig = LayoutConfig(),
    routing: RoutingRules = RoutingRules(),
) -> LayerwiseOptimizer:
    r"""Build Megatron's layer-wise distributed Muon for a parameter pytree on a mesh.

    Muon matrices (by default: 2-D, not embedding or output head) are updated
    with Muon (:func:`lwjax.muon.muon_update`); every other parameter with the
    ``elementwise`` direction plus decoupled weight decay:

    .. math::

       p \leftarrow p - \eta_a m_\eta (u + \lambda m_\lambda\, \mathbb{1}_{\text{decay}}\, p),
       \qquad u = \text{elementwise}(g)

    with per-parameter multipliers :math:`m_\eta` (``lr_mult``) and
    :math:`m_\lambda` (``wd_mult``); Muon matrices use the same multipliers.

    Expert parallelism: with ``expert_axis``, every device of the mesh axes
    ``(axis, expert_axis)`` is data-parallel for dense parameters (the batch is
    split over both), and expert leaves (``RoutingRules.expert``) are split over
    ``expert_axis`` on their expert axis. Dense buffers are sharded over all
    ``dp * ep`` devices, expert buffers over ``axis`` (Megatron's expert
    data-parallel group). ``params`` are the global parameters; the loss
    function sees the local experts and must exchange tokens over
    ``expert_axis`` itself.

    Sharding groups (Megatron's ``num_optimizer_shards``): with
    ``replica_axis``, the layout spans the ``(axis, expert_axis)`` devices of
    one group and each of the ``replica_axis`` groups holds a copy of the
    optimizer state; the batch is split over all three axes, gradients are
    reduce-scattered within a group and summed across groups
    (:mod:`lwjax.groups` chooses the group size).

    Tensor parallelism: with ``tensor_axis``, a leaf whose sharding
    (``NamedSharding`` of an array or ``jax.ShapeDtypeStruct``) names that
    axis on one of its dimensions is split over it, each device holding a
    contiguous block (column- or row-parallel kernels, vocabulary-parallel
    embeddings); other leaves are whole on every such device. The batch is
    not split over ``tensor_axis``. Every tensor-parallel device lays out
    its own blocks over the data-parallel axes (the same layout on each) and
    keeps its own optimizer state. A Muon matrix split over the axis is
    orthogonalised as ``muon.tp_mode`` says (Megatron's ``--muon-tp-mode``);
    a leaf held whole by every device counts once in the gradient norm. The
    same option runs fully sharded (FSDP) parameters: name an axis that splits
    the leaves and the batch (``docs/scaling.md``). A tuple names several such
    axes (e.g. ``("fsdp", "tp")``): a leaf may be split over any of them, on
    one stored axis each or on one together (major first, in this order).

    Args:
      params: The (global) parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
      mesh: A mesh with a data-parallel axis named ``axis``.
      axis: The data-parallel axis.
      expert_axis: The expert-parallel axis, or ``None`` (expert leaves, if
        any, then live in expert buffers sharded over ``axis``).
      replica_axis: The axis across sharding groups, or ``None`` (one group).
      tensor_axis: The tensor-parallel axis (or a tuple of them), or ``None``;
        which leaves are split over it is read from their shardings.
      learning_rate: Muon learning rate, or a schedule of the step count.
      adam_learning_rate: Learning rate of the elementwise parameters;
        defaults to ``learning_rate`` (Megatron uses one schedule for both).
      muon: Muon settings (:class:`lwjax.muon.MuonConfig`).
      elementwise: Elementwise optax transform giving the update direction of
        non-Muon parameters, without learning rate or weight decay; defaults to
        ``optax.scale_by_adam(0.9, 0.999, 1e-8)`` (Megatron's Adam defaults).
      config: Weight decay, clipping and dtypes (:class:`OptimizerConfig`).
      layout: Layout policy and bucket size (:class:`lwjax.layout.LayoutConfig`).
      routing: Which leaves are Muon matrices, stacked, tied, expert, QKV-split,
        and their multipliers and norm groups (:class:`lwjax.routing.RoutingRules`).

    Returns:
      A :class:`LayerwiseOptimizer`.

    Raises:
      ValueError: ``axis``, ``expert_axis``, ``replica_axis`` or ``tensor_axis`` not in
        the mesh, a leaf sharded over another mesh axis, a learning rate
        that is not a finite number >= 0 (a schedule is checked at each step:
        a non-finite value skips the step), or a routing/layout rule broken.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh
      >>> params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
      >>> opt = layerwise_muon(params, Mesh(np.array(jax.devices()[:1]), ("dp",)))
      >>> [(r.path, r.is_muon) for r in opt.plan.routes]
      [('b', False), ('w', True)]
      >>> state = opt.init(params)
      >>> int(state.count)
      0
    """
    for name, value in (
        ("learning_rate", learning_rate),
        ("adam_learning_rate", adam_learning_rate),
    ):
        if value is not None and not callable(value) and not is_finite_nonnegative(value):
            raise ValueError(
                f"layerwise_muon: {name} must be a finite number >= 0 or a schedule; got {value!r}."
            )
    axes = _mesh_axes(mesh, axis, expert_axis, replica_axis, tensor_axis)
    layout = resolved_layout(layout, axes, muon)
    plan = plan_step(
        plan_params(
            params,
            axes,
            layout,
            routing,
            grad_reduce_in_fp32=config.grad_reduce_in_fp32,
            matrix_convention=config.matrix_convention,
            tensor_dims=None if tensor_axis is None else tensor_dims(params, axes),
        ),
        config,
        muon,
        elementwise,
        learning_rate,
        adam_learning_rate,
    )
    if muon.tp_mode == "distributed":
        for r in plan.routes:
            if r.is_muon and all(r.tensor_split):
                raise ValueError(
                    f"layerwise_muon: {r.path} is split over tensor-parallel axes on both its "
                    "rows and its columns; MuonConfig(tp_mode='distributed') needs one side "
                    "whole (use 'duplicated')."
                )
    param_specs = P()  # a prefix of the parameters: replicated, unless some leaves are split
    leaf_specs = [_param_spec(r, expert_axis, axes.tp) for r in plan.routes]
    if any(spec != P() for spec in leaf_specs):
        param_specs = jax.tree_util.tree_unflatten(plan.treedef, leaf_specs)
    state_specs = _state_specs(plan)
    local_update = pipelined.update_pipelined if config.pipeline_muon else step_lib.update
    init, update = transform.optax_functions(plan, mesh, leaf_specs, state_specs, local_update)
    local_params = functools.partial(step_lib.local_params, plan)
    gather_params = jax.jit(
        jax.shard_map(
            local_params, mesh=mesh, in_specs=(state_specs,), out_specs=param_specs, check_vma=False
        )
    )
    return LayerwiseOptimizer(
        init,
        update,
        plan=plan,
        mesh=mesh,
        axis=axis,
        local_update=functools.partial(local_update, plan),
        local_params=local_params,
        gather_params=gather_params,
        state_specs=state_specs,
        expert_axis=expert_axis,
        tensor_axis=tensor_axis,
        param_specs=param_specs,
    )


def route_params(
    params,
    rules: RoutingRules = RoutingRules(),
    *,
    expert_parallel: int = 1,
    matrix_convention: MatrixConvention = "in_out",
) -> tuple[LeafRoute, ...]:
    """:func:`lwjax.routing.route_leaves` of a pytree's array leaves, in flatten order.

    Leaves may be arrays or ``jax.ShapeDtypeStruct``; only paths, shapes and
    dtypes are read, and flax logical axis names where the tree carries them
    (boxed linen params from ``nn.with_logical_partitioning``, nnx variables
    from ``nnx.with_partitioning``). ``None`` leaves are not parameters; other
    leaves without a shape and dtype (Python numbers, strings, functions in
    an equinox module) are skipped with a warning naming their paths.
    """
    records, skipped = [], []
    for path, value, names in _unboxed_leaves(params):
        if is_array_like(value):
            records.append((path, tuple(value.shape), value.dtype, names))
        else:
            skipped.append(path_name(path))
    if skipped:
        warnings.warn(
            f"layerwise_muon: {len(skipped)} leaves are not arrays and are not optimized: "
            f"{', '.join(skipped[:8])}{', ...' if len(skipped) > 8 else ''}. Filter them out "
            "(e.g. eqx.partition(model, eqx.is_inexact_array)) to silence this.",
            stacklevel=3,
        )
    return route_leaves(
        records, rules, expert_parallel=expert_parallel, matrix_convention=matrix_convention
    )


def _unboxed_leaves(params) -> list[tuple[Any, Any, tuple[str | None, ...] | None]]:
    """``(key path, value, flax axis names or None)`` per leaf, boxed parameters unboxed."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: axis_names(x) is not None
    )
    out = []
    for path, leaf in flat:
        names = axis_names(leaf)
        out.append((path, getattr(leaf, "value", leaf) if names is not None else leaf, names))
    return out


def axis_names(leaf) -> tuple[str | None, ...] | None:
    """The flax logical axis names a boxed parameter carries, or ``None``.

    Reads ``names`` (linen ``nn.Partitioned`` / ``nn.LogicallyPartitioned``)
    or the ``out_sharding`` metadata of an nnx variable.
    """
    for attribute in ("names", "out_sharding"):
        names = getattr(leaf, attribute, None)
        if isinstance(names, (tuple, list)) and hasattr(leaf, "value"):
            return tuple(names)
    return None


# A bucket closes once it holds this many elements: below MAX_BUCKET_ELEMENTS (int32
# offsets) with any parameter smaller than it, and a bounded fp32 temporary per bucket. A
# slot group cut by a bucket's end is dealt out (and padded) in each bucket separately.
ALONE_BUCKET_SIZE = 2**30


def resolved_layout(layout: LayoutConfig, axes: MeshAxes, muon: MuonConfig) -> LayoutConfig:
    """``layout`` with ``bucket_size="auto"`` resolved where the mesh decides it.

    Buckets of :data:`ALONE_BUCKET_SIZE` elements (one bucket per buffer up
    to a billion elements per device) when the layout spans one device and
    ``"duplicated"`` Muon deals each slot group's matrices out over
    tensor-parallel devices: no data-parallel collective is left for buckets
    to overlap, and the deal needs many matrices of a shape in a bucket (8b
    shapes × 4 layers at tp 2 on 2 × H200: 68 ms against 97 ms with 40M-element
    buckets). Elsewhere ``"auto"`` stays Megatron's size: without tensor
    parallelism one bucket was slower there (129 against 115 ms).
    """
    alone = axes.group_size == 1 and axes.tp_size > 1 and muon.tp_mode == "duplicated"
    if layout.bucket_size == "auto" and alone:
        return dataclasses.replace(layout, bucket_size=ALONE_BUCKET_SIZE)
    return layout


def tensor_dims(params, axes: MeshAxes) -> list[tuple[int | None, ...]]:
    """Per array leaf (flatten order), per tensor-parallel axis of ``axes.tp``, the stored axis
    the leaf's sharding splits over it, or ``None``.

    Leaves without a ``NamedSharding`` (numpy arrays, abstract leaves given
    none) are whole on every tensor-parallel device.

    Raises:
      ValueError: naming the leaf, when its sharding splits it over a mesh axis
        other than the tensor-parallel and expert axes, over one of them on two
        axes, or over two of them on one axis in an order other than ``tp``'s.
    """
    known = {*axes.tp, axes.ep} - {None}
    leaves = []
    for path, value, _ in _unboxed_leaves(params):
        if not is_array_like(value):
            continue
        sharding = getattr(value, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        dims: list[int | None] = [None] * len(axes.tp)
        for dim, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            other = [n for n in names if n is not None and n not in known]
            if other:
                raise ValueError(
                    f"layerwise_muon: {path_name(path)} is sharded over mesh axis "
                    f"{other[0]!r} on axis {dim} ({spec}); parameters may be split only over "
                    f"tensor_axis={axes.tp!r} (and the expert axis). Replicate it over "
                    f"{other[0]!r}."
                )
            split = [n for n in names if n in axes.tp]
            if split != sorted(split, key=axes.tp.index):
                raise ValueError(
                    f"layerwise_muon: {path_name(path)} splits axis {dim} over {tuple(split)} "
                    f"({spec}); name them in tensor_axis's order {axes.tp}."
                )
            for name in split:
                a = axes.tp.index(name)
                if dims[a] is not None:
                    raise ValueError(
                        f"layerwise_muon: {path_name(path)} is split over {name!r} on axes "
                        f"{dims[a]} and {dim} ({spec}); split it on one axis."
                    )
                dims[a] = dim
        leaves.append(tuple(dims))
    if axes.tp_size > 1 and all(d is None for dims in leaves for d in dims):
        warnings.warn(
            f"layerwise_muon: tensor_axis={axes.tp!r} is given but no parameter's sharding "
            "splits over it; every leaf is held whole by each tensor-parallel device. Pass "
            "parameters (or jax.ShapeDtypeStruct) with their NamedShardings.",
            stacklevel=3,
        )
    return leaves


def plan_params(
    params,
    axes: MeshAxes,
    layout: LayoutConfig = LayoutConfig(),
    routing: RoutingRules = RoutingRules(),
    *,
    grad_reduce_in_fp32: bool = True,
    matrix_convention: MatrixConvention = "in_out",
    tensor_dims: list[tuple[int | None, ...]] | None = None,
) -> ParamPlan:
    """Route a parameter pytree, lay it out over ``axes`` and build its per-rank tables.

    Dense buffers are laid out over the ``axes.group_size`` devices of a
    sharding group, expert buffers over ``axes.dp_size`` (expert leaves from
    their local shapes, ``E / ep`` experts each; leaves split over
    ``axes.tp`` on the ``tensor_dims`` axes from their blocks).
    ``bucket_size="auto"`` resolves with all ``axes.num_data`` data-parallel
    devices, as Megatron's DDP sizes buckets by the data-parallel world.
    """
    routes = route_params(
        params, routing, expert_parallel=axes.ep_size, matrix_convention=matrix_convention
    )
    if tensor_dims is not None:
        routes = with_tensor_parallel(
            routes, tensor_dims, axes.tp_sizes, matrix_convention=matrix_convention
        )
    full = compute_full_param_layout(
        param_specs(routes),
        axes.group_size,
        dataclasses.replace(layout, bucket_size=layout.bucket_size_for(axes.num_data)),
        expert_dp=axes.dp_size,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )
    arrays = jax.tree.map(lambda x: x if is_array_like(x) else None, params)
    return make_plan(jax.tree_util.tree_structure(arrays), routes, full, axes)


def plan_step(
    plan: ParamPlan,
    config: OptimizerConfig,
    muon: MuonConfig,
    elementwise: optax.GradientTransformation | None,
    learning_rate: ScalarOrSchedule,
    adam_learning_rate: ScalarOrSchedule | None,
) -> StepPlan:
    """``plan`` with the step's bucket schedule, options and per-leaf values."""
    transpose = config.matrix_convention == "in_out" and (
        muon.scale_mode != "spectral" or any(r.qkv_split_shapes for r in plan.routes)
    )
    norm_groups = (None, *plan.grad_norm_groups)  # norm group 0 is the main norm
    return StepPlan(
        **{f.name: getattr(plan, f.name) for f in dataclasses.fields(ParamPlan)},
        schedule=schedule_buckets(
            plan, num_ns_steps=muon.num_ns_steps, transpose=transpose, split_qkv=muon.split_qkv
        ),
        config=config,
        muon=muon,
        elementwise=elementwise
        if elementwise is not None
        else optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
        learning_rate=_schedule(learning_rate),
        adam_learning_rate=_schedule(
            adam_learning_rate if adam_learning_rate is not None else learning_rate
        ),
        master_dtype=jnp.dtype(config.master_dtype),
        transpose=transpose,
        norm_groups=norm_groups,
        group_of=tuple(norm_groups.index(r.grad_norm_group) for r in plan.routes),
        lr_mult_of=tuple(r.lr_mult for r in plan.routes),
        decay_of=_decay_of(plan.routes, config.weight_decay),
    )


def _decay_of(routes, weight_decay: ScalarOrSchedule) -> tuple[float, ...]:
    """Per leaf ``weight_decay * wd_mult`` (a float), or ``wd_mult`` for a schedule; 0 if 1-D."""
    scale = 1.0 if callable(weight_decay) else weight_decay
    return tuple(scale * r.wd_mult if len(r.param_shape) >= 2 else 0.0 for r in routes)


def _schedule(value: ScalarOrSchedule) -> Callable[[jax.Array], jax.Array]:
    return value if callable(value) else (lambda count: jnp.asarray(value, jnp.float32))


def _mesh_axes(
    mesh: Mesh,
    axis: str,
    expert_axis: str | None,
    replica_axis: str | None = None,
    tensor_axis: str | tuple[str, ...] | None = None,
) -> MeshAxes:
    """Check the axis names against the mesh and return their :class:`MeshAxes`."""
    tensor_axes = () if tensor_axis is None else as_axis_tuple(tensor_axis)
    named = (
        ("axis", axis, "data-parallel"),
        ("expert_axis", expert_axis, "expert-parallel"),
        ("replica_axis", replica_axis, "sharding-group"),
        *(("tensor_axis", name, "tensor-parallel") for name in tensor_axes),
    )
    for _, name, what in named:
        if name is not None and name not in mesh.axis_names:
            raise ValueError(
                f"layerwise_muon: mesh has axes {mesh.axis_names}; no {what} axis {name!r}."
            )
    given = [(arg, name) for arg, name, _ in named if name is not None]
    if len({name for _, name in given}) < len(given):
        raise ValueError(
            "layerwise_muon: axis, expert_axis, replica_axis and tensor_axis must differ; got "
            + ", ".join(f"{arg}={name!r}" for arg, name in given)
            + "."
        )
    return MeshAxes(
        axis,
        expert_axis,
        mesh.shape[axis],
        1 if expert_axis is None else mesh.shape[expert_axis],
        replica_axis,
        1 if replica_axis is None else mesh.shape[replica_axis],
        tensor_axes,
        tuple(mesh.shape[name] for name in tensor_axes),
    )


def group_mesh(mesh: Mesh, shards: int, *, axis: str = "dp", replica_axis: str = "replica") -> Mesh:
    """``mesh`` with its ``axis`` split into ``(replica_axis, axis)``: sharding groups of
    ``shards`` consecutive devices (for :func:`layerwise_muon`'s ``replica_axis``).

    Consecutive devices along ``axis`` share a group, so on a mesh laid out host by
    host the reduce-scatter and all-gather stay within a host or NVLink domain and
    only the all-reduce of each shard (``1 / shards`` of the bytes) crosses groups.
    :func:`auto_groups` chooses ``shards`` (:func:`lwjax.groups.choose_groups`).

    Raises:
      ValueError: ``axis`` not in the mesh, ``replica_axis`` already in it, or
        ``shards`` not a divisor of the axis size.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"group_mesh: mesh has axes {mesh.axis_names}; no axis {axis!r}.")
    if replica_axis in mesh.axis_names:
        raise ValueError(f"group_mesh: mesh already has an axis named {replica_axis!r}.")
    size = mesh.shape[axis]
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or size % shards:
        raise ValueError(
            f"group_mesh: shards must be a positive divisor of {axis}={size}; got {shards!r}."
        )
    i = mesh.axis_names.index(axis)
    devices = mesh.devices.reshape(
        mesh.devices.shape[:i] + (size // shards, shards) + mesh.devices.shape[i + 1 :]
    )
    names = mesh.axis_names[:i] + (replica_axis, axis) + mesh.axis_names[i + 1 :]
    return Mesh(devices, names)


def auto_groups(
    params,
    mesh: Mesh,
    *,
    axis: str = "dp",
    replica_axis: str = "replica",
    layout: LayoutConfig = LayoutConfig(),
    routing: RoutingRules = RoutingRules(),
    matrix_convention: MatrixConvention = "in_out",
    max_padding: float = MAX_PADDING,
) -> tuple[Mesh, LayoutConfig]:
    """The sharding groups :func:`lwjax.groups.choose_groups` picks for ``params`` over ``axis``:
    ``(group_mesh(mesh, G), layout with the chosen policy)``, for :func:`layerwise_muon`.

    Among the group sizes ``G`` dividing the axis and the layout policies, the
    layouts padded by at most ``max_padding`` (a fraction; Megatron-scale dp
    needs groups to stay there), the one whose busiest rank does the least
    Newton–Schulz work. ``G`` equal to the axis size is one group (the mesh
    then has a ``replica_axis`` of size 1).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> params = {f"w{i}": jnp.zeros((64, 64)) for i in range(4)}
      >>> grouped, layout = auto_groups(params, Mesh(np.array(jax.devices()[:8]), ("dp",)))
      >>> dict(grouped.shape)  # four matrices: more than 4 shards only pad
      {'replica': 2, 'dp': 4}
      >>> opt = layerwise_muon(params, grouped, replica_axis="replica", layout=layout)
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"auto_groups: mesh has axes {mesh.axis_names}; no axis {axis!r}.")
    specs = param_specs(route_params(params, routing, matrix_convention=matrix_convention))
    choice = choose_groups(specs, mesh.shape[axis], layout, max_padding=max_padding)
    grouped = group_mesh(mesh, choice.shards, axis=axis, replica_axis=replica_axis)
    return grouped, dataclasses.replace(layout, policy=choice.policy)


def _param_spec(route: LeafRoute, expert_axis: str | None, tensor_axes: tuple[str, ...]) -> P:
    """A leaf's ``PartitionSpec``: its expert axis over ``expert_axis`` (when given), its
    tensor-parallel splits over ``tensor_axes``; ``P()`` for a leaf whole on every device."""
    entries: list = [None] * len(route.shape)
    if route.expert_dim is not None and expert_axis is not None:
        entries[route.expert_dim] = expert_axis
    for name, dim in zip(tensor_axes, route.tensor_dims):
        if dim is not None:
            entries[dim] = name if entries[dim] is None else (*as_axis_tuple(entries[dim]), name)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _state_specs(plan: StepPlan) -> LayerwiseState:
    """Each state array's ``PartitionSpec``: split over its buffer's axes, scalars replicated."""

    def elementwise_specs(size, spec):
        local = jax.ShapeDtypeStruct((size,), plan.master_dtype)
        return jax.tree.map(
            lambda x: spec if x.shape == local.shape else P(),
            jax.eval_shape(plan.elementwise.init, local),
        )

    specs = [P(plan.axes.state_axes(b.key)) for b in plan.buffers]
    return LayerwiseState(
        count=P(),
        masters=tuple(tuple(spec for _ in b.shard_sizes) for b, spec in zip(plan.buffers, specs)),
        momenta=tuple(
            tuple(spec for _ in b.shard_sizes) if b.key.is_layer_wise else None
            for b, spec in zip(plan.buffers, specs)
        ),
        elementwise=tuple(
            None
            if b.key.is_layer_wise
            else tuple(elementwise_specs(size, spec) for size in b.shard_sizes)
            for b, spec in zip(plan.buffers, specs)
        ),
        speculate=P() if speculates(plan) else None,
    )


def named_shardings(mesh: Mesh, specs):
    """The ``NamedSharding`` on ``mesh`` of every ``PartitionSpec`` in the pytree ``specs``."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def state_shardings(optimizer: LayerwiseOptimizer) -> LayerwiseState:
    """``NamedSharding`` pytree of the optimizer state."""
    return named_shardings(optimizer.mesh, optimizer.state_specs)
