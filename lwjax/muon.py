"""Muon's per-matrix math, as Megatron-Core runs it, in batched ``jax.numpy``.

Only arithmetic lives here: Newton–Schulz, the scale modes, the QKV split and one
Muon step on a stack of whole matrices. Ownership and collectives belong to the
layer-wise optimizer, which gathers the matrices a rank owns and calls
:func:`muon_update` on them.

The numerics follow ``emerging_optimizers`` 0.3.0 (behind Megatron's
``TensorParallelMuon`` at TP=1): the same coefficient tables and schedules,
auto-transpose, Frobenius normalisation and step order. Arrays are ``[..., m, n]``
with any leading batch dims, handled by batched matmuls. Options are static Python
values, checked before anything is traced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax import gram as gram_lib

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol"]
ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
Precision = Literal["highest", "high", "medium"]

# (a, b, c) per Newton–Schulz step, as tabulated in emerging_optimizers 0.3.0.
COEFFICIENT_SETS = types.MappingProxyType({
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750),
    ),
    "cans": (
        (8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
})
# How a table is walked when num_ns_steps exceeds its length: "cycle" wraps around,
# "repeat_last" keeps reusing the final triple.
_ITERATION_MODES = types.MappingProxyType(
    {"simple": "cycle", "quintic": "cycle", "polar_express": "repeat_last", "cans": "repeat_last", "aol": "cycle"}
)
COEFFICIENT_TYPES: tuple[str, ...] = tuple(COEFFICIENT_SETS)
SCALE_MODES: tuple[str, ...] = ("spectral", "unit_rms_norm", "shape_scaling")
# Megatron's --muon-fp32-matmul-prec values (torch.set_float32_matmul_precision).
PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")

# Tables whose Newton–Schulz runs folded on CUDA (_iterate_folded). polar_express and cans open with
# a ≈ 8: bf16 rounds the folded factor's diagonal entries, all close to a, by up to 2^-5 and mostly the
# same way, which shifts every singular value's gain at once. Over a sweep of top singular values
# polar_express then ends 1.3× further from fp32 than in Megatron's order, and cans diverges where
# Megatron's order does not, so both keep that order.
_FOLDED_TABLES = frozenset({"simple", "quintic", "aol"})

# "high" is TF32-class: XLA's default precision for fp32 dots (TF32 on Ampere+,
# plain fp32 on CPU). "medium" feeds bf16 operands, for which DEFAULT is native.
_LAX_PRECISION = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.DEFAULT, "medium": lax.Precision.DEFAULT}


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


def _check_same_matrices(where: str, **arrays: jax.Array) -> None:
    """Each array a floating ``[..., m, n]`` stack, all of one shape."""
    for name, x in arrays.items():
        _check_matrix(where, name, x)
    if len({x.shape for x in arrays.values()}) > 1:
        shapes = ", ".join(f"{name}.shape={x.shape}" for name, x in arrays.items())
        raise ValueError(f"{where}: {', '.join(arrays)} must share a shape; got {shapes}.")


def _check_config(where: str, config: object) -> None:
    if not isinstance(config, MuonConfig):
        raise TypeError(f"{where}: config must be a MuonConfig, but got {type(config).__name__}.")


def _coefficient_schedule(coefficient_type: str, num_ns_steps: int) -> tuple[tuple[float, ...], ...]:
    """Expand a named coefficient table to one (a, b, c) triple per step."""
    table = COEFFICIENT_SETS[coefficient_type]
    if _ITERATION_MODES[coefficient_type] == "cycle":
        return tuple(table[i % len(table)] for i in range(num_ns_steps))
    return tuple(table[min(i, len(table) - 1)] for i in range(num_ns_steps))


def _storage_dtype(dtype, precision: str):
    """The dtype Newton–Schulz keeps its iterate in: bf16 under ``"medium"``, else fp32 or wider."""
    return jnp.bfloat16 if precision == "medium" else jnp.promote_types(dtype, jnp.float32)


def _iterate_exact(y: jax.Array, steps, *, precision, acc_dtype) -> jax.Array:
    """Newton–Schulz in Megatron's order (``addmm``): each product and combination rounds once to ``y.dtype``.

    .. math:: A = X X^\\top, \\quad B = b A + c A^2, \\quad X \\leftarrow a X + B X
    """
    matmul = functools.partial(jnp.matmul, precision=precision, preferred_element_type=acc_dtype)
    for a, b, c in steps:
        gram = matmul(y, jnp.swapaxes(y, -1, -2)).astype(y.dtype)
        poly = (b * gram.astype(acc_dtype) + c * matmul(gram, gram)).astype(y.dtype)
        y = (a * y.astype(acc_dtype) + matmul(poly, y)).astype(y.dtype)
    return y


def _iterate_folded(y: jax.Array, steps, *, precision, acc_dtype, tall: bool = False) -> jax.Array:
    """The same iteration with ``a`` folded into the small matrix, for GPUs: one matmul per ``[m, n]`` update.

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
    compute only their upper tiles (:func:`lwjax.gram.upper_gram`).
    """
    dot = functools.partial(_contract, precision=precision)
    axis = -2 if tall else -1
    eye = jnp.eye(y.shape[-1] if tall else y.shape[-2], dtype=acc_dtype)
    use_kernel = gram_lib.fits(y.shape, axis, y.dtype)
    for a, b, c in steps:
        if use_kernel:  # upper tiles only; the exactly symmetric A makes A A^T equal A A
            gram = gram_lib.upper_gram(y, axis, y.dtype)
            square = gram_lib.upper_gram(gram, -1, acc_dtype)
        else:
            gram = dot(y, y, axis, dtype=y.dtype)
            square = dot(gram, gram, -1, -2, dtype=acc_dtype)
        factor = (a * eye + b * gram.astype(acc_dtype) + c * square).astype(y.dtype)
        y = dot(y, factor, -1, -1, dtype=y.dtype) if tall else dot(factor, y, -1, -2, dtype=y.dtype)
    return y


def _contract(lhs: jax.Array, rhs: jax.Array, lhs_axis: int, rhs_axis: int | None = None, *, precision,
              dtype) -> jax.Array:
    """Batched product summing ``lhs``'s axis ``lhs_axis`` against ``rhs``'s ``rhs_axis`` (default: the same).

    Both axes are -1 or -2 of ``[..., m, n]`` stacks; the result is
    ``[..., lhs free axis, rhs free axis]``, e.g. ``(-1, -1)`` gives
    :math:`A B^\\top` and ``(-2, -2)`` gives :math:`A^\\top B`.
    """
    rhs_axis = lhs_axis if rhs_axis is None else rhs_axis
    batch = tuple(range(lhs.ndim - 2))
    dims = (((lhs.ndim + lhs_axis,), (rhs.ndim + rhs_axis,)), (batch, batch))
    return lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=dtype)


def _normalized(x: jax.Array, eps: float, dtype) -> jax.Array:
    """:math:`x / \\max(\\lVert x \\rVert_F, \\epsilon)` per matrix, rounded to ``dtype``."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    return (x / jnp.maximum(norm, eps)).astype(dtype)


