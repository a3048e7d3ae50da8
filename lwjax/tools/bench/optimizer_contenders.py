"""The contenders of ``lwjax bench`` (the optimizer step), each registered once.

Every contender is handed the same per-device gradients (the dp-mean is taken inside the
step), runs its step and is synchronised on its outputs:

* ``lwjax``: reduce-scatter, norm/clip, Muon/Adam on owned blocks, all-gather
  (:func:`time_lwjax`), with its no-overlap floor beside it;
* ``Megatron-Core LayerWiseDistributedOptimizer``: Megatron's own script under ``torchrun``
  (:func:`~lwjax.tools.bench.megatron_scripts.megatron_optimizer_step`);
* ``optax.contrib.muon (replicated)``: ``pmean`` of the gradients (all-reduce) and
  ``optax.contrib.muon`` with the same routing on every device (:func:`time_optax`, the JAX
  status quo).

:data:`OPTIMIZER_CONTENDERS` lists them in the order of the records.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.groups import AutoGroups
from lwjax.layout import LayoutConfig
from lwjax.megatron.gpt import GPTConfig
from lwjax.optimizer import LayerwiseOptimizer
from lwjax.parallel.jit import jit_shard_map
from lwjax.parallel.mesh import group_mesh, resolved_layout
from lwjax.speculation import FIRST_SPECULATION, chosen_on_host
from lwjax.state import speculates
from lwjax.tools.bench.config import BenchConfig
from lwjax.tools.bench.floor import optimizer_step_floor
from lwjax.tools.bench.megatron_scripts import megatron_optimizer_step
from lwjax.tools.bench.profile import profile_steps
from lwjax.tools.bench.synthetic import constant_params, local_grads
from lwjax.tools.bench.timing import pgle, time_back_to_back, time_steps, warmup_calls
from lwjax.tools.bench.workloads import workload_optimizer, workload_shapes

TP_FLOOR_SKIPPED = (
    "not measured at tp > 1: the floor times only the data-parallel reduce-scatter and "
    "all-gather and a rank's Newton-Schulz FLOPs, not the tensor-parallel gathers or Gram "
    "all-reduces of the tp mode, so it would not be a floor of this step"
)
TP_BASELINE_SKIPPED = (
    "optax.contrib.muon (replicated) not run at tp > 1: it has no tensor parallelism "
    "(every device would hold whole matrices), so it is no baseline for a split step"
)


def optimizer_step(opt: LayerwiseOptimizer):
    """``step(params, state, grads) -> (params, state)``: the timed step, ``params`` and ``state``
    donated; ``grads`` are per-device gradients ``[dp, ...]`` split over the data-parallel axes
    (``opt.data_axes``: with sharding groups ``("replica", "dp")``) and, for leaves split over
    tensor parallelism, as ``opt.param_specs`` says: ``P(opt.data_axes, *spec)``. A
    pipelined, clipping optimizer speculates as the host chooses, as in ``make_train_step``
    (:func:`lwjax.speculation.chosen_on_host`)."""
    param_specs, data = opt.param_specs, opt.data_axes
    if isinstance(param_specs, P):  # a prefix: nothing split
        grad_specs = P(data, *param_specs)
    else:
        grad_specs = jax.tree.map(
            lambda spec: P(data, *spec), param_specs, is_leaf=lambda x: isinstance(x, P)
        )

    def compiled(speculate=None):
        chosen, flag = ({}, ()) if speculate is None else ({"speculate": speculate}, (P(),))

        def local(p, s, g):
            p, s, _ = opt.local_update(jax.tree.map(lambda x: x[0], g), s, p, **chosen)
            return (p, s, s.speculate) if flag else (p, s)

        return jit_shard_map(
            local,
            opt.mesh,
            (param_specs, opt.state_specs, grad_specs),
            (param_specs, opt.state_specs, *flag),
            donate_argnums=(0, 1),
        )

    return chosen_on_host(compiled, 1) if speculates(opt.plan) else compiled()


def first_call(opt: LayerwiseOptimizer) -> int:
    """The call at which :func:`optimizer_step`'s last compiled step may first run."""
    return FIRST_SPECULATION if speculates(opt.plan) else 0


