"""The contenders of ``lwjax bench --train-step``, each registered once.

A :class:`TrainContender` says when it runs, what it builds on a :class:`TrainSetting` (one
dp size's mesh, batch and loss) and how its record compares with the others';
:data:`TRAIN_STEP_CONTENDERS` lists them in the order of the records. Each builds one jitted
step of :mod:`lwjax.tools.bench.train_steps` over the same devices and batch:

* ``lwjax Muon``: ``layerwise_muon``'s update on local gradients (reduce-scatter, clip, Muon on
  owned matrices and Adam on owned elements, all-gather);
* ``lwjax AdamW (ZeRO-1)``: the same sharded optimizer with every parameter routed to Adam;
* with ``optax_form``: lwjax Muon as an optax transformation under ``jax.jit``, gradients
  from ``jax.grad`` and from :func:`lwjax.value_and_grad`;
* with ``overlap_param_gather``: lwjax Muon and AdamW gathering the parameters from the
  masters at the start of the next step;
* with ``fsdp``: lwjax Muon and AdamW over parameters split over ``fsdp``
  (:mod:`lwjax.tools.bench.fsdp`) instead of the two above;
* ``optax AdamW (replicated)``: all-reduced gradients and ``optax.adamw`` on fp32
  parameters replicated on every device (the JAX status quo);
* ``forward+backward``: loss and gradients only, the floor of every other contender.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from lwjax.megatron.model import init_params, unstack_layers
from lwjax.parallel.gather import WHOLE, gather_params
from lwjax.tools.bench.config import TrainBenchConfig
from lwjax.tools.bench.fsdp import FSDP_AXIS, fsdp_param_gather, fsdp_params, fsdp_specs
from lwjax.tools.bench.synthetic import replicated
from lwjax.tools.bench.train_steps import (
    forward_backward_step,
    lwjax_optax_step,
    lwjax_optimizer,
    lwjax_step,
    optax_adamw,
    optax_step,
)

MUON = "lwjax Muon"
ADAMW_SHARDED = "lwjax AdamW (ZeRO-1)"
ADAMW_REPLICATED = "optax AdamW (replicated)"
MUON_FSDP = "lwjax Muon (FSDP)"
ADAMW_FSDP = "lwjax AdamW (FSDP)"
MUON_OPTAX = "lwjax Muon, optax form (jax.grad)"
MUON_OPTAX_PER_DEVICE = "lwjax Muon, optax form (lwjax.value_and_grad)"
MUON_OVERLAP = "lwjax Muon, gather in forward"
ADAMW_OVERLAP = "lwjax AdamW (ZeRO-1), gather in forward"
FORWARD_BACKWARD = "forward+backward"
CONTENDERS = (MUON, ADAMW_SHARDED, ADAMW_REPLICATED)  # the default run's, forward+backward aside
OPTAX_FORM_CONTENDERS = (MUON_OPTAX, MUON_OPTAX_PER_DEVICE)


@dataclasses.dataclass(frozen=True)
class TrainSetting:
    """One dp size of a run: what every contender's step shares.

    Attributes:
      cfg: The run's :class:`~lwjax.tools.bench.config.TrainBenchConfig`.
      mesh: ``("dp",)``, or with ``cfg.fsdp`` ``("dp", "fsdp") = (1, n)``.
      batch: The tokens, split over ``data_axes``.
      loss: ``loss(params, batch)`` (with ``cfg.fsdp``, gathering each layer over ``fsdp``).
      data_axes: The mesh axes the batch is split over.
      param_specs: How parameters are split (``None``: replicated).
    """

    cfg: TrainBenchConfig
    mesh: Any
    batch: Any
    loss: Callable
    data_axes: str | tuple[str, ...]
    param_specs: Any = None

    @property
    def fsdp(self) -> bool:
        return self.param_specs is not None

    def params(self, dtype) -> dict:
        """The initial parameters (``cfg.seed``) in ``dtype``, placed as the setting places them."""
        key = jax.random.key(self.cfg.seed)
        if self.fsdp:
            return fsdp_params(self.cfg.model(), key, dtype, self.mesh, self.param_specs)
        params = init_params(self.cfg.model(), key, dtype)
        return replicated(params if self.cfg.scan_layers else unstack_layers(params), self.mesh)


def train_setting(cfg: TrainBenchConfig, mesh, batch) -> TrainSetting:
    """The setting of ``cfg`` on ``mesh`` (an ``fsdp`` axis in it: fully sharded)."""
    if not cfg.fsdp:
        return TrainSetting(cfg, mesh, batch, cfg.loss(), "dp")
    specs = fsdp_specs(cfg.model(), mesh.shape[FSDP_AXIS])
    return TrainSetting(cfg, mesh, batch, cfg.loss(gather=gather_params), ("dp", FSDP_AXIS), specs)


class BuiltStep(NamedTuple):
    """A contender's step and its first arguments (``step(*args, batch)``).

    ``optimizer`` is lwjax's, where the step has one (its plan gives the Newton–Schulz floor).
    """

    step: Any
    args: tuple
    optimizer: Any = None


@dataclasses.dataclass(frozen=True)
class TrainContender:
    """One contender of the training-step bench.

    Attributes:
      name: Its records' ``contender``.
      runs: Whether a :class:`~lwjax.tools.bench.config.TrainBenchConfig` asks for it.
      build: ``build(setting) -> BuiltStep``.
      outputs: What its step returns after the next call's arguments, read once more after
        the timed steps (``loss``, ``grad_norm``). Empty: the step returns none of its
        arguments (forward+backward), which are passed again.
      muon: Its optimizer runs Newton–Schulz (its floor adds the busiest rank's).
      overhead_over: Contenders its ``muon_overhead_pct`` is taken over (those that ran).
      compared_with: A contender its ``vs_lwjax_step_pct`` is taken against.
      measures_newton_schulz: Measure :func:`~lwjax.tools.bench.floor.newton_schulz_floor`
        of its plan after it (once per dp size).
    """

    name: str
    runs: Callable[[TrainBenchConfig], bool]
    build: Callable[[TrainSetting], BuiltStep]
    outputs: tuple[str, ...] = ("loss",)
    muon: bool = False
    overhead_over: tuple[str, ...] = ()
    compared_with: str | None = None
    measures_newton_schulz: bool = False


def _lwjax(*, muon: bool, overlap: bool = False) -> Callable[[TrainSetting], BuiltStep]:
    """lwjax's step; with ``overlap`` it gathers the parameters from the masters when it starts
    and holds only the state between steps."""

    def build(setting: TrainSetting) -> BuiltStep:
        params = setting.params(setting.cfg.param_dtype)
        optimizer = lwjax_optimizer(params, setting.mesh, setting.cfg, muon=muon)
        step = lwjax_step(setting.loss, optimizer, fsdp=setting.fsdp, overlap_param_gather=overlap)
        state = optimizer.init(params)
        return BuiltStep(step, (state,) if overlap else (params, state), optimizer)

    return build


def _optax_form(*, per_device: bool) -> Callable[[TrainSetting], BuiltStep]:
    def build(setting: TrainSetting) -> BuiltStep:
        params = setting.params(setting.cfg.param_dtype)
        optimizer = lwjax_optimizer(params, setting.mesh, setting.cfg)
        step = lwjax_optax_step(setting.loss, optimizer, per_device=per_device)
        return BuiltStep(step, (params, optimizer.init(params)))

    return build


def _optax_adamw(setting: TrainSetting) -> BuiltStep:
    params = setting.params("float32")
    tx = optax_adamw(setting.cfg)
    step = optax_step(setting.loss, tx, setting.mesh)
    return BuiltStep(step, (params, replicated(tx.init(params), setting.mesh)))


def _forward_backward(setting: TrainSetting) -> BuiltStep:
    cfg, mesh = setting.cfg, setting.mesh
    gather = WHOLE
    if setting.fsdp:
        gather = fsdp_param_gather(cfg.model(), mesh, reduce_in_fp32=cfg.grad_reduce_in_fp32)
    step = forward_backward_step(
        setting.loss, mesh, axis=setting.data_axes, param_specs=setting.param_specs, gather=gather
    )
    return BuiltStep(step, (setting.params(setting.cfg.param_dtype),))


def _replicating(cfg: TrainBenchConfig) -> bool:
    return not cfg.fsdp


def _fully_sharded(cfg: TrainBenchConfig) -> bool:
    return cfg.fsdp


def _adamw(runs: Callable[[TrainBenchConfig], bool]) -> Callable[[TrainBenchConfig], bool]:
    """``runs``, where the config also asks for lwjax AdamW (``TrainBenchConfig.adamw``)."""
    return lambda cfg: cfg.adamw and runs(cfg)


LWJAX_OUTPUTS = ("loss", "grad_norm")  # grad_norm above clip_grad: clipping bound
TRAIN_STEP_CONTENDERS = (
    TrainContender(
        MUON,
        _replicating,
        _lwjax(muon=True),
        LWJAX_OUTPUTS,
        muon=True,
        overhead_over=(ADAMW_SHARDED, ADAMW_REPLICATED),
        measures_newton_schulz=True,  # the compute Muon adds to forward+backward
    ),
    TrainContender(
        MUON_FSDP,
        _fully_sharded,
        _lwjax(muon=True),
        LWJAX_OUTPUTS,
        muon=True,
        overhead_over=(ADAMW_FSDP,),
    ),
    *(
        TrainContender(
            name,
            lambda cfg: cfg.optax_form,
            _optax_form(per_device=per_device),
            muon=True,
            compared_with=MUON,  # make_train_step's per-device step
        )
        for name, per_device in zip(OPTAX_FORM_CONTENDERS, (False, True))
    ),
    TrainContender(
        MUON_OVERLAP,
        lambda cfg: cfg.overlap_param_gather,
        _lwjax(muon=True, overlap=True),
        LWJAX_OUTPUTS,
        muon=True,
        overhead_over=(ADAMW_OVERLAP,),  # against AdamW with the same gathers
    ),
    TrainContender(ADAMW_SHARDED, _adamw(_replicating), _lwjax(muon=False), LWJAX_OUTPUTS),
    TrainContender(ADAMW_FSDP, _adamw(_fully_sharded), _lwjax(muon=False), LWJAX_OUTPUTS),
    TrainContender(
        ADAMW_OVERLAP,
        _adamw(lambda cfg: cfg.overlap_param_gather),
        _lwjax(muon=False, overlap=True),
        LWJAX_OUTPUTS,
    ),
    TrainContender(ADAMW_REPLICATED, lambda cfg: cfg.baselines, _optax_adamw),
    TrainContender(FORWARD_BACKWARD, lambda cfg: True, _forward_backward, outputs=()),
)
