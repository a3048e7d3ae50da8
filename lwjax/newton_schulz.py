"""Newton–Schulz orthogonalisation with Megatron-Core's coefficients and numerics, in ``jax.numpy``.

:func:`newton_schulz` maps each matrix of a stack ``[..., m, n]`` close to the
orthogonal factor of its polar decomposition. The numerics follow
``emerging_optimizers`` 0.3.0 (behind Megatron's ``TensorParallelMuon`` at
TP=1): the same coefficient tables and schedules, auto-transpose, Frobenius
normalisation and rounding points. On CUDA the polynomial is applied in one
product per step (:func:`_iterate_folded`), with the symmetric products taken
from their upper tiles where :mod:`lwjax.gram`'s kernel fits.
"""

from __future__ import annotations

import functools
import math
import numbers
import types
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from lwjax import gram as gram_lib

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol"]
Precision = Literal["highest", "high", "medium"]

# (a, b, c) per Newton–Schulz step, as tabulated in emerging_optimizers 0.3.0.
COEFFICIENT_SETS = types.MappingProxyType(
    {
        "simple": ((3.4445, -4.7750, 2.0315),),
        "quintic": (
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        ),
        "polar_express": (
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        "cans": (
            (8.4703, -25.1081, 18.6293),
            (4.1828, -3.1087, 0.5806),
            (3.9619, -2.9541, 0.5630),
            (3.2866, -2.4647, 0.5074),
            (2.2737, -1.6447, 0.4162),
        ),
        "aol": (
            (4.0098, -7.0585, 2.4635),
            (3.4585, -5.5479, 2.5959),
            (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169),
        ),
    }
)
# How a table is walked when num_ns_steps exceeds its length: "cycle" wraps around,
# "repeat_last" keeps reusing the final triple.
_ITERATION_MODES = types.MappingProxyType(
    {
        "simple": "cycle",
        "quintic": "cycle",
        "polar_express": "repeat_last",
        "cans": "repeat_last",
        "aol": "cycle",
    }
)
COEFFICIENT_TYPES: tuple[str, ...] = tuple(COEFFICIENT_SETS)
# optax.contrib.muon's preset names for the same tables: its default "standard" is Keller
# Jordan's single triple, "dion" the five-step table emerging_optimizers calls "quintic".
COEFFICIENT_ALIASES = types.MappingProxyType({"standard": "simple", "dion": "quintic"})
# Megatron's --muon-fp32-matmul-prec values (torch.set_float32_matmul_precision).
PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

# Tables whose Newton–Schulz runs folded on CUDA (_iterate_folded). polar_express and cans open
# with a ≈ 8: bf16 rounds the folded factor's diagonal entries, all close to a, by up to 2^-5 and
# mostly the same way, which shifts every singular value's gain at once. Over a sweep of top
# singular values polar_express then ends 1.3× further from fp32 than in Megatron's order, and
# cans diverges where Megatron's order does not, so both keep that order.
_FOLDED_TABLES = frozenset({"simple", "quintic", "aol"})

# "high" is TF32-class: XLA's default precision for fp32 dots (TF32 on Ampere+,
# plain fp32 on CPU). "medium" feeds bf16 operands, for which DEFAULT is native.
_LAX_PRECISION = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.DEFAULT,
    "medium": lax.Precision.DEFAULT,
}


def _check_choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``; ``field`` is the display path."""
    if not isinstance(value, str) or value not in choices:
        name = field.replace(".", " ").split()[-1]
        raise ValueError(f"{field} must be one of {choices}; got {name}={value!r}.")


def _check_num_ns_steps(field: str, value: object) -> None:
    """Raise unless ``value`` is a Python int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, but got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{field} must be at least 1; got num_ns_steps={value!r}.")


def _check_matrix(where: str, name: str, x: jax.Array) -> None:
    """Raise unless ``x`` is a floating array of rank >= 2."""
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"{where}: {name} must be an array, but got {type(x).__name__}.")
    if x.ndim < 2:
        raise ValueError(f"{where}: {name} must have rank >= 2 ([..., m, n]); got {x.shape=}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{where}: {name} must have a floating dtype; got {x.dtype=}.")


