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
:func:`upper_grams` launches the tiles of several stacks with one Gram edge as one
kernel, so that no stack's last partial round of tiles leaves the GPU idle, and writes
their Gram matrices as one array; :func:`polynomials` runs one kernel body over it.

The kernel needs a GPU with bf16 tensor cores (Ampere or newer). It has no
sharding rule: call it on device-local stacks (inside ``shard_map``, as the
optimizer does), or XLA gathers a sharded stack onto every device first.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
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

    ``matrices_inner`` puts the matrix index fastest (consecutive programs take one tile
    of successive matrices); otherwise the programs run matrix after matrix.
    """

    matrices_inner: bool
    stages: int  # slices of the contracted axis in flight per program


def _schedule(transposed: bool) -> _Schedule:
    """The faster schedule for one stack, :math:`X^\\top X` (``transposed``: the rows are
    contracted, tall matrices) or :math:`X X^\\top`, measured on one H200 over every stack of
    the 1b and 8b workloads (docs/benchmarks.md, thirty-third session): contracting rows,
    matrices inner and 4 stages (8b's ``[28672, 4096]``: 0.78 -> 0.67 ms); contracting
    columns, matrix after matrix and 3 stages (1b's ``[8, 2048, 2048]``: 0.158 -> 0.135 ms).
    The schedule changes no result bit: each tile sums the same slices in the same order.
    """
    return _Schedule(matrices_inner=True, stages=4) if transposed else _Schedule(False, 3)


def _together(transposed: bool) -> _Schedule:
    """The schedule of stacks launched together (:func:`upper_grams`),
    ``transposed`` if any of them contracts rows: matrix after matrix, the stages as one such
    stack takes them. Over the 1b step's stacks joined by shape (docs/benchmarks.md,
    thirty-fifth session): 57.6 ms of Newton–Schulz matrix after matrix against 63.0 ms with
    the rows-contracted stack's matrices inner; 57.3 ms with 4 stages."""
    return _Schedule(matrices_inner=False, stages=_schedule(transposed).stages)


class _Programs(NamedTuple):
    """The programs of one stack in a launch: one per output tile ``(n, i, j)``."""

    start: int  # the launch's program index of the stack's first
    matrices: int
    tiles: int  # tiles a side of each matrix's result
    steps: int  # BLOCK_K slices of the contracted axis
    transposed: bool  # the rows are contracted
    matrices_inner: bool
    first: int  # the joined result's index of the stack's first matrix

    @property
    def end(self) -> int:
        return self.start + self.matrices * self.tiles**2

    def tile(self, p):
        """``(n, i, j)`` of the launch's program ``p`` (clamped into this stack)."""
        q, t = jnp.clip(p - self.start, 0, self.end - self.start - 1), self.tiles
        if self.matrices_inner:
            rest = q // self.matrices
            return q % self.matrices, rest % t, rest // t
        return q // (t * t), q % t, (q // t) % t


def fits(shape: tuple[int, ...], axis: int, dtype) -> bool:
    """Whether :func:`upper_gram` takes a ``[..., r, c]`` stack of ``dtype``
    contracted over ``axis``.
    """
    if len(shape) < 2 or jnp.dtype(dtype) != jnp.bfloat16 or axis not in (-1, -2):
        return False
    size, depth = _sides(shape, axis)
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
    _check_gram("upper_gram", "x", x, axis)
    gram = _upper_grams((x,), (axis,), jnp.dtype(dtype), False, interpret)
    return gram.reshape(*x.shape[:-2], *gram.shape[-2:])


def upper_grams(
    xs: Sequence[jax.Array], axes: Sequence[int], dtype, *, interpret: bool = False
) -> jax.Array:
    """:func:`upper_gram` of several stacks with one Gram edge, in one launch, as one array.

    Launched alone, each stack ends in a round of tiles too few to fill the GPU
    (a pair of 1b's ``[16384, 2048]`` matrices: 272 tiles for 264 slots, so a
    second round of 8). Launched together, heaviest tiles first, the light
    stacks fill the heavy ones' last rounds. Every tile is the one
    :func:`upper_gram` computes, bit for bit. The result is one array, so that
    :func:`polynomials` runs one kernel body over all of them.

    Args:
      xs: Arrays ``[..., r, c]`` of bf16, each a stack :func:`fits` takes, all with
        the same Gram edge ``s``.
      axes: Each stack's contracted axis, -1 or -2.
      dtype: Output dtype.
      interpret: Run the kernel in Pallas' interpreter (any backend; for tests).

    Returns:
      ``[matrices, s, s]`` in ``dtype``: every stack's Gram matrices, the stacks in the
      given order, each one's leading axes flattened.

    Raises:
      ValueError: If ``axes`` does not give one axis per stack, or a stack is
        not one :func:`fits` takes or has another Gram edge (named by its index).
    """
    xs, axes = tuple(xs), tuple(axes)
    if not xs or len(xs) != len(axes):
        raise ValueError(
            f"upper_grams: expected one or more stacks, one axis each; got {len(xs)=}, {axes=}."
        )
    for k, (x, axis) in enumerate(zip(xs, axes)):
        _check_gram("upper_grams", f"xs[{k}]", x, axis)
        edge, first = _sides(x.shape, axis)[0], _sides(xs[0].shape, axes[0])[0]
        if edge != first:
            raise ValueError(
                f"upper_grams: expected stacks with one Gram edge; xs[0] has {first} and "
                f"xs[{k}] has {edge} (xs[{k}].shape={x.shape}, axis={axis})."
            )
    return _upper_grams(xs, axes, jnp.dtype(dtype), True, interpret)


def _sides(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    """The edge of a ``[..., r, c]`` stack's Gram matrices (its free axis) and their depth
    (the contracted ``axis``)."""
    return (shape[-2], shape[-1]) if axis == -1 else (shape[-1], shape[-2])


def _check_gram(where: str, name: str, x: jax.Array, axis: int) -> None:
    if not fits(x.shape, axis, x.dtype):
        raise ValueError(
            f"{where}: expected {name} a bf16 [..., r, c] stack whose Gram edge is a multiple "
            f"of {BLOCK} and at least {MIN_SIZE}, contracted (axis -1 or -2) over a multiple "
            f"of {BLOCK_K}; got {name}.shape={x.shape}, {name}.dtype={x.dtype}, {axis=}."
        )


# Jitted so that a step with many calls on stacks of one shape traces and lowers the kernel
# once per shape (Newton-Schulz calls it twice a step for every slot group: 200 calls and
# 4.6 s of tracing and lowering in the 1b workload's step when each was built anew).
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _upper_grams(xs, axes, dtype, together: bool, interpret: bool) -> jax.Array:
    """:func:`upper_grams` after its checks (``together=False``: one stack, scheduled alone)."""
    stacks, geometry = [], []
    for x, axis in zip(xs, axes):
        stacks.append(x.reshape(-1, *x.shape[-2:]))
        geometry.append((*_sides(x.shape, axis), axis == -2))
    (joined,) = _launch(
        _gram_tile,
        (),
        stacks,
        geometry,
        (sum(s.shape[0] for s in stacks),),
        dtype,
        together,
        interpret,
    )
    return joined


def _launch(
    tile, operands, stacks, geometry, counts, dtype, together: bool, interpret: bool
) -> list[jax.Array]:
    """One program per output tile ``(n, i, j)`` of every stack's ``[matrices, size, size]``
    result in ``dtype``: ``tile(operand_refs, stack_ref, i, j, programs)`` on matrix ``n``
    where ``i <= j``, stored with its mirror. ``geometry`` gives each stack's
    ``(size, depth, transposed)``, one ``size`` for all; ``operands`` are small 1-d arrays
    every program reads whole. The results, the stacks' matrices in order, are written as
    arrays of ``counts`` matrices each. Stacks with deeper tiles launch first; each stack's
    programs run as :func:`_schedule` says, or as :func:`_together` says with ``together``."""
    order = sorted(range(len(stacks)), key=lambda k: -geometry[k][1])
    together_schedule = _together(any(transposed for *_, transposed in geometry))
    programs, start = [None] * len(stacks), 0
    firsts = [sum(s.shape[0] for s in stacks[:k]) for k in range(len(stacks))]
    for k in order:
        edge, depth, transposed = geometry[k]
        schedule = together_schedule if together else _schedule(transposed)
        programs[k] = _Programs(
            start,
            stacks[k].shape[0],
            edge // BLOCK,
            depth // BLOCK_K,
            transposed,
            schedule.matrices_inner,
            firsts[k],
        )
        start = programs[k].end
    stages = (together_schedule if together else _schedule(geometry[0][2])).stages
    size = geometry[0][0]
    bounds = [(sum(counts[:r]), sum(counts[: r + 1])) for r in range(len(counts))]

    def kernel(*refs):
        fixed = refs[: len(operands)]
        ins, outs = refs[len(operands) : -len(counts)], refs[-len(counts) :]
        p = pl.program_id(0)
        for of, in_ref in zip(programs, ins):

            @pl.when((p >= of.start) & (p < of.end))
            def _(of=of, in_ref=in_ref):
                n, i, j = of.tile(p)

                @pl.when(i <= j)
                def _():
                    # Rounded before the stores: an fp32 tile held across several outputs'
                    # stores spilled 1076 bytes of registers (468 so), and the 1b step took
                    # 0.8 ms longer (docs/benchmarks.md, thirty-seventh session).
                    result = tile(fixed, in_ref, i, j, of).astype(dtype)
                    for (lo, hi), out_ref in zip(bounds, outs):
                        if lo <= of.first and of.first + of.matrices <= hi:
                            _store_with_mirror(out_ref, i, j, result)
                        elif lo < of.first + of.matrices and of.first < hi:

                            @pl.when((of.first + n >= lo) & (of.first + n < hi))
                            def _(out_ref=out_ref):
                                _store_with_mirror(out_ref, i, j, result)

    def in_block(of):
        return lambda p: (of.tile(p)[0], 0, 0)

    def out_block(lo, hi):
        def index(p):  # the program's matrix in the joined result, clamped into [lo, hi)
            joined = sum(
                jnp.where((p >= of.start) & (p < of.end), of.first + of.tile(p)[0], 0)
                for of in programs
            )
            return jnp.clip(joined - lo, 0, hi - lo - 1), 0, 0

        return index

    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((count, size, size), dtype) for count in counts],
        grid=(start,),
        in_specs=[
            *(pl.BlockSpec(o.shape, lambda p: (0,)) for o in operands),
            *(pl.BlockSpec((None, *s.shape[1:]), in_block(of)) for s, of in zip(stacks, programs)),
        ],
        out_specs=[pl.BlockSpec((None, size, size), out_block(lo, hi)) for lo, hi in bounds],
        compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=stages),
        interpret=interpret,
    )(*operands, *stacks)
    return list(outs)


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
    _check_square("polynomial", "gram", gram)
    stack = gram.reshape(-1, *gram.shape[-2:])
    (factor,) = _polynomials(stack, _coefficients(coefficients), (stack.shape[0],), interpret)
    return factor.reshape(gram.shape)


