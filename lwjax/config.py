"""The optimizer's options that are not learning rates, transforms, layout or routing (pure Python).

:class:`OptimizerConfig` crosses layers: :func:`lwjax.layerwise_muon` takes it,
the :class:`~lwjax.plan.StepPlan` carries it and the step reads it. It lives
below all of them and imports no jax, so the plan and the CLI can name it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeAlias

import ml_dtypes
import numpy as np

from lwjax.routing import is_finite_nonnegative

if TYPE_CHECKING:
    import jax

ScalarOrSchedule: TypeAlias = "float | Callable[[jax.Array], jax.Array]"
ParamSync = Literal["all_gather", "broadcast"]
MatrixConvention = Literal["in_out", "out_in"]

PARAM_SYNCS = ("all_gather", "broadcast")
MATRIX_CONVENTIONS = ("in_out", "out_in")

# ml_dtypes' floating dtypes (bfloat16, float8_*, ...): numpy files them under kind "V".
_ML_FLOAT_DTYPES = frozenset(
    np.dtype(kind)
    for name, kind in vars(ml_dtypes).items()
    if name.startswith(("bfloat", "float")) and isinstance(kind, type)
)


def is_floating_dtype(dtype) -> bool:
    """Whether ``dtype`` names a floating dtype, numpy's or ml_dtypes' (``"bfloat16"``)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype.kind == "f" or dtype in _ML_FLOAT_DTYPES


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Options of :func:`lwjax.layerwise_muon` beside learning rates, transforms, layout, routing.

    Attributes:
      weight_decay: Decoupled weight decay for Muon matrices and for
        elementwise parameters with 2+ dims (Megatron's ``--weight-decay``);
        biases, norms and other 1-D parameters get none. A float, or a
        schedule ``count -> value`` evaluated at the state's count like the
        learning rate (Megatron's ``--weight-decay-incr-style``; see
        :mod:`lwjax.megatron.schedules`). A float is a constant of the
        compiled step; a step whose scheduled value is not a finite number
        >= 0 is skipped, like one with a non-finite learning rate.
      clip_grad: Clip to this global L2 norm (``--clip-grad``); ``0`` or ``None`` disables.
      grad_reduce_in_fp32: Reduce gradients in fp32 (Megatron's
        ``--accumulate-allreduce-grads-in-fp32``); else in the parameter dtype.
      master_dtype: Dtype of master weights and optimizer state.
      matrix_convention: How 2-D parameters are stored: ``"in_out"`` (flax
        kernels, ``x @ W``) or ``"out_in"`` (Megatron/torch weights). Muon's
        scale modes and QKV split read rows as the output dimension.
      param_sync: How updated parameters reach every device: ``"all_gather"``
        (one tiled all-gather per bucket) or ``"broadcast"``, Megatron's
        reference path (each owner's shard broadcast; bitwise equal).
      pipeline_muon: Start each layer-wise bucket's Muon direction (momentum,
        Newton–Schulz) as soon as its gradient shard arrives
        (:mod:`lwjax.pipelined`). Exact without clipping. With clipping it
        speculates that no Muon matrix's clip coefficient is below 1, and only
        after a step that needed no Muon clip (``LayerwiseState.speculate``;
        otherwise the step is the serial one): it computes the directions
        again where the speculation fails (``metrics["recomputed"]``), so a
        step that clips right after one that did not runs momentum and
        Newton–Schulz twice. ``make_train_step`` makes the choice on the host
        (:mod:`lwjax.speculation`), from the step before last: there the first
        two steps that clip after steps that did not run it twice. It pays off
        for the optimizer step alone under XLA's profile-guided scheduling;
        see ``docs/configuration.md`` for what was measured.
    """

    weight_decay: ScalarOrSchedule = 0.01
    clip_grad: float | None = 1.0
    grad_reduce_in_fp32: bool = True
    master_dtype: str = "float32"
    matrix_convention: MatrixConvention = "in_out"
    param_sync: ParamSync = "all_gather"
    pipeline_muon: bool = False

    def __post_init__(self):
        if self.param_sync not in PARAM_SYNCS:
            raise ValueError(
                f"OptimizerConfig.param_sync must be one of {PARAM_SYNCS}; got {self.param_sync!r}."
            )
        if self.matrix_convention not in MATRIX_CONVENTIONS:
            raise ValueError(
                "OptimizerConfig.matrix_convention must be 'in_out' or 'out_in'; "
                f"got {self.matrix_convention!r}."
            )
        if self.clip_grad is not None and not is_finite_nonnegative(self.clip_grad):
            raise ValueError(
                f"OptimizerConfig.clip_grad must be a finite number >= 0 or None; "
                f"got {self.clip_grad!r}."
            )
        if not callable(self.weight_decay) and not is_finite_nonnegative(self.weight_decay):
            raise ValueError(
                f"OptimizerConfig.weight_decay must be a finite number >= 0 or a schedule "
                f"count -> value; got {self.weight_decay!r}."
            )
        if not is_floating_dtype(self.master_dtype):
            raise ValueError(
                "OptimizerConfig.master_dtype must be a floating dtype such as 'float32'; "
                f"got {self.master_dtype!r}."
            )
