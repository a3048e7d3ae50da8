"""Muon's per-matrix step, as Megatron-Core runs it, in batched ``jax.numpy``.

Only arithmetic lives here: one Muon step (:func:`muon_update`) on a stack of
whole matrices ``[..., m, n]``, on top of
:func:`~lwjax.newton_schulz.newton_schulz` and the scale modes and QKV split of
:mod:`lwjax.muon_scale`. Ownership and collectives belong to the layer-wise step
(:mod:`lwjax.step`), which reads the matrices a rank owns as one stack per shape
and runs :func:`muon_update` on them in its two halves: :func:`muon_polar`
(momentum and Newton–Schulz, no parameter needed, so it can start before the
gradient norm is known) and :func:`apply_polar` (scale, weight decay and step).
Blocks of matrices split over devices come with an exchange (``_BlockExchange``: how
to orthogonalise them, which shape scales them), built by :mod:`lwjax.parallel.exchange`:
the math calls it and reads no mesh axis name.

The numerics follow ``emerging_optimizers`` 0.3.0: the same step order, scale
modes and QKV split. Options are static Python values in a :class:`MuonConfig`,
checked when it is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import jax
import jax.numpy as jnp

from lwjax.moved import moved_names
from lwjax.muon_scale import SCALE_MODES, ScaleMode, _check_qkv_split, _row_scales, _scaled
from lwjax.muon_scale import get_muon_scale_factor as get_muon_scale_factor
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
    newton_schulz_many,
)

TensorParallelMode = Literal["duplicated", "distributed", "blockwise"]
TP_MODES: tuple[str, ...] = ("duplicated", "distributed", "blockwise")


class _BlockExchange(Protocol):
    """What the math needs to know of a stack of blocks of split matrices (in ``shard_map``).

    :class:`lwjax.parallel.exchange.SplitExchange` is the one the step uses; a
    test may pass any object with these two methods.
    """

    def orthogonalizer(self, ns: Callable) -> Callable[[jax.Array], jax.Array]:
        """``ns`` (Newton–Schulz of whole matrices) made to map this device's blocks to
        its blocks of the result."""

    def whole_shape(self, shape: tuple[int, int]) -> tuple[int, int] | None:
        """The ``(m, n)`` whose scale applies to a block of ``shape``; ``None``: its own."""


# TensorSplit moved to lwjax.parallel.exchange after 0.4.0; readable here for one release.
__getattr__ = moved_names(__name__, {"TensorSplit": "lwjax.parallel.exchange"})


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
    exchange: _BlockExchange | None = None,
) -> jax.Array:
    """Newton–Schulz of the matrix, or of each QKV piece with its rows put back, unscaled.

    Kept in the iteration's storage dtype (bf16 under ``"medium"``): rounding it
    there again loses nothing. With ``exchange``, ``update`` is this device's
    block of each matrix (and of each QKV piece), orthogonalised as the
    exchange says.
    """
    ns = _newton_schulz_in(update.dtype, coefficient_type, num_ns_steps, precision)
    if exchange is not None:
        ns = exchange.orthogonalizer(ns)
    stacks, join = _pieces(update, qkv_split_shapes)
    return join([ns(x) for x in stacks])


def _newton_schulz_in(dtype, coefficient_type, num_ns_steps, precision) -> Callable:
    """:func:`newton_schulz` with these options, iterating in the storage dtype of ``dtype``."""
    return functools.partial(
        newton_schulz, **_ns_options(dtype, coefficient_type, num_ns_steps, precision)
    )


def _ns_options(dtype, coefficient_type, num_ns_steps, precision) -> dict:
    return dict(
        coefficient_type=coefficient_type,
        num_ns_steps=num_ns_steps,
        precision=precision,
        dtype=_storage_dtype(dtype, precision),
    )


def orthogonalize_together(stacks: Sequence[jax.Array], *, config: MuonConfig) -> list:
    """:func:`newton_schulz_many` of the stacks of several :func:`polar_pieces` calls with
    ``config`` (updates of one dtype): each comes back as those calls' ``ns`` gives it."""
    _check_config("orthogonalize_together", config)
    options = _ns_options(
        stacks[0].dtype, config.coefficient_type, config.num_ns_steps, config.fp32_matmul_prec
    )
    return newton_schulz_many(stacks, **options)


def piece_stacks(rows: int, qkv_split_shapes) -> list[tuple[int, int]]:
    """``(pieces, rows)`` of each stack Newton–Schulz runs on for a matrix of ``rows`` rows
    (:func:`_pieces`): the whole matrix, or per distinct QKV row count its pieces together."""
    if not qkv_split_shapes:
        return [(1, rows)]
    groups = rows // sum(qkv_split_shapes)
    return [(qkv_split_shapes.count(r), groups * r) for r in dict.fromkeys(qkv_split_shapes)]