def _coefficient_schedule(
    coefficient_type: str, num_ns_steps: int
) -> tuple[tuple[float, ...], ...]:
    """Expand a named coefficient table to one (a, b, c) triple per step."""
    table = COEFFICIENT_SETS[coefficient_type]
    if _ITERATION_MODES[coefficient_type] == "cycle":
        return tuple(table[i % len(table)] for i in range(num_ns_steps))
    return tuple(table[min(i, len(table) - 1)] for i in range(num_ns_steps))


def _storage_dtype(dtype, precision: str):
    """The dtype Newton–Schulz keeps its iterate in: bf16 under ``"medium"``, else fp32 or wider."""
    return jnp.bfloat16 if precision == "medium" else jnp.promote_types(dtype, jnp.float32)


def _iterate_exact(y: jax.Array, steps, *, precision, acc_dtype, reduce=None) -> jax.Array:
    """Newton–Schulz in Megatron's order (``addmm``): each product and sum rounds to ``y.dtype``.

    .. math:: A = X X^\\top, \\quad B = b A + c A^2, \\quad X \\leftarrow a X + B X

    ``reduce`` sums each Gram matrix over the devices holding blocks of ``X``'s columns.
    """
    matmul = functools.partial(jnp.matmul, precision=precision, preferred_element_type=acc_dtype)
    for a, b, c in steps:
        gram = matmul(y, jnp.swapaxes(y, -1, -2))
        gram = (gram if reduce is None else reduce(gram)).astype(y.dtype)
        poly = (b * gram.astype(acc_dtype) + c * matmul(gram, gram)).astype(y.dtype)
        y = (a * y.astype(acc_dtype) + matmul(poly, y)).astype(y.dtype)
    return y


def _iterate_folded(
    y: jax.Array, steps, *, precision, acc_dtype, tall: bool = False, reduce=None
) -> jax.Array:
    """The same iteration with ``a`` folded into the small matrix, for GPUs: one matmul per update.

    .. math:: A = X X^\\top, \\quad X \\leftarrow (a I + b A + c A^2)\\, X

    In Megatron's order the addend ``a X`` needs a pass that reads ``X`` and
    ``B X`` after the matmul (XLA's cuBLAS path does not fold a scaled addend
    into the matmul). Here the ``[m, m]`` factor is combined in ``acc_dtype``
    and rounded once to ``y.dtype``, and the product comes out in ``y.dtype``:
    a step rounds three times, as Megatron's does (Gram, polynomial, product),
    only ``a`` is rounded inside the factor instead of added in fp32, which not
    every table tolerates (``_FOLDED_TABLES``).

    ``tall=True`` runs the iteration of :math:`Y^\\top` on ``y`` as stored:
    :math:`A = Y^\\top Y` and :math:`Y \\leftarrow Y F^\\top`, the transpose of
    :math:`Y^\\top \\leftarrow F Y^\\top`. Every product names the axes it
    contracts, so no pass transposes ``y``.

    On bf16 stacks that :func:`lwjax.gram.fits`, both symmetric products
    compute only their upper tiles (:func:`lwjax.gram.upper_gram`), and the
    factor comes out of the second one's kernel (:func:`lwjax.gram.polynomial`).
    ``reduce`` sums each Gram matrix (in ``acc_dtype``, before it rounds) over
    the devices holding blocks of the contracted axis.
    """
    dot = functools.partial(_contract, precision=precision)
    axis = -2 if tall else -1
    use_kernel = _kernel_takes(y, axis, acc_dtype)
    gram_dtype = y.dtype if reduce is None else acc_dtype
    for a, b, c in steps:
        if use_kernel:  # upper tiles only; the exactly symmetric A makes A A^T equal A A
            gram = gram_lib.upper_gram(y, axis, gram_dtype)
        else:
            gram = dot(y, y, axis, dtype=gram_dtype)
        if reduce is not None:
            gram = reduce(gram).astype(y.dtype)
        if use_kernel:
            factor = gram_lib.polynomial(gram, (a, b, c))
        else:
            factor = _xla_factor(gram, (a, b, c), acc_dtype, y.dtype, dot)
        y = _folded_product(y, factor, tall, dot)
    return y


