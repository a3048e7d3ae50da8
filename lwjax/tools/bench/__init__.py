"""``lwjax bench``: lwjax's optimizer step and training step against their contenders.

One module per concern:

* :mod:`~lwjax.tools.bench.config`: :class:`BenchConfig` and :class:`TrainBenchConfig`, what
  the two benchmarks measure;
* :mod:`~lwjax.tools.bench.workloads`: the Megatron-Core GPTs and lwjax's optimizer for them;
* :mod:`~lwjax.tools.bench.synthetic`: constant parameters, random gradients and tokens;
* :mod:`~lwjax.tools.bench.timing`: synchronised and back-to-back timing, warm-up, PGLE;
* :mod:`~lwjax.tools.bench.profile`: traced kernels per kind, communication beside compute;
* :mod:`~lwjax.tools.bench.compiled`: a compiled step's memory and collectives;
* :mod:`~lwjax.tools.bench.floor`: the Newton–Schulz, memory and communication floors;
* :mod:`~lwjax.tools.bench.megatron_scripts`: Megatron-Core's own benchmarks under torchrun;
* :mod:`~lwjax.tools.bench.optimizer_contenders` and
  :mod:`~lwjax.tools.bench.optimizer_bench`: the optimizer step's contenders and
  :func:`run_bench`;
* :mod:`~lwjax.tools.bench.fsdp`, :mod:`~lwjax.tools.bench.train_steps`,
  :mod:`~lwjax.tools.bench.train_contenders` and :mod:`~lwjax.tools.bench.train_bench`: fully
  sharded parameters, the timed training steps, their contenders and
  :func:`run_train_bench` (``lwjax bench --train-step``).

The names below were the public surface of the former ``lwjax/tools/bench.py`` and
``lwjax/tools/train_bench.py`` modules and stay importable from here.
"""

from lwjax.megatron.gpt import MATRIX_CONVENTION
from lwjax.tools.bench.compiled import collectives
from lwjax.tools.bench.config import TRAIN_DEFAULTS, BenchConfig, TrainBenchConfig
from lwjax.tools.bench.floor import (
    MATMUL_CHAIN,
    copy_bandwidth,
    newton_schulz_floor,
    optimizer_step_floor,
    step_bytes,
    symmetric_share,
)
from lwjax.tools.bench.fsdp import FSDP_AXIS, fsdp_param_gather, fsdp_params, fsdp_specs
from lwjax.tools.bench.megatron_scripts import (
    MEGATRON_CONTENDERS,
    megatron_optimizer_step,
    megatron_train_records,
    run_torch_script,
)
from lwjax.tools.bench.optimizer_bench import run_bench
from lwjax.tools.bench.optimizer_contenders import (
    OPTIMIZER_CONTENDERS,
    TP_BASELINE_SKIPPED,
    TP_FLOOR_SKIPPED,
    optimizer_step,
    time_lwjax,
    time_optax,
)
from lwjax.tools.bench.profile import COLLECTIVE_KINDS, kernel_summary, profile_steps
from lwjax.tools.bench.synthetic import constant_params, local_grads, replicated, synthetic_batch
from lwjax.tools.bench.timing import (
    PGLE_RUNS,
    WARMUP_STEPS,
    pgle,
    time_back_to_back,
    time_steps,
    warmup_calls,
)
from lwjax.tools.bench.train_bench import (
    PEAK_BF16_FLOPS,
    PROFILED_STEPS,
    model_flops_per_token,
    run_train_bench,
)
from lwjax.tools.bench.train_contenders import (
    ADAMW_FSDP,
    ADAMW_OVERLAP,
    ADAMW_REPLICATED,
    ADAMW_SHARDED,
    CONTENDERS,
    FORWARD_BACKWARD,
    MUON,
    MUON_FSDP,
    MUON_OPTAX,
    MUON_OPTAX_PER_DEVICE,
    MUON_OVERLAP,
    OPTAX_FORM_CONTENDERS,
    TRAIN_STEP_CONTENDERS,
)
from lwjax.tools.bench.train_steps import (
    forward_backward_step,
    lwjax_optax_step,
    lwjax_optimizer,
    lwjax_step,
    optax_adamw,
    optax_step,
)
from lwjax.tools.bench.workloads import (
    WORKLOADS,
    check_tensor_split,
    workload_config,
    workload_optimizer,
    workload_shapes,
)

__all__ = [
    "ADAMW_FSDP",
    "ADAMW_OVERLAP",
    "ADAMW_REPLICATED",
    "ADAMW_SHARDED",
    "COLLECTIVE_KINDS",
    "CONTENDERS",
    "FORWARD_BACKWARD",
    "FSDP_AXIS",
    "MATMUL_CHAIN",
    "MATRIX_CONVENTION",
    "MEGATRON_CONTENDERS",
    "MUON",
    "MUON_FSDP",
    "MUON_OPTAX",
    "MUON_OPTAX_PER_DEVICE",
    "MUON_OVERLAP",
    "OPTAX_FORM_CONTENDERS",
    "OPTIMIZER_CONTENDERS",
    "PEAK_BF16_FLOPS",
    "PGLE_RUNS",
    "PROFILED_STEPS",
    "TP_BASELINE_SKIPPED",
    "TP_FLOOR_SKIPPED",
    "TRAIN_DEFAULTS",
    "TRAIN_STEP_CONTENDERS",
    "WARMUP_STEPS",
    "WORKLOADS",
    "BenchConfig",
    "TrainBenchConfig",
    "check_tensor_split",
    "collectives",
    "constant_params",
    "copy_bandwidth",
    "forward_backward_step",
    "fsdp_param_gather",
    "fsdp_params",
    "fsdp_specs",
    "kernel_summary",
    "local_grads",
    "lwjax_optax_step",
    "lwjax_optimizer",
    "lwjax_step",
    "megatron_optimizer_step",
    "megatron_train_records",
    "model_flops_per_token",
    "newton_schulz_floor",
    "optax_adamw",
    "optax_step",
    "optimizer_step",
    "optimizer_step_floor",
    "pgle",
    "profile_steps",
    "replicated",
    "run_bench",
    "run_torch_script",
    "run_train_bench",
    "step_bytes",
    "symmetric_share",
    "synthetic_batch",
    "time_back_to_back",
    "time_lwjax",
    "time_optax",
    "time_steps",
    "warmup_calls",
    "workload_config",
    "workload_optimizer",
    "workload_shapes",
]
