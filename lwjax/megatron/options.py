"""Megatron's optimizer options, read under every name Megatron stores them by (pure Python).

A checkpoint's ``args`` come from Megatron-LM's argparse (``muon_use_nesterov``)
or from a megatron-core ``OptimizerConfig`` (``muon_nesterov``); the optimizer's
param groups hold what the last step actually used (``momentum``, ``betas``,
``eps``, ``nesterov``). :func:`read_options` reads each option from the first
of: the param groups, each of its argument names, megatron-core's default, and
records where it came from. A value lwjax cannot continue with is an error that
names the argument; two names that disagree are an error too. The learning
rate and weight decay are a schedule's (:mod:`lwjax.megatron.schedules`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from lwjax.muon import SCALE_MODES
from lwjax.newton_schulz import COEFFICIENT_TYPES, PRECISIONS

TP_MODES = ("blockwise", "duplicated", "distributed")
OPTIMIZERS = ("adam", "muon", "dist_muon")


class _Bad(ValueError):
    """A value's problem, without the argument's name (added by the reader)."""


def _real(low: float, high: float, *, high_open: bool = False) -> Callable[[Any], float]:
    def check(value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _Bad(f"expected a real number; got {value!r}")
        value = float(value)
        if not (low <= value and (value < high if high_open else value <= high)):
            bound = ")" if high_open else "]"
            raise _Bad(f"expected a number in [{low}, {high}{bound}; got {value!r}")
        return value

    return check


def _flag(value) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false; got {value!r}")
    return value


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise _Bad(f"expected a positive integer; got {value!r}")
    return int(value)


def _one_of(choices: tuple[str, ...], note: str = "") -> Callable[[Any], str]:
    def check(value):
        if value not in choices:
            raise _Bad(f"lwjax supports {list(choices)}{note}; got {value!r}")
        return value

    return check


def _absent(value):
    if value is not None:
        raise _Bad(f"lwjax has no separate learning rate for it; got {value!r}")
    return None


@dataclasses.dataclass(frozen=True)
class Option:
    """One optimizer option and where Megatron keeps it.

    Attributes:
      name: megatron-core's ``OptimizerConfig`` field.
      arg_names: Its names in ``args``: Megatron-LM's argparse name(s), then
        megatron-core's field when it differs.
      default: megatron-core's default, used when nothing stores it.
      check: Validates and converts a value (raises on an unsupported one).
      group: ``(kind, key, index)``: the ``"muon"`` or ``"adam"`` param-group
        entry that holds the value the optimizer used, if any.
    """

    name: str
    arg_names: tuple[str, ...]
    default: Any
    check: Callable[[Any], Any]
    group: tuple[str, str, int | None] | None = None


OPTIONS: tuple[Option, ...] = (
    Option("optimizer", ("optimizer",), "adam", _one_of(OPTIMIZERS)),
    Option("clip_grad", ("clip_grad",), 1.0, _real(0.0, math.inf)),
    Option(
        "adam_beta1", ("adam_beta1",), 0.9, _real(0.0, 1.0, high_open=True), ("adam", "betas", 0)
    ),
    Option(
        "adam_beta2", ("adam_beta2",), 0.999, _real(0.0, 1.0, high_open=True), ("adam", "betas", 1)
    ),
    Option("adam_eps", ("adam_eps",), 1e-8, _real(0.0, math.inf), ("adam", "eps", None)),
    Option(
        "decoupled_weight_decay",
        ("decoupled_weight_decay",),
        True,
        _one_of((True,), " (AdamW's decoupled weight decay)"),
    ),
    Option("decoupled_lr", ("decoupled_lr",), None, _absent),
    Option(
        "muon_momentum",
        ("muon_momentum",),
        0.95,
        _real(0.0, 1.0, high_open=True),
        ("muon", "momentum", None),
    ),
    Option(
        "muon_nesterov",
        ("muon_use_nesterov", "muon_nesterov"),
        False,
        _flag,
        ("muon", "nesterov", None),
    ),
    Option("muon_split_qkv", ("muon_split_qkv",), True, _flag),
    Option("muon_scale_mode", ("muon_scale_mode",), "spectral", _one_of(SCALE_MODES)),
    Option(
        "muon_fp32_matmul_prec",
        ("muon_fp32_matmul_prec",),
        "medium",
        _one_of(PRECISIONS, " (torch's float32 matmul precisions)"),
    ),
    Option(
        "muon_coefficient_type", ("muon_coefficient_type",), "quintic", _one_of(COEFFICIENT_TYPES)
    ),
    Option("muon_num_ns_steps", ("muon_num_ns_steps",), 5, _count),
    Option(
        "muon_extra_scale_factor", ("muon_extra_scale_factor",), 1.0, _real(-math.inf, math.inf)
    ),
    Option("muon_tp_mode", ("muon_tp_mode",), "blockwise", _one_of(TP_MODES)),
    Option("muon_scalar_optimizer", ("muon_scalar_optimizer",), "adam", _one_of(("adam",))),
)


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    """The optimizer options of a Megatron run and where each was read.

    Attributes:
      values: ``{OptimizerConfig field: value}``.
      sources: ``{field: "args.<name>" | "param group <kind>.<key>" | "default"}``.
    """

    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def report(self) -> str:
        """One line per option: ``name = value  (source)``."""
        width = max(map(len, self.values))
        return "\n".join(
            f"{name:<{width}} = {value!r}  ({self.sources[name]})"
            for name, value in self.values.items()
        )


def _group_value(hyperparameters: Mapping[str, Mapping], group) -> tuple[bool, Any]:
    if group is None:
        return False, None
    kind, key, index = group
    entry = hyperparameters.get(kind, {})
    if key not in entry or entry[key] is None:
        return False, None
    value = entry[key]
    if index is not None:
        value = tuple(value)[index]
    return True, value


def read_options(
    args: Mapping[str, Any], hyperparameters: Mapping[str, Mapping]
) -> MegatronOptions:
    """Read every :data:`OPTIONS` entry from a checkpoint's args and param groups.

    Args:
      args: Megatron's ``args`` as a dict.
      hyperparameters: ``{"muon": {...}, "adam": {...}}`` param-group values
        (:attr:`lwjax.megatron.state.MegatronState.hyperparameters`).

    Raises:
      ValueError: an unsupported or malformed value, or two names of one option
        that disagree; the message names the argument.
    """
    values, sources = {}, {}
    for option in OPTIONS:
        stored = [(f"args.{n}", args[n]) for n in option.arg_names if args.get(n) is not None]
        if len({repr(v) for _, v in stored}) > 1:
            raise ValueError(
                f"{option.name}: the checkpoint's args disagree: "
                + ", ".join(f"{where}={value!r}" for where, value in stored)
                + "."
            )
        found, value = _group_value(hyperparameters, option.group)
        if found:
            kind, key, index = option.group
            where = f"param group {kind}.{key}" + ("" if index is None else f"[{index}]")
        elif stored:
            where, value = stored[0]
        else:
            where, value = "default", option.default
        try:
            values[option.name] = option.check(value)
        except _Bad as err:
            raise ValueError(f"{option.name} (from {where}): {err}.") from None
        sources[option.name] = where
    return MegatronOptions(values=values, sources=sources)
