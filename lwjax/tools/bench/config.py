"""What the two benchmarks measure: :class:`BenchConfig` (the optimizer step, ``lwjax bench``)
and :class:`TrainBenchConfig` (a full training step, ``lwjax bench --train-step``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from lwjax.layout import DEFAULT_POLICY
from lwjax.megatron.gpt import ATTENTIONS, GPTConfig
from lwjax.megatron.model import gpt_loss
from lwjax.muon import TP_MODES
from lwjax.tools.bench.timing import WARMUP_STEPS
from lwjax.tools.bench.workloads import WORKLOADS, workload_config
from lwjax.train_options import STEP_COMPILER_OPTIONS

# (seq_len, micro_batch) per workload when not given: the GPU workloads at 2048 tokens, the
# small one CPU-sized.
TRAIN_DEFAULTS = {
    "small": (128, 2),
    "1b": (2048, 4),
    "8b": (2048, 2),
    "70b": (2048, 1),
    "405b": (2048, 1),
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What :func:`~lwjax.tools.bench.optimizer_bench.run_bench` measures.

    Attributes:
      workload: A key of :data:`~lwjax.tools.bench.workloads.WORKLOADS`.
      layers: Transformer layers (``None``: the workload's default).
      dp_sizes: Data-parallel sizes to run (each ≤ the device count).
      iters: Timed steps per measurement (median reported), and steps of the
        back-to-back window (:func:`~lwjax.tools.bench.timing.time_back_to_back`).
      warmup: Untimed steps first (:data:`~lwjax.tools.bench.timing.WARMUP_STEPS`).
      param_dtype: Parameter (compute) dtype.
      grad_reduce_in_fp32: Reduce gradients in fp32, else in ``param_dtype``.
      ns_precision: Newton–Schulz precision (``"medium"`` = bf16, Megatron's default).
      policy: lwjax layout policy.
      bucket_size: lwjax bucket size in elements, ``None`` (one bucket per
        buffer) or ``"auto"`` (the optimizer's default). Megatron always runs
        with one bucket per buffer, its default without overlapped reduction.
      baselines: Also time replicated ``optax.contrib.muon``.
      megatron_script: Path of ``megatron_bench.py`` (``shared/perf``); when
        set, Megatron-Core's layer-wise optimizer is timed too, one ``torchrun``
        per dp size, before JAX touches the devices.
      profile_dir: Also trace a few lwjax steps there and summarise kernel
        time per kind and communication/compute overlap (GPU).
      pgle: Compile lwjax's step with XLA's profile-guided latency estimates
        (JAX's PGLE: the first :data:`~lwjax.tools.bench.timing.PGLE_RUNS` calls are
        profiled, then the step is recompiled), so XLA's scheduler knows what the
        all-gathers and updates really cost.
      grad_std: Standard deviation of every device's random gradients (as
        ``megatron_bench.py``'s ``--grad-std``, passed on to it). The mean
        gradient's norm is about ``grad_std * sqrt(N / dp)`` for ``N``
        parameters (reported): the default 1e-2 puts it far above the clip
        (1.0), so clipping binds on every step; 2e-5 keeps it below for the 8b
        and 1b workloads at dp ≥ 2, as in most steps of a pretraining run.
      pipeline_muon: lwjax's ``OptimizerConfig.pipeline_muon``.
      tp: Tensor-parallel size: each dp size runs on ``dp * tp`` devices, the
        parameters split over ``tp`` by
        :meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`. At ``tp > 1`` the floor
        and the optax baseline are skipped (named in the record).
      tp_mode: How a split Muon matrix is orthogonalised
        (``MuonConfig.tp_mode``, Megatron's ``--muon-tp-mode``; passed to both).
      replica: lwjax's sharding groups (``layerwise_muon``'s ``replica_axis``): each dp size
        runs as ``replica`` groups of ``dp / replica`` devices, the layout spanning one group
        and every group holding a copy of the optimizer state; ``"auto"``: the groups
        :func:`lwjax.groups.choose_groups` picks for ``policy``. The baselines are unaffected.
    """

    workload: str = "small"
    layers: int | None = None
    dp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    iters: int = 10
    warmup: int = WARMUP_STEPS
    param_dtype: str = "bfloat16"
    grad_reduce_in_fp32: bool = True
    ns_precision: str = "medium"
    policy: str = "ns_cost"
    bucket_size: int | str | None = "auto"
    baselines: bool = True
    megatron_script: str | None = None
    profile_dir: str | None = None
    pgle: bool = False
    grad_std: float = 1e-2
    pipeline_muon: bool = False
    tp: int = 1
    tp_mode: str = "duplicated"
    replica: int | str = 1

    def __post_init__(self):
        if not self.grad_std > 0:
            raise ValueError(f"BenchConfig.grad_std must be positive; got {self.grad_std!r}.")
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"BenchConfig.workload must be one of {tuple(WORKLOADS)}; got {self.workload!r}."
            )
        if not self.dp_sizes or min(self.dp_sizes) < 1:
            raise ValueError(
                f"BenchConfig.dp_sizes must be positive integers; got {self.dp_sizes!r}."
            )
        if not (isinstance(self.tp, int) and self.tp >= 1):
            raise ValueError(f"BenchConfig.tp must be a positive integer; got {self.tp!r}.")
        if self.tp_mode not in TP_MODES:
            raise ValueError(
                f"BenchConfig.tp_mode must be one of {TP_MODES}; got {self.tp_mode!r}."
            )
        if self.replica != "auto" and not (
            isinstance(self.replica, int)
            and not isinstance(self.replica, bool)
            and self.replica >= 1
        ):
            raise ValueError(
                f"BenchConfig.replica must be a positive integer or 'auto'; got {self.replica!r}."
            )
        undivided = [dp for dp in self.dp_sizes if self.replica != "auto" and dp % self.replica]
        if undivided:
            raise ValueError(
                f"BenchConfig.replica={self.replica} must divide every dp size (groups of "
                f"dp / replica devices); dp={undivided[0]} does not divide by it."
            )


