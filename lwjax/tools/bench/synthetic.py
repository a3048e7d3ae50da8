"""Synthetic inputs of the benchmarks: constant parameters, random gradients and tokens.

The step times do not depend on the values, only on shapes, dtypes and placement.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _leaf_specs(shapes, specs):
    """``specs`` flattened as ``shapes`` is (``None``: every leaf ``P()``)."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    if specs is None:
        return [P()] * len(jax.tree.leaves(shapes, is_leaf=is_shape))
    return jax.tree.leaves(
        jax.tree.map(lambda _, spec: spec, shapes, specs, is_leaf=is_shape),
        is_leaf=lambda x: isinstance(x, P),
    )


def local_grads(shapes, mesh, dtype, std, specs=None, *, axis: str | tuple[str, ...] = "dp"):
    """Per-device gradients ``[dp, ...]`` of standard deviation ``std``, sharded over ``axis``
    (a mesh axis or a tuple of them, ``dp`` devices in all: with sharding groups
    ``("replica", "dp")``).

    Every data-parallel device's gradients differ, and the values do not depend on how
    ``axis`` splits the devices. With ``specs``
    (:meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`) each leaf is also split as its spec says
    (``P(axis, *spec)``); a leaf it leaves whole has the same gradient on every
    tensor-parallel device, as backward gives it.
    """
    dp = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))

    def make(key, shape, spec):
        return jax.jit(
            lambda key: (std * jax.random.normal(key, (dp, *shape), jnp.float32)).astype(dtype),
            out_shardings=NamedSharding(mesh, P(axis, *spec)),
        )(key)

    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [make(k, s, sp) for k, s, sp in zip(keys, leaves, _leaf_specs(shapes, specs))]
    )


def constant_params(shapes, mesh, dtype, specs=None):
    """Every parameter ``0.01``, created on ``mesh`` split as ``specs`` says (``None``: whole)."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    made = [
        jax.jit(
            lambda shape: jnp.full(shape, 0.01, dtype),
            static_argnums=0,
            out_shardings=NamedSharding(mesh, spec),
        )(s)
        for s, spec in zip(leaves, _leaf_specs(shapes, specs))
    ]
    return jax.tree_util.tree_unflatten(treedef, made)


def synthetic_batch(
    mesh: Mesh,
    micro_batch: int,
    seq_len: int,
    vocab: int,
    seed: int = 0,
    *,
    axis: str | tuple[str, ...] = "dp",
):
    """Uniformly random tokens ``[devices * micro_batch, seq_len + 1]`` (int32), split over
    ``axis`` (a mesh axis or a tuple of them, ``devices`` in all)."""
    rng = np.random.default_rng(seed)
    devices = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    tokens = rng.integers(0, vocab, (devices * micro_batch, seq_len + 1), dtype=np.int32)
    return jax.device_put(tokens, NamedSharding(mesh, P(axis)))


def replicated(tree, mesh: Mesh):
    """``tree`` placed whole on every device of ``mesh``."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
