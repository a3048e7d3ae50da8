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

Out of scope: per-param-group overrides (a group's own ``max_lr``/``min_lr``,
``decoupled_lr`` for the embedding and output layer, ``lr_mult``): the schedule
is the default groups'. lwjax's per-parameter ``lr_mult``/``wd_mult`` still scale it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# Field of MegatronSchedule -> its keys in a stored ``opt_param_scheduler``, the first found wins
# (older Megatron names first, as ``OptimizerParamScheduler.load_state_dict`` reads them).
_STORED_KEYS = {
    "max_lr": ("start_lr", "max_lr"),
    "min_lr": ("min_lr",),
    "warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
    "decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
    "decay_style": ("decay_style", "lr_decay_style"),
    "start_wd": ("start_wd",),
    "end_wd": ("end_wd",),
    "wd_incr_steps": ("wd_incr_steps",),
    "wd_incr_style": ("wd_incr_style",),
}
_NUM_STEPS_KEYS = ("num_iters", "num_steps")


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


def schedule_from_megatron(
    args: Mapping[str, Any], scheduler: Mapping[str, Any] | None, iteration: int
) -> MegatronSchedule:
    """Resolve a Megatron checkpoint's learning-rate and weight-decay schedule.

    Builds the schedule the way Megatron-LM does from its arguments
    (iteration-based with ``train_iters``, sample-based with
    ``train_samples``), then, unless ``override_opt_param_scheduler`` is set,
    takes every value the stored ``opt_param_scheduler`` holds (its older key
    names too). When ``use_checkpoint_opt_param_scheduler`` is not set either,
    Megatron refuses a resume whose stored values differ from the arguments,
    and so does this. ``lr_warmup_init`` and the WSD anneal are never stored
    and always come from ``args``.

    Args:
      args: The checkpoint's ``args`` (Megatron-LM argparse names; a dict or
        an ``argparse.Namespace``). ``None`` values count as absent.
      scheduler: The stored ``opt_param_scheduler`` state dict; ``None`` or
        empty when the checkpoint has none (then ``num_steps`` is
        ``iteration * global_batch_size``). Missing keys fall back to ``args``.
      iteration: The checkpoint's iteration, lwjax's step count after import.

    Returns:
      The resolved :class:`MegatronSchedule`.

    Raises:
      ValueError: A missing or invalid argument, an unsupported style, a
        batch-size ramp-up still under way, or a stored value that Megatron
        would refuse; the message names the argument or stored key.

    Examples:
      >>> args = {"lr": 1e-3, "min_lr": 1e-4, "train_iters": 100, "global_batch_size": 8,
      ...         "lr_warmup_iters": 10, "lr_decay_style": "cosine", "weight_decay": 0.1}
      >>> schedule = schedule_from_megatron(args, None, iteration=0)
      >>> float(schedule.learning_rate(10))
      0.0010000000474974513
      >>> schedule.describe()["decay_steps"]
      {'value': 800, 'from': 'args.lr_decay_iters * args.global_batch_size (train_iters)'}
    """
    args = args if isinstance(args, Mapping) else vars(args)
    get = lambda name, default=None: default if args.get(name) is None else args[name]  # noqa: E731
    scheduler = dict(scheduler or {})
    batch = _integer(get("global_batch_size"), "args.global_batch_size", low=1)
    _integer(iteration, "iteration", low=0)
    values, sources = {}, {}

    def put(name, value, where):
        values[name], sources[name] = value, where

    put("max_lr", _number(get("lr"), "args.lr"), "args.lr")
    for name, arg, default in (("min_lr", "min_lr", 0.0), ("init_lr", "lr_warmup_init", 0.0)):
        put(name, _number(get(arg, default), f"args.{arg}"), _origin(args, arg))
    put("decay_style", get("lr_decay_style", "linear"), _origin(args, "lr_decay_style"))
    put(
        "wsd_decay_style",
        get("lr_wsd_decay_style", "exponential"),
        _origin(args, "lr_wsd_decay_style"),
    )
    if get("train_iters"):
        _steps_from_iterations(get, batch, put)
    elif get("train_samples"):
        _steps_from_samples(get, put)
    else:
        raise ValueError(
            "args.train_iters, args.train_samples: Megatron needs one of them to build its "
            f"schedule; got train_iters={get('train_iters')!r}, "
            f"train_samples={get('train_samples')!r}."
        )
    weight_decay = get("weight_decay", 0.01)
    for name, arg in (("start_wd", "start_weight_decay"), ("end_wd", "end_weight_decay")):
        where = _origin(args, arg if get(arg) is not None else "weight_decay")
        put(name, _number(get(arg, weight_decay), where), where)
    put(
        "wd_incr_style",
        get("weight_decay_incr_style", "constant"),
        _origin(args, "weight_decay_incr_style"),
    )

    num_steps = _stored_num_steps(scheduler, iteration, batch, sources)
    _check_rampup(get("rampup_batch_size"), num_steps)
    counts = dict(num_steps=num_steps, iteration=int(iteration), increment=batch)
    sources.update(iteration="iteration", increment="args.global_batch_size")
    # Megatron builds its scheduler from the arguments first, with the same checks.
    from_args = MegatronSchedule(**values, **counts, sources=tuple(sorted(sources.items())))
    _apply_stored(scheduler, values, sources, args)
    schedule = MegatronSchedule(**values, **counts, sources=tuple(sorted(sources.items())))
    # Megatron's load_state_dict sets the first resumed step's weight decay before it reads
    # the stored weight-decay settings, so that one step follows the arguments' settings.
    resume_wd = float(from_args.weight_decay_at(num_steps))
    if resume_wd != float(schedule.weight_decay_at(num_steps)):
        sources["resume_wd"] = "args weight-decay settings at opt_param_scheduler.num_steps"
        schedule = dataclasses.replace(
            schedule, resume_wd=resume_wd, sources=tuple(sorted(sources.items()))
        )
    return schedule


