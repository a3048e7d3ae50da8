r"""The scale of Muon's orthogonalised update, per matrix or per row of a fused QKV weight.

An orthogonal :math:`m \times n` matrix has RMS :math:`1/\sqrt{\max(m, n)}`; each scale
mode (:data:`SCALE_MODES`) multiplies it by a factor of the shape, following
``emerging_optimizers`` 0.3.0. A fused QKV weight's rows are read as interleaved query
groups of Q, K and V pieces, each scaled with its own shape (``_row_scales``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from lwjax.newton_schulz import _check_choice

ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
SCALE_MODES: tuple[str, ...] = ("spectral", "unit_rms_norm", "shape_scaling")


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