@dataclasses.dataclass(frozen=True)
class TrainBenchConfig:
    """What :func:`~lwjax.tools.bench.train_bench.run_train_bench` measures.

    Attributes:
      workload: A key of :data:`lwjax.tools.bench.WORKLOADS`.
      layers: Transformer layers (``None``: the workload's default).
      dp_sizes: Data-parallel sizes to run (each ≤ the device count).
      seq_len: Tokens per sequence (``None``: :data:`TRAIN_DEFAULTS`).
      micro_batch: Sequences per device per step (``None``: :data:`TRAIN_DEFAULTS`);
        the global batch is ``micro_batch * dp``.
      remat: Recompute each layer's activations in the backward pass.
      attention: ``"auto"``, ``"cudnn"`` or ``"xla"``: every JAX contender's attention
        (:func:`lwjax.megatron.model.gpt_logits`; ``"auto"`` is cuDNN's fused attention on a
        GPU in bf16). ``"xla"`` lets a fully sharded step run with
        ``--xla_gpu_deterministic_ops``: with cuDNN's it aborts on 2 GPUs (jax 0.11.2).
      iters: Timed steps per measurement (median reported).
      warmup: Untimed steps first (:data:`lwjax.tools.bench.WARMUP_STEPS`).
      param_dtype: Parameter and activation dtype (the replicated optax
        contender keeps fp32 parameters and casts them in the forward).
      grad_reduce_in_fp32: lwjax reduces gradients in fp32, else in ``param_dtype``.
      ns_precision: Newton–Schulz precision (``"medium"`` = bf16, Megatron's default).
      policy: lwjax layout policy.
      bucket_size: lwjax bucket size in elements, ``None`` or ``"auto"``.
      learning_rate: Learning rate of every contender (Muon and Adam alike, as in
        :mod:`lwjax.tools.bench`).
      weight_decay: Decoupled weight decay on matrices (not on norms).
      clip_grad: Global gradient-norm clip of every contender; ``None`` or ``0`` disables.
      pipeline_muon: lwjax Muon's ``OptimizerConfig.pipeline_muon``.
      pgle: Compile every contender's step with JAX's profile-guided latency
        estimates (:func:`lwjax.tools.bench.pgle`; the profiled calls are part of
        the warm-up), as :class:`lwjax.tools.bench.BenchConfig` does for the
        optimizer step.
      baselines: Also time the replicated optax AdamW.
      adamw: Also time lwjax AdamW (each lwjax Muon contender's counterpart); ``False``:
        lwjax Muon and forward+backward only, as when the device memory is held to what
        Muon's step needs (AdamW's state is larger).
      optax_form: Also time lwjax Muon as an optax transformation in a plain
        ``jax.jit`` step, with gradients from ``jax.grad`` (all-reduced by
        GSPMD) and from :func:`lwjax.value_and_grad` (reduce-scattered).
      peak_flops: Peak FLOP/s of one device for MFU; ``None``: by device kind
        (:data:`~lwjax.tools.bench.train_bench.PEAK_BF16_FLOPS`), and no MFU for
        unknown kinds (CPU).
      seed: Seed of the initial parameters and tokens.
      megatron_script: Also time Megatron-Core's own training step with this
        script (``docs/scripts/megatron_train_bench.py``; GPU host with
        megatron-core installed): Muon and Adam, each without and with
        ``--overlap-grad-reduce --overlap-param-gather``, and forward+backward
        alone, on the same shapes and dp size.
      fsdp: Split every parameter over the ``dp`` devices (an ``fsdp`` mesh
        axis, see :mod:`lwjax.tools.bench.train_bench`) instead of replicating it:
        lwjax Muon, lwjax AdamW and forward+backward, fully sharded.
      overlap_param_gather: Also time lwjax Muon and lwjax AdamW with the
        parameters gathered at the start of the next step (see
        :mod:`lwjax.tools.bench.train_bench`).
      scan_layers: Stack the layers and scan them; ``False``: one leaf per
        layer's parameter, the layers run one after the other
        (:func:`lwjax.megatron.model.unstack_layers`), every contender alike.
      profile_dir: Also trace a few steps of every contender there (GPU), and
        record device 0's kernel time per kind and how much of the
        communication ran beside compute
        (:func:`lwjax.tools.bench.profile_steps`).
      compiler_options: XLA's options for every contender's step,
        ``make_train_step``'s by default
        (:data:`lwjax.train_options.STEP_COMPILER_OPTIONS`); ``{}``: XLA's
        defaults. Under ``pgle`` the steps compile through ``jax.jit`` with
        XLA's defaults (each record says which it had).
    """

    workload: str = "small"
    layers: int | None = None
    dp_sizes: tuple[int, ...] = (1,)
    seq_len: int | None = None
    micro_batch: int | None = None
    remat: bool = False
    attention: str = "auto"
    iters: int = 10
    warmup: int = WARMUP_STEPS
    param_dtype: str = "bfloat16"
    grad_reduce_in_fp32: bool = True
    ns_precision: str = "medium"
    policy: str = DEFAULT_POLICY
    bucket_size: int | str | None = "auto"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    pipeline_muon: bool = False
    pgle: bool = False
    baselines: bool = True
    adamw: bool = True
    optax_form: bool = False
    peak_flops: float | None = None
    seed: int = 0
    megatron_script: str | None = None
    fsdp: bool = False
    overlap_param_gather: bool = False
    scan_layers: bool = True
    profile_dir: str | None = None
    compiler_options: Mapping[str, bool | int | float | str] = STEP_COMPILER_OPTIONS

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"TrainBenchConfig.workload must be one of {tuple(WORKLOADS)}; "
                f"got {self.workload!r}."
            )
        if not self.dp_sizes or min(self.dp_sizes) < 1:
            raise ValueError(
                f"TrainBenchConfig.dp_sizes must be positive integers; got {self.dp_sizes!r}."
            )
        if self.megatron_script and (
            self.workload not in ("1b", "8b") or self.param_dtype != "bfloat16"
        ):
            raise ValueError(
                "TrainBenchConfig.megatron_script: Megatron's training step runs the 1b and 8b "
                f"workloads in bfloat16 only; got workload={self.workload!r}, "
                f"param_dtype={self.param_dtype!r}."
            )
        replicating = {
            name: getattr(self, name)
            for name in ("baselines", "optax_form", "megatron_script")
            if getattr(self, name)
        }
        if self.fsdp and (self.overlap_param_gather or not self.scan_layers):
            raise ValueError(
                "TrainBenchConfig.fsdp needs overlap_param_gather=False and scan_layers=True "
                "(its steps gather each layer of the stacked, scanned model in the forward "
                f"pass already); got overlap_param_gather={self.overlap_param_gather!r}, "
                f"scan_layers={self.scan_layers!r}."
            )
        if self.fsdp and replicating:
            raise ValueError(
                "TrainBenchConfig.fsdp times lwjax's fully sharded steps only; turn off "
                f"baselines, optax_form and megatron_script (they replicate the model); got "
                f"{', '.join(f'{k}={v!r}' for k, v in replicating.items())}."
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"TrainBenchConfig.attention must be one of {ATTENTIONS}; got {self.attention!r}."
            )
        seq_len, micro_batch = TRAIN_DEFAULTS[self.workload]
        object.__setattr__(self, "seq_len", self.seq_len if self.seq_len is not None else seq_len)
        object.__setattr__(
            self, "micro_batch", self.micro_batch if self.micro_batch is not None else micro_batch
        )
        for name, least in (("seq_len", 1), ("micro_batch", 1), ("iters", 1), ("warmup", 0)):
            if getattr(self, name) < least:
                raise ValueError(
                    f"TrainBenchConfig.{name} must be >= {least}; got {getattr(self, name)!r}."
                )

    def model(self) -> GPTConfig:
        """The benchmarked model."""
        return workload_config(self.workload, self.layers)

    def loss(self, gather=None):
        """``loss(params, tokens [B, T + 1])``: mean next-token cross-entropy in ``param_dtype``
        (``gather``: :func:`lwjax.megatron.model.gpt_logits`'s)."""
        config = self.model()

        def loss(params, batch):
            return gpt_loss(
                params,
                (batch[:, :-1], batch[:, 1:]),
                config,
                dtype=self.param_dtype,
                attention=self.attention,
                remat=self.remat,
                gather=gather,
            )

        return loss