def _iterate_folded_together(ys, talls, steps, *, precision, acc_dtype) -> list[jax.Array]:
    """:func:`_iterate_folded` of several stacks in lockstep: each step's Gram kernels of
    every stack the kernel takes, one Gram edge at a time, run as one launch
    (:func:`lwjax.gram.upper_grams`), and so do their factor kernels
    (:func:`lwjax.gram.polynomials`), each tile as :func:`_iterate_folded` computes it."""
    dot = functools.partial(_contract, precision=precision)
    axes = [-2 if tall else -1 for tall in talls]
    by_edge = {}
    for k, (y, axis) in enumerate(zip(ys, axes)):
        if _kernel_takes(y, axis, acc_dtype):
            by_edge.setdefault(y.shape[-2] if axis == -1 else y.shape[-1], []).append(k)
    ys = list(ys)
    for a, b, c in steps:
        factors = {}
        for kernel in by_edge.values():
            joined = gram_lib.upper_grams(
                [ys[k] for k in kernel], [axes[k] for k in kernel], ys[kernel[0]].dtype
            )
            counts = [math.prod(ys[k].shape[:-2]) for k in kernel]
            for k, factor in zip(kernel, gram_lib.polynomials(joined, (a, b, c), counts)):
                factors[k] = factor.reshape(*ys[k].shape[:-2], *factor.shape[-2:])
        for k, y in enumerate(ys):
            factor = factors.get(k)
            if factor is None:
                factor = _xla_factor(
                    dot(y, y, axes[k], dtype=y.dtype), (a, b, c), acc_dtype, y.dtype, dot
                )
            ys[k] = _folded_product(y, factor, talls[k], dot)
    return ys


def _kernel_takes(y: jax.Array, axis: int, acc_dtype) -> bool:
    """Whether the upper-tile kernels run ``y``'s products: they accumulate and combine in
    fp32, so a float64 run keeps XLA's, and an empty stack has no tiles to launch."""
    return gram_lib.fits(y.shape, axis, y.dtype) and acc_dtype == jnp.float32 and y.size > 0


def _xla_factor(gram: jax.Array, coefficients, acc_dtype, dtype, dot) -> jax.Array:
    """:math:`a I + b A + c A^2` from XLA's products, combined in ``acc_dtype``, rounded to
    ``dtype``."""
    a, b, c = coefficients
    eye = jnp.eye(gram.shape[-1], dtype=acc_dtype)
    square = dot(gram, gram, -1, -2, dtype=acc_dtype)
    return (a * eye + b * gram.astype(acc_dtype) + c * square).astype(dtype)


def _folded_product(y: jax.Array, factor: jax.Array, tall: bool, dot) -> jax.Array:
    """:math:`F X`, or :math:`Y F^\\top` for a tall ``y`` iterated as stored."""
    return dot(y, factor, -1, -1, dtype=y.dtype) if tall else dot(factor, y, -1, -2, dtype=y.dtype)


def _contract(
    lhs: jax.Array, rhs: jax.Array, lhs_axis: int, rhs_axis: int | None = None, *, precision, dtype
) -> jax.Array:
    """Batched product summing ``lhs``'s axis ``lhs_axis`` against ``rhs``'s ``rhs_axis``.

    ``rhs_axis`` defaults to ``lhs_axis``. Both axes are -1 or -2 of ``[..., m, n]``
    stacks; the result is ``[..., lhs free axis, rhs free axis]``, e.g. ``(-1, -1)`` gives
    :math:`A B^\\top` and ``(-2, -2)`` gives :math:`A^\\top B`.
    """
    rhs_axis = lhs_axis if rhs_axis is None else rhs_axis
    batch = tuple(range(lhs.ndim - 2))
    dims = (((lhs.ndim + lhs_axis,), (rhs.ndim + rhs_axis,)), (batch, batch))
    return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=dtype)