def _steps_from_iterations(get, batch: int, put) -> None:
    """Megatron-LM's iteration-based lengths: iterations times the global batch size."""
    train = _integer(get("train_iters"), "args.train_iters", low=1)
    times = " * args.global_batch_size"
    if get("lr_decay_iters") is None:
        decay, decay_from = train, "args.lr_decay_iters" + times + " (train_iters)"
    else:
        decay = _integer(get("lr_decay_iters"), "args.lr_decay_iters", low=0)
        decay_from = "args.lr_decay_iters" + times
    put("decay_steps", decay * batch, decay_from)
    put("wd_incr_steps", train * batch, "args.train_iters" + times)
    if get("lr_wsd_decay_iters") is not None:
        wsd = _integer(get("lr_wsd_decay_iters"), "args.lr_wsd_decay_iters", low=0)
        put("wsd_decay_steps", wsd * batch, "args.lr_wsd_decay_iters" + times)
    else:
        put("wsd_decay_steps", None, "args.lr_wsd_decay_iters")
    _put_warmup(get, put, decay * batch, "lr_warmup_iters", batch, times)


def _steps_from_samples(get, put) -> None:
    """Megatron-LM's sample-based lengths, read as they are."""
    train = _integer(get("train_samples"), "args.train_samples", low=1)
    if get("lr_decay_samples") is None:
        decay, decay_from = train, "args.lr_decay_samples (train_samples)"
    else:
        decay = _integer(get("lr_decay_samples"), "args.lr_decay_samples", low=0)
        decay_from = "args.lr_decay_samples"
    put("decay_steps", decay, decay_from)
    put("wd_incr_steps", train, "args.train_samples")
    wsd = get("lr_wsd_decay_samples")
    if wsd is not None:
        wsd = _integer(wsd, "args.lr_wsd_decay_samples", low=0)
    put("wsd_decay_steps", wsd, "args.lr_wsd_decay_samples")
    _put_warmup(get, put, decay, "lr_warmup_samples", 1, "")


def _put_warmup(get, put, decay_steps: int, arg: str, batch: int, times: str) -> None:
    """The warmup: ``lr_warmup_fraction`` of the decay if set, else ``arg`` times ``batch``."""
    fraction = get("lr_warmup_fraction")
    if fraction is not None:
        fraction = _number(fraction, "args.lr_warmup_fraction")
        put("warmup_steps", fraction * decay_steps, "args.lr_warmup_fraction * decay samples")
    else:
        steps = _integer(get(arg, 0), f"args.{arg}", low=0)
        put("warmup_steps", steps * batch, f"args.{arg}{times}")


def _apply_stored(scheduler: Mapping, values: dict, sources: dict, args: Mapping) -> None:
    """Megatron's ``load_state_dict``: the stored value wins unless the arguments override it."""
    override = bool(args.get("override_opt_param_scheduler"))
    use_checkpoint = bool(args.get("use_checkpoint_opt_param_scheduler"))
    for name, keys in _STORED_KEYS.items():
        key = next((k for k in keys if k in scheduler and scheduler[k] is not None), None)
        if key is None or override:
            continue
        stored, where = scheduler[key], f"opt_param_scheduler.{key}"
        if name not in ("decay_style", "wd_incr_style"):
            stored = _number(stored, where)
        if not use_checkpoint and stored != values[name]:
            raise ValueError(
                f"{where}: differs from the arguments' value ({sources[name]} = "
                f"{values[name]!r}), which Megatron refuses on resume unless "
                "use_checkpoint_opt_param_scheduler or override_opt_param_scheduler is set; "
                f"got {stored!r}."
            )
        values[name], sources[name] = stored, where


def _stored_num_steps(scheduler: Mapping, iteration: int, batch: int, sources: dict) -> int:
    """The stored sample count, else ``iteration * global_batch_size``."""
    key = next((k for k in _NUM_STEPS_KEYS if scheduler.get(k) is not None), None)
    if key is None:
        sources["num_steps"] = "iteration * args.global_batch_size"
        return int(iteration) * batch
    sources["num_steps"] = f"opt_param_scheduler.{key}"
    return _integer(scheduler[key], sources["num_steps"], low=0)


def _check_rampup(rampup, num_steps: int) -> None:
    """A batch-size ramp-up must be over: from then on every step is a global batch."""
    if rampup is None:
        return
    try:
        ramp_samples = int(rampup[2])
    except (TypeError, ValueError, IndexError):
        raise ValueError(
            f"args.rampup_batch_size: expected [start, increment, ramp samples]; got {rampup!r}."
        ) from None
    if num_steps < ramp_samples:
        raise ValueError(
            f"args.rampup_batch_size: the batch-size ramp-up ({ramp_samples} samples) is not "
            f"over at the imported sample count; got num_steps={num_steps}. lwjax steps by "
            "the full global batch size only."
        )


def _origin(args: Mapping, name: str) -> str:
    return f"args.{name}" if args.get(name) is not None else "default"


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite real number; got {value!r}.")
    return value


def _integer(value, where: str, *, low: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value != int(value)
        or value < low
    ):
        raise ValueError(f"{where}: expected an integer >= {low}; got {value!r}.")
    return int(value)


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
