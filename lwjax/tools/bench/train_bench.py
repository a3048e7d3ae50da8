"""Benchmark of a full training step: lwjax Muon against AdamW on the same Llama.

:mod:`lwjax.tools.bench.optimizer_bench` times the optimizer alone. This module times what a
user pays per step: forward, backward and optimizer of a Megatron-shaped Llama, data
parallel over a 1-D mesh axis ``dp``, and reports Muon's overhead over AdamW.

Model. Megatron-Core's GPT of :mod:`lwjax.megatron.model` (the one the
Megatron import runs) over the tree of the workload's
:class:`~lwjax.megatron.gpt.GPTConfig` (:data:`lwjax.tools.bench.WORKLOADS`):
weights ``[out, in]``, layers stacked and scanned, or with ``scan_layers=False``
a list of per-layer trees run one after the other (optionally rematerialised),
parameters and activations in ``param_dtype``, fp32 norms, rotary embeddings,
softmax and logits for the mean next-token cross-entropy.

Data. One fixed batch of uniformly random tokens (``micro_batch`` sequences of
``seq_len + 1`` tokens per device) is reused every step: synthetic, since the
step time does not depend on the token values.

Contenders (:mod:`lwjax.tools.bench.train_contenders`, each registered once) are
each one jitted ``shard_map`` step over the same devices and batch, parameters
and optimizer state donated; forward+backward alone is the floor: each other
contender's ``optimizer_ms`` is its step time minus that one's.

With ``overlap_param_gather`` two more contenders run lwjax Muon and lwjax
AdamW as ``make_train_step(..., overlap_param_gather=True)`` does: the step
keeps only the state, and all-gathers every bucket from the masters at the
start of the next step, where XLA may run each gather under the forward pass.

Fully sharded (``fsdp``, :mod:`lwjax.tools.bench.fsdp`): the mesh is
``("dp", "fsdp") = (1, n)``, every parameter split over ``fsdp`` on its last axis and the
batch over both axes. The forward all-gathers each layer just before it runs (with
``remat`` again in the backward) and the backward
reduce-scatters each layer's gradient as its turn in the scan ends; lwjax
Muon (``param_axes="fsdp"``, whole matrices by ``"duplicated"``) and lwjax
AdamW then update the blocks in place, and forward+backward is the same
gathers and reduce-scatters without an optimizer. No contender holds a whole
copy of the model, so none can be the replicated optax AdamW.

Each is timed as the median of ``iters`` steps after ``warmup`` steps,
synchronised with ``jax.block_until_ready``. Memory is XLA's buffer
assignment for the compiled step; on GPU it matched the allocator's
measured peak (``peak_bytes_so_far``) for every contender.
"""

from __future__ import annotations

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from lwjax.megatron.gpt import GPTConfig
from lwjax.tools.bench.compiled import compiled_summary
from lwjax.tools.bench.config import TrainBenchConfig
from lwjax.tools.bench.floor import newton_schulz_floor
from lwjax.tools.bench.fsdp import FSDP_AXIS
from lwjax.tools.bench.megatron_scripts import megatron_train_records
from lwjax.tools.bench.profile import profile_steps
from lwjax.tools.bench.synthetic import synthetic_batch
from lwjax.tools.bench.timing import pgle, time_steps, warmup_calls
from lwjax.tools.bench.train_contenders import (
    FORWARD_BACKWARD,
    TRAIN_STEP_CONTENDERS,
    BuiltStep,
    TrainContender,
    TrainSetting,
    train_setting,
)
from lwjax.tools.demo.devices import bytes_per_device

PROFILED_STEPS = 3  # traced after the timed ones, with profile_dir
# Dense bf16 peak of one device in FLOP/s, by a substring of ``device_kind`` (vendor
# datasheets, SXM parts).
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


def model_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    r"""Training FLOPs per token: :math:`6N + 6 L T H d`.

    :math:`N` counts the parameters of every matrix product (the layers' four
    matrices and the output layer; not the embedding lookup or the norms), at
    2 FLOPs per multiply-add and 3 products (forward, two backward) each. The
    second term is causal attention: :math:`QK^\top` and :math:`AV` cost
    :math:`2 \cdot 2 T H d` per token and layer without the mask, half with
    it, times 3. Recomputation (remat) is not counted (model FLOPs, not hardware FLOPs).
    """
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    heads, groups = config.num_attention_heads, config.num_query_groups
    per_layer = (heads + 2 * groups) * d * h + h * heads * d + 2 * f * h + h * f
    matmul_params = config.num_layers * per_layer + config.vocab_size * h
    return 6 * matmul_params + 6 * config.num_layers * seq_len * heads * d