def newton_schulz(
    x: jax.Array,
    coefficient_type: CoefficientType = "quintic",
    num_ns_steps: int = 5,
    *,
    eps: float = 1e-7,
    precision: Precision = "highest",
    dtype: jnp.dtype | None = None,
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
    as stored, its products reading it transposed); with ``"medium"``, for a
    random 1024×4096 matrix on an H200, 0.89% RMS error against float64
    (Megatron's order: 0.87%). Under ``"medium"`` the products :math:`A_k` and
    :math:`A_k^2` of matrices that :func:`lwjax.gram.fits` compute only their
    upper tiles. ``"polar_express"`` and ``"cans"`` stay in
    Megatron's order there (see ``_FOLDED_TABLES``).

    Args:
      x: Array ``[..., m, n]`` of a floating dtype (narrower than fp32 is computed in fp32).
      coefficient_type: One of ``COEFFICIENT_TYPES``.
      num_ns_steps: Number of iterations, at least 1.
      eps: Floor on the Frobenius norm used for normalisation.
      precision: One of ``PRECISIONS``. ``"highest"``: full fp32 (or wider) matmuls.
        ``"high"``: XLA's default fp32 dots (TF32 on recent GPUs, fp32 on CPU).
        ``"medium"``: the normalised matrix and every intermediate are rounded to bf16,
        with products and linear combinations accumulated in fp32.
      dtype: Output dtype, ``x``'s by default. The iterate is bf16 under ``"medium"``,
        so a bf16 output loses nothing there and takes half the bytes of fp32.

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
    _check_matrix("newton_schulz", "x", x)
    _check_choice("newton_schulz: coefficient_type", coefficient_type, COEFFICIENT_TYPES)
    _check_num_ns_steps("newton_schulz: num_ns_steps", num_ns_steps)
    _check_choice("newton_schulz: precision", precision, PRECISIONS)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"newton_schulz: eps must be a positive number; got {eps=}.")

    acc_dtype = jnp.promote_types(x.dtype, jnp.float32)
    store_dtype = _storage_dtype(x.dtype, precision)
    tall = x.shape[-2] > x.shape[-1]
    options = dict(steps=_coefficient_schedule(coefficient_type, num_ns_steps),
                   precision=_LAX_PRECISION[precision], acc_dtype=acc_dtype)

    def megatron_order(y):
        """Transpose a tall matrix, normalise, iterate, transpose back."""
        if tall:
            y = jnp.swapaxes(y, -1, -2)
        y = _iterate_exact(_normalized(y, eps, store_dtype), **options)
        return jnp.swapaxes(y, -1, -2) if tall else y

    def folded(y):
        return _iterate_folded(_normalized(y, eps, store_dtype), tall=tall, **options)

    on_cuda = folded if coefficient_type in _FOLDED_TABLES else megatron_order
    y = lax.platform_dependent(x.astype(acc_dtype), default=megatron_order, cuda=on_cuda)
    return y.astype(x.dtype if dtype is None else dtype)


