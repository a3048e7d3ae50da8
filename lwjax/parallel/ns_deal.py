r"""Which device orthogonalises which split matrix, and the Newton–Schulz work each device does.

Under ``MuonConfig(tp_mode="duplicated")`` every device of a data-parallel
rank's tensor-parallel axes (tensor parallelism, FSDP) holds one block of each
matrix the rank owns; each whole matrix is assembled on one of them,
orthogonalised there, and its blocks are sent back
(:mod:`lwjax.parallel.exchange`). :func:`deal_newton_schulz` chooses that
device: per rank and per set of splitting axes, the rank's matrices of every
slot group of the step are dealt out over the ``t`` devices of the axes
longest-processing-time first (:func:`lwjax.cost.deal`), so the busiest
device carries at most :math:`\tfrac43` of the least achievable load and, when
one matrix outweighs the rest, that matrix alone. A device runs Newton–Schulz
only on the matrices dealt to it, never on padding.

:func:`device_ns_flops` counts the Newton–Schulz FLOPs each device computes
in one step of a plan, as the step computes them (padding included where it is
computed): the table ``lwjax plan`` prints. The step runs Newton–Schulz in
regions, each done when its busiest device is: the joint pass over every
bucket (:mod:`lwjax.joint_directions`: dealt matrices, and at one data-parallel rank
every whole matrix), then each bucket's other slot groups in its update.
:func:`ns_critical_path` sums the busiest device of each region, the figure the deal is
held to. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math

from lwjax.cost import deal, ns_flops
from lwjax.parallel.axes import MeshAxes
from lwjax.param_plan import BufferPlan, ParamPlan, SlotGroup


def whole_shape(axes: MeshAxes, group: SlotGroup, transpose: bool) -> tuple[int, int]:
    """The whole matrix's ``(rows, cols)`` of a slot group's blocks, rows as the step reads them
    (outputs: ``transpose`` reads ``[in, out]`` stored matrices transposed)."""
    rows, cols = group.shape
    (row_axes, col_axes) = group.tensor_split
    rows *= math.prod(axes.tp_sizes[a] for a in row_axes)
    cols *= math.prod(axes.tp_sizes[a] for a in col_axes)
    return (cols, rows) if transpose else (rows, cols)


def matrix_ns_flops(
    shape: tuple[int, int],
    qkv_split_shapes,
    num_ns_steps: int,
    split_qkv: bool,
    symmetric_share=None,
) -> int:
    """Newton–Schulz FLOPs of one matrix of ``shape`` (rows as read), per QKV piece when split
    (``symmetric_share``: :func:`lwjax.cost.ns_flops`')."""
    split = qkv_split_shapes if split_qkv else None
    if split and shape[0] % sum(split):
        split = None  # left to fail in lwjax.muon, which names the parameter
    return ns_flops(shape, num_ns_steps, split, symmetric_share=symmetric_share)


def split_devices(axes: MeshAxes, group: SlotGroup) -> int:
    """The number ``t`` of devices a slot group's matrices are split over."""
    return math.prod(axes.tp_sizes[a] for side in group.tensor_split for a in side)


def deal_newton_schulz(
    plan: ParamPlan, tp_mode: str, transpose: bool, num_ns_steps: int, split_qkv: bool
) -> tuple[BufferPlan, ...]:
    """``plan``'s buffers, every split slot group's devices set
    (:attr:`~lwjax.param_plan.SlotGroup.ns_devices`) under ``tp_mode="duplicated"``;
    unchanged under another mode.

    Per buffer rank axes (:meth:`MeshAxes.of`), rank and splitting axes, the
    rank's matrices of all such groups, in every bucket, are dealt out by
    their Newton–Schulz FLOPs over the ``t`` devices of the axes
    (:func:`lwjax.cost.deal`).
    """
    if tp_mode != "duplicated":
        return plan.buffers
    items: dict[tuple, list[tuple[int, int, int, int]]] = {}  # deal key -> (cost, i, g, slot)
    for i, buffer in enumerate(plan.buffers):
        for g, group in enumerate(buffer.slot_groups):
            if group.tensor_split == ((), ()):
                continue
            cost = matrix_ns_flops(
                whole_shape(plan.axes, group, transpose),
                group.qkv_split_shapes,
                num_ns_steps,
                split_qkv,
            )
            for rank, names in enumerate(group.names):
                key = (plan.axes.of(buffer.key), rank, group.tensor_split)
                items.setdefault(key, []).extend((cost, i, g, s) for s in range(len(names)))
    devices: dict[tuple[int, int], list[list[int]]] = {}  # (i, g) -> per rank, per slot
    for (_, rank, split), dealt in items.items():
        t = math.prod(plan.axes.tp_sizes[a] for side in split for a in side)
        for (_, i, g, s), device in zip(dealt, deal([c for c, *_ in dealt], t)):
            group = plan.buffers[i].slot_groups[g]
            per_rank = devices.setdefault((i, g), [[-1] * len(n) for n in group.names])
            per_rank[rank][s] = device
    return tuple(
        dataclasses.replace(
            buffer,
            slot_groups=tuple(
                dataclasses.replace(group, ns_devices=tuple(map(tuple, devices[(i, g)])))
                if (i, g) in devices
                else group
                for g, group in enumerate(buffer.slot_groups)
            ),
        )
        for i, buffer in enumerate(plan.buffers)
    )


def is_dealt(group: SlotGroup) -> bool:
    """Whether a slot group's matrices are dealt to devices (split, ``tp_mode="duplicated"``):
    its Newton–Schulz runs in the step's joint exchange, before any bucket's update."""
    return bool(group.ns_devices)


def is_joint(group: SlotGroup, buffer: BufferPlan) -> bool:
    """Whether a slot group's Newton–Schulz runs in the step's joint pass
    (:mod:`lwjax.joint_directions`), before any bucket's update: matrices dealt to devices
    (:func:`is_dealt`), and whole matrices in a buffer of one data-parallel rank. That buffer
    gathers nothing for its buckets' updates to hide, and Newton–Schulz of every bucket
    together runs one launch per step's kernels and Gram edge
    (:func:`lwjax.newton_schulz.newton_schulz_many`)."""
    whole = group.tensor_split == ((), ())
    return is_dealt(group) or (buffer.dp == 1 and whole)


def region_ns_flops(plan, symmetric_share=None) -> dict:
    """Per Newton–Schulz region of a step of ``plan``, the FLOPs each device computes in it.

    Keys: ``"joint"`` for the joint pass' matrices of every bucket (:func:`is_joint`),
    ``(buffer, bucket)`` for each layer-wise bucket's other slot groups; values
    are tables as :func:`device_ns_flops` returns (``symmetric_share``: the share of the
    symmetric products a kernel computes, :func:`lwjax.cost.ns_flops`).
    """
    axes = plan.axes
    coords = [_unravel(c, axes.tp_sizes) for c in range(axes.tp_size)]
    tables: dict = {}
    for i, buffer in enumerate(plan.buffers):
        if not buffer.key.is_layer_wise:
            continue
        expert = axes.of(buffer.key) != axes.group
        for group in buffer.slot_groups:
            key = "joint" if is_joint(group, buffer) else (i, group.bucket)
            table = tables.setdefault(key, [[0] * axes.tp_size for _ in range(axes.group_size)])
            for d, row in enumerate(table):
                rank = d // axes.ep_size if expert else d
                for c, at in enumerate(coords):
                    row[c] += _group_work(plan, group, rank, at, symmetric_share)
    return tables


def device_ns_flops(plan, symmetric_share=None) -> list[list[int]]:
    """Newton–Schulz FLOPs per device in one step of ``plan`` (a :class:`~lwjax.plan.StepPlan`),
    as the step computes them.

    ``table[d][c]``: device ``d`` of a sharding group (its index over
    :attr:`MeshAxes.group`, ``dp``-major) and ``c`` of the tensor-parallel axes
    (row-major over ``MeshAxes.tp``); every sharding group does the same work.
    Per slot group of the device's rank:

    * whole matrices (no split): every slot of the group's width, spare slots
      (zeros) included, on every tensor-parallel device;
    * ``"duplicated"``: the matrices dealt to the device (:attr:`SlotGroup.ns_devices`);
    * ``"blockwise"``: every slot of the width on the device's blocks;
    * ``"distributed"``: every slot of the width, the Gram products of the
      device's blocks (the split side contracted) and the small products whole.
    """
    axes = plan.axes
    table = [[0] * axes.tp_size for _ in range(axes.group_size)]
    for region in region_ns_flops(plan, symmetric_share).values():
        for row, add in zip(table, region):
            row[:] = [a + b for a, b in zip(row, add)]
    return table


def ns_critical_path(plan) -> int:
    """The Newton–Schulz FLOPs on a step's critical path: each region's busiest device's
    (:func:`region_ns_flops`), summed.

    A region ends when its busiest device is done (the exchange back, or the
    bucket's gather, waits for it), so this, not the busiest device's total
    over the step, is what the deal must keep near ``max(total / devices,
    largest matrix)``.
    """
    return sum(max(map(max, table)) for table in region_ns_flops(plan).values())


def _group_work(plan, group: SlotGroup, rank: int, at: tuple[int, ...], share=None) -> int:
    """One device's Newton–Schulz FLOPs for a slot group (``at``: its tensor-parallel
    coordinates)."""
    axes, muon, steps = plan.axes, plan.muon, plan.muon.num_ns_steps
    whole = whole_shape(axes, group, plan.transpose)
    flops = lambda shape: matrix_ns_flops(  # noqa: E731
        shape, group.qkv_split_shapes, steps, muon.split_qkv, share
    )
    if group.tensor_split == ((), ()):
        return group.width * flops(whole)
    rows, cols = group.tensor_split
    if plan.transpose:
        rows, cols = cols, rows
    t_rows = math.prod(axes.tp_sizes[a] for a in rows)
    t_cols = math.prod(axes.tp_sizes[a] for a in cols)
    if muon.tp_mode == "duplicated":
        j = _ravel([at[a] for a in (*rows, *cols)], [axes.tp_sizes[a] for a in (*rows, *cols)])
        return flops(whole) * sum(device == j for device in group.ns_devices[rank])
    if muon.tp_mode == "blockwise":
        return group.width * flops((whole[0] // t_rows, whole[1] // t_cols))
    return group.width * _distributed_flops(whole, group, steps, muon.split_qkv, t_rows, t_cols)


def _distributed_flops(whole, group: SlotGroup, steps: int, split_qkv: bool, t_rows, t_cols):
    r"""One device's FLOPs of ``"distributed"`` Newton–Schulz on a matrix split on one side.

    The Gram matrix is ``u x u`` for the unsplit side ``u`` and contracts the
    device's ``b`` of the split side: per step :math:`4 u^2 b + 2 u^3`, per QKV
    piece when split (pieces cut the rows).
    """
    rows, cols = whole
    split = group.qkv_split_shapes if split_qkv else None
    pieces = [rows] if not split or rows % sum(split) else [rows // sum(split) * r for r in split]
    total = 0
    for piece in pieces:
        u, b = (cols, piece // t_rows) if t_rows > 1 else (piece, cols // t_cols)
        total += steps * (4 * u * u * b + 2 * u**3)
    return total


def _unravel(index: int, sizes) -> tuple[int, ...]:
    """Row-major coordinates of ``index`` in a grid of ``sizes``."""
    out = []
    for size in reversed(sizes):
        index, at = divmod(index, size)
        out.append(at)
    return tuple(reversed(out))


def _ravel(coords, sizes) -> int:
    """The row-major index of ``coords`` in a grid of ``sizes``."""
    index = 0
    for at, size in zip(coords, sizes):
        index = index * size + at
    return index
