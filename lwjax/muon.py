"""Muon's per-matrix step, as Megatron-Core runs it, in batched ``jax.numpy``.

Only arithmetic lives here: the scale modes, the QKV split and one Muon step
(:func:`muon_update`) on a stack of whole matrices ``[..., m, n]``, on top of
:func:`~lwjax.newton_schulz.newton_schulz`. Ownership and collectives belong to
the layer-wise step (:mod:`lwjax.step`), which reads the matrices a rank owns
as one stack per shape and runs :func:`muon_update` on them in its two halves:
:func:`muon_polar` (momentum and Newton–Schulz, no parameter needed, so it can
start before the gradient norm is known) and :func:`apply_polar` (scale, weight
decay and step).

The numerics follow ``emerging_optimizers`` 0.3.0: the same step order, scale
modes and QKV split. Options are static Python values in a :class:`MuonConfig`,
checked when it is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.newton_schulz import (
    COEFFICIENT_ALIASES,
    COEFFICIENT_TYPES,
    PRECISIONS,
    CoefficientType,
    Precision,
    _check_choice,
    _check_matrix,
    _check_num_ns_steps,
    _storage_dtype,
    newton_schulz,
)

ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
SCALE_MODES: tuple[str, ...] = ("spectral", "unit_rms_norm", "shape_scaling")
TensorParallelMode = Literal["duplicated", "distributed", "blockwise"]
TP_MODES: tuple[str, ...] = ("duplicated", "distributed", "blockwise")


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


def _spectral_scale(size_out: int, size_in: int) -> float:
    """sqrt(max(m, n)); Jordan / Kimi, https://arxiv.org/abs/2502.16982."""
    return math.sqrt(max(size_out, size_in))


def _unit_rms_norm_scale(size_out: int, size_in: int) -> float:
    """sqrt(m / n); Scion, https://arxiv.org/abs/2502.07529."""
    return math.sqrt(size_out / size_in)


def _shape_scaling_scale(size_out: int, size_in: int) -> float:
    """sqrt(max(1, m / n)); Jordan, https://kellerjordan.github.io/posts/muon/."""
    return math.sqrt(max(1.0, size_out / size_in))


_SCALE_FNS = {
    "spectral": _spectral_scale,
    "unit_rms_norm": _unit_rms_norm_scale,
    "shape_scaling": _shape_scaling_scale,
}


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
            raise ValueError(
                f"get_muon_scale_factor: {name} must be a positive int; got {name}={size!r}."
            )
    _check_choice("get_muon_scale_factor: mode", mode, SCALE_MODES)
    return _SCALE_FNS[mode](size_out, size_in)


def _check_qkv_split(qkv_split_shapes: object, rows: int) -> tuple[int, ...]:
    """Validate a QKV split against the row count and return it as a tuple."""
    where = "orthogonalize: qkv_split_shapes"
    if not isinstance(qkv_split_shapes, Sequence) or isinstance(qkv_split_shapes, str):
        raise TypeError(
            f"{where} must be a sequence of ints, but got {type(qkv_split_shapes).__name__}."
        )
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
    return _scaled(
        polar,
        _row_scales(update.shape[-2:], scale_mode, qkv_split_shapes),
        extra_scale_factor,
        update.dtype,
    )


