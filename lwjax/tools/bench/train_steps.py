"""The training steps the training-step bench times, each one jitted step over one batch.

* :func:`lwjax_step`: local gradients into ``layerwise_muon``'s ``local_update`` in
  ``shard_map``, over replicated parameters or, with ``fsdp``, ``make_train_step``'s step over
  parameters split over ``fsdp`` (:mod:`lwjax.tools.bench.fsdp`);
* :func:`lwjax_optax_step`: lwjax's optimizer as an optax transformation under ``jax.jit``;
* :func:`optax_step`: all-reduced gradients and a replicated optax transformation
  (:func:`optax_adamw`);
* :func:`forward_backward_step`: loss and gradients alone, the compute floor.

Parameters and optimizer state are donated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.optimizer import LayerwiseOptimizer, state_shardings
from lwjax.parallel.gather import WHOLE, ParamGather
from lwjax.parallel.jit import jit_shard_map
from lwjax.tools.bench.config import TrainBenchConfig
from lwjax.tools.bench.fsdp import FSDP_AXIS
from lwjax.tools.bench.workloads import workload_optimizer
from lwjax.train import make_train_step, value_and_grad
from lwjax.train_options import TrainStepOptions


def lwjax_optimizer(
    params, mesh: Mesh, cfg: TrainBenchConfig, *, muon: bool = True
) -> LayerwiseOptimizer:
    """The optimizer of ``lwjax Muon`` (``muon=True``) or ``lwjax AdamW (ZeRO-1)``.

    :func:`lwjax.tools.bench.workload_optimizer` with ``cfg``'s hyper-parameters;
    with ``cfg.fsdp``, over parameters split over ``fsdp`` (``param_axes``).
    """
    return workload_optimizer(
        params,
        mesh,
        cfg.model(),
        muon=muon,
        ns_precision=cfg.ns_precision,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        policy=cfg.policy,
        bucket_size=cfg.bucket_size,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        clip_grad=cfg.clip_grad,
        pipeline_muon=cfg.pipeline_muon,
        param_axes=FSDP_AXIS if cfg.fsdp else None,
        stacked=cfg.scan_layers,
    )


def lwjax_step(
    loss, optimizer: LayerwiseOptimizer, *, fsdp: bool = False, overlap_param_gather=False
):
    """``step(params, state, batch) -> (params, state, loss, grad_norm)``.

    Local gradients go into ``optimizer.local_update``, which takes each
    device's gradient of its local mean loss and the mean over dp itself
    (inside its reduce-scatter). With ``fsdp`` it is
    :func:`lwjax.make_train_step`'s step with ``fsdp_axes="fsdp"``: the loss
    gathers each layer over ``fsdp`` (:func:`lwjax.gather_params`), whose
    transpose reduce-scatters each gradient, and the step averages over the
    ``fsdp`` devices (:mod:`lwjax.sharded_gradients`). ``params`` (split as
    ``optimizer.param_specs`` says) and ``state`` are donated; ``batch`` is
    split over the data axes on its leading axis. With
    ``overlap_param_gather`` the step is ``step(state, batch) -> (state,
    loss, grad_norm)``: it gathers the parameters from the masters first and
    none at the end.
    """
    if fsdp:
        train_step = make_train_step(loss, optimizer, options=TrainStepOptions(fsdp_axes=FSDP_AXIS))

        def step(params, state, batch):
            params, state, metrics = train_step(params, state, batch)
            return params, state, metrics["loss"], metrics["grad_norm"]

        return jax.jit(step, donate_argnums=(0, 1))  # the bench lowers and compiles it

    def local(params, state, batch):
        if overlap_param_gather:
            params = optimizer.local_params(state)
        value, grads = jax.value_and_grad(loss)(params, batch)
        params, state, metrics = optimizer.local_update(
            grads, state, params, gather=not overlap_param_gather
        )
        return params, state, lax.pmean(value, optimizer.axis), metrics["grad_norm"]

    axis = optimizer.axis
    if overlap_param_gather:
        return jit_shard_map(
            lambda state, batch: local(None, state, batch)[1:],
            optimizer.mesh,
            (optimizer.state_specs, P(axis)),
            (optimizer.state_specs, P(), P()),
            donate_argnums=(0,),
        )
    specs = optimizer.param_specs
    return jit_shard_map(
        local,
        optimizer.mesh,
        (specs, optimizer.state_specs, P(axis)),
        (specs, optimizer.state_specs, P(), P()),
        donate_argnums=(0, 1),
    )


def lwjax_optax_step(loss, optimizer: LayerwiseOptimizer, *, per_device: bool):
    """``step(params, state, batch) -> (params, state, loss)``: the optax form under ``jax.jit``.

    Gradients come from ``jax.grad`` on the global batch (GSPMD all-reduces
    them), or with ``per_device`` from :func:`lwjax.value_and_grad`
    (reduce-scattered by ``optimizer.update``); ``optax.apply_updates``
    applies the updates. ``params`` and ``state`` are donated.
    """
    grad_fn = value_and_grad(loss, optimizer) if per_device else jax.value_and_grad(loss)

    def step(params, state, batch):
        value, grads = grad_fn(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    replicated = NamedSharding(optimizer.mesh, P())
    return jax.jit(
        step,
        out_shardings=(replicated, state_shardings(optimizer), replicated),
        donate_argnums=(0, 1),
    )


def _is_matrix(path, x) -> bool:
    """A leaf whose (per-layer) parameters have 2+ dims: decayed, as lwjax decays them."""
    stacked = 1 if jax.tree_util.keystr(path).startswith("['decoder']['layers']") else 0
    return x.ndim - stacked >= 2


def optax_adamw(cfg: TrainBenchConfig) -> optax.GradientTransformation:
    r"""AdamW as lwjax applies it to elementwise parameters, clipped as optax clips.

    (lwjax divides by :math:`\lVert g \rVert + 10^{-6}`, optax by :math:`\lVert g \rVert`.)

    .. math::

       g \leftarrow g \min\!\big(1, c / \lVert g \rVert\big), \qquad
       p \leftarrow p - \eta\Big(\frac{\hat m}{\sqrt{\hat v} + \epsilon}
                        + \lambda \mathbb{1}_{\text{matrix}}\, p\Big)

    with :math:`c` = ``clip_grad`` (skipped when ``None``/0), :math:`\eta` =
    ``learning_rate``, :math:`\lambda` = ``weight_decay``, Adam's
    :math:`(\beta_1, \beta_2, \epsilon) = (0.9, 0.999, 10^{-8})`, and the
    decay only on matrices (a stacked ``[L, h]`` norm is ``L`` vectors).
    """
    mask = lambda params: jax.tree_util.tree_map_with_path(_is_matrix, params)  # noqa: E731
    adamw = optax.adamw(
        cfg.learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay, mask=mask
    )
    return optax.chain(optax.clip_by_global_norm(cfg.clip_grad), adamw) if cfg.clip_grad else adamw


def optax_step(loss, tx: optax.GradientTransformation, mesh: Mesh, *, axis: str = "dp"):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``.

    All-reduce, then ``tx`` on every device.

    Parameters and optimizer state are replicated (``P()``) and donated.
    """

    def local(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        grads = lax.pmean(grads, axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(value, axis)

    return jit_shard_map(local, mesh, (P(), P(), P(axis)), (P(), P(), P()), donate_argnums=(0, 1))


def forward_backward_step(
    loss,
    mesh: Mesh,
    *,
    axis: str | tuple[str, ...] = "dp",
    param_specs=None,
    gather: ParamGather = WHOLE,
):
    r"""``step(params, batch) -> (loss, a sum of squares of the gradients)``: the compute floor.

    ``batch`` is split over ``axis`` (a name or a tuple), ``params`` as ``param_specs`` says
    (``None``: replicated), and ``loss`` runs with ``gather`` active (what
    :func:`lwjax.gather_params` gathers: :func:`~lwjax.tools.bench.fsdp.fsdp_param_gather`
    with ``fsdp``). The sum keeps every gradient computed: of each device's own gradients
    (:math:`\sum_d \lVert g_d \rVert^2`), or with ``params`` split as
    :func:`fsdp_specs` says, of the blocks the gathers' transposes summed
    (:math:`\lVert \sum_d g_d \rVert^2`).
    """

    def local(params, batch):
        with gather.active():
            value, grads = jax.value_and_grad(loss)(params, batch)
        square = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
        return lax.pmean(value, axis), lax.psum(square, axis)

    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P() if param_specs is None else param_specs, P(axis)),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
