"""What a ``Mesh`` decides: the step's mesh axes, sharding groups, and buckets by mesh shape.

:func:`mesh_axes` reads :func:`lwjax.layerwise_muon`'s axis names off the mesh
into a :class:`~lwjax.parallel.axes.MeshAxes`, the only form in which the plan
and the step see a mesh. :func:`group_mesh` and :func:`auto_groups` build a mesh
with sharding groups (Megatron's ``num_optimizer_shards``);
:func:`resolved_layout` sizes ``bucket_size="auto"`` buckets from the axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from jax.sharding import Mesh

from lwjax.config import MatrixConvention
from lwjax.groups import AutoGroups, GroupChoice, choose_groups
from lwjax.layout import LayoutConfig
from lwjax.parallel.axes import MeshAxes, as_axis_tuple
from lwjax.param_tree import route_params
from lwjax.routing import RoutingRules, param_specs

if TYPE_CHECKING:
    from lwjax.muon import MuonConfig


def mesh_axes(
    mesh: Mesh,
    axis: str,
    expert_axis: str | None,
    replica_axis: str | None = None,
    param_axes: str | tuple[str, ...] | None = None,
) -> MeshAxes:
    """Check the axis names of :func:`lwjax.layerwise_muon` against ``mesh`` and return their
    :class:`~lwjax.parallel.axes.MeshAxes`.

    Raises:
      ValueError: a name that is not an axis of ``mesh``, or one named twice.
    """
    tensor_axes = () if param_axes is None else as_axis_tuple(param_axes)
    named = (
        ("axis", axis, "data-parallel"),
        ("expert_axis", expert_axis, "expert-parallel"),
        ("replica_axis", replica_axis, "sharding-group"),
        *(("param_axes", name, "tensor-parallel") for name in tensor_axes),
    )
    for _, name, what in named:
        if name is not None and name not in mesh.axis_names:
            raise ValueError(
                f"layerwise_muon: mesh has axes {mesh.axis_names}; no {what} axis {name!r}."
            )
    given = [(arg, name) for arg, name, _ in named if name is not None]
    if len({name for _, name in given}) < len(given):
        raise ValueError(
            "layerwise_muon: axis, expert_axis, replica_axis and param_axes must differ; got "
            + ", ".join(f"{arg}={name!r}" for arg, name in given)
            + "."
        )
    return MeshAxes(
        axis,
        expert_axis,
        mesh.shape[axis],
        1 if expert_axis is None else mesh.shape[expert_axis],
        replica_axis,
        1 if replica_axis is None else mesh.shape[replica_axis],
        tensor_axes,
        tuple(mesh.shape[name] for name in tensor_axes),
    )


def group_mesh(mesh: Mesh, shards: int, *, axis: str = "dp", replica_axis: str = "replica") -> Mesh:
    """``mesh`` with its ``axis`` split into ``(replica_axis, axis)``: sharding groups of
    ``shards`` consecutive devices (for :func:`lwjax.layerwise_muon`'s ``replica_axis``).

    Consecutive devices along ``axis`` share a group, so on a mesh laid out host by
    host the reduce-scatter and all-gather stay within a host or NVLink domain and
    only the all-reduce of each shard (``1 / shards`` of the bytes) crosses groups.
    :func:`auto_groups` chooses ``shards`` (:func:`lwjax.groups.choose_groups`).

    Raises:
      ValueError: ``axis`` not in the mesh, ``replica_axis`` already in it, or
        ``shards`` not a divisor of the axis size.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"group_mesh: mesh has axes {mesh.axis_names}; no axis {axis!r}.")
    if replica_axis in mesh.axis_names:
        raise ValueError(f"group_mesh: mesh already has an axis named {replica_axis!r}.")
    size = mesh.shape[axis]
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or size % shards:
        raise ValueError(
            f"group_mesh: shards must be a positive divisor of {axis}={size}; got {shards!r}."
        )
    i = mesh.axis_names.index(axis)
    devices = mesh.devices.reshape(
        mesh.devices.shape[:i] + (size // shards, shards) + mesh.devices.shape[i + 1 :]
    )
    names = mesh.axis_names[:i] + (replica_axis, axis) + mesh.axis_names[i + 1 :]
    return Mesh(devices, names)


def mesh_hosts(mesh: Mesh, axis: str, devices_per_host: int | None = None) -> Callable[[int], int]:
    """``G -> hosts the widest group of`` :func:`group_mesh` ``(mesh, G)`` spans.

    A device's host is ``device.id // devices_per_host``, or its process
    (``device.process_index``) when ``devices_per_host`` is ``None``.
    """
    host = np.vectorize(
        (lambda d: d.process_index)
        if devices_per_host is None
        else (lambda d: d.id // devices_per_host),
        otypes=[int],
    )(mesh.devices)
    i = mesh.axis_names.index(axis)

    def hosts(shards: int) -> int:
        split = host.reshape(host.shape[:i] + (-1, shards) + host.shape[i + 1 :])
        groups = np.moveaxis(split, i, 0).reshape(split.shape[i], -1)
        return max(len(set(group.tolist())) for group in groups)

    return hosts


def auto_groups(
    params,
    mesh: Mesh,
    *,
    axis: str = "dp",
    param_axes: str | tuple[str, ...] | None = None,
    groups: AutoGroups = AutoGroups(),
    layout: LayoutConfig = LayoutConfig(),
    routing: RoutingRules = RoutingRules(),
    matrix_convention: MatrixConvention = "in_out",
) -> tuple[Mesh, LayoutConfig, GroupChoice]:
    """The sharding groups :func:`lwjax.groups.choose_groups` picks for ``params`` on ``mesh``:
    ``(group_mesh(mesh, G, replica_axis=groups.name), layout with the chosen policy, the
    choice)``, for :func:`lwjax.layerwise_muon` (which does this itself with
    ``replica_axis="auto"``).

    Each rank's matrices are orthogonalised over its ``param_axes`` devices (their
    sizes' product); hosts are read off the mesh's devices (:func:`mesh_hosts`).
    ``G`` equal to the axis size is one group (the mesh then has a replica axis
    of size 1).

    Raises:
      ValueError: ``axis`` or a ``param_axes`` name not in the mesh, the mesh
        already has an axis named ``groups.name``, or as :func:`~lwjax.groups.choose_groups`.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from lwjax import layerwise_muon
      >>> params = {f"w{i}": jnp.zeros((64, 64)) for i in range(4)}
      >>> grouped, layout, choice = auto_groups(params, Mesh(np.array(jax.devices()[:8]), ("dp",)))
      >>> dict(grouped.shape)  # four matrices: more than 4 shards only pad
      {'replica': 2, 'dp': 4}
      >>> opt = layerwise_muon(params, grouped, replica_axis="replica", layout=layout)
    """
    tensor_axes = () if param_axes is None else as_axis_tuple(param_axes)
    for name in (axis, *tensor_axes):
        if name not in mesh.axis_names:
            raise ValueError(f"auto_groups: mesh has axes {mesh.axis_names}; no axis {name!r}.")
    if groups.name in mesh.axis_names:
        raise ValueError(
            f"auto_groups: mesh already has an axis named {groups.name!r}; name the axis across "
            "groups otherwise (AutoGroups(name=...))."
        )
    specs = param_specs(route_params(params, routing, matrix_convention=matrix_convention))
    choice = choose_groups(
        specs,
        mesh.shape[axis],
        layout,
        policies=groups.policies,
        devices_per_rank=math.prod(mesh.shape[name] for name in tensor_axes),
        hosts=mesh_hosts(mesh, axis, groups.devices_per_host),
        max_padding=groups.max_padding,
        max_ns_ratio=groups.max_ns_ratio,
    )
    grouped = group_mesh(mesh, choice.option.shards, axis=axis, replica_axis=groups.name)
    return grouped, dataclasses.replace(layout, policy=choice.option.policy), choice


# A bucket closes once it holds this many elements: below MAX_BUCKET_ELEMENTS (int32
# offsets) with any parameter smaller than it, and a bounded fp32 temporary per bucket. A
# slot group cut by a bucket's end is dealt out (and padded) in each bucket separately.
ALONE_BUCKET_SIZE = 2**30


def resolved_layout(layout: LayoutConfig, axes: MeshAxes, muon: MuonConfig) -> LayoutConfig:
    """``layout`` with ``bucket_size="auto"`` resolved where the mesh decides it.

    Buckets of :data:`ALONE_BUCKET_SIZE` elements (one bucket per buffer up
    to a billion elements per device) when the layout spans one device and
    ``"duplicated"`` Muon deals each slot group's matrices out over
    tensor-parallel devices: no data-parallel collective is left for buckets
    to overlap, and the deal needs many matrices of a shape in a bucket.
    Elsewhere ``"auto"`` stays Megatron's size, where one bucket was slower
    (both measured: ``docs/benchmarks.md``, tensor parallelism per
    ``--muon-tp-mode``).
    """
    alone = axes.group_size == 1 and axes.tp_size > 1 and muon.tp_mode == "duplicated"
    if layout.bucket_size == "auto" and alone:
        return dataclasses.replace(layout, bucket_size=ALONE_BUCKET_SIZE)
    return layout
