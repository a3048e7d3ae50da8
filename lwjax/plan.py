"""The static plan of a step: the per-rank tables, the bucket order and the options (pure Python).

:class:`StepPlan` is what :func:`lwjax.planner.plan_step` builds once and
the step (:mod:`lwjax.step`, :mod:`lwjax.pipelined`) reads and never changes:
the per-rank tables of :mod:`lwjax.param_plan` (a :class:`ParamPlan`), the
bucket schedule of :mod:`lwjax.schedule`, and the options with their per-leaf
values. The tables and :class:`~lwjax.parallel.axes.MeshAxes` lived here before
0.5 and keep this path for one release.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lwjax.parallel.axes import MeshAxes as MeshAxes
from lwjax.parallel.axes import as_axis_tuple as as_axis_tuple
from lwjax.param_plan import BufferPlan as BufferPlan
from lwjax.param_plan import ParamPlan
from lwjax.param_plan import Segment as Segment
from lwjax.param_plan import SlotGroup as SlotGroup
from lwjax.param_plan import make_plan as make_plan

if TYPE_CHECKING:
    import optax

    from lwjax.config import OptimizerConfig
    from lwjax.muon import MuonConfig
    from lwjax.schedule import BucketSchedule


@dataclasses.dataclass(frozen=True)
class StepPlan(ParamPlan):
    """Everything static about a step: where parameters live, the bucket order, and the options.

    Built once by :func:`lwjax.planner.plan_step`; the step (:mod:`lwjax.step`)
    reads it and never changes it.

    Attributes:
      schedule: Bucket updates in program order, each gather paired with a later update.
      config: Weight decay, clipping, dtypes and synchronisation.
      muon: The Muon options.
      elementwise: The elementwise optax transform (the update direction of
        non-Muon parameters, without learning rate or weight decay).
      learning_rate: Muon learning rate as a function of the step count.
      adam_learning_rate: Learning rate of the elementwise parameters, likewise.
      master_dtype: Dtype of master weights, optimizer state and reduced gradients.
      transpose: Matrices are stored ``[in, out]`` and read transposed, so
        that rows are outputs for the scale and the QKV split.
      norm_groups: Gradient-norm groups; group 0 (``None``) is the main norm.
      group_of: Per leaf, the index of its norm group.
      lr_mult_of: Per leaf, its learning-rate multiplier.
      decay_of: Per leaf, its weight decay ``weight_decay * wd_mult`` (``0``
        for 1-D parameters); for a scheduled ``weight_decay``, just ``wd_mult``,
        which the step scales by the schedule's value.
    """

    schedule: BucketSchedule
    config: OptimizerConfig
    muon: MuonConfig
    elementwise: optax.GradientTransformation
    learning_rate: Callable[[Any], Any]
    adam_learning_rate: Callable[[Any], Any]
    master_dtype: Any
    transpose: bool
    norm_groups: tuple[str | None, ...]
    group_of: tuple[int, ...]
    lr_mult_of: tuple[float, ...]
    decay_of: tuple[float, ...]
