"""The ``lwjax convert`` job: one conversion from a :class:`ConvertConfig` (Megatron ->
lwjax checkpoint or safetensors, lwjax checkpoint -> ``torch_dist`` or safetensors), read,
converted and written in named steps.

The two directions live in :mod:`lwjax.megatron.megatron_import` (Megatron -> lwjax:
:class:`MegatronImport`, :func:`megatron_to_logical`, :func:`import_megatron`) and
:mod:`lwjax.megatron.export` (lwjax -> Megatron: :func:`logical_to_megatron`,
:func:`save_torch_dist`, :func:`save_safetensors`); their names are importable from here
too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Literal, NamedTuple

from lwjax.megatron.export import EXP_AVG_PREFIX as EXP_AVG_PREFIX
from lwjax.megatron.export import EXP_AVG_SQ_PREFIX as EXP_AVG_SQ_PREFIX
from lwjax.megatron.export import FP32_PREFIX as FP32_PREFIX
from lwjax.megatron.export import MOMENTUM_PREFIX as MOMENTUM_PREFIX
from lwjax.megatron.export import logical_to_megatron as logical_to_megatron
from lwjax.megatron.export import megatron_tensors as megatron_tensors
from lwjax.megatron.export import safetensors_tensors as safetensors_tensors
from lwjax.megatron.export import save_safetensors, save_torch_dist
from lwjax.megatron.gpt import MATRIX_CONVENTION, GPTConfig
from lwjax.megatron.lwjax_checkpoint import detect_source, import_metadata, state_from_lwjax
from lwjax.megatron.megatron_import import MegatronImport as MegatronImport
from lwjax.megatron.megatron_import import gpt_config_of, megatron_to_logical
from lwjax.megatron.megatron_import import import_megatron as import_megatron
from lwjax.megatron.state import READERS, MegatronState, read_megatron

TARGETS = ("lwjax", "safetensors", "torch_dist")
Target = Literal["lwjax", "safetensors", "torch_dist"]


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """One ``lwjax convert`` job.

    Attributes:
      src: A Megatron checkpoint directory or an lwjax checkpoint directory.
      dst: Output: a directory, or a path ending in ``.safetensors``.
      to: ``"lwjax"``, ``"safetensors"`` or ``"torch_dist"``; ``None`` infers it
        (``.safetensors`` suffix; else the other side of ``src``).
      reader: Megatron reader, ``"numpy"`` (no torch) or ``"torch"``.
      iteration: Megatron iteration to read; ``None`` for the latest.
      num_attention_heads: For checkpoints whose args lack it.
      num_query_groups: For checkpoints whose args lack it.
      overwrite: Replace an existing output.
      weights_only: Take a Megatron checkpoint's model weights alone (fresh
        optimizer state in the output), e.g. when its optimizer file is lost.
    """

    src: str
    dst: str
    to: Target | None = None
    reader: str = "numpy"
    iteration: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    overwrite: bool = False
    weights_only: bool = False

    def __post_init__(self):
        if self.to is not None and self.to not in TARGETS:
            raise ValueError(
                f"ConvertConfig.to must be one of {TARGETS} or None; got to={self.to!r}."
            )
        if self.reader not in READERS:
            raise ValueError(
                f"ConvertConfig.reader must be one of {READERS}; got reader={self.reader!r}."
            )


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    """What a conversion did.

    Attributes:
      source: ``"megatron"`` or ``"lwjax"``; ``target``: one of :data:`TARGETS`.
      src, dst: Paths read and written.
      iteration: Iterations done.
      rows: ``(key, shape, dtype, state kinds)`` per parameter.
      notes: Source details (format, optimizer sharding, reader).
      seconds: Wall time.
    """

    source: str
    target: str
    src: str
    dst: str
    iteration: int
    rows: tuple[tuple[str, tuple[int, ...], str, str], ...]
    notes: dict
    seconds: float


def convert(
    config: ConvertConfig, progress: Callable[[str, int, int], None] | None = None
) -> ConvertSummary:
    """Run one conversion (see :class:`ConvertConfig`); ``progress(stage, done, total)``
    reports stages.

    Raises:
      ValueError: unreadable input, an output that exists, or an impossible direction.
    """
    started = time.perf_counter()
    report = progress or (lambda *_: None)
    source = detect_source(config.src)
    target = _target(config, source)
    total = 3
    report("reading", 0, total)
    read = _read(config, source)
    report("converting", 1, total)
    _WRITERS[target](config, read, lambda: report("writing", 2, total))
    report("done", total, total)
    return ConvertSummary(
        source=source,
        target=target,
        src=str(config.src),
        dst=str(config.dst),
        iteration=read.state.iteration,
        rows=_rows(read.state),
        notes={k: v for k, v in read.state.source.items() if k != "directory"},
        seconds=time.perf_counter() - started,
    )


def _target(config: ConvertConfig, source: str) -> str:
    """``config.to``, else ``.safetensors`` by the suffix, else the other side of ``source``."""
    target = config.to or (
        "safetensors"
        if config.dst.endswith(".safetensors")
        else "torch_dist"
        if source == "lwjax"
        else "lwjax"
    )
    if source == "lwjax" and target == "lwjax":
        raise ValueError(
            f"{config.src} is already an lwjax checkpoint; choose --to torch_dist or safetensors."
        )
    if target == "safetensors" and not config.dst.endswith(".safetensors"):
        raise ValueError(f"{config.dst}: a safetensors output must end in .safetensors.")
    return target


class _Read(NamedTuple):
    """A conversion's input: ``"megatron"`` or ``"lwjax"``, its state, and the GPT config
    an lwjax checkpoint stored (``None`` for Megatron's, read from its args when needed).
    """

    source: str
    state: MegatronState
    gpt: GPTConfig | None


def _read(config: ConvertConfig, source: str) -> _Read:
    """Read the conversion's input."""
    if source == "megatron":
        state = read_megatron(
            config.src,
            iteration=config.iteration,
            reader=config.reader,
            weights_only=config.weights_only,
        )
        return _Read(source, state, None)
    from lwjax.checkpoint import load_arrays

    arrays, record = load_arrays(config.src)
    return _Read(source, *state_from_lwjax(arrays, record))


def _write_lwjax(config: ConvertConfig, read: _Read, writing: Callable[[], None]) -> None:
    """Megatron -> an lwjax checkpoint of the GPT tree, with Megatron's records as metadata."""
    from lwjax.checkpoint import save_logical
    from lwjax.optimizer import route_params

    imported = megatron_to_logical(
        read.state,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
    )
    routes = route_params(
        imported.params,
        imported.config.routing_rules(muon=imported.muon),
        matrix_convention=MATRIX_CONVENTION,
    )
    metadata = import_metadata(imported)
    writing()
    save_logical(
        config.dst,
        imported.params,
        imported.logical,
        routes,
        step=imported.iteration,
        metadata=metadata,
        overwrite=config.overwrite,
        matrix_convention=MATRIX_CONVENTION,
        elementwise_transform="scale_by_adam",  # Megatron's Adam, as optimizer_kwargs builds
    )


def _write_safetensors(config: ConvertConfig, read: _Read, writing: Callable[[], None]) -> None:
    writing()
    save_safetensors(read.state, config.dst, overwrite=config.overwrite)


def _write_torch_dist(config: ConvertConfig, read: _Read, writing: Callable[[], None]) -> None:
    """A ``torch_dist`` checkpoint; a Megatron source's GPT config is read from its args."""
    gpt = read.gpt
    if gpt is None and read.source == "megatron":
        gpt = gpt_config_of(
            read.state,
            None,
            {
                "num_attention_heads": config.num_attention_heads,
                "num_query_groups": config.num_query_groups,
            },
        )
    writing()
    save_torch_dist(read.state, config.dst, config=gpt, overwrite=config.overwrite)


_WRITERS = {
    "lwjax": _write_lwjax,
    "safetensors": _write_safetensors,
    "torch_dist": _write_torch_dist,
}


def _rows(state: MegatronState) -> tuple:
    rows = []
    for key, weight in state.model.items():
        tables = (
            ("master", state.masters),
            ("momentum", state.momentum),
            ("exp_avg", state.exp_avg),
            ("exp_avg_sq", state.exp_avg_sq),
        )
        kinds = [name for name, table in tables if key in table]
        rows.append((key, tuple(weight.shape), weight.dtype.name, ", ".join(kinds) or "-"))
    return tuple(rows)
