"""What Muon does with a matrix split over tensor-parallel mesh axes (``MuonConfig.tp_mode``).

Each device of the tensor axes holds one block of every split matrix. The Muon math
(:mod:`lwjax.muon`) runs on those blocks and is told, through a :class:`SplitExchange`,
how to orthogonalise the whole matrices and which shape scales them; the collectives over
the mesh axes live here, where the axis names are known:

* ``"duplicated"``: each whole matrix is assembled on one device (``all_to_all``),
  orthogonalised there, and its blocks sent back (:func:`_assembled`);
* ``"distributed"``: Newton–Schulz iterates on the blocks, its norm and Gram matrices
  summed over the splitting axes (``psum``);
* ``"blockwise"``: every block is a matrix of its own; nothing is exchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.parallel.axes import MeshAxes
from lwjax.param_plan import SlotGroup


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """How a stack ``[..., m, n]`` is split over tensor-parallel mesh axes (in ``shard_map``).

    Each device holds a contiguous block of every matrix: the rows cut by the
    ``rows`` mesh axes, the columns by the ``cols`` ones, the first axis of each
    the major one; the whole matrix is the grid of every device's block.

    Attributes:
      rows: ``(axis name, size)`` of the mesh axes splitting the rows, major first.
      cols: The same for the columns.
    """

    rows: tuple[tuple[str, int], ...] = ()
    cols: tuple[tuple[str, int], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every splitting mesh axis, rows' first: a device's linear index over them is its
        block's position in the grid, row-major."""
        return tuple(name for name, _ in (*self.rows, *self.cols))

    def full(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The whole matrix's ``(m, n)`` from one block's."""
        m, n = shape
        return m * math.prod(s for _, s in self.rows), n * math.prod(s for _, s in self.cols)


@dataclasses.dataclass(frozen=True)
class SplitExchange:
    """One tensor-parallel mode applied to matrices split as ``split`` says.

    Handed to :func:`lwjax.muon.muon_polar` and :func:`lwjax.muon.apply_polar`
    (the ``lwjax.muon._BlockExchange`` they call).

    Attributes:
      split: How each matrix of the stack is split over the mesh axes.
      mode: One of ``lwjax.muon.TP_MODES``.
    """

    split: TensorSplit
    mode: str

    def orthogonalizer(self, ns: Callable) -> Callable[[jax.Array], jax.Array]:
        """``ns`` (Newton–Schulz of whole matrices, e.g. a partial of
        :func:`~lwjax.newton_schulz.newton_schulz`) made to take and return this
        device's blocks: the block of the whole matrix's iterate, or of the block's own
        under ``"blockwise"``."""
        split = self.split
        if self.mode == "distributed":
            if split.rows and split.cols:
                raise ValueError(
                    "tp_mode='distributed' needs each matrix split on one side; got a block of "
                    f"rows split over {split.rows} and columns over {split.cols}."
                )
            side = split.rows or split.cols
            reduce = functools.partial(lax.psum, axis_name=tuple(name for name, _ in side))
            return functools.partial(ns, sharded=(reduce, -2 if split.rows else -1))
        if self.mode == "duplicated":
            return functools.partial(_assembled, ns, split)
        return ns

    def whole_shape(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The shape that scales a block of ``shape``: the whole matrix's, or ``None`` (the
        block's own) under ``"blockwise"``."""
        return None if self.mode == "blockwise" else self.split.full(shape)


def _assembled(ns, split: TensorSplit, block: jax.Array) -> jax.Array:
    """``ns`` of the whole matrices, each computed once; this device's block of each back.

    The ``duplicated`` mode's update, without its duplicated work: matrix ``j``
    of the stack (padded with zero matrices to a multiple of the ``t`` devices
    the blocks are spread over) is assembled on device ``j // ceil(count / t)``
    from every device's block (one ``all_to_all``), orthogonalised there whole,
    and its blocks are sent back (another). Each device moves ``(t-1)/t`` of
    its blocks each way, where an ``all_gather`` moves ``t-1`` times them, and
    runs Newton–Schulz on ``1/t`` of the matrices (Megatron's proposed
    ``layer_sharded`` mode does the same).
    """
    grid_rows = [size for _, size in split.rows]
    grid_cols = [size for _, size in split.cols]
    k, t = len(grid_rows), math.prod(grid_rows) * math.prod(grid_cols)
    *lead, r, c = block.shape
    count = math.prod(lead)
    per = -(-count // t)
    flat = block.reshape(count, r, c)
    if per * t > count:
        flat = jnp.concatenate([flat, jnp.zeros((per * t - count, r, c), flat.dtype)])
    # received[s]: the block at grid position s (row-major) of the matrices this device assembles.
    received = lax.all_to_all(flat.reshape(t, per, r, c), split.names, 0, 0)
    grid = received.reshape(*grid_rows, *grid_cols, per, r, c)
    n = grid.ndim - 3  # grid axes
    to_whole = (n, *range(k), n + 1, *range(k, n), n + 2)  # [per, rows grid, r, cols grid, c]
    whole = grid.transpose(to_whole).reshape(
        per, r * math.prod(grid_rows), c * math.prod(grid_cols)
    )
    done = ns(whole).reshape(per, *grid_rows, r, *grid_cols, c)
    blocks = done.transpose(tuple(int(i) for i in np.argsort(to_whole))).reshape(t, per, r, c)
    # back[g]: this device's block of the matrices device g assembled.
    back = lax.all_to_all(blocks, split.names, 0, 0)
    return back.reshape(t * per, r, c)[:count].reshape(block.shape)


def tensor_split(axes: MeshAxes, group: SlotGroup, transpose: bool = False) -> TensorSplit | None:
    """How a slot group's matrices, as :func:`~lwjax.shards.take` reads them (``transpose``:
    ``[in, out]`` stored, read transposed), are split over the tensor-parallel axes;
    ``None`` when they are whole on each device."""
    if group.tensor_split == ((), ()):
        return None
    rows, cols = (
        tuple((axes.tp[a], axes.tp_sizes[a]) for a in side) for side in group.tensor_split
    )
    return TensorSplit(cols, rows) if transpose else TensorSplit(rows, cols)


def split_exchange(
    axes: MeshAxes, group: SlotGroup, transpose: bool, mode: str
) -> SplitExchange | None:
    """The :class:`SplitExchange` of a slot group's matrices under ``mode``, or ``None`` when
    they are whole on each device."""
    split = tensor_split(axes, group, transpose)
    return None if split is None else SplitExchange(split, mode)
