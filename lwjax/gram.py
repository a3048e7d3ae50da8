"""The Gram matrix of a bf16 stack on CUDA GPUs, computing only its upper tiles.

Newton–Schulz forms two symmetric products a step: :math:`A = X X^\\top` and
:math:`A^2 = A A^\\top`. A general matmul computes both triangles; here a
Pallas (Triton) kernel computes the tiles on and above the diagonal and writes
each off-diagonal tile a second time, transposed, below it (:func:`upper_gram`):

.. math::

  A_{ij} = \\sum_k X_{ik} X_{jk}^\\top \\quad (i \\le j), \\qquad A_{ji} = A_{ij}^\\top,

which is nearly half the multiply-adds and an exactly symmetric result. Each tile
accumulates in fp32 over ``BLOCK_K``-wide slices of the contracted axis, then
rounds once to the output dtype. :func:`polynomial` forms the step's whole factor
:math:`a I + b A + c A^2` the same way, each tile of :math:`A^2` combined in fp32
with the same tile of :math:`a I + b A` before it rounds: no fp32 :math:`A^2` is
written, and no pass over it follows. Below ``MIN_SIZE`` the kernel's tiles lose to
cuBLAS, so :func:`fits` turns those stacks down (timings: docs/benchmarks.md).

The kernel needs a GPU with bf16 tensor cores (Ampere or newer). It has no
sharding rule: call it on device-local stacks (inside ``shard_map``, as the
optimizer does), or XLA gathers a sharded stack onto every device first.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 128  # output tile edge
BLOCK_K = 64  # slice of the contracted axis per accumulation step
MIN_SIZE = 2048  # smallest Gram edge the kernel takes (measured: 1024 is slower than XLA)
_NUM_WARPS = 4


class _Schedule(NamedTuple):
    """How a stack's tile programs are ordered and pipelined.

    Pallas on Triton launches the grid's first axis fastest. ``matrices_inner``
    puts the matrix index there (consecutive programs take one tile of successive
    matrices); otherwise the programs run matrix after matrix.
    """

    matrices_inner: bool
    stages: int  # slices of the contracted axis in flight per program


def _schedule(transposed: bool) -> _Schedule:
    """The faster schedule for :math:`X^\\top X` (``transposed``: the rows are contracted,
    tall matrices) or :math:`X X^\\top`, measured on one H200 over every stack of the 1b and
    8b workloads (docs/benchmarks.md, thirty-third session): contracting rows, matrices
    inner and 4 stages (8b's ``[28672, 4096]``: 0.78 -> 0.67 ms); contracting columns,
    matrix after matrix and 3 stages (1b's ``[8, 2048, 2048]``: 0.158 -> 0.135 ms).
    The schedule changes no result bit: each tile sums the same slices in the same order.
    """
    return _Schedule(matrices_inner=True, stages=4) if transposed else _Schedule(False, 3)


def fits(shape: tuple[int, ...], axis: int, dtype) -> bool:
    """Whether :func:`upper_gram` takes a ``[..., r, c]`` stack of ``dtype``
    contracted over ``axis``.
    """
    if len(shape) < 2 or jnp.dtype(dtype) != jnp.bfloat16 or axis not in (-1, -2):
        return False
    size, depth = (shape[-2], shape[-1]) if axis == -1 else (shape[-1], shape[-2])
    return size >= MIN_SIZE and size % BLOCK == 0 and depth % BLOCK_K == 0


def computed_share(size: int, depth: int) -> float:
    """Share of a full ``[size, size]`` Gram product over ``depth`` that
    :func:`upper_gram` computes.

    With :math:`T` tiles a side it computes :math:`T (T + 1) / 2` of :math:`T^2`,
    :math:`(T + 1) / 2T`: 0.53 at 2048, 0.52 at 4096. 1 where the kernel does not take
    the stack (bf16 assumed: the kernel runs only under ``"medium"`` precision).
    """
    if not fits((size, depth), -1, jnp.bfloat16):
        return 1.0
    tiles = size // BLOCK
    return (tiles + 1) / (2 * tiles)


def upper_gram(x: jax.Array, axis: int, dtype, *, interpret: bool = False) -> jax.Array:
    """:math:`X X^\\top` (``axis=-1``) or :math:`X^\\top X` (``axis=-2``) per matrix
    of a bf16 stack.

    Args:
      x: Array ``[..., r, c]`` of bf16.
      axis: The contracted axis, -1 or -2.
      dtype: Output dtype.
      interpret: Run the kernel in Pallas' interpreter (any backend; for tests).

    Returns:
      ``[..., s, s]`` in ``dtype``, exactly symmetric, where ``s`` is the free axis' size.

    Raises:
      ValueError: If the stack is not one :func:`fits` takes.
    """
    if not fits(x.shape, axis, x.dtype):
        raise ValueError(
            "upper_gram: expected a bf16 [..., r, c] stack whose Gram edge is a multiple of "
            f"{BLOCK} and at least {MIN_SIZE}, contracted (axis -1 or -2) over a multiple of "
            f"{BLOCK_K}; got {x.shape=}, {x.dtype=}, {axis=}."
        )
    return _upper_gram(x, axis, jnp.dtype(dtype), interpret)


# Jitted so that a step with many calls on stacks of one shape traces and lowers the kernel
# once per shape (Newton-Schulz calls it twice a step for every slot group: 200 calls and
# 4.6 s of tracing and lowering in the 1b workload's step when each was built anew).
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _upper_gram(x: jax.Array, axis: int, dtype, interpret: bool) -> jax.Array:
    """:func:`upper_gram` after its checks."""
    rows, cols = x.shape[-2:]
    size, depth = (rows, cols) if axis == -1 else (cols, rows)
    kernel = functools.partial(_upper_tiles, steps=depth // BLOCK_K, transposed=axis == -2)
    schedule = _schedule(transposed=axis == -2)
    out = _tile_grid_call(kernel, (), x.reshape(-1, rows, cols), size, dtype, schedule, interpret)
    return out.reshape(*x.shape[:-2], size, size)


def _tile_grid_call(
    kernel, operands, stack, size: int, dtype, schedule: _Schedule, interpret: bool
) -> jax.Array:
    """``kernel`` run once per output tile ``(n, i, j)`` of a ``[matrices, size, size]``
    result in ``dtype``, reading ``operands`` (small 1-d arrays, whole) and matrix ``n`` of
    ``stack``, its programs ordered and pipelined as ``schedule`` says (``kernel`` is given
    it, to find its tile: :func:`_tile`)."""
    tiles, matrices = size // BLOCK, stack.shape[0]
    if schedule.matrices_inner:
        grid, matrix_of = (matrices, tiles, tiles), lambda n, i, j: n
    else:
        grid, matrix_of = (tiles, tiles, matrices), lambda i, j, n: n
    whole = [pl.BlockSpec(o.shape, lambda *ids: (0,)) for o in operands]
    return pl.pallas_call(
        functools.partial(kernel, schedule=schedule),
        out_shape=jax.ShapeDtypeStruct((matrices, size, size), dtype),
        grid=grid,
        in_specs=[
            *whole,
            pl.BlockSpec((None, *stack.shape[1:]), lambda *ids: (matrix_of(*ids), 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, size, size), lambda *ids: (matrix_of(*ids), 0, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=schedule.stages),
        interpret=interpret,
    )(*operands, stack)


def _tile(schedule: _Schedule) -> tuple[jax.Array, jax.Array]:
    """The program's output tile ``(i, j)`` under ``schedule``."""
    first = 1 if schedule.matrices_inner else 0
    return pl.program_id(first), pl.program_id(first + 1)


def polynomial(
    gram: jax.Array, coefficients: tuple[float, float, float], *, interpret: bool = False
) -> jax.Array:
    r""":math:`F = a I + b A + c A^2` per matrix of a symmetric bf16 stack :math:`A`, in bf16.

    :math:`A^2` is taken as :math:`A A^\top` from its upper tiles, each
    accumulated in fp32 as :func:`upper_gram`'s are; the tile of :math:`F` is
    then :math:`(a I + b A) + c A^2` in fp32, rounded once, and written with
    its mirror. The coefficients are an operand, so the five steps of a
    Newton–Schulz run share one kernel per stack shape.

    Args:
      gram: Array ``[..., s, s]`` of bf16, symmetric (``upper_gram``'s output).
      coefficients: ``(a, b, c)``.
      interpret: Run the kernel in Pallas' interpreter (any backend; for tests).

    Raises:
      ValueError: If the stack is not square or not one :func:`fits` takes.
    """
    if gram.ndim < 2 or gram.shape[-1] != gram.shape[-2] or not fits(gram.shape, -1, gram.dtype):
        raise ValueError(
            "polynomial: expected a square bf16 [..., s, s] stack with s a multiple of "
            f"{BLOCK} and at least {MIN_SIZE}; got {gram.shape=}, {gram.dtype=}."
        )
    a, b, c = coefficients
    return _polynomial(gram, jnp.asarray([a, b, c, 0.0], jnp.float32), interpret)


@functools.partial(jax.jit, static_argnums=(2,))
def _polynomial(gram: jax.Array, coefficients: jax.Array, interpret: bool) -> jax.Array:
    """:func:`polynomial` after its checks; ``coefficients`` is ``[a, b, c, 0]``."""
    size = gram.shape[-1]
    kernel = functools.partial(_polynomial_tiles, steps=size // BLOCK_K)
    stack = gram.reshape(-1, size, size)
    schedule = _schedule(transposed=False)
    return _tile_grid_call(
        kernel, (coefficients,), stack, size, gram.dtype, schedule, interpret
    ).reshape(gram.shape)


def _tile_product(x_ref, i, j, steps: int, transposed: bool) -> jax.Array:
    """Tile ``(i, j)`` of :math:`X X^\top` (:math:`X^\top X` if ``transposed``), fp32."""

    def accumulate(step, acc):
        depth = pl.ds(pl.multiple_of(step * BLOCK_K, BLOCK_K), BLOCK_K)
        if transposed:  # x is [depth, size]
            return acc + pltriton.dot(
                x_ref[depth, pl.ds(i * BLOCK, BLOCK)],
                x_ref[depth, pl.ds(j * BLOCK, BLOCK)],
                trans_a=True,
            )
        return acc + pltriton.dot(
            x_ref[pl.ds(i * BLOCK, BLOCK), depth],
            x_ref[pl.ds(j * BLOCK, BLOCK), depth],
            trans_b=True,
        )

    return lax.fori_loop(0, steps, accumulate, jnp.zeros((BLOCK, BLOCK), jnp.float32))


def _store_with_mirror(out_ref, i, j, tile: jax.Array) -> None:
    """Write ``tile`` at ``(i, j)`` and, off the diagonal, its transpose at ``(j, i)``."""
    out_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)] = tile.astype(out_ref.dtype)

    @pl.when(i < j)
    def _():
        out_ref[pl.ds(j * BLOCK, BLOCK), pl.ds(i * BLOCK, BLOCK)] = tile.T.astype(out_ref.dtype)


def _upper_tiles(x_ref, out_ref, *, steps: int, transposed: bool, schedule: _Schedule):
    """Program ``(n, i, j)``: tile ``(i, j)`` of matrix ``n`` and its mirror, if ``i <= j``."""
    i, j = _tile(schedule)

    @pl.when(i <= j)
    def _():
        _store_with_mirror(out_ref, i, j, _tile_product(x_ref, i, j, steps, transposed))


def _polynomial_tiles(coefficients_ref, a_ref, out_ref, *, steps: int, schedule: _Schedule):
    """Program ``(n, i, j)``: tile ``(i, j)`` of ``a I + b A + c A A^T`` and its mirror, if
    ``i <= j``; the same sums, in the same order, as the factor XLA would form from
    :func:`upper_gram`'s fp32 ``A A^T``."""
    i, j = _tile(schedule)

    @pl.when(i <= j)
    def _():
        square = _tile_product(a_ref, i, j, steps, transposed=False)
        slot = lax.broadcasted_iota(jnp.int32, (4,), 0)
        coefficients = coefficients_ref[...]
        a, b, c = (jnp.sum(jnp.where(slot == k, coefficients, 0.0)) for k in range(3))
        rows = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
        cols = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
        eye = jnp.where((rows == cols) & (i == j), 1.0, 0.0)
        linear = a * eye + b * a_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)].astype(
            jnp.float32
        )
        _store_with_mirror(out_ref, i, j, linear + c * square)