def polynomials(
    joined: jax.Array,
    coefficients: tuple[float, float, float],
    counts: Sequence[int],
    *,
    interpret: bool = False,
) -> list[jax.Array]:
    """:func:`polynomial` of the stacks :func:`upper_grams` joined, in one launch, each
    stack's factors written as an array of its own, so that they come apart without a copy.

    One kernel body serves every stack. Launched over the stacks as separate operands,
    the kernel repeated its loop once per stack; the 1b workload's, three bodies, took
    about 2.5 s of the training step's compile (docs/benchmarks.md, thirty-seventh
    session).

    Args:
      joined: Array ``[matrices, s, s]`` of bf16, symmetric matrices (``upper_grams``'s
        output).
      coefficients: ``(a, b, c)``.
      counts: The stacks' matrix counts, in order, summing to ``matrices``.
      interpret: Run the kernel in Pallas' interpreter (any backend; for tests).

    Returns:
      One array ``[count, s, s]`` per count, bit for bit :func:`polynomial`'s.

    Raises:
      ValueError: If ``joined`` is not a square ``[matrices, s, s]`` stack
        :func:`fits` takes, or ``counts`` are not positive ints summing to ``matrices``.
    """
    _check_square("polynomials", "joined", joined)
    if joined.ndim != 3:
        raise ValueError(
            f"polynomials: expected joined a [matrices, s, s] stack; got {joined.shape=}."
        )
    return _polynomials(
        joined, _coefficients(coefficients), _counts(counts, joined.shape[0]), interpret
    )


