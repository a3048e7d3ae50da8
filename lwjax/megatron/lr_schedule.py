r"""Megatron-LM's learning-rate and weight-decay schedules as optax schedules of lwjax's step count.

Megatron's ``OptimizerParamScheduler`` counts *samples* :math:`s`: every
successful optimizer step advances it by the global batch size :math:`B`, and
iteration :math:`k + 1` runs with the values at the :math:`s` reached after
:math:`k` successful steps. With warmup :math:`W` and decay :math:`D` samples,
:math:`\eta_0` = ``lr_warmup_init``, :math:`\eta_+` = ``lr`` and :math:`\eta_-` = ``min_lr``,
the first case that applies gives the learning rate:

.. math::

   \eta(s) = \begin{cases}
     \eta_0 + (\eta_+ - \eta_0)\, s / W & W > 0,\ s \le W \\
     \eta_+ & \text{constant} \\
     \eta_- & s > D \\
     \max\bigl(\eta_-,\ \eta_+ \sqrt{\max(W, 1) / \max(s, 1)}\bigr) & \text{inv.-square-root} \\
     \eta_- + c\,(\eta_+ - \eta_-), \quad r = (s - W) / (D - W) & \text{otherwise}
   \end{cases}

with :math:`c = 1 - r` (linear) or :math:`(1 + \cos \pi r) / 2` (cosine). WSD
holds :math:`c = 1` until :math:`D - A` (:math:`A` anneal samples), then with
:math:`q = (s - D + A) / A` anneals by :math:`1 - q` (linear),
:math:`(1 + \cos \pi q) / 2` (cosine), :math:`2 \cdot 2^{-q} - 1` (exponential)
or :math:`1 - \sqrt q` (minus_sqrt). Weight decay grows over :math:`I` samples
from :math:`\lambda_0` = ``start_weight_decay`` to :math:`\lambda_1` = ``end_weight_decay``:

.. math::

   \lambda(s) = \lambda_0 + c\,(\lambda_1 - \lambda_0), \qquad
   c = s / I \text{ (linear)},\ (1 - \cos(\pi s / I)) / 2 \text{ (cosine)},

and :math:`\lambda_1` when constant or :math:`s > I`. lwjax's ``state.count``
counts applied steps and a checkpoint imported at iteration :math:`N` has count
:math:`N`, so the lwjax schedules are

.. math:: f(\text{count}) = \text{value}\bigl(s_N + (\text{count} - N)\, B\bigr)

where :math:`s_N` is the checkpoint's stored ``num_steps`` (it excludes skipped
iterations), or :math:`N B` when nothing is stored.

:func:`lwjax.megatron.schedules.schedule_from_megatron` reads these values from a
checkpoint's args and stored scheduler state. Out of scope: per-param-group overrides
(a group's own ``max_lr``/``min_lr``, ``decoupled_lr`` for the embedding and output
layer, ``lr_mult``): the schedule is the default groups'. lwjax's per-parameter
``lr_mult``/``wd_mult`` still scale it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class MegatronSchedule:
    """Megatron's learning-rate and weight-decay schedule, resolved to numbers.

    Steps are Megatron's: samples. :meth:`learning_rate` and
    :meth:`weight_decay` are optax schedules of lwjax's step count (jnp,
    float32, traceable); :meth:`learning_rate_at` and :meth:`weight_decay_at`
    are the same values at Megatron's sample count in float64 numpy.

    Attributes:
      max_lr: Peak learning rate (``lr``).
      min_lr: Floor after the decay (``min_lr``).
      init_lr: Start of the warmup (``lr_warmup_init``).
      warmup_steps: Warmup length in samples (may be fractional).
      decay_steps: Samples until the decay reaches ``min_lr``.
      decay_style: One of :data:`LR_DECAY_STYLES`.
      wsd_decay_steps: WSD anneal length in samples; ``None`` unless WSD.
      wsd_decay_style: One of :data:`WSD_DECAY_STYLES`.
      start_wd: Weight decay at sample 0.
      end_wd: Weight decay from ``wd_incr_steps`` on.
      wd_incr_steps: Samples over which the weight decay grows.
      wd_incr_style: One of :data:`WD_INCR_STYLES`.
      num_steps: Megatron's sample count at the imported iteration.
      iteration: The imported iteration, lwjax's ``state.count`` there.
      increment: Samples per step (the global batch size).
      resume_wd: The weight decay of the first step after the import (count
        ``iteration``) where it differs from the schedule's, else ``None``.
        Megatron's ``load_state_dict`` sets that step's value before it reads
        the stored weight-decay settings, so when the arguments' settings
        differ from the stored ones (``use_checkpoint_opt_param_scheduler``)
        that one step follows the arguments'.
      sources: ``(field, where it was read)`` pairs; error messages name these.
    """

    max_lr: float
    min_lr: float = 0.0
    init_lr: float = 0.0
    warmup_steps: float = 0
    decay_steps: float = 1
    decay_style: str = "linear"
    wsd_decay_steps: float | None = None
    wsd_decay_style: str = "exponential"
    start_wd: float = 0.0
    end_wd: float = 0.0
    wd_incr_steps: float = 1
    wd_incr_style: str = "constant"
    num_steps: int = 0
    iteration: int = 0
    increment: int = 1
    resume_wd: float | None = None
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        where = self._where
        if self.resume_wd is not None:
            _check_number(self.resume_wd, where("resume_wd"), low=0.0)
        for name in ("max_lr", "min_lr", "init_lr", "start_wd", "end_wd", "warmup_steps"):
            _check_number(getattr(self, name), where(name), low=0.0)
        for name in ("wd_incr_steps", "num_steps", "iteration"):
            _check_number(getattr(self, name), where(name), low=0.0)
        _check_number(self.decay_steps, where("decay_steps"), low=0.0, open_low=True)
        _check_number(self.increment, where("increment"), low=1.0)
        _check_choice(self.decay_style, LR_DECAY_STYLES, where("decay_style"))
        _check_choice(self.wsd_decay_style, WSD_DECAY_STYLES, where("wsd_decay_style"))
        _check_choice(self.wd_incr_style, WD_INCR_STYLES, where("wd_incr_style"))
        if self.min_lr > self.max_lr:
            raise ValueError(
                f"{where('min_lr')}: must not exceed the peak learning rate "
                f"({where('max_lr')} = {self.max_lr!r}); got {self.min_lr!r}."
            )
        if self.init_lr > self.max_lr:
            raise ValueError(
                f"{where('init_lr')}: must not exceed the peak learning rate "
                f"({where('max_lr')} = {self.max_lr!r}); got {self.init_lr!r}."
            )
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(
                f"{where('warmup_steps')}: the warmup must be shorter than the decay "
                f"({where('decay_steps')} = {self.decay_steps!r} samples); "
                f"got {self.warmup_steps!r} samples."
            )
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ValueError(
                    f"{where('wsd_decay_steps')}: lr_decay_style 'WSD' needs the anneal length "
                    "(lr_wsd_decay_iters or lr_wsd_decay_samples); got None."
                )
            _check_number(self.wsd_decay_steps, where("wsd_decay_steps"), low=0.0, open_low=True)
        if self.end_wd < self.start_wd:
            raise ValueError(
                f"{where('end_wd')}: must be >= the starting weight decay "
                f"({where('start_wd')} = {self.start_wd!r}); got {self.end_wd!r}."
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(
                f"{where('wd_incr_style')}: a constant weight decay needs equal start and end "
                f"({where('start_wd')} = {self.start_wd!r}, {where('end_wd')} = "
                f"{self.end_wd!r}); got {self.wd_incr_style!r}."
            )
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ValueError(
                f"{where('wd_incr_steps')}: a {self.wd_incr_style} weight decay needs a "
                f"positive number of samples; got {self.wd_incr_steps!r}."
            )

    def _where(self, name: str) -> str:
        return dict(self.sources).get(name, f"MegatronSchedule.{name}")

    def describe(self) -> dict[str, dict[str, Any]]:
        """Every value and where it was read: ``{field: {"value": ..., "from": ...}}``.

        ``from`` is ``"args.<name>"`` (possibly a product with
        ``args.global_batch_size``), ``"opt_param_scheduler.<key>"``, ``"default"``
        or ``"MegatronSchedule.<field>"`` for a value given directly.
        """
        return {
            f.name: {"value": getattr(self, f.name), "from": self._where(f.name)}
            for f in dataclasses.fields(self)
            if f.name != "sources"
        }

    def num_steps_of(self, count):
        """Megatron's sample count at lwjax's step ``count``: ``num_steps + (count - iteration) B``.

        A plain integer computation (numpy), for reports and tests.
        """
        return self.num_steps + (np.asarray(count) - self.iteration) * self.increment

    def learning_rate(self, count) -> jnp.ndarray:
        """The learning rate at lwjax's step ``count`` (float32; an optax schedule)."""
        return self._learning_rate(self._samples(count), jnp)

    def weight_decay(self, count) -> jnp.ndarray:
        """The weight decay at lwjax's step ``count`` (float32; an optax schedule)."""
        weight_decay = self._weight_decay(self._samples(count), jnp)
        if self.resume_wd is None:
            return weight_decay
        return jnp.where(jnp.asarray(count) == self.iteration, self.resume_wd, weight_decay)

    def learning_rate_at(self, num_steps) -> np.ndarray:
        """Megatron's learning rate at its sample count ``num_steps`` (float64 numpy)."""
        return self._learning_rate(np.asarray(num_steps, np.float64), np)

    def weight_decay_at(self, num_steps) -> np.ndarray:
        """Megatron's weight decay at its sample count ``num_steps`` (float64 numpy).

        The formula alone: :attr:`resume_wd` is a property of lwjax's count.
        """
        return self._weight_decay(np.asarray(num_steps, np.float64), np)

    def _samples(self, count) -> jnp.ndarray:
        """``num_steps_of(count)`` in float32, clipped at 0 for counts before the import.

        Beyond 2**24 samples the count rounds to float32 (relative error below 6e-8).
        """
        steps = jnp.asarray(count).astype(jnp.float32) - self.iteration
        return jnp.maximum(steps * self.increment + self.num_steps, 0.0)

    def _learning_rate(self, s, xp):
        """:math:`\\eta(s)`; the cases in reverse, each ``where`` taking over the ones after it."""
        peak, floor, warmup, decay = self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps
        if self.decay_style == "constant":
            lr = xp.full_like(s, peak)
        else:
            if self.decay_style == "inverse-square-root":
                scaled = peak * max(warmup, 1) ** 0.5 / xp.sqrt(xp.maximum(s, 1.0))
                lr = xp.maximum(floor, scaled)
            else:
                ratio = xp.clip((s - warmup) / (decay - warmup), 0.0, 1.0)
                lr = floor + self._decay_coefficient(s, ratio, xp) * (peak - floor)
            lr = xp.where(s > decay, floor, lr)
        if warmup > 0:
            lr = xp.where(s <= warmup, self.init_lr + (peak - self.init_lr) * s / warmup, lr)
        return lr

    def _decay_coefficient(self, s, ratio, xp):
        """:math:`c` of the linear, cosine and WSD decays."""
        if self.decay_style == "linear":
            return 1.0 - ratio
        if self.decay_style == "cosine":
            return 0.5 * (xp.cos(math.pi * ratio) + 1.0)
        anneal_start = self.decay_steps - self.wsd_decay_steps
        q = xp.clip((s - anneal_start) / self.wsd_decay_steps, 0.0, 1.0)
        annealed = {
            "linear": lambda: 1.0 - q,
            "cosine": lambda: 0.5 * (xp.cos(math.pi * q) + 1.0),
            "exponential": lambda: 2.0 * xp.power(0.5, q) - 1.0,
            "minus_sqrt": lambda: 1.0 - xp.sqrt(q),
        }[self.wsd_decay_style]()
        return xp.where(s <= anneal_start, 1.0, annealed)

    def _weight_decay(self, s, xp):
        r""":math:`\lambda(s)`."""
        start, end = self.start_wd, self.end_wd
        if self.wd_incr_style == "constant":
            return xp.full_like(s, end)
        ratio = xp.clip(s / self.wd_incr_steps, 0.0, 1.0)
        if self.wd_incr_style == "linear":
            coefficient = ratio
        else:
            coefficient = 0.5 * (xp.cos(math.pi * (1.0 - ratio)) + 1.0)
        return xp.where(s > self.wd_incr_steps, end, start + coefficient * (end - start))


def _check_number(value, where: str, *, low: float, open_low: bool = False) -> None:
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if open_low else value >= low)
    )
    if not ok:
        bound = ">" if open_low else ">="
        raise ValueError(f"{where}: expected a finite number {bound} {low:g}; got {value!r}.")


def _check_choice(value, choices: tuple[str, ...], where: str) -> None:
    if value not in choices:
        raise ValueError(f"{where}: expected one of {list(choices)}; got {value!r}.")
