"""lwjax checkpoints of a converted Megatron run: recognised (:func:`detect_source`),
their Megatron metadata written (:func:`import_metadata`: the GPT config, args, param
groups, scheduler and source) and read back as a
:class:`~lwjax.megatron.state.MegatronState` (:func:`state_from_lwjax`), so that a run
continued in lwjax can be written for Megatron again.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from lwjax.megatron.export import logical_to_megatron
from lwjax.megatron.export_records import advanced_records, plain
from lwjax.megatron.gpt import GPTConfig, tree_from_keys
from lwjax.megatron.state import MegatronState


def detect_source(path) -> str:
    """``"lwjax"`` for an lwjax checkpoint directory, ``"megatron"`` otherwise (checked on read)."""
    path = pathlib.Path(path)
    if (path / "lwjax").is_dir() and (path / "arrays").is_dir():
        return "lwjax"
    return "megatron"


def state_from_lwjax(
    arrays: Mapping[str, np.ndarray], record: Mapping
) -> tuple[MegatronState, GPTConfig | None]:
    """A MegatronState from an lwjax checkpoint of the GPT tree
    (names ``params/...``, ``state/...``).
    """
    import optax

    from lwjax.logical import LogicalState

    def group(prefix):
        return {
            name[len(prefix) :].replace("/", "."): value
            for name, value in arrays.items()
            if name.startswith(prefix)
        }

    params, masters, momenta = group("params/"), group("state/masters/"), group("state/momenta/")
    mu, nu = group("state/elementwise/mu/"), group("state/elementwise/nu/")
    if not params or not masters:
        raise ValueError("the lwjax checkpoint has no params/ or state/masters/ arrays.")
    fill = lambda table: tree_from_keys({k: table.get(k) for k in params})  # noqa: E731
    count = arrays.get("state/elementwise/count", arrays.get("state/count"))
    logical = LogicalState(
        count=arrays["state/count"],
        masters=fill(masters),
        momenta=fill(momenta),
        elementwise=optax.ScaleByAdamState(count=count, mu=fill(mu), nu=fill(nu)),
    )
    meta = record.get("metadata", {}).get("megatron", {})
    config = GPTConfig(**meta["config"]) if "config" in meta else None
    args, scheduler = advanced_records(
        meta.get("args"), meta.get("scheduler"), meta.get("iteration"), record.get("step")
    )
    state = logical_to_megatron(
        tree_from_keys(params),
        logical,
        iteration=record.get("step"),
        hyperparameters=meta.get("hyperparameters"),
        args=args,
        scheduler=scheduler,
    )
    return state, config


def import_metadata(imported: Any) -> dict:
    """What an lwjax checkpoint of a :class:`~lwjax.megatron.megatron_import.MegatronImport`
    records of Megatron under ``metadata["megatron"]`` (read back by :func:`state_from_lwjax`).
    """
    return {
        "megatron": {
            "config": dataclasses.asdict(imported.config),
            "hyperparameters": plain(imported.hyperparameters),
            "args": {
                k: v for k, v in ((k, plain(v)) for k, v in imported.args.items()) if v is not None
            },
            "source": plain(imported.source),
            "muon": imported.muon,
            "scheduler": plain(imported.scheduler),
            "iteration": imported.iteration,
        }
    }