def _spectral_scale(size_out: int, size_in: int) -> float:
    """sqrt(max(m, n)); Jordan / Kimi, https://arxiv.org/abs/2502.16982."""
    return math.sqrt(max(size_out, size_in))


def _unit_rms_norm_scale(size_out: int, size_in: int) -> float:
    """sqrt(m / n); Scion, https://arxiv.org/abs/2502.07529."""
    return math.sqrt(size_out / size_in)


def _shape_scaling_scale(size_out: int, size_in: int) -> float:
    """sqrt(max(1, m / n)); Jordan, https://kellerjordan.github.io/posts/muon/."""
    return math.sqrt(max(1.0, size_out / size_in))


_SCALE_FNS = {"spectral": _spectral_scale, "unit_rms_norm": _unit_rms_norm_scale,
              "shape_scaling": _shape_scaling_scale}


def get_muon_scale_factor(size_out: int, size_in: int, mode: ScaleMode = "spectral") -> float:
    r"""Return the factor that multiplies an orthogonalised ``[size_out, size_in]`` update.

    With :math:`m` = ``size_out`` (rows, output features) and :math:`n` = ``size_in``:

    .. math::

      s_{\text{spectral}} = \sqrt{\max(m, n)}, \quad
      s_{\text{unit\_rms\_norm}} = \sqrt{m / n}, \quad
      s_{\text{shape\_scaling}} = \sqrt{\max(1, m / n)}.

    An orthogonal :math:`m \times n` matrix has RMS :math:`1/\sqrt{\max(m, n)}`, so
    ``"spectral"`` gives updates of RMS about 1 before ``extra_scale_factor``.

    Args:
      size_out: Rows ``m``, a positive int.
      size_in: Columns ``n``, a positive int.
      mode: One of ``SCALE_MODES``.

    Returns:
      The scale as a Python float.
    """
    for name, size in (("size_out", size_out), ("size_in", size_in)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"get_muon_scale_factor: {name} must be a positive int; got {name}={size!r}.")
    _check_choice("get_muon_scale_factor: mode", mode, SCALE_MODES)
    return _SCALE_FNS[mode](size_out, size_in)