def _pieces(update: jax.Array, qkv_split_shapes) -> tuple[list[jax.Array], Callable]:
    """The stacks Newton–Schulz runs on for ``update`` and the function that joins their results.

    Without a split, ``update`` itself. With one, per distinct row count the QKV
    pieces of that count stacked on a new leading axis (key and value as one
    batch: half the small kernels); the join puts each piece's rows back.
    """
    if qkv_split_shapes is None:
        return [update], lambda done: done[0]
    *batch, m, n = update.shape
    split = _check_qkv_split(qkv_split_shapes, m)
    groups = m // sum(split)
    grouped = update.reshape(*batch, groups, sum(split), n)
    starts = [sum(split[:i]) for i in range(len(split))]
    pieces = [
        grouped[..., start : start + rows, :].reshape(*batch, groups * rows, n)
        for start, rows in zip(starts, split)
    ]
    counts = list(dict.fromkeys(split))
    stacks = [jnp.stack([p for p, r in zip(pieces, split) if r == rows]) for rows in counts]

    def join(done: list[jax.Array]) -> jax.Array:
        joined = [None] * len(split)
        for rows, out in zip(counts, done):
            same = [i for i, r in enumerate(split) if r == rows]
            for j, i in enumerate(same):
                joined[i] = out[j].reshape(*batch, groups, rows, n)
        return jnp.concatenate(joined, axis=-2).reshape(update.shape)

    return stacks, join


def polar_pieces(
    update: jax.Array, *, config: MuonConfig, qkv_split_shapes: Sequence[int] | None = None
) -> tuple[list[jax.Array], Callable[[list[jax.Array]], jax.Array], Callable]:
    """:func:`muon_polar`'s Newton–Schulz taken apart, for a caller that batches it with others.

    Returns ``(stacks, join, ns)``: the stacks of matrices Newton–Schulz runs
    on for ``update`` (:func:`muon_momentum`'s; per QKV piece when split), the
    function that turns ``ns`` of each stack into :math:`Q`, and ``ns``
    itself (:func:`newton_schulz` with ``config``'s options), so that
    ``join([ns(x) for x in stacks])`` is :func:`muon_polar`'s :math:`Q`.
    """
    _check_config("polar_pieces", config)
    stacks, join = _pieces(update, qkv_split_shapes if config.split_qkv else None)
    ns = _newton_schulz_in(
        update.dtype, config.coefficient_type, config.num_ns_steps, config.fp32_matmul_prec
    )
    return stacks, join, ns


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
    exchange: _BlockExchange | None = None,
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

    ``exchange``: the arrays are this device's blocks of matrices split over
    devices (``_BlockExchange``); :math:`Q` is the block of the whole
    matrix's polar factor, or of the block's own, as the exchange says
    (``MuonConfig.tp_mode``).

    Returns:
      ``(polar, new_momentum)``.

    Raises:
      TypeError, ValueError: As :func:`muon_update`.
    """
    _check_config("muon_polar", config)
    _check_same_matrices("muon_polar", grad=grad, momentum=momentum)
    update, momentum = muon_momentum(grad, momentum, config=config, skip=skip)
    split = qkv_split_shapes if config.split_qkv else None
    return _polar(
        update,
        config.coefficient_type,
        config.num_ns_steps,
        config.fp32_matmul_prec,
        split,
        exchange,
    ), momentum


def muon_momentum(
    grad: jax.Array, momentum: jax.Array, *, config: MuonConfig, skip: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    r""":func:`muon_polar`'s first step: the new momentum and the matrix it orthogonalises.

    .. math::

      M \leftarrow M + (1 - \beta)(G - M), \qquad
      U = G + \beta (M - G) \text{ if nesterov, else } M

    ``skip`` as in :func:`muon_polar`. Returns ``(U, new_momentum)``.
    """
    beta = config.momentum
    new = _lerp(momentum, grad, 1.0 - beta)
    momentum = new if skip is None else jnp.where(skip, momentum, new)
    return muon_look_ahead(grad, momentum, config=config), momentum


def muon_look_ahead(grad: jax.Array, momentum: jax.Array, *, config: MuonConfig) -> jax.Array:
    r"""The matrix :func:`muon_momentum` orthogonalises, from the gradient and the *new* momentum.

    .. math:: U = G + \beta (M - G) \text{ if nesterov, else } M
    """
    return _lerp(grad, momentum, config.momentum) if config.nesterov else momentum


def apply_polar(
    param: jax.Array,
    polar: jax.Array,
    *,
    learning_rate: float | jax.Array,
    weight_decay: float | jax.Array,
    config: MuonConfig,
    qkv_split_shapes: Sequence[int] | None = None,
    exchange: _BlockExchange | None = None,
) -> jax.Array:
    r"""The second half of :func:`muon_update`: scale :func:`muon_polar`'s :math:`Q`, take the step.

    .. math::

      O = Q\, s\, \gamma, \qquad P \leftarrow P - \eta\lambda P - \eta O

    :math:`s` is :func:`get_muon_scale_factor` of the matrix, or of each row's
    QKV piece, and :math:`\gamma` is ``config.extra_scale_factor``; :math:`O`
    is formed in ``param``'s dtype (the fp32 masters'). Decay is skipped when
    it is a literal zero, as Megatron does. With ``exchange`` (blocks of split
    matrices), :math:`s` is that of the shape it names
    (``whole_shape``: the whole matrix's, except under
    ``"blockwise"``).

    Returns:
      The new parameters, in ``param``'s dtype.

    Raises:
      TypeError, ValueError: As :func:`muon_update`.
    """
    _check_config("apply_polar", config)
    _check_same_matrices("apply_polar", param=param, polar=polar)
    split = qkv_split_shapes if config.split_qkv else None
    direction = _scaled(
        polar,
        _row_scales(
            polar.shape[-2:],
            config.scale_mode,
            split,
            None if exchange is None else exchange.whole_shape(polar.shape[-2:]),
        ),
        config.extra_scale_factor,
        param.dtype,
    )
    new = param
    if not (isinstance(weight_decay, numbers.Real) and weight_decay == 0):
        new = new - (learning_rate * weight_decay) * new
    return (new - learning_rate * direction).astype(param.dtype)