def _normalized(x: jax.Array, eps: float, dtype, reduce=None) -> jax.Array:
    """:math:`x / \\max(\\lVert x \\rVert_F, \\epsilon)` per matrix, rounded to ``dtype``;
    ``reduce`` sums the squares over the devices holding the matrix's blocks."""
    squares = jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)
    norm = jnp.sqrt(squares if reduce is None else reduce(squares))
    return (x / jnp.maximum(norm, eps)).astype(dtype)


def newton_schulz(
    x: jax.Array,
    coefficient_type: CoefficientType = "quintic",
    num_ns_steps: int = 5,
    *,
    eps: float = 1e-7,
    precision: Precision = "highest",
    dtype: jnp.dtype | None = None,
    sharded: tuple[Callable[[jax.Array], jax.Array], int] | None = None,
) -> jax.Array:
    r"""Approximately orthogonalise each matrix of a stack by Newton–Schulz iteration.

    Each ``[m, n]`` matrix is transposed if tall (so the Gram matrix is the small one),
    scaled to unit Frobenius norm, then pushed ``num_ns_steps`` times through an odd quintic:

    .. math::

      X_0 = \frac{x}{\max(\lVert x \rVert_F, \epsilon)}, \qquad
      A_k = X_k X_k^\top, \qquad
      X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2)\, X_k,

    where :math:`\epsilon` is ``eps`` and :math:`(a_k, b_k, c_k)` walk
    ``COEFFICIENT_SETS[coefficient_type]``. The coefficients favour speed over
    convergence: singular values land near 1, not at 1, which Muon tolerates and which
    saves steps. A zero matrix maps exactly to zero.

    Off CUDA the steps run in Megatron's order, rounding as its ``addmm`` calls
    do. On CUDA GPUs the ``"simple"``, ``"quintic"`` and ``"aol"`` tables fold
    :math:`a_k` into the small matrix, :math:`X_{k+1} = (a_k I + b_k A_k + c_k
    A_k^2) X_k` (:func:`_iterate_folded`: the same polynomial, one fewer pass
    over each matrix per step, as many roundings; a tall matrix is iterated
    as stored, its products reading it transposed), about as close to float64 as
    Megatron's order (``docs/benchmarks.md``). Under ``"medium"`` the products :math:`A_k` and
    :math:`A_k^2` of matrices that :func:`lwjax.gram.fits` compute only their
    upper tiles. ``"polar_express"`` and ``"cans"`` stay in
    Megatron's order there (see ``_FOLDED_TABLES``).

    Args:
      x: Array ``[..., m, n]`` of a floating dtype (narrower than fp32 is computed in fp32).
      coefficient_type: One of ``COEFFICIENT_TYPES``, or an optax name in
        ``COEFFICIENT_ALIASES``.
      num_ns_steps: Number of iterations, at least 1.
      eps: Floor on the Frobenius norm used for normalisation.
      precision: One of ``PRECISIONS``. ``"highest"``: full fp32 (or wider) matmuls.
        ``"high"``: XLA's default fp32 dots (TF32 on recent GPUs, fp32 on CPU).
        ``"medium"``: the normalised matrix and every intermediate are rounded to bf16,
        with products and linear combinations accumulated in fp32.
      dtype: Output dtype, ``x``'s by default. The iterate is bf16 under ``"medium"``,
        so a bf16 output loses nothing there and takes half the bytes of fp32.
      sharded: ``(reduce, dim)``: ``x`` is one block of each matrix, split
        along ``dim`` (-2 rows, -1 columns), and ``reduce`` sums an array over
        the blocks (in ``shard_map``, a ``psum`` over the splitting mesh axes),
        as Megatron's ``distributed`` tensor-parallel mode runs it. The
        iteration is oriented so that the Gram matrix contracts the split axis
        (a row split is iterated transposed, whatever the shape), and the
        squared Frobenius norm and every Gram matrix are reduced (in fp32):
        the result is the block of the whole matrix's iterate, never gathered.

    Returns:
      Array of ``x``'s shape, in ``dtype``.

    Raises:
      ValueError: If ``x`` has rank < 2 or an option is outside its allowed set.
      TypeError: If ``x`` is not floating or ``num_ns_steps`` is not an int.

    Examples:
      >>> import jax.numpy as jnp
      >>> newton_schulz(jnp.ones((2, 3, 5))).shape
      (2, 3, 5)

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024
    """
    coefficient_type = _checked_options(x, coefficient_type, num_ns_steps, precision, eps)
    acc_dtype = jnp.promote_types(x.dtype, jnp.float32)
    store_dtype = _storage_dtype(x.dtype, precision)
    tall, reduce = x.shape[-2] > x.shape[-1], None
    if sharded is not None:
        reduce, tall = _split_of(sharded)
    options = dict(
        steps=_coefficient_schedule(coefficient_type, num_ns_steps),
        precision=_LAX_PRECISION[precision],
        acc_dtype=acc_dtype,
        reduce=reduce,
    )

    def megatron_order(y):
        return _megatron_order(y, tall, eps, store_dtype, options)

    def folded(y):
        return _iterate_folded(_normalized(y, eps, store_dtype, reduce), tall=tall, **options)

    on_cuda = folded if coefficient_type in _FOLDED_TABLES else megatron_order
    y = lax.platform_dependent(x.astype(acc_dtype), default=megatron_order, cuda=on_cuda)
    return y.astype(x.dtype if dtype is None else dtype)