def _counts(counts, matrices: int) -> tuple[int, ...]:
    """``counts`` as a tuple of ints, each positive, summing to ``matrices``."""
    try:
        given = list(counts)
        checked = tuple(operator.index(n) for n in given if not isinstance(n, bool))
    except TypeError:
        given, checked = None, ()
    if given is None or len(checked) != len(given) or not checked or min(checked) < 1:
        raise ValueError(
            f"polynomials: expected counts a non-empty sequence of positive ints; got {counts!r}."
        )
    if sum(checked) != matrices:
        raise ValueError(
            f"polynomials: expected counts summing to joined's {matrices} matrices; got "
            f"{checked} (sum {sum(checked)})."
        )
    return checked


def _check_square(where: str, name: str, a: jax.Array) -> None:
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or not fits(a.shape, -1, a.dtype):
        raise ValueError(
            f"{where}: expected {name} a square bf16 [..., s, s] stack with s a multiple of "
            f"{BLOCK} and at least {MIN_SIZE}; got {name}.shape={a.shape}, "
            f"{name}.dtype={a.dtype}."
        )


def _coefficients(coefficients: tuple[float, float, float]) -> jax.Array:
    a, b, c = coefficients
    return jnp.asarray([a, b, c, 0.0], jnp.float32)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _polynomials(stack, coefficients: jax.Array, counts: tuple, interpret: bool) -> list:
    """:func:`polynomials` after its checks; ``coefficients`` is ``[a, b, c, 0]``."""
    geometry = [(stack.shape[-1], stack.shape[-1], False)]
    return _launch(
        _factor_tile, (coefficients,), [stack], geometry, counts, jnp.bfloat16, False, interpret
    )


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
    out_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)] = tile

    @pl.when(i < j)
    def _():
        out_ref[pl.ds(j * BLOCK, BLOCK), pl.ds(i * BLOCK, BLOCK)] = tile.T


def _gram_tile(fixed, x_ref, i, j, of: _Programs) -> jax.Array:
    """Tile ``(i, j)`` of one matrix's Gram product."""
    del fixed
    return _tile_product(x_ref, i, j, of.steps, of.transposed)


def _factor_tile(fixed, a_ref, i, j, of: _Programs) -> jax.Array:
    """Tile ``(i, j)`` of ``a I + b A + c A A^T``: the same sums, in the same
    order, as the factor XLA would form from :func:`upper_gram`'s fp32 ``A A^T``."""
    (coefficients_ref,) = fixed
    square = _tile_product(a_ref, i, j, of.steps, transposed=False)
    slot = lax.broadcasted_iota(jnp.int32, (4,), 0)
    coefficients = coefficients_ref[...]
    a, b, c = (jnp.sum(jnp.where(slot == k, coefficients, 0.0)) for k in range(3))
    rows = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
    cols = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
    eye = jnp.where((rows == cols) & (i == j), 1.0, 0.0)
    linear = a * eye + b * a_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)].astype(
        jnp.float32
    )
    return linear + c * square