def _polar(
    update: jax.Array,
    coefficient_type,
    num_ns_steps,
    precision,
    qkv_split_shapes,
    tensor: TensorSplit | None = None,
    tp_mode: str = "duplicated",
) -> jax.Array:
    """Newton–Schulz of the matrix, or of each QKV piece with its rows put back, unscaled.

    Kept in the iteration's storage dtype (bf16 under ``"medium"``): rounding it
    there again loses nothing. With ``tensor``, ``update`` is this device's
    block of each matrix (and of each QKV piece); ``tp_mode`` says how the
    whole matrix is orthogonalised (:class:`MuonConfig`).
    """
    ns = functools.partial(
        newton_schulz,
        coefficient_type=coefficient_type,
        num_ns_steps=num_ns_steps,
        precision=precision,
        dtype=_storage_dtype(update.dtype, precision),
    )
    if tensor is not None and tp_mode == "distributed":
        if tensor.rows and tensor.cols:
            raise ValueError(
                "tp_mode='distributed' needs each matrix split on one side; got a block of "
                f"rows split over {tensor.rows} and columns over {tensor.cols}."
            )
        side = tensor.rows or tensor.cols
        ns = functools.partial(
            ns, sharded=(tuple(name for name, _ in side), -2 if tensor.rows else -1)
        )
    elif tensor is not None and tp_mode == "duplicated":
        ns = functools.partial(_exchanged, ns, tensor)
    if qkv_split_shapes is None:
        return ns(update)
    *batch, m, n = update.shape
    split = _check_qkv_split(qkv_split_shapes, m)
    groups = m // sum(split)
    grouped = update.reshape(*batch, groups, sum(split), n)
    starts = [sum(split[:i]) for i in range(len(split))]
    pieces = [
        grouped[..., start : start + rows, :].reshape(*batch, groups * rows, n)
        for start, rows in zip(starts, split)
    ]
    # Pieces of one shape (key and value) are orthogonalised as one batch: half the small kernels.
    done = [None] * len(split)
    for rows in dict.fromkeys(split):
        same = [i for i, r in enumerate(split) if r == rows]
        out = ns(jnp.stack([pieces[i] for i in same]))
        for j, i in enumerate(same):
            done[i] = out[j].reshape(*batch, groups, rows, n)
    return jnp.concatenate(done, axis=-2).reshape(update.shape)


