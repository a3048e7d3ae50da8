"""``lwjax bench``: the optimizer step of lwjax against replicated ``optax.contrib.muon``.

Workloads are Megatron-shaped transformers (:mod:`lwjax.tools.bench.workloads`). Only the
optimizer path is timed: every device is handed its local gradients (the dp-mean is taken
inside the step), the step runs, results are synchronised. The JAX contenders
(:mod:`lwjax.tools.bench.optimizer_contenders`) run in the same process on the same devices.

With tensor parallelism (``BenchConfig.tp > 1``) the devices form a ``dp x tp``
mesh and the parameters are split over ``tp`` as Megatron-Core splits them
(:meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`); lwjax runs with
``param_axes="tp"``, Megatron-Core with ``tensor_model_parallel_size=tp``, both in
``BenchConfig.tp_mode``. The no-overlap floor and the replicated optax baseline are
not measured there (the record says so).

With sharding groups (``BenchConfig.replica``) lwjax runs each dp size as ``replica``
groups of ``dp / replica`` devices: a ``("replica", "dp")`` mesh, the layout over one
group; the baselines run on the dp devices as before.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from lwjax.tools.bench.config import BenchConfig
from lwjax.tools.bench.optimizer_contenders import OPTIMIZER_CONTENDERS
from lwjax.tools.bench.workloads import check_tensor_split, workload_config


def run_bench(cfg: BenchConfig) -> list[dict]:
    """Time lwjax's optimizer step (and the optax baseline) at each dp size.

    Returns:
      One record per (contender, dp): ``step_ms`` (median of synchronised
      steps), ``back_to_back_ms`` (per step, back to back:
      :func:`~lwjax.tools.bench.timing.time_back_to_back`; JAX contenders only),
      ``state_bytes_per_device`` (optimizer state plus fp32 masters held by one device), and
      the settings (``warmup``: the untimed calls the contender made first; ``tp`` and
      ``tp_mode``). Megatron's ``step_ms`` is
      its CUDA-event time of the reduce-scatter plus ``optimizer.step()``.
      At ``tp > 1`` lwjax's record has ``floor_skipped`` (and, with
      ``baselines``, ``baseline_skipped``) instead of the floor and the optax
      record. lwjax's record names its sharding groups: ``replica`` (as asked: a
      number or ``"auto"``), ``replicas`` and ``group_size`` (``dp = replicas *
      group_size``), and under ``"auto"`` the chooser's ``groups_notes``; its floor
      is that of one group's layout, with the all-reduce across groups in ``rs_ms``.
    """
    config = workload_config(cfg.workload, cfg.layers)
    devices = jax.devices()
    numel = sum(int(np.prod(s)) for s in config.param_shapes().values())
    if cfg.tp > 1:
        check_tensor_split(config, cfg.tp)
    for dp in cfg.dp_sizes:
        if dp * cfg.tp > len(devices):
            what = f"dp={dp}" if cfg.tp == 1 else f"dp={dp} x tp={cfg.tp}"
            raise ValueError(
                f"BenchConfig.dp_sizes: {what} exceeds the {len(devices)} available devices."
            )
    contenders = [c for c in OPTIMIZER_CONTENDERS if c.runs(cfg)]
    # torchrun scripts first, every dp size: once JAX starts, XLA holds most of each GPU's memory.
    before = {
        (c.name, dp): c.measure(cfg, dp) for c in contenders if c.torchrun for dp in cfg.dp_sizes
    }
    records = []
    for dp in cfg.dp_sizes:
        mesh = _mesh(devices, dp, cfg.tp)
        base = dict(
            workload=cfg.workload,
            layers=config.num_layers,
            params=numel,
            dp=dp,
            tp=cfg.tp,
            tp_mode=cfg.tp_mode,
            device=devices[0].device_kind,
            jax=jax.__version__,
            iters=cfg.iters,
            warmup=cfg.warmup,
        )
        for c in contenders:
            fields = before[c.name, dp] if c.torchrun else c.measure(cfg, config, mesh)
            records.append(dict(base, contender=c.name, **fields))
    return records


def _mesh(devices, dp: int, tp: int) -> Mesh:
    """``("dp",)`` over ``dp`` devices, or ``("dp", "tp")`` over ``dp * tp`` at ``tp > 1``."""
    if tp == 1:
        return Mesh(np.array(devices[:dp]), ("dp",))
    return Mesh(np.array(devices[: dp * tp]).reshape(dp, tp), ("dp", "tp"))
