"""Megatron-Core's layer-wise distributed Muon for a parameter pytree on a mesh.

:func:`layerwise_muon` builds everything static once, one named stage after
another: it reads the mesh axes (:mod:`lwjax.parallel.mesh`), routes the leaves
(:mod:`lwjax.param_tree`), lays them out over the data-parallel ranks
(:mod:`lwjax.policies`), turns the layout into per-rank tables
(:mod:`lwjax.param_plan`) and orders the bucket updates (:mod:`lwjax.schedule`).
The result, a frozen :class:`~lwjax.plan.StepPlan`, is closed over by pure
functions: ``init`` builds the sharded state, ``local_update`` is the step of
:mod:`lwjax.step` (or :mod:`lwjax.pipelined`), called inside ``shard_map``,
and ``init``/``update`` are also optax's, on global arrays (:mod:`lwjax.transform`).

Names that lived here before 0.5 keep this path for one release (the docs cite
it): the options (:mod:`lwjax.config`), ``route_params`` (:mod:`lwjax.param_tree`),
``plan_params``/``plan_step`` (:mod:`lwjax.planner`), ``group_mesh``,
``auto_groups``, ``resolved_layout`` (:mod:`lwjax.parallel.mesh`),
``named_shardings`` and ``tensor_dims`` (:mod:`lwjax.parallel.shardings`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import pipelined, transform
from lwjax import step as step_lib
from lwjax.config import MatrixConvention as MatrixConvention
from lwjax.config import OptimizerConfig, ScalarOrSchedule
from lwjax.config import ParamSync as ParamSync
from lwjax.groups import AutoGroups, GroupChoice
from lwjax.layout import LayoutConfig
from lwjax.muon import MuonConfig
from lwjax.parallel.axes import MeshAxes
from lwjax.parallel.mesh import ALONE_BUCKET_SIZE as ALONE_BUCKET_SIZE
from lwjax.parallel.mesh import auto_groups as auto_groups
from lwjax.parallel.mesh import group_mesh as group_mesh
from lwjax.parallel.mesh import mesh_axes, resolved_layout
from lwjax.parallel.shardings import named_shardings, param_spec, state_specs, tensor_dims
from lwjax.param_tree import axis_names as axis_names
from lwjax.param_tree import route_params as route_params
from lwjax.plan import StepPlan
from lwjax.planner import plan_params, plan_step
from lwjax.routing import RoutingRules, format_routing_table, is_finite_nonnegative
from lwjax.state import LayerwiseState


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
      param_axes: Name of the mesh axis that splits parameters (tensor
        parallelism, FSDP), or a tuple of them, or ``None``; also readable as
        ``tensor_axis``, its name before 0.5 (deprecated).
      param_specs: ``PartitionSpec`` pytree (prefix) of the parameters:
        ``P()`` for dense leaves, the expert axis split over ``expert_axis``
        for expert leaves, the split axes over ``param_axes`` for split
        leaves; just ``P()`` when nothing is split.
      groups: The :class:`~lwjax.groups.GroupChoice` that chose the sharding
        groups (``replica_axis="auto"``), or ``None``.
    """

    plan: StepPlan
    mesh: Mesh
    axis: str
    local_update: Callable
    local_params: Callable
    gather_params: Callable
    state_specs: LayerwiseState
    expert_axis: str | None
    param_axes: str | tuple[str, ...] | None
    param_specs: Any
    groups: GroupChoice | None

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
        param_axes: str | tuple[str, ...] | None = None,
        param_specs: Any = None,
        groups: GroupChoice | None = None,
    ):
        self = super().__new__(cls, init, update)
        self.plan, self.mesh, self.axis = plan, mesh, axis
        self.local_update, self.state_specs = local_update, state_specs
        self.local_params, self.gather_params = local_params, gather_params
        self.expert_axis, self.param_axes = expert_axis, param_axes
        self.param_specs, self.groups = param_specs, groups
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
    def tensor_axis(self) -> str | tuple[str, ...] | None:
        """Deprecated name of :attr:`param_axes` (before 0.5)."""
        warnings.warn(
            "LayerwiseOptimizer.tensor_axis is deprecated; use .param_axes.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.param_axes

    @property
    def mesh_axes(self) -> MeshAxes:
        """The :class:`~lwjax.parallel.axes.MeshAxes` of this optimizer."""
        return self.plan.axes

    @property
    def data_axes(self) -> str | tuple[str, str]:
        """The data-parallel axes the batch is split over: ``axis``, with ``replica_axis``
        before it and ``expert_axis`` after it when given."""
        return self.plan.axes.data

    def leaf_shardings(self) -> dict[str, NamedSharding]:
        """Per routed leaf path, where its global array lives: whole on every device, or
        split over ``expert_axis`` / ``param_axes`` as :attr:`param_specs` says."""
        return {
            r.path: NamedSharding(self.mesh, param_spec(r, self.expert_axis, self.plan.axes.tp))
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
    replica_axis: str | AutoGroups | None = None,
    param_axes: str | tuple[str, ...] | None = None,
    learning_rate: ScalarOrSchedule = 0.02,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon: MuonConfig = MuonConfig(),
    elementwise: optax.GradientTransformation | None = None,
    config: OptimizerConfig = OptimizerConfig(),
    layout: LayoutConfig = LayoutConfig(),
    routing: RoutingRules = RoutingRules(),
    tensor_axis: str | tuple[str, ...] | None = None,
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
    reduce-scattered within a group and summed across groups.
    ``replica_axis="auto"`` (or :class:`~lwjax.groups.AutoGroups`) chooses the
    group size and layout policy (:func:`lwjax.parallel.mesh.auto_groups`) and
    runs on ``mesh`` with ``axis`` split into ``("replica", axis)``: the
    optimizer's :attr:`~LayerwiseOptimizer.mesh`, whose devices hold a batch
    split over ``axis`` of ``mesh`` as before; it warns when the choice misses
    a bound or its groups span hosts (:attr:`~LayerwiseOptimizer.groups` says why).

    Tensor parallelism: with ``param_axes``, a leaf whose sharding
    (``NamedSharding`` of an array or ``jax.ShapeDtypeStruct``) names that
    axis on one of its dimensions is split over it, each device holding a
    contiguous block (column- or row-parallel kernels, vocabulary-parallel
    embeddings); other leaves are whole on every such device. The batch is
    not split over ``param_axes``. Every tensor-parallel device lays out
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
      replica_axis: The axis across sharding groups, ``None`` (one group), or
        ``"auto"`` / :class:`~lwjax.groups.AutoGroups` (choose them).
      param_axes: The mesh axis that splits parameters (tensor parallelism,
        FSDP), or a tuple of them, or ``None``; which leaves are split over
        it is read from their shardings.
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
      tensor_axis: Deprecated name of ``param_axes`` (before 0.5); it warns.

    Returns:
      A :class:`LayerwiseOptimizer`.

    Raises:
      ValueError: ``axis``, ``expert_axis``, ``replica_axis`` or ``param_axes`` not in
        the mesh, a leaf sharded over another mesh axis, a learning rate
        that is not a finite number >= 0 (a schedule is checked at each step:
        a non-finite value skips the step), or a routing/layout rule broken.
      TypeError: both ``param_axes`` and its deprecated name ``tensor_axis`` given.

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
    param_axes = _renamed_tensor_axis(param_axes, tensor_axis)
    _check_learning_rates(learning_rate, adam_learning_rate)
    groups = None
    if replica_axis == "auto" or isinstance(replica_axis, AutoGroups):
        mesh, layout, replica_axis, groups = _auto_grouped(
            params, mesh, axis, expert_axis, param_axes, replica_axis, layout, routing, config
        )
    axes = mesh_axes(mesh, axis, expert_axis, replica_axis, param_axes)
    plan = plan_step(
        plan_params(
            params,
            axes,
            resolved_layout(layout, axes, muon),
            routing,
            grad_reduce_in_fp32=config.grad_reduce_in_fp32,
            matrix_convention=config.matrix_convention,
            tensor_dims=None if param_axes is None else tensor_dims(params, axes),
        ),
        config,
        muon,
        elementwise,
        learning_rate,
        adam_learning_rate,
    )
    _check_tensor_splits(plan, muon)
    return _optimizer(plan, mesh, axis, expert_axis, param_axes)._replace(groups=groups)


def _auto_grouped(
    params, mesh, axis, expert_axis, param_axes, replica_axis, layout, routing, config
):
    """``replica_axis="auto"``: ``(grouped mesh, layout, replica axis name, GroupChoice)``
    (:func:`lwjax.parallel.mesh.auto_groups`), with a warning when the choice misses a bound."""
    auto = AutoGroups() if replica_axis == "auto" else replica_axis
    if expert_axis is not None:
        raise ValueError(
            "layerwise_muon: replica_axis='auto' does not choose groups beside an "
            f"expert_axis ({expert_axis!r}); build the groups with group_mesh(mesh, G) and "
            "pass replica_axis='replica'."
        )
    mesh, layout, groups = auto_groups(
        params,
        mesh,
        axis=axis,
        param_axes=param_axes,
        groups=auto,
        layout=layout,
        routing=routing,
        matrix_convention=config.matrix_convention,
    )
    _warn_groups(groups)
    return mesh, layout, auto.name, groups


def _warn_groups(choice: GroupChoice) -> None:
    """Say when the groups ``replica_axis="auto"`` chose miss a bound or span hosts."""
    if choice.notes:
        option = choice.option
        warnings.warn(
            f"layerwise_muon: replica_axis='auto' chose groups of {option.shards} "
            f"({option.policy}): " + " ".join(choice.notes) + " (optimizer.groups has every "
            "option; pass replica_axis='replica' with group_mesh(mesh, G) to fix G.)",
            UserWarning,
            stacklevel=4,  # the caller of layerwise_muon
        )


def _renamed_tensor_axis(param_axes, tensor_axis):
    """``param_axes``, or the value of its deprecated name ``tensor_axis`` (with a warning)."""
    if tensor_axis is None:
        return param_axes
    if param_axes is not None:
        raise TypeError(
            "layerwise_muon: got both param_axes and tensor_axis; tensor_axis is the deprecated "
            "name of param_axes (since 0.5). Pass param_axes only."
        )
    warnings.warn(
        "layerwise_muon: tensor_axis= is deprecated since lwjax 0.5 and will be removed; pass "
        "param_axes= (the mesh axes that split parameters: tensor parallelism and FSDP).",
        DeprecationWarning,
        stacklevel=3,
    )
    return tensor_axis


def _check_learning_rates(learning_rate, adam_learning_rate) -> None:
    """A learning rate given as a number is finite and >= 0 (a schedule is checked per step)."""
    for name, value in (
        ("learning_rate", learning_rate),
        ("adam_learning_rate", adam_learning_rate),
    ):
        if value is not None and not callable(value) and not is_finite_nonnegative(value):
            raise ValueError(
                f"layerwise_muon: {name} must be a finite number >= 0 or a schedule; got {value!r}."
            )


def _check_tensor_splits(plan: StepPlan, muon: MuonConfig) -> None:
    """``"distributed"`` Muon needs each split matrix whole on its rows or its columns."""
    if muon.tp_mode == "distributed":
        for r in plan.routes:
            if r.is_muon and all(r.tensor_split):
                raise ValueError(
                    f"layerwise_muon: {r.path} is split over tensor-parallel axes on both its "
                    "rows and its columns; MuonConfig(tp_mode='distributed') needs one side "
                    "whole (use 'duplicated')."
                )


def _optimizer(
    plan: StepPlan,
    mesh: Mesh,
    axis: str,
    expert_axis: str | None,
    param_axes: str | tuple[str, ...] | None,
) -> LayerwiseOptimizer:
    """The step functions over ``plan``, on ``mesh``, and their specs."""
    param_specs = P()  # a prefix of the parameters: replicated, unless some leaves are split
    leaf_specs = [param_spec(r, expert_axis, plan.axes.tp) for r in plan.routes]
    if any(spec != P() for spec in leaf_specs):
        param_specs = jax.tree_util.tree_unflatten(plan.treedef, leaf_specs)
    specs = state_specs(plan)
    local_update = pipelined.update_pipelined if plan.config.pipeline_muon else step_lib.update
    init, update = transform.optax_functions(plan, mesh, leaf_specs, specs, local_update)
    local_params = functools.partial(step_lib.local_params, plan)
    gather_params = jax.jit(
        jax.shard_map(
            local_params, mesh=mesh, in_specs=(specs,), out_specs=param_specs, check_vma=False
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
        state_specs=specs,
        expert_axis=expert_axis,
        param_axes=param_axes,
        param_specs=param_specs,
    )


def state_shardings(optimizer: LayerwiseOptimizer) -> LayerwiseState:
    """``NamedSharding`` pytree of the optimizer state."""
    return named_shardings(optimizer.mesh, optimizer.state_specs)