def _check_qkv_split(qkv_split_shapes: object, rows: int) -> tuple[int, ...]:
    """Validate a QKV split against the row count and return it as a tuple."""
    where = "orthogonalize: qkv_split_shapes"
    if not isinstance(qkv_split_shapes, Sequence) or isinstance(qkv_split_shapes, str):
        raise TypeError(f"{where} must be a sequence of ints, but got {type(qkv_split_shapes).__name__}.")
    split = tuple(qkv_split_shapes)
    if not split or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in split):
        raise ValueError(f"{where} must be non-empty positive ints; got {qkv_split_shapes=}.")
    if rows % sum(split):
        raise ValueError(
            f"{where}: the row count must be divisible by sum(qkv_split_shapes)={sum(split)}; "
            f"got {rows=}. Pass qkv_split_shapes=None for non-QKV matrices."
        )
    return split


def orthogonalize(
    update: jax.Array,
    *,
    coefficient_type: CoefficientType = "quintic",
    num_ns_steps: int = 5,
    scale_mode: ScaleMode = "spectral",
    extra_scale_factor: float = 1.0,
    precision: Precision = "medium",
    qkv_split_shapes: Sequence[int] | None = None,
) -> jax.Array:
    r"""Turn a (momentum) update into Muon's scaled, orthogonalised direction.

    .. math::

      O = \mathrm{NS}(U) \cdot s(m, n) \cdot \gamma,

    with :math:`\mathrm{NS}` from :func:`newton_schulz`, :math:`s` from
    :func:`get_muon_scale_factor` and :math:`\gamma` = ``extra_scale_factor``.
    With ``qkv_split_shapes=(q, k, v)``, a fused QKV weight's rows are read as
    ``g = m / (q + k + v)`` interleaved groups; the ``g*q`` query rows, ``g*k`` key
    rows and ``g*v`` value rows each form a matrix that is orthogonalised and scaled
    with its own shape, then the rows return to their places. Any number of pieces
    works (``(q, q, k, v)`` with an output gate).

    Args:
      update: Array ``[..., m, n]``; leading dims are a batch.
      coefficient_type: See :func:`newton_schulz`.
      num_ns_steps: See :func:`newton_schulz`.
      scale_mode: One of ``SCALE_MODES``.
      extra_scale_factor: Extra multiplier, e.g. 0.2 to match AdamW's update RMS.
      precision: See :func:`newton_schulz`; Megatron's default is ``"medium"``.
      qkv_split_shapes: Rows per query group of each piece, or ``None`` to treat
        the matrix as a whole.

    Returns:
      Array with the shape and dtype of ``update``.

    Raises:
      ValueError: If an option is invalid or ``m`` is not divisible by the split's sum.
      TypeError: If ``update`` is not floating or ``qkv_split_shapes`` is not a sequence.
    """
    _check_matrix("orthogonalize", "update", update)
    _check_choice("orthogonalize: scale_mode", scale_mode, SCALE_MODES)
    polar = _polar(update, coefficient_type, num_ns_steps, precision, qkv_split_shapes)
    return _scaled(polar, _row_scales(update.shape[-2:], scale_mode, qkv_split_shapes), extra_scale_factor,
                   update.dtype)


