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
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.parallel.axes import MeshAxes
from lwjax.param_plan import SlotGroup
from lwjax.shards import rank_row


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
class SlotDeal:
    """Which device assembles each of a rank's matrices of one slot group.

    Attributes:
      devices: ``devices[r][j]``: the device (index over the splitting axes,
        :attr:`TensorSplit.names` order) of rank ``r``'s ``j``-th matrix
        (:attr:`lwjax.param_plan.SlotGroup.ns_devices`).
      rank_axes: The mesh axes whose index is the rank (the buffer's
        :meth:`~lwjax.parallel.axes.MeshAxes.of`).
    """

    devices: tuple[tuple[int, ...], ...]
    rank_axes: str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SplitExchange:
    """One tensor-parallel mode applied to matrices split as ``split`` says.

    Handed to :func:`lwjax.muon.muon_polar` and :func:`lwjax.muon.apply_polar`
    (the ``lwjax.muon._BlockExchange`` they call).

    Attributes:
      split: How each matrix of the stack is split over the mesh axes.
      mode: One of ``lwjax.muon.TP_MODES``.
      deal: Under ``"duplicated"``, which device assembles each matrix.
    """

    split: TensorSplit
    mode: str
    deal: SlotDeal | None = None

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
            return functools.partial(_assembled, ns, split, deal=self.deal)
        return ns

    def whole_shape(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The shape that scales a block of ``shape``: the whole matrix's, or ``None`` (the
        block's own) under ``"blockwise"``."""
        return None if self.mode == "blockwise" else self.split.full(shape)


def _assembled(
    ns, split: TensorSplit, block: jax.Array, *, deal: SlotDeal | None = None
) -> jax.Array:
    """``ns`` of the whole matrices of one stack of blocks (:func:`assembled_together`)."""
    if deal is None:
        raise ValueError(
            "tp_mode='duplicated': the split exchange needs the plan's deal of matrices to "
            "devices (SlotGroup.ns_devices, set by lwjax.planner.plan_step)."
        )
    return assembled_together(ns, split, [block], [deal])[0]


def assembled_together(
    ns, split: TensorSplit, blocks: Sequence[jax.Array], deals: Sequence[SlotDeal]
) -> list[jax.Array]:
    """``ns`` of the whole matrices of several stacks of blocks, each computed once; this
    device's block of each back.

    The ``duplicated`` mode's update, without its duplicated work. Every stack
    holds blocks ``[..., r, c]`` of one shape split as ``split`` says; each
    matrix (the last leading axis of a stack; axes before it, e.g. QKV pieces,
    travel with their matrix) of rank ``rank`` is assembled on device
    ``deal.devices[rank][j]`` of the ``t`` devices the blocks are spread over,
    from every device's block (one ``all_to_all`` of equal chunks for all the
    stacks: the most matrices any device assembles, zero-filled),
    orthogonalised there whole, and its blocks are sent back (another). Each
    device moves ``(t-1)/t`` of its chunks each way, where an ``all_gather``
    moves ``t-1`` times them (Megatron's proposed ``layer_sharded`` mode does
    the same), and runs Newton–Schulz only on the matrices dealt to it: one
    branch of a ``lax.switch`` per count of matrices a device assembles, so the
    zero fill and the spare slots are never computed. Spare slots come back zero.
    The chunk positions go in rounds (:func:`exchange_rounds`), one after the
    other, so that the exchange buffers hold one round's matrices at a time.
    """
    rank_axes = deals[0].rank_axes
    if any(d.rank_axes != rank_axes for d in deals):
        raise ValueError(f"stacks dealt over different rank axes: {[d.rank_axes for d in deals]}.")
    grid_rows = [size for _, size in split.rows]
    grid_cols = [size for _, size in split.cols]
    k, t = len(grid_rows), math.prod(grid_rows) * math.prod(grid_cols)
    r, c = blocks[0].shape[-2:]
    tables = deal_tables(
        [(d.devices, math.prod(b.shape[:-3]), b.shape[-3]) for b, d in zip(blocks, deals)], t
    )
    rank = lax.axis_index(rank_axes) if len(deals[0].devices) > 1 else 0
    per = tables.per
    flat = [b.reshape(-1, r, c) for b in blocks]
    flat = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
    send = jnp.asarray(rank_row(tables.send, rank)).reshape(t, per)
    n = len(grid_rows) + len(grid_cols)  # grid axes
    to_whole = (n, *range(k), n + 1, *range(k, n), n + 2)  # [items, rows grid, r, cols grid, c]
    device = lax.axis_index(split.names)
    backs, previous = [], None
    for lo, hi in exchange_rounds(per, t * r * c * flat.dtype.itemsize):
        m = hi - lo
        positions = send[:, lo:hi].reshape(-1)
        if previous is not None:  # this round's buffers once the last round's Newton-Schulz is done
            positions, _ = lax.optimization_barrier((positions, previous))
        to_send = jnp.take(flat, positions, axis=0, mode="fill", fill_value=0)
        # received[s]: the block at grid position s (row-major) of the matrices this device
        # assembles in this round.
        received = lax.all_to_all(to_send.reshape(t, m, r, c), split.names, 0, 0)
        grid = received.reshape(*grid_rows, *grid_cols, m, r, c)
        whole = grid.transpose(to_whole).reshape(
            m, r * math.prod(grid_rows), c * math.prod(grid_cols)
        )
        counts, branches = round_counts(tables, lo, hi)
        branch = jnp.asarray(rank_row(branches, rank))[device]
        previous = _dealt_only(ns, whole, counts, branch)
        done = previous.reshape(m, *grid_rows, r, *grid_cols, c)
        out_blocks = done.transpose(tuple(int(i) for i in np.argsort(to_whole))).reshape(t, m, r, c)
        # back[g]: this device's block of the matrices device g assembled in this round.
        backs.append(lax.all_to_all(out_blocks, split.names, 0, 0))
    back = (backs[0] if len(backs) == 1 else jnp.concatenate(backs, axis=1)).reshape(t * per, r, c)
    out = jnp.take(back, rank_row(tables.receive, rank), axis=0, mode="fill", fill_value=0)
    starts = np.cumsum([0] + [math.prod(b.shape[:-2]) for b in blocks])
    return [out[a:b].reshape(x.shape) for a, b, x in zip(starts, starts[1:], blocks)]


# At most this many bytes of blocks per device and direction in one round of an exchange.
EXCHANGE_ROUND_BYTES = 2**28


class DealTables(NamedTuple):
    """Per-rank index tables of one deal (:func:`deal_tables`)."""

    per: int  # stack items each device assembles in the all_to_all (the most over devices)
    send: np.ndarray  # [ranks, t * per]: item sent in each chunk position (past the end: zero)
    receive: np.ndarray  # [ranks, items]: chunk position of each item's result (past: zero)
    branch: np.ndarray  # [ranks, t]: the entry of ``counts`` each device runs
    counts: tuple[int, ...]  # the distinct numbers of real items a device assembles


def deal_tables(stacks, t: int) -> DealTables:
    """The index tables that move stacks ``[pieces, width, ...]`` as their deals say.

    ``stacks``: per stack ``(devices, pieces, width)``, ``devices[r][j]`` the
    device of rank ``r``'s matrix ``j``. Item ``q * width + j`` of a stack,
    after the items of the stacks before it, is piece ``q`` of matrix ``j``;
    device ``d``'s chunk holds its matrices stack by stack in slot order, each
    with its pieces consecutively, real ones first.
    """
    for devices, _, width in stacks:
        if any(len(row) > width for row in devices):
            raise ValueError(f"deal of {max(map(len, devices))} matrices for a stack of {width}.")
    ranks = len(stacks[0][0])
    starts = np.cumsum([0] + [pieces * width for _, pieces, width in stacks])
    # mine[r][d]: the items device d assembles for rank r, in chunk order.
    mine = [[[] for _ in range(t)] for _ in range(ranks)]
    for (devices, pieces, width), start in zip(stacks, starts):
        for r, row in enumerate(devices):
            for j, device in enumerate(row):
                mine[r][device] += [start + q * width + j for q in range(pieces)]
    per = max(len(items) for row in mine for items in row)
    send = np.full((ranks, t * per), starts[-1], np.int32)
    receive = np.full((ranks, starts[-1]), t * per, np.int32)
    for r, row in enumerate(mine):
        for device, items in enumerate(row):
            for p, item in enumerate(items):
                send[r, device * per + p] = item
                receive[r, item] = device * per + p
    sizes = [[len(items) for items in row] for row in mine]
    counts = tuple(sorted({n for row in sizes for n in row}))
    branch = np.asarray([[counts.index(n) for n in row] for row in sizes], np.int32)
    return DealTables(per, send, receive, branch, counts)


def exchange_rounds(per: int, position_bytes: int) -> list[tuple[int, int]]:
    """The rounds ``[lo, hi)`` of chunk positions :func:`assembled_together` exchanges at a
    time: as many as fit :data:`EXCHANGE_ROUND_BYTES` (``position_bytes``: one position's
    blocks, to every device), at least one. Each round's buffers are freed before the next
    is sent, so a step's exchange holds about one round each way, not every dealt matrix of
    a shape (two fp32 copies of every fc1 of 8B at fsdp 8, 3.8 GB per device)."""
    size = max(1, min(per, EXCHANGE_ROUND_BYTES // max(1, position_bytes)))
    return [(lo, min(per, lo + size)) for lo in range(0, per, size)]


def round_counts(tables: DealTables, lo: int, hi: int) -> tuple[tuple[int, ...], np.ndarray]:
    """``(counts, branch)`` of the round ``[lo, hi)``: the distinct numbers of real items
    a device assembles in it, and per rank and device the entry of ``counts`` it runs."""
    real = np.clip(np.asarray(tables.counts)[tables.branch] - lo, 0, hi - lo)
    counts = tuple(sorted({int(x) for x in real.flat}))
    return counts, np.searchsorted(counts, real).astype(np.int32)


def _dealt_only(ns, whole: jax.Array, counts: tuple[int, ...], branch) -> jax.Array:
    """``ns`` of the first ``counts[branch]`` matrices of ``whole``, zeros after them: one
    ``lax.switch`` branch per count, so a device computes only its own matrices."""
    dtype = jax.eval_shape(ns, whole[:1]).dtype

    def first(n, x):
        rest = jnp.zeros((x.shape[0] - n, *x.shape[1:]), dtype)
        return rest if n == 0 else ns(x) if n == x.shape[0] else jnp.concatenate([ns(x[:n]), rest])

    if len(counts) == 1:
        return first(counts[0], whole)
    return lax.switch(branch, [functools.partial(first, n) for n in counts], whole)


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
    axes: MeshAxes,
    group: SlotGroup,
    transpose: bool,
    mode: str,
    rank_axes: str | tuple[str, ...] | None = None,
) -> SplitExchange | None:
    """The :class:`SplitExchange` of a slot group's matrices under ``mode``, or ``None`` when
    they are whole on each device; ``rank_axes``: the axes of the group's buffer
    (:meth:`~lwjax.parallel.axes.MeshAxes.of`), for its deal of matrices to devices."""
    split = tensor_split(axes, group, transpose)
    if split is None:
        return None
    deal = SlotDeal(group.ns_devices, rank_axes) if group.ns_devices else None
    return SplitExchange(split, mode, deal)