def run_train_bench(cfg: TrainBenchConfig) -> list[dict]:
    """Time a full training step: lwjax Muon, lwjax AdamW, optax AdamW, forward+backward alone.

    Returns:
      One record per (contender, dp): ``step_ms`` (median), ``tokens_per_s``
      (global), ``mfu`` (model FLOPs utilisation over all dp devices, see
      :func:`model_flops_per_token`; ``None`` without a known peak),
      ``optimizer_ms`` (``step_ms`` minus forward+backward's), ``floor_ms``
      (what no schedule removes from the step: forward+backward's
      ``step_ms``, plus for lwjax's Muon steps the busiest rank's
      Newton–Schulz, ``ns_computed_ms`` of the Muon record's
      ``newton_schulz``, :func:`lwjax.tools.bench.newton_schulz_floor`; not
      recorded for the fully sharded Muon),
      ``compiled_bytes_per_device`` (XLA's estimate for the step),
      ``peak_bytes_so_far`` (the process's first device's peak memory since it
      started, a running maximum over the records; ``None`` on CPU),
      ``device_bytes_limit`` (what XLA may allocate on a device; ``None`` on
      CPU), ``replicated_bytes`` (the parameters in ``param_dtype`` plus fp32
      gradients: what one device would hold before any optimizer state if
      the model were replicated), ``state_bytes_per_device`` (parameters plus optimizer state on one
      device), ``loss`` of one more step after the timed ones,
      ``attention`` (``"cudnn"`` where the compiled step calls cuDNN's fused
      attention, else ``"xla"``), ``grad_norm`` of that step (lwjax contenders:
      above ``clip_grad``, the clip bound, so a pipelined Muon step ran
      serially, or recomputed its directions if the step before did not clip),
      ``profile`` (with ``profile_dir``: :func:`lwjax.tools.bench.profile_steps`'s
      summary of device 0's kernels; empty without a GPU), and the settings
      (``warmup``: the untimed calls each contender made first). The Muon
      record adds ``muon_overhead_pct``: per other contender,
      :math:`100\\,(t_\\text{Muon} / t - 1)`. With ``megatron_script``,
      Megatron-Core's contenders follow each dp size's
      (:func:`~lwjax.tools.bench.megatron_scripts.megatron_train_records`, run before JAX
      starts, which then holds most of each GPU's memory).
    """
    model = cfg.model()
    # Megatron first: once JAX starts, XLA holds most of each GPU's memory (75% by default).
    megatron = {
        dp: megatron_train_records(cfg, dp, dp * cfg.micro_batch * cfg.seq_len)
        for dp in (cfg.dp_sizes if cfg.megatron_script else ())
    }
    devices = jax.devices()
    flops_per_token = model_flops_per_token(model, cfg.seq_len)
    peak = _peak_flops(cfg, devices[0])
    contenders = [c for c in TRAIN_STEP_CONTENDERS if c.runs(cfg)]
    records = []
    for dp in cfg.dp_sizes:
        if dp > len(devices):
            raise ValueError(
                f"TrainBenchConfig.dp_sizes: dp={dp} exceeds the {len(devices)} available devices."
            )
        setting = _setting(cfg, devices[:dp])
        base = _base_record(cfg, model, dp, flops_per_token, devices[0])
        tokens = base["tokens_per_step"]
        rows = {}
        for contender in contenders:
            r = _run_contender(contender, setting)
            seconds = r["step_ms"] / 1e3
            r["tokens_per_s"] = tokens / seconds
            r["mfu"] = tokens * flops_per_token / (seconds * dp * peak) if peak else None
            rows[contender.name] = dict(base, contender=contender.name, **r)
        _compare(rows, contenders)
        records += rows.values()
        for r in megatron.get(dp, ()):
            seconds = r.get("step_ms", 0) / 1e3
            mfu = tokens * flops_per_token / (seconds * dp * peak) if peak and seconds else None
            records.append(dict(base, **r, mfu=mfu))
    return records


def _setting(cfg: TrainBenchConfig, devices) -> TrainSetting:
    """The mesh over ``devices`` (``("dp", "fsdp") = (1, n)`` with ``cfg.fsdp``), the batch
    split over its data axes, and the loss."""
    dp = len(devices)
    if cfg.fsdp:
        mesh = Mesh(np.array(devices).reshape(1, dp), ("dp", FSDP_AXIS))
    else:
        mesh = Mesh(np.array(devices), ("dp",))
    batch = synthetic_batch(
        mesh,
        cfg.micro_batch,
        cfg.seq_len,
        cfg.model().vocab_size,
        cfg.seed,
        axis=("dp", FSDP_AXIS) if cfg.fsdp else "dp",
    )
    return train_setting(cfg, mesh, batch)