def newton_schulz_many(
    xs: Sequence[jax.Array],
    coefficient_type: CoefficientType = "quintic",
    num_ns_steps: int = 5,
    *,
    eps: float = 1e-7,
    precision: Precision = "highest",
    dtype: jnp.dtype | None = None,
) -> list[jax.Array]:
    r""":func:`newton_schulz` of several stacks, run together.

    On CUDA GPUs, where :func:`newton_schulz` folds the polynomial, the matrices
    of every stack of one ``[m, n]`` are concatenated into one batch and iterated
    as one, and each step's upper-tile kernels for every batch of one Gram edge run
    as one launch (:func:`lwjax.gram.upper_grams`, then one factor loop over their
    joined Grams, :func:`lwjax.gram.polynomials`): launched apart, each stack's last
    round of tiles leaves most of the GPU idle. Every tile and normalisation is the one
    :func:`newton_schulz` computes; only the products :math:`F X` may round
    otherwise. They are XLA's, whose GEMM autotuner may pick another cuBLAS
    kernel for a longer batch: in three processes of four, the 1b workload's step
    differed from stack by stack in 0.6% of one leaf's elements by one bf16 step
    after three steps (docs/benchmarks.md, thirty-fifth and thirty-sixth
    sessions). Joining only stacks of one whole shape gave the same difference
    with twice the kernel bodies: the 1b optimizer step compiled in 12.9-15.0 s
    against 6.2-7.7 s. Elsewhere (Megatron's order) each stack runs as
    :func:`newton_schulz` runs it, bit for bit.

    The iterates of every stack are alive together: memory for speed where no
    communication could overlap the stacks one by one.

    Args:
      xs: Arrays ``[..., m, n]``, all of one floating dtype.
      coefficient_type, num_ns_steps, eps, precision, dtype: As :func:`newton_schulz`.

    Returns:
      Per stack, its :func:`newton_schulz`, in its shape.

    Raises:
      ValueError, TypeError: As :func:`newton_schulz`, naming the stack by its index; a
        ``ValueError`` if the stacks' dtypes differ.
    """
    xs = list(xs)
    for k, x in enumerate(xs):
        _check_matrix("newton_schulz_many", f"xs[{k}]", x)
        if x.dtype != xs[0].dtype:
            raise ValueError(
                "newton_schulz_many: expected stacks of one dtype; got "
                f"xs[0].dtype={xs[0].dtype}, xs[{k}].dtype={x.dtype}."
            )
    if not xs:
        return []
    coefficient_type = _checked_options(xs[0], coefficient_type, num_ns_steps, precision, eps)
    acc_dtype = jnp.promote_types(xs[0].dtype, jnp.float32)
    store_dtype = _storage_dtype(xs[0].dtype, precision)
    steps = _coefficient_schedule(coefficient_type, num_ns_steps)
    options = dict(steps=steps, precision=_LAX_PRECISION[precision], acc_dtype=acc_dtype)
    # Stacks of one matrix shape [m, n], each flattened to [matrices, m, n].
    members: dict[tuple[int, int], list[int]] = {}
    for k, x in enumerate(xs):
        members.setdefault(x.shape[-2:], []).append(k)
    talls = [m > n for m, n in members]

    def megatron_order(stacks):  # stack by stack: a longer batch may round otherwise
        return [
            _megatron_order(x, x.shape[-2] > x.shape[-1], eps, store_dtype, options) for x in stacks
        ]

    def folded(stacks):
        joined = [
            jnp.concatenate(
                [_normalized(stacks[k].reshape(-1, *shape), eps, store_dtype) for k in ks]
            )
            for shape, ks in members.items()
        ]
        outs = _iterate_folded_together(joined, talls, **options)
        parts = [None] * len(stacks)
        for ks, out in zip(members.values(), outs):
            start = 0
            for k in ks:
                end = start + math.prod(xs[k].shape[:-2])
                parts[k] = out[start:end].reshape(xs[k].shape)
                start = end
        return parts

    on_cuda = folded if coefficient_type in _FOLDED_TABLES else megatron_order
    outs = lax.platform_dependent(
        [x.astype(acc_dtype) for x in xs], default=megatron_order, cuda=on_cuda
    )
    return [out.astype(x.dtype if dtype is None else dtype) for out, x in zip(outs, xs)]


