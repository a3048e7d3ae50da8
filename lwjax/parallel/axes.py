"""The data-parallel mesh axes of a step, by name and size (pure Python).

:class:`MeshAxes` is what the rest of lwjax knows of a mesh: which axes the
batch is split over, which a buffer is reduce-scattered over, which split the
parameters. :func:`lwjax.parallel.mesh.mesh_axes` reads it from a ``Mesh``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lwjax.layout import BufferKey


def as_axis_tuple(axes: str | tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axis names as a tuple: ``"dp"`` is ``("dp",)``."""
    return axes if isinstance(axes, tuple) else (axes,)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The data-parallel mesh axes of a step and which buffers live on which.

    The data-parallel devices span ``(replica, dp, ep)`` (just ``dp`` without
    sharding groups or expert parallelism); the batch is split over all of them.
    A sharding group is one ``replica`` index: its ``(dp, ep)`` devices hold one
    copy of the optimizer state. A dense bucket has one shard per device of a
    group, shard ``r`` on the device with ``axis_index((dp, ep)) == r``
    (``dp``-major); an expert bucket has one shard per ``dp`` rank inside each
    expert group. Gradients are reduce-scattered within a group and summed
    across groups (:mod:`lwjax.groups` says why in that order).

    Attributes:
      dp: The data-parallel axis (Megatron's expert data-parallel group).
      ep: The expert-parallel axis, or ``None`` without expert parallelism.
      dp_size: Size of ``dp``.
      ep_size: Size of ``ep`` (1 when ``ep`` is ``None``).
      replica: The axis across sharding groups, or ``None`` (one group).
      replica_size: Size of ``replica`` (1 when ``replica`` is ``None``).
      tp: The tensor-parallel axes (``()`` without). Each of their devices
        holds its own block of every split leaf and runs the same plan on it,
        and their devices' optimizer states differ.
      tp_sizes: Their sizes.
    """

    dp: str
    ep: str | None = None
    dp_size: int = 1
    ep_size: int = 1
    replica: str | None = None
    replica_size: int = 1
    tp: tuple[str, ...] = ()
    tp_sizes: tuple[int, ...] = ()

    @property
    def tp_size(self) -> int:
        """Devices a tensor-parallel block is one of: the product of ``tp_sizes``."""
        return math.prod(self.tp_sizes)

    @property
    def group(self) -> str | tuple[str, str]:
        """The devices of one sharding group: dense buffers are split over these axes."""
        return self.dp if self.ep is None else (self.dp, self.ep)

    @property
    def group_size(self) -> int:
        """Devices in a sharding group, ``dp * ep``."""
        return self.dp_size * self.ep_size

    @property
    def data(self) -> str | tuple[str, ...]:
        """All data-parallel devices: the batch is split over these axes."""
        if self.replica is None:
            return self.group
        group = self.group
        return (self.replica, *(group if isinstance(group, tuple) else (group,)))

    @property
    def num_data(self) -> int:
        """Number of data-parallel devices, ``replica * dp * ep``."""
        return self.replica_size * self.group_size

    def of(self, key: BufferKey) -> str | tuple[str, str]:
        """The axes a buffer is reduce-scattered over and gathered from (in one group)."""
        return self.dp if key.is_expert_parallel else self.group

    def state_axes(self, key: BufferKey) -> str | tuple[str, ...]:
        """Axes of a buffer's global state arrays: expert buckets ``ep``-major, one per group;
        with tensor parallelism, one such array per ``tp`` device, ``tp``-major."""
        if key.is_expert_parallel and self.ep is not None:
            axes = (self.ep, self.dp)
        else:
            group = self.group
            axes = group if isinstance(group, tuple) else (group,)
        axes = (*self.tp, *axes)
        return axes if len(axes) > 1 else axes[0]

    @property
    def statistics(self) -> str | tuple[str, ...]:
        """The axes gradient statistics are summed over: a group's devices and ``tp``."""
        group = self.group
        if not self.tp:
            return group
        return (*(group if isinstance(group, tuple) else (group,)), *self.tp)
