"""torch objects <-> numpy, with torch imported only when a torch path is chosen.

:func:`torch_load` is ``torch.load(weights_only=True)`` whose tensors come back as numpy
arrays (:func:`to_numpy`; bf16 through ``ml_dtypes``); :func:`to_torch` is the way back
for writing. Nothing here runs at import time, so reading with numpy never needs torch.
"""

from __future__ import annotations

import collections

import numpy as np

from lwjax.megatron.allow_list import TORCH_DTYPES
from lwjax.megatron.errors import DamagedCheckpointError

TORCH_CPU_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def import_torch(what: str, *, reading: bool = False):
    """``import torch``, or a ValueError saying that ``what`` needs it and how to install it
    (and, when ``reading``, that the numpy reader needs none).

    The ``megatron`` extra leaves torch out (its default wheels bring gigabytes of CUDA
    libraries that nothing here uses); the CPU wheel is enough.
    """
    try:
        import torch
    except ImportError:
        instead = " Or read with reader='numpy' (the default), which needs no torch."
        raise ValueError(
            f"{what} needs torch, which the megatron extra does not install; the CPU wheel is "
            f"enough: {TORCH_CPU_INSTALL}." + (instead if reading else "")
        ) from None
    return torch


def to_numpy(obj):
    """Turn torch tensors and dtypes inside ``obj`` into numpy arrays and ``"torch.<name>"``
    strings.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(TORCH_DTYPES["bfloat16"]).copy()
        return t.numpy().copy()
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, torch.Size):
        return tuple(obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
        for key, value in obj.items():
            out[to_numpy(key)] = to_numpy(value)
        return out
    if isinstance(obj, list):
        return [to_numpy(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(to_numpy(x) for x in obj)
    return obj


def torch_load(source, *, where: str):
    """``torch.load`` with ``weights_only=True``, admitting ``argparse.Namespace``; numpy out."""
    import argparse
    import pickle

    torch = import_torch("reader='torch'", reading=True)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DamagedCheckpointError(f"{where}: torch.load failed: {first}") from None
    return to_numpy(obj)


def to_torch(array: np.ndarray):
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype == TORCH_DTYPES["bfloat16"]:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())