def _megatron_order(y, tall: bool, eps, store_dtype, options) -> jax.Array:
    """Megatron's order: transpose a tall matrix, normalise, iterate, transpose back."""
    y = _normalized(_transposed_if(y, tall), eps, store_dtype, options.get("reduce"))
    return _transposed_if(_iterate_exact(y, **options), tall)


def _transposed_if(y: jax.Array, transpose: bool) -> jax.Array:
    return jnp.swapaxes(y, -1, -2) if transpose else y


def _checked_options(x, coefficient_type, num_ns_steps, precision, eps) -> str:
    """Check :func:`newton_schulz`'s arguments; the coefficient table's lwjax name."""
    _check_matrix("newton_schulz", "x", x)
    coefficient_type = COEFFICIENT_ALIASES.get(coefficient_type, coefficient_type)
    _check_choice("newton_schulz: coefficient_type", coefficient_type, COEFFICIENT_TYPES)
    _check_num_ns_steps("newton_schulz: num_ns_steps", num_ns_steps)
    _check_choice("newton_schulz: precision", precision, PRECISIONS)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"newton_schulz: eps must be a positive number; got {eps=}.")
    return coefficient_type


def _split_of(sharded) -> tuple[Callable, bool]:
    """``newton_schulz(sharded=(reduce, dim))``'s reduce, and whether to iterate transposed."""
    reduce, dim = sharded
    if not callable(reduce):
        raise TypeError(
            "newton_schulz: sharded=(reduce, dim) takes a callable that sums over the blocks, "
            f"no longer a mesh axis name (as 0.4.0 did); got {type(reduce).__name__}. Pass "
            "functools.partial(jax.lax.psum, axis_name=...)."
        )
    if dim not in (-2, -1):
        raise ValueError(f"newton_schulz: sharded dim must be -2 or -1; got {sharded=}.")
    return reduce, dim == -2
