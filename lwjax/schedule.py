r"""The order in which a device updates its buckets, and which update hides each all-gather.

After the gradient norm, a step updates every bucket it owns a shard of and
gathers each updated bucket. The gathers are asynchronous collectives, so they
can run while later buckets compute, but XLA's scheduler keeps one collective
in flight at a time and, left to its own cost estimates, puts the all-gathers
after the last Newton–Schulz, where nothing hides them. A
:class:`BucketSchedule` decides instead:

* the update order: elementwise buckets (cheap to update, large to gather:
  the embedding and the output layer) each followed by a layer-wise bucket,
  layer-wise buckets from the most Newton–Schulz work to the least, so the
  gathers left exposed at the end are small ones;
* for each bucket's gather, the one later update it runs alongside: the first
  unclaimed update long enough to hide it, else the longest unclaimed one.
  The step makes the gather land before the update after that one
  (optimization barriers), which leaves XLA no later place to put it.

The estimates only have to rank things; their constants are round numbers
for an H100/H200 (bf16 matmul rate, HBM and NVLink bus bandwidth), and only
their ratios matter:

.. math::

   t_\text{update} = \frac{F_\text{NS}}{R_\text{mm}} + \frac{S\,\beta}{B_\text{mem}},
   \qquad
   t_\text{gather} = \frac{S\,(d - 1)\,b_\text{param}}{B_\text{bus}}

with :math:`S` the shard size, :math:`\beta` the bytes an update moves per
element, :math:`d` the number of shards and :math:`F_\text{NS}` the
Newton–Schulz FLOPs of the shard's batched matrices (every rank runs the
same batch width), those of the joint pass left out: the step orthogonalises
them before any update (:mod:`lwjax.joint_directions`, :func:`lwjax.parallel.ns_deal.is_joint`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lwjax.cost import DEFAULT_NUM_NS_STEPS, ns_flops
from lwjax.parallel.ns_deal import is_joint
from lwjax.param_plan import ParamPlan, SlotGroup

MATMUL_FLOPS_PER_S = 600e12
MEMORY_BYTES_PER_S = 3e12
BUS_BYTES_PER_S = 300e9
MUON_BYTES_PER_ELEMENT = 40  # grad, momentum, master in and out, bf16 copies
ELEMENTWISE_BYTES_PER_ELEMENT = 32  # grad, two moments, master in and out, bf16 copy


@dataclasses.dataclass(frozen=True)
class BucketStep:
    """One bucket's update in a :class:`BucketSchedule`.

    Attributes:
      buffer, bucket: Which bucket (indices into ``plan.buffers`` and its buckets).
      layer_wise: Whether the bucket holds Muon matrices.
      update_s: Estimated time of the update of one shard.
      gather_s: Estimated time of the bucket's all-gather.
      gathered_during: Position (in the schedule) of the later update that
        runs while this bucket is gathered, or ``None``: after the last update.
    """

    buffer: int
    bucket: int
    layer_wise: bool
    update_s: float
    gather_s: float
    gathered_during: int | None = None


@dataclasses.dataclass(frozen=True)
class BucketSchedule:
    """Bucket updates in program order (see the module docstring)."""

    steps: tuple[BucketStep, ...]

    def lands_before(self, t: int) -> list[int]:
        """Positions of the buckets whose gathers must land before update ``t`` starts."""
        return [
            j
            for j, s in enumerate(self.steps)
            if s.gathered_during is not None and s.gathered_during + 1 == t
        ]

    @property
    def exposed_gather_s(self) -> float:
        """Estimated all-gather time no update hides."""
        return sum(
            max(
                0.0,
                s.gather_s
                - (
                    self.steps[s.gathered_during].update_s if s.gathered_during is not None else 0.0
                ),
            )
            for s in self.steps
        )


def _group_flops(group: SlotGroup, num_ns_steps: int, transpose: bool, split_qkv: bool) -> int:
    """Newton–Schulz FLOPs of one matrix of a slot group, rows as outputs.

    A QKV split that does not divide the rows is left to fail in
    :func:`lwjax.muon.orthogonalize`, which names the parameter.
    """
    shape = group.shape[::-1] if transpose else group.shape
    split = group.qkv_split_shapes if split_qkv else None
    if split and shape[0] % sum(split):
        split = None
    return ns_flops(shape, num_ns_steps, split)


def _estimates(
    plan: ParamPlan, num_ns_steps: int, transpose: bool, split_qkv: bool
) -> list[BucketStep]:
    steps = []
    for i, buffer in enumerate(plan.buffers):
        itemsize = np.dtype(buffer.key.param_dtype).itemsize
        for k, size in enumerate(buffer.shard_sizes):
            if buffer.key.is_layer_wise:
                flops = sum(  # the joint pass orthogonalises before any update
                    g.width * _group_flops(g, num_ns_steps, transpose, split_qkv)
                    for g in buffer.slot_groups
                    if g.bucket == k and not is_joint(g, buffer)
                )
                update_s = (
                    flops / MATMUL_FLOPS_PER_S + size * MUON_BYTES_PER_ELEMENT / MEMORY_BYTES_PER_S
                )
            else:
                update_s = size * ELEMENTWISE_BYTES_PER_ELEMENT / MEMORY_BYTES_PER_S
            gather_s = size * (buffer.dp - 1) * itemsize / BUS_BYTES_PER_S
            steps.append(BucketStep(i, k, buffer.key.is_layer_wise, update_s, gather_s))
    return steps


def schedule_buckets(
    plan: ParamPlan,
    *,
    num_ns_steps: int = DEFAULT_NUM_NS_STEPS,
    transpose: bool = False,
    split_qkv: bool = True,
) -> BucketSchedule:
    """Order ``plan``'s bucket updates and pair each all-gather with a later update.

    Args:
      plan: The model's :class:`~lwjax.plan.ParamPlan`.
      num_ns_steps: Newton–Schulz iterations (for the FLOP estimate).
      transpose: Matrices are stored ``(in, out)``, so a QKV split cuts their
        columns (``matrix_convention="in_out"`` with a QKV split or a
        non-spectral scale).
      split_qkv: Fused QKV matrices are orthogonalised per q/k/v block.

    Returns:
      A :class:`BucketSchedule` holding every bucket once.
    """
    steps = _estimates(plan, num_ns_steps, transpose, split_qkv)
    elementwise = [s for s in steps if not s.layer_wise]
    layer_wise = sorted((s for s in steps if s.layer_wise), key=lambda s: -s.update_s)
    order = []
    for e in range(max(len(elementwise), len(layer_wise))):
        order += elementwise[e : e + 1] + layer_wise[e : e + 1]
    during: list[int | None] = [None] * len(order)
    claimed: set[int] = set()
    for j, step in enumerate(order):
        free = [t for t in range(j + 1, len(order)) if t not in claimed]
        if step.gather_s == 0 or not free:
            continue
        t = next(
            (t for t in free if order[t].update_s >= step.gather_s),
            max(free, key=lambda t: order[t].update_s),
        )
        during[j] = t
        claimed.add(t)
    return BucketSchedule(
        tuple(dataclasses.replace(s, gathered_during=d) for s, d in zip(order, during))
    )
