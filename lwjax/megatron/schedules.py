"""Megatron-LM's schedule read from a checkpoint: :func:`schedule_from_megatron` resolves a
:class:`~lwjax.megatron.lr_schedule.MegatronSchedule` from Megatron's ``args`` and its
stored ``opt_param_scheduler`` state, the way Megatron-LM builds and resumes its
``OptimizerParamScheduler`` (the formulas are in :mod:`lwjax.megatron.lr_schedule`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from lwjax.megatron.lr_schedule import LR_DECAY_STYLES as LR_DECAY_STYLES
from lwjax.megatron.lr_schedule import WD_INCR_STYLES as WD_INCR_STYLES
from lwjax.megatron.lr_schedule import WSD_DECAY_STYLES as WSD_DECAY_STYLES
from lwjax.megatron.lr_schedule import MegatronSchedule

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