def _polar(update: jax.Array, coefficient_type, num_ns_steps, precision, qkv_split_shapes) -> jax.Array:
    """Newton–Schulz of the matrix, or of each QKV piece with its rows put back, unscaled.

    Kept in the iteration's storage dtype (bf16 under ``"medium"``): rounding it
    there again loses nothing.
    """
    ns = functools.partial(newton_schulz, coefficient_type=coefficient_type, num_ns_steps=num_ns_steps,
                           precision=precision, dtype=_storage_dtype(update.dtype, precision))
    if qkv_split_shapes is None:
        return ns(update)
    *batch, m, n = update.shape
    split = _check_qkv_split(qkv_split_shapes, m)
    groups = m // sum(split)
    grouped = update.reshape(*batch, groups, sum(split), n)
    starts = [sum(split[:i]) for i in range(len(split))]
    pieces = [grouped[..., start:start + rows, :].reshape(*batch, groups * rows, n)
              for start, rows in zip(starts, split)]
    # Pieces of one shape (key and value) are orthogonalised as one batch: half the small kernels.
    done = [None] * len(split)
    for rows in dict.fromkeys(split):
        same = [i for i, r in enumerate(split) if r == rows]
        out = ns(jnp.stack([pieces[i] for i in same]))
        for j, i in enumerate(same):
            done[i] = out[j].reshape(*batch, groups, rows, n)
    return jnp.concatenate(done, axis=-2).reshape(update.shape)


def _row_scales(shape: tuple[int, int], scale_mode, qkv_split_shapes) -> np.ndarray:
    """Each row's :func:`get_muon_scale_factor` (its QKV piece's): a float64 ``[m, 1]`` column, ``[1, 1]`` unsplit."""
    m, n = shape
    if qkv_split_shapes is None:
        return np.full((1, 1), get_muon_scale_factor(m, n, scale_mode))
    split = _check_qkv_split(qkv_split_shapes, m)
    groups = m // sum(split)
    group = np.concatenate([np.full(rows, get_muon_scale_factor(groups * rows, n, scale_mode)) for rows in split])
    return np.tile(group, groups)[:, None]


def _scaled(polar: jax.Array, row_scales: np.ndarray, extra_scale_factor: float, dtype) -> jax.Array:
    r""":math:`O = Q s \gamma` in ``dtype``, as ``(Q * s) * gamma`` (under ``jit`` XLA may fold the constants)."""
    return polar.astype(dtype) * jnp.asarray(row_scales, dtype) * extra_scale_factor


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    r"""Static Muon options, with Megatron's ``OptimizerConfig`` defaults.

    Learning rate and weight decay are not here: they follow a schedule and are
    passed to :func:`muon_update` on every call.

    Attributes:
      momentum: EMA coefficient :math:`\beta` of the momentum buffer, in [0, 1).
      nesterov: Whether to orthogonalise the Nesterov look-ahead instead of the buffer.
      coefficient_type: Newton–Schulz table, one of ``COEFFICIENT_TYPES``.
      num_ns_steps: Newton–Schulz iterations, at least 1.
      scale_mode: Update scale, one of ``SCALE_MODES``.
      extra_scale_factor: Extra multiplier on the orthogonalised update.
      fp32_matmul_prec: Newton–Schulz matmul precision, one of ``PRECISIONS``.
      split_qkv: Whether fused QKV weights are orthogonalised per Q/K/V piece
        (only where the caller passes ``qkv_split_shapes``).
    """

    momentum: float = 0.95
    nesterov: bool = False
    coefficient_type: CoefficientType = "quintic"
    num_ns_steps: int = 5
    scale_mode: ScaleMode = "spectral"
    extra_scale_factor: float = 1.0
    fp32_matmul_prec: Precision = "medium"
    split_qkv: bool = True

    def __post_init__(self):
        for name, kind, label in (("momentum", numbers.Real, "real number"), ("nesterov", bool, "bool"),
                                  ("extra_scale_factor", numbers.Real, "real number"), ("split_qkv", bool, "bool")):
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise TypeError(f"MuonConfig.{name} must be a {label}, but got {type(value).__name__}.")
        if not 0.0 <= self.momentum < 1.0:  # also rejects NaN
            raise ValueError(f"MuonConfig.momentum must be in [0, 1); got momentum={self.momentum!r}.")
        if not math.isfinite(self.extra_scale_factor):
            raise ValueError(f"MuonConfig.extra_scale_factor must be finite; got extra_scale_factor={self.extra_scale_factor!r}.")
        _check_choice("MuonConfig.coefficient_type", self.coefficient_type, COEFFICIENT_TYPES)
        _check_choice("MuonConfig.scale_mode", self.scale_mode, SCALE_MODES)
        _check_choice("MuonConfig.fp32_matmul_prec", self.fp32_matmul_prec, PRECISIONS)
        _check_num_ns_steps("MuonConfig.num_ns_steps", self.num_ns_steps)