def grouped_mesh(cfg: BenchConfig, mesh: Mesh) -> tuple[Mesh, str | AutoGroups | None]:
    """``(mesh, replica_axis)`` of lwjax's optimizer for ``cfg.replica``: ``mesh`` and ``None``
    for one group; its ``"dp"`` axis split into ``("replica", "dp")``, groups of
    ``dp / replica`` devices (:func:`~lwjax.parallel.mesh.group_mesh`), for a number; ``mesh``
    and :class:`~lwjax.groups.AutoGroups` weighing ``cfg.policy`` alone for ``"auto"`` (the
    optimizer's own mesh then has the groups)."""
    if cfg.replica == "auto":
        return mesh, AutoGroups(policies=(cfg.policy,))
    if cfg.replica == 1:
        return mesh, None
    return group_mesh(mesh, mesh.shape["dp"] // cfg.replica), "replica"


def built_lwjax(cfg: BenchConfig, config: GPTConfig, mesh: Mesh):
    """lwjax's optimizer for the workload on ``mesh`` (in ``cfg.replica`` sharding groups:
    :func:`grouped_mesh`), and what its step starts from: ``(opt, mesh, params, state,
    grads)``, ``mesh`` the optimizer's (split into the groups ``"auto"`` chose)."""
    dtype = jnp.dtype(cfg.param_dtype)
    shapes = workload_shapes(config)
    tensor_parallel = "tp" in mesh.axis_names
    specs = config.tensor_specs() if tensor_parallel else None
    mesh, replica_axis = grouped_mesh(cfg, mesh)
    params = constant_params(shapes, mesh, dtype, specs)
    opt = workload_optimizer(
        params,
        mesh,
        config,
        ns_precision=cfg.ns_precision,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        policy=cfg.policy,
        bucket_size=cfg.bucket_size,
        pipeline_muon=cfg.pipeline_muon,
        param_axes="tp" if tensor_parallel else None,
        tp_mode=cfg.tp_mode,
        replica_axis=replica_axis,
    )
    if opt.mesh is not mesh:  # "auto" split the mesh into the groups it chose
        mesh = opt.mesh
        params = jax.device_put(
            params, jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), params)
        )
    state = opt.init(params)
    grads = local_grads(shapes, mesh, dtype, cfg.grad_std, specs, axis=opt.data_axes)
    return opt, mesh, params, state, grads


def time_lwjax(cfg: BenchConfig, config: GPTConfig, mesh: Mesh):
    """Build lwjax's optimizer for the workload (:func:`built_lwjax`) and time its step.

    Returns:
      ``(seconds, back_to_back, state_bytes, opt, profile, grad_norm)``: the median
      synchronised step and the back-to-back step in seconds, the busiest device's
      optimizer state in bytes, the optimizer, :func:`~lwjax.tools.bench.profile.profile_steps`'
      summary (empty without ``cfg.profile_dir``) and the norm of the mean gradient.
    """
    opt, mesh, params, state, grads = built_lwjax(cfg, config, mesh)
    tensor_parallel = "tp" in mesh.axis_names
    grad_norm = float(
        jax.jit(
            lambda g: optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32).mean(0), g))
        )(grads)
    )  # of the mean gradient, what the step clips by
    step = optimizer_step(opt)

    def call(p, s):
        return step(p, s, grads)

    # PGLE is part of jit's cache key: the timed and the traced steps both run under it.
    with pgle() if cfg.pgle else contextlib.nullcontext():
        seconds, (params, state) = time_steps(
            call, (params, state), cfg.iters, warmup_calls(cfg.warmup, cfg.pgle, first_call(opt))
        )
        back_to_back, (params, state) = time_back_to_back(call, (params, state), cfg.iters)
        profile = {}
        if cfg.profile_dir:
            groups = f"_replica{mesh.shape['replica']}" if "replica" in mesh.shape else ""
            tp = f"_tp{mesh.shape['tp']}" if tensor_parallel else ""
            name = f"dp{opt.num_data}{groups}{tp}"
            profile, (params, state) = profile_steps(
                call, (params, state), 3, f"{cfg.profile_dir}/{name}"
            )
    state_bytes = max(
        sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(state)
            for s in leaf.addressable_shards
            if s.device == d
        )
        for d in mesh.devices.flat
    )
    return seconds, back_to_back, state_bytes, opt, profile, grad_norm