def _exchanged(ns, tensor: TensorSplit, block: jax.Array) -> jax.Array:
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
    grid_rows = [size for _, size in tensor.rows]
    grid_cols = [size for _, size in tensor.cols]
    k, t = len(grid_rows), math.prod(grid_rows) * math.prod(grid_cols)
    *lead, r, c = block.shape
    count = math.prod(lead)
    per = -(-count // t)
    flat = block.reshape(count, r, c)
    if per * t > count:
        flat = jnp.concatenate([flat, jnp.zeros((per * t - count, r, c), flat.dtype)])
    # received[s]: the block at grid position s (row-major) of the matrices this device assembles.
    received = lax.all_to_all(flat.reshape(t, per, r, c), tensor.names, 0, 0)
    grid = received.reshape(*grid_rows, *grid_cols, per, r, c)
    n = grid.ndim - 3  # grid axes
    to_whole = (n, *range(k), n + 1, *range(k, n), n + 2)  # [per, rows grid, r, cols grid, c]
    whole = grid.transpose(to_whole).reshape(
        per, r * math.prod(grid_rows), c * math.prod(grid_cols)
    )
    done = ns(whole).reshape(per, *grid_rows, r, *grid_cols, c)
    blocks = done.transpose(tuple(int(i) for i in np.argsort(to_whole))).reshape(t, per, r, c)
    # back[g]: this device's block of the matrices device g assembled.
    back = lax.all_to_all(blocks, tensor.names, 0, 0)
    return back.reshape(t * per, r, c)[:count].reshape(block.shape)


def _row_scales(
    shape: tuple[int, int], scale_mode, qkv_split_shapes, full: tuple[int, int] | None = None
) -> np.ndarray:
    """Each row's :func:`get_muon_scale_factor` (its QKV piece's) as a float64 ``[m, 1]`` column.

    ``[1, 1]`` when the matrix is not split. ``full``: ``shape`` is a block of
    a matrix of this shape, which the scales are taken from (QKV pieces keep
    their rows' share of it).
    """
    m, n = shape
    full_m, full_n = full or shape
    if qkv_split_shapes is None:
        return np.full((1, 1), get_muon_scale_factor(full_m, full_n, scale_mode))
    split = _check_qkv_split(qkv_split_shapes, m)
    groups = m // sum(split)
    full_groups = full_m * groups // m
    group = np.concatenate(
        [
            np.full(rows, get_muon_scale_factor(full_groups * rows, full_n, scale_mode))
            for rows in split
        ]
    )
    return np.tile(group, groups)[:, None]


def _scaled(
    polar: jax.Array, row_scales: np.ndarray, extra_scale_factor: float, dtype
) -> jax.Array:
    r""":math:`O = Q s \gamma` in ``dtype``, as ``(Q * s) * gamma`` (XLA may fold the constants)."""
    return polar.astype(dtype) * jnp.asarray(row_scales, dtype) * extra_scale_factor


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


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    r"""Static Muon options, with Megatron's ``OptimizerConfig`` defaults.

    Learning rate and weight decay are not here: they follow a schedule and are
    passed to :func:`muon_update` on every call.

    Attributes:
      momentum: EMA coefficient :math:`\beta` of the momentum buffer, in [0, 1).
      nesterov: Whether to orthogonalise the Nesterov look-ahead instead of the buffer.
      coefficient_type: Newton–Schulz table, one of ``COEFFICIENT_TYPES``;
        optax's preset names ``"standard"`` (= ``"simple"``) and ``"dion"``
        (= ``"quintic"``) are accepted and stored as lwjax's.
      num_ns_steps: Newton–Schulz iterations, at least 1.
      scale_mode: Update scale, one of ``SCALE_MODES``.
      extra_scale_factor: Extra multiplier on the orthogonalised update.
      fp32_matmul_prec: Newton–Schulz matmul precision, one of ``PRECISIONS``.
      split_qkv: Whether fused QKV weights are orthogonalised per Q/K/V piece
        (only where the caller passes ``qkv_split_shapes``).
      tp_mode: How a matrix split over tensor parallelism is orthogonalised
        (Megatron's ``--muon-tp-mode``), one of ``TP_MODES``:
        ``"duplicated"`` orthogonalises the whole matrix (Megatron gathers it
        on every device and each runs Newton–Schulz; lwjax assembles each
        matrix on one device of the axis, runs it once there and sends the
        blocks back); ``"distributed"`` iterates on the
        blocks, summing the norm and each Gram matrix over the axis (no
        gather; the same result up to rounding); both scale by the whole
        matrix's shape, so the update does not depend on the tensor-parallel
        size. ``"blockwise"`` orthogonalises and scales each block as a
        matrix of its own, so the update does (Megatron-Core 0.19's default).
    """

    momentum: float = 0.95
    nesterov: bool = False
    coefficient_type: CoefficientType = "quintic"
    num_ns_steps: int = 5
    scale_mode: ScaleMode = "spectral"
    extra_scale_factor: float = 1.0
    fp32_matmul_prec: Precision = "medium"
    split_qkv: bool = True
    tp_mode: TensorParallelMode = "duplicated"

    def __post_init__(self):
        for name, kind, label in (
            ("momentum", numbers.Real, "real number"),
            ("nesterov", bool, "bool"),
            ("extra_scale_factor", numbers.Real, "real number"),
            ("split_qkv", bool, "bool"),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise TypeError(
                    f"MuonConfig.{name} must be a {label}, but got {type(value).__name__}."
                )
        if not 0.0 <= self.momentum < 1.0:  # also rejects NaN
            raise ValueError(
                f"MuonConfig.momentum must be in [0, 1); got momentum={self.momentum!r}."
            )
        if not math.isfinite(self.extra_scale_factor):
            raise ValueError(
                "MuonConfig.extra_scale_factor must be finite; "
                f"got extra_scale_factor={self.extra_scale_factor!r}."
            )
        canonical = COEFFICIENT_ALIASES.get(self.coefficient_type, self.coefficient_type)
        object.__setattr__(self, "coefficient_type", canonical)
        _check_choice("MuonConfig.coefficient_type", self.coefficient_type, COEFFICIENT_TYPES)
        _check_choice("MuonConfig.scale_mode", self.scale_mode, SCALE_MODES)
        _check_choice("MuonConfig.fp32_matmul_prec", self.fp32_matmul_prec, PRECISIONS)
        _check_choice("MuonConfig.tp_mode", self.tp_mode, TP_MODES)
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

      M &\leftarrow M + (1 - \beta)(G - M) \\
      U &= G + \beta (M - G) \text{ if nesterov, else } M \\
      P &\leftarrow P - \eta \lambda P - \eta\, \mathrm{orthogonalize}(U)

    Weight decay is decoupled. Since Newton–Schulz normalises its input, the
    first step from zero momentum does not depend on :math:`\beta` or Nesterov.
    It is :func:`apply_polar` of :func:`muon_polar`: the layer-wise step runs the
    two halves apart.

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
    polar, momentum = muon_polar(grad, momentum, config=config, qkv_split_shapes=qkv_split_shapes)
    new_param = apply_polar(
        param,
        polar,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        config=config,
        qkv_split_shapes=qkv_split_shapes,
    )
    return new_param, momentum


def muon_polar(
    grad: jax.Array,
    momentum: jax.Array,
    *,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
    skip: jax.Array | None = None,
    tensor: TensorSplit | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""The first half of :func:`muon_update`, which needs no parameter: new momentum and :math:`Q`.

    .. math::

      M &\leftarrow M + (1 - \beta)(G - M) \\
      Q &= \mathrm{NS}(G + \beta (M - G) \text{ if nesterov, else } M)

    with :math:`\mathrm{NS}` per QKV piece, as :func:`orthogonalize` runs it,
    before its scale. :math:`Q` is kept in Newton–Schulz's storage dtype, bf16
    under ``"medium"``: what waits for :func:`apply_polar` takes half the
    bytes of an fp32 direction.

    ``skip`` (a boolean scalar, e.g. traced) marks a skipped step: the old
    momentum comes back bit for bit and :math:`Q` means nothing. The select
    comes before :math:`\mathrm{NS}` reads the momentum, so XLA can compute
    the new momentum and its norm in one pass.

    ``tensor``: the arrays are this device's blocks of matrices split over a
    tensor-parallel axis (inside ``shard_map``); :math:`Q` is the block of the
    whole matrix's polar factor, or of the block's own under
    ``config.tp_mode == "blockwise"``.

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
    return _polar(
        update,
        config.coefficient_type,
        config.num_ns_steps,
        config.fp32_matmul_prec,
        split,
        tensor,
        config.tp_mode,
    ), momentum


def apply_polar(
    param: jax.Array,
    polar: jax.Array,
    *,
    learning_rate: float | jax.Array,
    weight_decay: float | jax.Array,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
    tensor: TensorSplit | None = None,
) -> jax.Array:
    r"""The second half of :func:`muon_update`: scale :func:`muon_polar`'s :math:`Q`, take the step.

    .. math::

      O = Q\, s\, \gamma, \qquad P \leftarrow P - \eta\lambda P - \eta O

    :math:`s` is :func:`get_muon_scale_factor` of the matrix, or of each row's
    QKV piece, and :math:`\gamma` is ``config.extra_scale_factor``; :math:`O`
    is formed in ``param``'s dtype (the fp32 masters'). Decay is skipped when
    it is a literal zero, as Megatron does. With ``tensor`` (blocks of split
    matrices), :math:`s` is the whole matrix's, except under
    ``config.tp_mode == "blockwise"``.

    Returns:
      The new parameters, in ``param``'s dtype.

    Raises:
      TypeError, ValueError: As :func:`muon_update`.
    """
    _check_config("apply_polar", config)
    _check_same_matrices("apply_polar", param=param, polar=polar)
    split = qkv_split_shapes if config.split_qkv else None
    whole = tensor is not None and config.tp_mode != "blockwise"
    direction = _scaled(
        polar,
        _row_scales(
            polar.shape[-2:],
            config.scale_mode,
            split,
            tensor.full(polar.shape[-2:]) if whole else None,
        ),
        config.extra_scale_factor,
        param.dtype,
    )
    new = param
    if not (isinstance(weight_decay, numbers.Real) and weight_decay == 0):
        new = new - (learning_rate * weight_decay) * new
    return (new - learning_rate * direction).astype(param.dtype)