def _base_record(cfg: TrainBenchConfig, model: GPTConfig, dp: int, flops_per_token, device):
    """What every record of one dp size shares: the workload, the shape of the step, settings."""
    numel = sum(math.prod(s) for s in model.param_shapes().values())
    return dict(
        workload=cfg.workload,
        layers=model.num_layers,
        params=numel,
        dp=dp,
        seq_len=cfg.seq_len,
        micro_batch=cfg.micro_batch,
        global_batch=dp * cfg.micro_batch,
        tokens_per_step=dp * cfg.micro_batch * cfg.seq_len,
        remat=cfg.remat,
        param_dtype=cfg.param_dtype,
        fsdp=cfg.fsdp,
        # parameters (param_dtype) and fp32 gradients whole on every device: the criterion
        # of a model too big to replicate
        replicated_bytes=numel * (jnp.dtype(cfg.param_dtype).itemsize + 4),
        model_flops_per_token=flops_per_token,
        pipeline_muon=cfg.pipeline_muon,
        overlap_param_gather=cfg.overlap_param_gather,
        scan_layers=cfg.scan_layers,
        pgle=cfg.pgle,
        iters=cfg.iters,
        warmup=warmup_calls(cfg.warmup, cfg.pgle),
        device=device.device_kind,
        jax=jax.__version__,
    )


def _compare(rows: dict[str, dict], contenders: list[TrainContender]) -> None:
    """Add to each row its ``optimizer_ms`` and ``floor_ms`` over forward+backward, and the
    comparisons its contender asks for (``muon_overhead_pct``, ``vs_lwjax_step_pct``)."""
    floor_ms = rows[FORWARD_BACKWARD]["step_ms"]
    # not measured for the fully sharded Muon
    ns = next((r["newton_schulz"] for r in rows.values() if "newton_schulz" in r), None)
    for contender in (c for c in contenders if c.name != FORWARD_BACKWARD):
        row = rows[contender.name]
        row["optimizer_ms"] = row["step_ms"] - floor_ms
        # What no schedule removes: forward+backward, and a Muon step's Newton-Schulz.
        if not contender.muon:
            row["floor_ms"] = floor_ms
        elif ns:
            row["floor_ms"] = floor_ms + ns["ns_computed_ms"]
        if contender.overhead_over:
            row["muon_overhead_pct"] = {
                n: 100 * (row["step_ms"] / rows[n]["step_ms"] - 1)
                for n in contender.overhead_over
                if n in rows
            }
        if contender.compared_with:
            against = rows[contender.compared_with]["step_ms"]
            row["vs_lwjax_step_pct"] = 100 * (row["step_ms"] / against - 1)


def _peak_flops(cfg: TrainBenchConfig, device) -> float | None:
    if cfg.peak_flops:
        return cfg.peak_flops
    return next((peak for kind, peak in PEAK_BF16_FLOPS if kind in device.device_kind), None)


def _run_contender(contender: TrainContender, setting: TrainSetting) -> dict:
    """Build, compile and time one contender at one dp size; its params and state are freed."""
    built = contender.build(setting)
    record = measure(contender, setting, built)
    if contender.measures_newton_schulz:  # the compute Muon adds to forward+backward
        cfg = setting.cfg
        record["newton_schulz"] = newton_schulz_floor(
            built.optimizer.plan, setting.mesh, cfg.ns_precision, cfg.iters, cfg.warmup
        )
    return record


def measure(contender: TrainContender, setting: TrainSetting, built: BuiltStep) -> dict:
    """Compile the built step on its arguments and the batch, time it, and record what it
    holds and, once more after the timed steps, what it returns (``contender.outputs``)."""
    cfg, batch, step, args = setting.cfg, setting.batch, built.step, built.args
    options = {} if cfg.pgle else dict(cfg.compiler_options)  # PGLE compiles through jax.jit
    compiled = step.lower(*args, batch).compile(compiler_options=options)
    record = dict(compiled_summary(compiled), compiler_options=options)
    # Under PGLE the step is called through jit, which profiles the first calls and recompiles; the
    # executable compiled above only gives the memory figures then.
    run = step if cfg.pgle else compiled
    warmup = warmup_calls(cfg.warmup, cfg.pgle)
    n = len(args)  # (params, state), the state alone, or forward+backward's params
    if contender.outputs:
        fn = lambda *a: run(*a, batch)[:n]  # noqa: E731
    else:  # the step returns none of its arguments: they are passed again
        fn, args = (lambda *a: (*a[:n], run(*a[:n], batch))), (*args, None)
    with pgle() if cfg.pgle else contextlib.nullcontext():
        seconds, args = time_steps(fn, args, cfg.iters, warmup)
        if cfg.profile_dir:
            name = re.sub("[^a-z0-9]+", "_", contender.name.lower()).strip("_")
            record["profile"], args = profile_steps(
                fn, args, PROFILED_STEPS, f"{cfg.profile_dir}/{name}"
            )
        record["state_bytes_per_device"] = bytes_per_device(args[:n])
        if contender.outputs:
            out = run(*args, batch)
            for i, key in enumerate(contender.outputs):
                record[key] = float(out[n + i])
    record["step_ms"] = seconds * 1e3
    # this process's first device: under jax.distributed the mesh's first may be another's
    stats = setting.mesh.local_devices[0].memory_stats()  # None on CPU
    record["peak_bytes_so_far"] = stats.get("peak_bytes_in_use") if stats else None
    record["device_bytes_limit"] = stats.get("bytes_limit") if stats else None
    return record
