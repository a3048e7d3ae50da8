"""What both Megatron checkpoint formats share: the reader that opens a ``torch.save`` file,
and the common state as plain dicts (``args``, the optimizer param groups, and the Muon
and Adam hyperparameters and Adam step those groups hold).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from lwjax.megatron.pickle_io import load_torch_file
from lwjax.megatron.torch_io import torch_load

READERS = ("numpy", "torch")
Reader = Literal["numpy", "torch"]


def load_file(path: pathlib.Path, directory: pathlib.Path, reader: Reader) -> Any:
    """A ``torch.save`` file inside ``directory``, read with numpy or with torch."""
    if reader == "numpy":
        return load_torch_file(path, directory)
    return torch_load(str(path), where=str(path))


def as_dict(obj) -> dict:
    """``args`` (an ``argparse.Namespace``) or a stored dict as a dict; ``{}`` for ``None``."""
    return (
        dict(vars(obj))
        if hasattr(obj, "__dict__") and not isinstance(obj, dict)
        else dict(obj or {})
    )


def find_param_groups(obj) -> list[dict]:
    """Every optimizer param-group dict nested anywhere in ``obj``."""
    found = []
    if isinstance(obj, Mapping):
        groups = obj.get("param_groups")
        if isinstance(groups, list):
            found += [g for g in groups if isinstance(g, Mapping)]
        for key, value in obj.items():
            if key != "param_groups":
                found += find_param_groups(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            found += find_param_groups(value)
    return found


def hyperparameters_of(groups: Sequence[Mapping]) -> tuple[dict, int | None]:
    """Muon and Adam hyperparameters and Adam's step from param groups."""
    hyper: dict[str, dict] = {}
    steps = []
    for group in groups:
        kind = "adam" if "betas" in group else "muon" if "momentum" in group else None
        if kind is None:
            continue
        entry = hyper.setdefault(kind, {})
        for name in (
            "lr",
            "max_lr",
            "min_lr",
            "start_wd",
            "end_wd",
            "weight_decay",
            "betas",
            "eps",
            "momentum",
            "nesterov",
        ):
            if name in group and name not in entry:
                entry[name] = group[name]
        if kind == "adam" and group.get("step") is not None:
            steps.append(int(float(np.asarray(group["step"]))))
    return hyper, (max(steps) if steps else None)
