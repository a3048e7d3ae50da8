"""The route of one pytree leaf: its name, matrix view, optimizer and options (pure Python).

A :class:`LeafRoute` is what :func:`lwjax.routing.route_leaves` decides for a leaf
and what the layout, the plan and the step read: how many parameters the leaf stacks
and their names, their shapes on one device (the properties of
:class:`lwjax.parallel.geometry.LeafGeometry`), and the :class:`lwjax.layout.ParamSpec`
of each.
"""

from __future__ import annotations

import dataclasses

from lwjax.layout import ParamSpec
from lwjax.parallel.geometry import LeafGeometry


@dataclasses.dataclass(frozen=True)
class LeafRoute(LeafGeometry):
    """How one pytree leaf maps onto layout parameters.

    Attributes:
      path: The leaf's name (``/``-joined key path).
      shape: The leaf's full shape.
      dtype: The leaf's dtype name.
      stack_dims: Leading axes that index independent parameters (0: the leaf
        is one parameter; 1: ``[L, ...]`` is ``L`` parameters).
      is_muon: The parameters are Muon matrices.
      is_tied: A tied embedding (never Muon; not isolated in a bucket: Megatron
        isolates only the pipeline-stage copies of a tied embedding, and lwjax
        has no pipeline stages).
      is_expert: Expert-parallel parameters.
      qkv_split_shapes: For a fused QKV Muon matrix, the output rows of q, k
        and v per query group (e.g. ``(128, 64, 64)``); ``None`` otherwise.
      expert_dim: For expert leaves, the stacked axis that indexes experts
        (split over the expert-parallel mesh axis); ``None`` otherwise.
      expert_parallel: Expert-parallel size: each device holds
        ``shape[expert_dim] / expert_parallel`` experts.
      tensor_dims: Per tensor-parallel mesh axis (in the order the optimizer
        names them), the stored axis it splits, or ``None`` where the leaf is
        whole over it; ``()`` without tensor parallelism. A device holds a
        contiguous block of each split axis; two mesh axes may split one
        stored axis, the first the major one
        (:func:`lwjax.parallel.geometry.with_tensor_parallel`).
      tensor_sizes: The sizes of those mesh axes.
      lr_mult: Learning-rate multiplier (Megatron's ``lr_mult``).
      wd_mult: Weight-decay multiplier (Megatron's ``wd_mult``).
      grad_norm_group: Name of a separate gradient-norm group, or ``None`` for
        the main norm.
      axes_order: The leaf's axes in the order the optimizer reads them
        (batch axes, matrix rows, matrix columns), or ``None`` when that is
        the stored order.
      view: The shape read in that order, the rows and columns of a Muon
        matrix each merged into one axis; ``None`` when it is ``shape``.
      why: Why the leaf routes as it does (shown by
        :func:`lwjax.routing_table.routing_table`).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    stack_dims: int = 0
    is_muon: bool = False
    is_tied: bool = False
    is_expert: bool = False
    qkv_split_shapes: tuple[int, ...] | None = None
    expert_dim: int | None = None
    expert_parallel: int = 1
    tensor_dims: tuple[int | None, ...] = ()
    tensor_sizes: tuple[int, ...] = ()
    lr_mult: float = 1.0
    wd_mult: float = 1.0
    grad_norm_group: str | None = None
    axes_order: tuple[int, ...] | None = None
    view: tuple[int, ...] | None = None
    why: str = ""

    def __post_init__(self):
        if self.is_expert and self.expert_dim is None and self.stack_dims:
            object.__setattr__(self, "expert_dim", self.stack_dims - 1)

    def param_names(self) -> tuple[str, ...]:
        """Names of the (device-local) stacked parameters, in row-major stack order."""
        if self.stack_dims == 0:
            return (self.path,)
        names = []
        for flat in range(self.num_params):
            index, rest = [], flat
            for size in reversed(self.local_view[: self.stack_dims]):
                index.append(rest % size)
                rest //= size
            names.append(f"{self.path}[{','.join(map(str, reversed(index)))}]")
        return tuple(names)

    def specs(self) -> tuple[ParamSpec, ...]:
        """One :class:`ParamSpec` per (device-local) stacked parameter."""
        return tuple(
            ParamSpec(
                name=name,
                shape=self.param_shape,
                dtype=self.dtype,
                is_muon=self.is_muon,
                is_expert=self.is_expert,
            )
            for name in self.param_names()
        )
