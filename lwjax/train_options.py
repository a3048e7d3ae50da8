"""How the step that :func:`lwjax.make_train_step` builds schedules its communication and
compiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from lwjax.layout import FrozenDict

# XLA's options for the training step (jax.jit's compiler_options). Triton GEMM fusions off:
# every product goes to cuBLAS, whose autotuning is cheap. One H200, jax 0.11.2, dp 1 (bench
# workloads): the 1b Muon step compiles in about 6 s instead of 20 s, and every step measured
# ran as fast or faster (1b Muon 241.9 -> 233.2 ms, forward+backward 162.7 -> 155.5; 8b Muon
# 200.1 -> 198.6); docs/benchmarks.md. XLA's CPU compiler ignores the option.
STEP_COMPILER_OPTIONS = FrozenDict({"xla_gpu_enable_triton_gemm": False})


@dataclasses.dataclass(frozen=True)
class TrainStepOptions:
    """Options of the step's schedule and compilation; none changes its signature or (after the
    first step) what it computes.

    The other overlap, Newton–Schulz under the gradients' reduce-scatters
    (Megatron has none), is ``OptimizerConfig(pipeline_muon=True)``, not an
    option here: it changes the optimizer's plan and its state (the
    speculation flag ``LayerwiseState.speculate``), which the optax form
    (``optimizer.update``) and checkpoints share with this step. The step
    reads it from the optimizer, and with clipping chooses on the host
    whether each step speculates (:mod:`lwjax.speculation`).

    Attributes:
      overlap_param_gather: (Megatron's ``--overlap-param-gather``) The step
        ends with the new state and gathers no parameters; the next step
        all-gathers each bucket from the masters at its start
        (``optimizer.local_params``), and XLA's scheduler may run each gather
        under the forward pass of the layers before the first one that reads
        it. The step then takes and returns ``None`` for the parameters, and
        ``optimizer.gather_params(state)`` returns them (evaluation,
        checkpoints). It computes what the default step computes (the
        parameters are the masters cast to the parameter dtype either way);
        only the first step differs, where the masters cannot hold the
        initial parameters exactly (``master_dtype`` narrower than them).
      fsdp_axes: The optimizer's ``param_axes`` that also split the batch
        (fully sharded data parallelism), a name or a tuple; ``()``: none,
        every parameter axis is tensor-parallel. The loss then runs per
        device over them and sees its blocks of the leaves they split, which
        it gathers with :func:`lwjax.gather_params` where it uses them (one
        scanned layer at a time); the other parameter axes stay XLA's, which
        partitions the model over them (:mod:`lwjax.sharded_gradients`). An
        axis left out here trains the same model with XLA's communication
        over it instead (whole leaves gathered, full-size gradients reduced);
        only batch statistics differ (each device's are over its slice of
        the batch, split over these axes too).
      compiler_options: XLA's options for the step's compilation (``jax.jit``'s
        ``compiler_options``). The default, :data:`STEP_COMPILER_OPTIONS`,
        turns XLA's Triton GEMM fusions off on GPUs, the model's products
        included: autotuning them was most of the Muon step's compile time,
        and cuBLAS ran every measured step as fast or faster. ``{}`` compiles
        with XLA's defaults.

    Raises:
      TypeError: ``overlap_param_gather`` is not a bool; ``fsdp_axes`` is not
        a name or a tuple of names; ``compiler_options`` is not a mapping of
        option names.
    """

    overlap_param_gather: bool = False
    fsdp_axes: str | tuple[str, ...] = ()
    compiler_options: Mapping[str, bool | int | float | str] = STEP_COMPILER_OPTIONS

    def __post_init__(self):
        if not isinstance(self.overlap_param_gather, bool):
            raise TypeError(
                "TrainStepOptions.overlap_param_gather must be a bool; "
                f"got {self.overlap_param_gather!r}."
            )
        axes = (self.fsdp_axes,) if isinstance(self.fsdp_axes, str) else self.fsdp_axes
        if not isinstance(axes, tuple) or not all(isinstance(a, str) for a in axes):
            raise TypeError(
                "TrainStepOptions.fsdp_axes must be a mesh axis name or a tuple of them; "
                f"got {self.fsdp_axes!r}."
            )
        object.__setattr__(self, "fsdp_axes", axes)
        options = self.compiler_options
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise TypeError(
                "TrainStepOptions.compiler_options must be a mapping of XLA option names to "
                f"values; got {options!r}."
            )
        object.__setattr__(self, "compiler_options", FrozenDict(options))