def time_optax(cfg: BenchConfig, config: GPTConfig, mesh: Mesh):
    """Time replicated ``optax.contrib.muon`` on the workload: ``pmean`` of the gradients
    (all-reduce), then the same update on every device.

    Returns:
      ``(seconds, back_to_back, state_bytes)`` as :func:`time_lwjax`'s.
    """
    dtype = jnp.dtype(cfg.param_dtype)
    shapes = workload_shapes(config)
    params = constant_params(shapes, mesh, jnp.float32)
    # The stacked [L, out, in] layer matrices are Muon's, everything else Adam's.
    stacked = optax.contrib.MuonDimensionNumbers(reduction_axis=2, output_axis=1)
    dims = jax.tree.map(
        lambda s: stacked if len(s) == 3 else None, shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    tx = optax.contrib.muon(
        learning_rate=1e-3, weight_decay=0.01, muon_weight_dimension_numbers=dims
    )
    opt_state = jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)
    grads = local_grads(shapes, mesh, dtype, cfg.grad_std)
    state_spec = jax.tree.map(lambda _: P(), opt_state)

    def local(p, o, g):
        g = jax.tree.map(lambda x: jax.lax.pmean(x[0].astype(jnp.float32), "dp"), g)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    step = jit_shard_map(
        local, mesh, (P(), state_spec, P("dp")), (P(), state_spec), donate_argnums=(0, 1)
    )

    def call(p, o):
        return step(p, o, grads)

    seconds, (params, opt_state) = time_steps(call, (params, opt_state), cfg.iters, cfg.warmup)
    back_to_back, (params, opt_state) = time_back_to_back(call, (params, opt_state), cfg.iters)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state)) + sum(
        x.nbytes for x in jax.tree.leaves(params)
    )
    return seconds, back_to_back, state_bytes


def _lwjax_fields(cfg: BenchConfig, config: GPTConfig, mesh: Mesh) -> dict:
    """lwjax's record: its settings, its sharding groups, its times and state, and its floor (or
    why there is none)."""
    seconds, back_to_back, nbytes, opt, profile, grad_norm = time_lwjax(cfg, config, mesh)
    if cfg.tp == 1:
        floor = optimizer_step_floor(cfg, opt, opt.mesh, nbytes)
    else:
        floor = dict(floor_skipped=TP_FLOOR_SKIPPED)
        if cfg.baselines:
            floor["baseline_skipped"] = TP_BASELINE_SKIPPED
    bucket_size = resolved_layout(
        LayoutConfig(bucket_size=cfg.bucket_size), opt.mesh_axes, opt.plan.muon
    ).bucket_size_for(opt.num_data)
    axes = opt.mesh_axes
    return dict(
        replica=cfg.replica,
        replicas=axes.replica_size,
        group_size=axes.group_size,
        **({"groups_notes": list(opt.groups.notes)} if opt.groups is not None else {}),
        policy=cfg.policy,
        bucket_size=bucket_size,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        pgle=cfg.pgle,
        grad_std=cfg.grad_std,
        grad_norm=grad_norm,
        pipeline_muon=cfg.pipeline_muon,
        warmup=warmup_calls(cfg.warmup, cfg.pgle, first_call(opt)),
        step_ms=seconds * 1e3,
        back_to_back_ms=back_to_back * 1e3,
        state_bytes_per_device=nbytes,
        **floor,
        **({"profile": profile} if profile else {}),
    )


def _optax_fields(cfg: BenchConfig, config: GPTConfig, mesh: Mesh) -> dict:
    seconds, back_to_back, nbytes = time_optax(cfg, config, mesh)
    return dict(
        step_ms=seconds * 1e3, back_to_back_ms=back_to_back * 1e3, state_bytes_per_device=nbytes
    )


@dataclasses.dataclass(frozen=True)
class OptimizerContender:
    """One contender of ``lwjax bench``: when it runs and how it is measured.

    Attributes:
      name: Its records' ``contender``.
      runs: Whether a :class:`~lwjax.tools.bench.config.BenchConfig` asks for it.
      measure: Its record's fields at one dp size: ``measure(cfg, config, mesh)``, timed in
        this process on ``mesh``; with ``torchrun``, ``measure(cfg, dp)``, a script run
        under ``torchrun`` for every dp size before JAX takes the devices.
      torchrun: How ``measure`` is called (above).
    """

    name: str
    runs: Callable[[BenchConfig], bool]
    measure: Callable[..., dict]
    torchrun: bool = False


OPTIMIZER_CONTENDERS = (
    OptimizerContender("lwjax", lambda cfg: True, _lwjax_fields),
    OptimizerContender(
        "Megatron-Core LayerWiseDistributedOptimizer",
        lambda cfg: bool(cfg.megatron_script),
        megatron_optimizer_step,
        torchrun=True,
    ),
    OptimizerContender(
        "optax.contrib.muon (replicated)",
        lambda cfg: cfg.baselines and cfg.tp == 1,  # no tensor parallelism: TP_BASELINE_SKIPPED
        _optax_fields,
    ),
)
