"""What an lwjax checkpoint records, and how a record is checked against a target.

A checkpoint (:mod:`lwjax.checkpoint`) is named arrays plus one JSON record.
The record holds the format and its version, the step, the parameters'
routing, the matrix convention, the elementwise transform and the structure
of its state, and per array its shape, dtype and fingerprint. The arrays are
stored as jax holds them (:func:`build_contents`). :func:`mismatches` lists
every way a record differs from what a target optimizer expects, before
anything is read; :func:`fingerprints` then checks the data that was read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax import lax

import lwjax
from lwjax import logical_shards as shards
from lwjax.logical import LogicalState
from lwjax.routing import LeafRoute, path_name

FORMAT = "lwjax.checkpoint"
FORMAT_VERSION = 1
_MIX = (0x9E3779B1, 0x7F4A7C15, 0x85EBCA77)


def _bits_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).astype(np.uint32)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return x.view(view).astype(np.uint32)


def _fingerprint_np(x) -> str:
    bits = _bits_np(np.asarray(x)).reshape(-1)
    with np.errstate(over="ignore"):
        mix = np.arange(bits.size, dtype=np.uint32) * np.uint32(_MIX[0]) + np.uint32(_MIX[1])
        h1 = np.sum(bits * (mix | np.uint32(1)), dtype=np.uint32)
        h2 = np.sum((bits ^ mix) * np.uint32(_MIX[2]) + (bits >> np.uint32(13)), dtype=np.uint32)
    return f"{int(h1):08x}{int(h2):08x}"


def _bits_jnp(x):
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    view = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, view).astype(jnp.uint32)


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's flat (C-order) index, modulo 2^32, shaped like the array: computed per
    axis, so that it is split as the array is (a flat ``arange`` would be whole on every
    device, and so would the array reshaped to match it)."""
    out, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        out = out + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return out


@jax.jit
def _fingerprint_jnp(x: jax.Array) -> jax.Array:
    """Two uint32 position-weighted sums of an array's bits; exact under any sharding, each
    device summing its own elements in one pass (one reduction of both sums, so that XLA
    computes its operands as it reads them instead of keeping them whole)."""
    bits = _bits_jnp(x)
    mix = _positions(x.shape) * jnp.uint32(_MIX[0]) + jnp.uint32(_MIX[1])
    terms = (
        bits * (mix | jnp.uint32(1)),
        (bits ^ mix) * jnp.uint32(_MIX[2]) + (bits >> jnp.uint32(13)),
    )
    zero = jnp.uint32(0)
    sums = lax.reduce(
        terms, (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim))
    )
    return jnp.stack(sums)


@jax.jit
def _fingerprints_jnp(arrays: dict) -> dict:
    return {name: _fingerprint_jnp(x) for name, x in arrays.items()}


def fingerprints(arrays: Mapping[str, Any]) -> dict[str, str]:
    """A 64-bit fingerprint of every array (numpy and jax agree bit for bit).

    jax arrays are fingerprinted on the devices that hold them, each device summing its own
    elements, in programs over chunks of arrays: an array in another memory (host memory: a
    checkpoint's logical state) is copied onto its devices for its chunk, at most
    :data:`~lwjax.logical_shards.STAGING_BYTES` of copies per device (or one array) at a
    time, and freed before the next chunk's are made.
    """
    names = [k for k, v in arrays.items() if isinstance(v, jax.Array) and v.dtype.itemsize <= 4]
    out = {k: _fingerprint_np(v) for k, v in arrays.items() if k not in names}
    elsewhere = [arrays[k].sharding.memory_kind not in (None, "device") for k in names]
    costs = [
        math.prod(arrays[k].sharding.shard_shape(arrays[k].shape)) * arrays[k].dtype.itemsize
        if moved
        else 0
        for k, moved in zip(names, elsewhere)
    ]
    pairs = {}
    for group in shards.chunks(costs, shards.STAGING_BYTES):
        chunk = {
            names[i]: jax.device_put(
                arrays[names[i]], arrays[names[i]].sharding.with_memory_kind("device")
            )
            if elsewhere[i]
            else arrays[names[i]]
            for i in group
        }
        pairs.update(jax.block_until_ready(_fingerprints_jnp(chunk)))
        del chunk  # its copies are freed before the next chunk's are made
    for name, pair in jax.device_get(pairs).items():
        out[name] = f"{int(pair[0]):08x}{int(pair[1]):08x}"
    return {k: out[k] for k in arrays}


