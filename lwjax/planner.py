"""From a parameter pytree and the options to the :class:`~lwjax.plan.StepPlan` of its step.

:func:`plan_params` routes the leaves (:mod:`lwjax.param_tree`), lays them out
over a sharding group (:mod:`lwjax.policies`) and builds the per-rank tables
(:mod:`lwjax.param_plan`); :func:`plan_step` adds the bucket schedule
(:mod:`lwjax.schedule`), the options and their per-leaf values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from lwjax.config import MatrixConvention, OptimizerConfig, ScalarOrSchedule
from lwjax.layout import LayoutConfig
from lwjax.muon import MuonConfig
from lwjax.parallel.axes import MeshAxes
from lwjax.parallel.ns_deal import deal_newton_schulz
from lwjax.param_plan import ParamPlan, make_plan
from lwjax.param_tree import route_params
from lwjax.plan import StepPlan
from lwjax.policies import compute_full_param_layout
from lwjax.routing import RoutingRules, is_array_like, param_specs, with_tensor_parallel
from lwjax.schedule import schedule_buckets


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
    """``plan`` with the step's bucket schedule, options and per-leaf values, and its split
    matrices dealt out to the devices that orthogonalise them
    (:func:`~lwjax.parallel.ns_deal.deal_newton_schulz`)."""
    transpose = config.matrix_convention == "in_out" and (
        muon.scale_mode != "spectral" or any(r.qkv_split_shapes for r in plan.routes)
    )
    norm_groups = (None, *plan.grad_norm_groups)  # norm group 0 is the main norm
    buffers = deal_newton_schulz(plan, muon.tp_mode, transpose, muon.num_ns_steps, muon.split_qkv)
    return StepPlan(
        **{f.name: getattr(plan, f.name) for f in dataclasses.fields(ParamPlan)}
        | {"buffers": buffers},
        schedule=schedule_buckets(
            dataclasses.replace(plan, buffers=buffers),
            num_ns_steps=muon.num_ns_steps,
            transpose=transpose,
            split_qkv=muon.split_qkv,
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