def _lerp(start: jax.Array, end: jax.Array, weight: float) -> jax.Array:
    """Interpolate with ATen's two-sided formula, so rounding matches ``torch.lerp``."""
    if abs(weight) < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1.0 - weight)


def muon_update(
    param: jax.Array,
    grad: jax.Array,
    momentum: jax.Array,
    *,
    learning_rate: float | jax.Array,
    weight_decay: float | jax.Array,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Apply one Muon step to a stack of whole matrices.

    In Megatron's order, with :math:`\eta` = ``learning_rate``, :math:`\lambda` =
    ``weight_decay`` and :math:`\beta` = ``config.momentum``:

    .. math::

      P &\leftarrow P - \eta \lambda P \\
      M &\leftarrow M + (1 - \beta)(G - M) \\
      U &= G + \beta (M - G) \text{ if nesterov, else } M \\
      P &\leftarrow P - \eta \, \mathrm{orthogonalize}(U)

    Weight decay is decoupled and comes first. Since Newton–Schulz normalises its
    input, the first step from zero momentum does not depend on :math:`\beta` or Nesterov.

    Args:
      param: fp32 master weights ``[..., m, n]``; leading dims are a batch.
      grad: Gradient with the shape of ``param``.
      momentum: Momentum buffer with the shape of ``param`` (zeros at the start).
      learning_rate: Scalar, Python float or traced.
      weight_decay: Scalar, Python float or traced; 0 disables decay.
      config: The static options.
      qkv_split_shapes: Per-group Q/K/V row counts for a fused QKV weight, used only
        when ``config.split_qkv`` is true; ``None`` for every other matrix.

    Returns:
      ``(new_param, new_momentum)``, shapes and dtypes as ``param`` and ``momentum``.

    Raises:
      TypeError: If ``config`` is not a :class:`MuonConfig` or an array is not floating.
      ValueError: If the three arrays differ in shape or the split does not fit.

    Examples:
      >>> import jax.numpy as jnp
      >>> p, g = jnp.ones((2, 4, 6)), jnp.arange(48.0).reshape(2, 4, 6)
      >>> p1, m1 = muon_update(p, g, jnp.zeros_like(p), learning_rate=0.02,
      ...                      weight_decay=0.01, config=MuonConfig())
      >>> p1.shape, bool(jnp.allclose(m1, 0.05 * g))
      ((2, 4, 6), True)
    """
    _check_config("muon_update", config)
    _check_same_matrices("muon_update", param=param, grad=grad, momentum=momentum)
    direction, momentum = muon_direction(grad, momentum, config=config, qkv_split_shapes=qkv_split_shapes)
    return apply_direction(param, direction, learning_rate=learning_rate, weight_decay=weight_decay), momentum


def muon_polar(
    grad: jax.Array,
    momentum: jax.Array,
    *,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
    skip: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""The half of :func:`muon_update` that needs no parameter, before its scale: new momentum and :math:`Q`.

    .. math::

      M &\leftarrow M + (1 - \beta)(G - M) \\
      Q &= \mathrm{NS}(G + \beta (M - G) \text{ if nesterov, else } M)

    with :math:`\mathrm{NS}` per QKV piece, as :func:`orthogonalize` runs it.
    :func:`scale_polar` turns :math:`Q` into the direction. :math:`Q` is kept in
    Newton–Schulz's storage dtype, bf16 under ``"medium"``: what waits between
    the two halves takes half the bytes of the fp32 direction.

    ``skip`` (a boolean scalar, e.g. traced) marks a skipped step: the old
    momentum comes back bit for bit and :math:`Q` means nothing. The select
    comes before :math:`\mathrm{NS}` reads the momentum, so XLA can compute
    the new momentum and its norm in one pass.

    Returns:
      ``(polar, new_momentum)``.

    Raises:
      TypeError, ValueError: As :func:`muon_update`.
    """
    _check_config("muon_polar", config)
    _check_same_matrices("muon_polar", grad=grad, momentum=momentum)
    beta = config.momentum
    new = _lerp(momentum, grad, 1.0 - beta)
    momentum = new if skip is None else jnp.where(skip, momentum, new)
    update = _lerp(grad, momentum, beta) if config.nesterov else momentum
    split = qkv_split_shapes if config.split_qkv else None
    return _polar(update, config.coefficient_type, config.num_ns_steps, config.fp32_matmul_prec, split), momentum


def scale_polar(
    polar: jax.Array,
    *,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    r"""Muon's direction from :func:`muon_polar`'s :math:`Q`: :math:`O = Q\, s\, \gamma` in ``dtype``.

    :math:`s` is :func:`get_muon_scale_factor` of the matrix, or of each row's
    QKV piece, and :math:`\gamma` is ``config.extra_scale_factor``.
    """
    _check_config("scale_polar", config)
    _check_matrix("scale_polar", "polar", polar)
    split = qkv_split_shapes if config.split_qkv else None
    return _scaled(polar, _row_scales(polar.shape[-2:], config.scale_mode, split), config.extra_scale_factor, dtype)


def muon_direction(
    grad: jax.Array,
    momentum: jax.Array,
    *,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""The half of :func:`muon_update` that needs no parameter: new momentum and the direction.

    .. math::

      M &\leftarrow M + (1 - \beta)(G - M) \\
      O &= \mathrm{orthogonalize}(G + \beta (M - G) \text{ if nesterov, else } M)

    It is :func:`muon_polar` followed by :func:`scale_polar`.

    Returns:
      ``(direction, new_momentum)``; the direction in ``momentum``'s dtype.

    Raises:
      TypeError, ValueError: As :func:`muon_update`.
    """
    _check_config("muon_direction", config)
    _check_same_matrices("muon_direction", grad=grad, momentum=momentum)
    polar, momentum = muon_polar(grad, momentum, config=config, qkv_split_shapes=qkv_split_shapes)
    return scale_polar(polar, config=config, qkv_split_shapes=qkv_split_shapes, dtype=momentum.dtype), momentum


def apply_direction(
    param: jax.Array,
    direction: jax.Array,
    *,
    learning_rate: float | jax.Array,
    weight_decay: float | jax.Array,
) -> jax.Array:
    r"""The other half: decoupled weight decay, then the step, :math:`P \leftarrow P - \eta\lambda P - \eta O`.

    Decay is skipped when it is a literal zero, as Megatron does. Returns ``param``'s dtype.

    Raises:
      TypeError, ValueError: As :func:`muon_update`.
    """
    _check_same_matrices("apply_direction", param=param, direction=direction)
    new = param
    if not (isinstance(weight_decay, numbers.Real) and weight_decay == 0):
        new = new - (learning_rate * weight_decay) * new
    return (new - learning_rate * direction).astype(param.dtype)