def named_leaves(tree) -> tuple[dict[str, Any], Any]:
    """``name -> leaf`` (names from key paths, ``/``-joined) and the tree's structure."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = {}
    for key_path, leaf in leaves:
        name = path_name(key_path)
        if name in named:
            raise ValueError(
                f"{name}: two leaves share this checkpoint name; leaf names must be unique."
            )
        named[name] = leaf
    return named, treedef


def _route_record(route: LeafRoute) -> dict:
    return {
        "path": route.path,
        "shape": list(route.shape),
        "dtype": route.dtype,
        "stack_dims": route.stack_dims,
        "is_muon": route.is_muon,
        "qkv_split_shapes": list(route.qkv_split_shapes or []) or None,
    }


def _as_held(x):
    """A numpy leaf in the dtype jax holds it in (float64 is float32 while x64 is off)."""
    if isinstance(x, jax.Array):
        return x
    x = np.asarray(x)
    held = jax.dtypes.canonicalize_dtype(x.dtype)
    return x if held == x.dtype else x.astype(held)


def build_contents(
    params,
    logical: LogicalState,
    routes: Sequence[LeafRoute],
    *,
    step: int | None,
    metadata: Mapping[str, Any] | None,
    matrix_convention: str,
    elementwise_transform: str | None,
) -> tuple[dict[str, Any], dict]:
    """The named arrays and the JSON record of a checkpoint: the one definition of the format."""
    arrays, _ = named_leaves({"params": params, "state": logical})
    arrays = {name: _as_held(x) for name, x in arrays.items()}
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lwjax_version": lwjax.__version__,  # "0+unknown" from a source tree never installed
        "jax_version": jax.__version__,
        "step": int(step if step is not None else np.asarray(jax.device_get(logical.count))),
        "matrix_convention": matrix_convention,
        "elementwise": {
            "transform": elementwise_transform,
            "state": state_structure(logical.elementwise, params),
        },
        "routes": [_route_record(r) for r in routes],
        "arrays": {
            name: {"shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name, "fingerprint": fp}
            for (name, x), fp in zip(arrays.items(), fingerprints(arrays).values())
        },
        "metadata": dict(metadata or {}),
    }
    json.dumps(record)  # fail before writing anything if metadata is not JSON
    return arrays, record


def transform_name(transform) -> str:
    """The name of the function that built an optax transform (``"scale_by_adam"``)."""
    init = getattr(transform, "init", transform)
    name = getattr(init, "__qualname__", None) or type(init).__qualname__
    return name.split(".<locals>")[0]


def state_structure(state, params) -> str:
    """An optax state's containers and field names, per-parameter trees shown as ``*``.

    E.g. ``ScaleByAdamState(count=*, mu=*, nu=*)``: two transforms whose states
    have the same array names and shapes (Adam and AdaBelief) still differ here.
    """
    is_none = lambda x: x is None  # noqa: E731 - non-parameter leaves are None in a state
    params_def = jax.tree_util.tree_structure(params, is_leaf=is_none)

    def render(node) -> str:
        if node is None:
            return "None"
        if jax.tree_util.tree_structure(node, is_leaf=is_none) == params_def:
            return "*"
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and not children[0][0]:
            return "*"  # an array, e.g. a step count
        fields = ", ".join(f"{path_name(key)}={render(child)}" for key, child in children)
        return f"{type(node).__name__}({fields})"

    return render(state)


def check_record(record: Mapping, path: epath.Path) -> None:
    """Refuse a record whose fields a bit flip or an edit has damaged, naming the field."""
    arrays = record.get("arrays")
    if not isinstance(arrays, Mapping):
        raise ValueError(f"{path}: damaged checkpoint record: 'arrays' is not a mapping.")
    for name, entry in arrays.items():
        ok = (
            isinstance(entry, Mapping)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("fingerprint"), str)
        )
        if not ok:
            raise ValueError(
                f"{path}: damaged checkpoint record: arrays[{name!r}] needs a shape (list of "
                f"sizes), a dtype and a fingerprint; got {entry!r}."
            )
    if not isinstance(record.get("step"), int) or not isinstance(record.get("routes"), list):
        raise ValueError(f"{path}: damaged checkpoint record: 'step' or 'routes' is missing.")
    elementwise = record.get("elementwise", {})  # absent from older records
    if not isinstance(elementwise, Mapping) or not all(
        isinstance(elementwise.get(k), (str, type(None))) for k in ("transform", "state")
    ):
        raise ValueError(
            f"{path}: damaged checkpoint record: 'elementwise' needs a transform and a state "
            f"(strings or null); got {elementwise!r}."
        )


def _describe(entry) -> str:
    return f"{entry['dtype']}{list(entry['shape'])}"


def _elementwise_mismatches(saved: Mapping, target: Mapping[str, str]) -> list[str]:
    """Another elementwise transform, whose state would be read as this one's.

    Records without the field (older ones) are not checked. Hyper-parameters
    (learning rates, betas, Muon's momentum) are not compared: changing them on
    resume is a choice, as with any optax state.
    """
    state, transform = saved.get("state"), saved.get("transform")
    if state is not None and state != target["state"]:
        return [
            f"elementwise: the checkpoint's state is {state}, the target optimizer's "
            f"{target['state']} (another elementwise transform)"
        ]
    if transform and target["state"] != "None" and transform != target["transform"]:
        return [
            f"elementwise: the checkpoint's state was made by {transform}, the target optimizer "
            f"uses {target['transform']} (same arrays, another meaning)"
        ]
    return []


def mismatches(
    record: Mapping,
    target: Mapping[str, jax.ShapeDtypeStruct],
    routes: Sequence[LeafRoute],
    convention: str,
    elementwise: Mapping[str, str],
) -> list[str]:
    """Every way ``record`` differs from a target, one line each (empty if none).

    Args:
      record: A checked record (:func:`check_record`).
      target: ``name -> jax.ShapeDtypeStruct`` of every array the target expects.
      routes: The target optimizer's routes.
      convention: The target optimizer's ``matrix_convention``.
      elementwise: The target's ``{"transform": ..., "state": ...}``
        (:func:`transform_name`, :func:`state_structure`).
    """
    saved = record["arrays"]
    problems = []
    saved_convention = record.get("matrix_convention")  # unrecorded (so unchecked) before 0.3
    if saved_convention is not None and saved_convention != convention:
        problems.append(
            f"matrix_convention: the checkpoint's matrices are {saved_convention!r}, the target "
            f"optimizer's {convention!r} (Muon's scale and QKV split would read the wrong axis)"
        )
    problems += _elementwise_mismatches(record.get("elementwise") or {}, elementwise)
    saved_routes = {r["path"]: r for r in record.get("routes", [])}
    for route in routes:
        old = saved_routes.get(route.path)
        if old is not None and bool(old["is_muon"]) != route.is_muon:
            kinds = ("Muon", "elementwise")
            problems.append(
                f"routing: {route.path} is {kinds[not old['is_muon']]} in the checkpoint but "
                f"{kinds[not route.is_muon]} in the target optimizer"
            )
    for name in target:
        if name not in saved:
            want = target[name]
            problems.append(
                f"missing: {name} (target {np.dtype(want.dtype).name}{list(want.shape)})"
            )
    for name in saved:
        if name not in target:
            problems.append(f"unexpected: {name} ({_describe(saved[name])}) is not in the target")
    for name, want in target.items():
        have = saved.get(name)
        if have is None:
            continue
        if tuple(have["shape"]) != tuple(want.shape):
            problems.append(
                f"shape: {name}: checkpoint {tuple(have['shape'])}, target {tuple(want.shape)}"
            )
        if have["dtype"] != np.dtype(want.dtype).name:
            problems.append(
                f"dtype: {name}: checkpoint {have['dtype']}, target {np.dtype(want.dtype).name}"
            )
    return problems
