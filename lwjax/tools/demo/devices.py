"""Devices for the demo and examples: a data-parallel mesh over local devices, bytes per device.

Without an accelerator, JAX shows one CPU device; the demo asks for several
*virtual* CPU devices (``jax_num_cpu_devices``) so that the data-parallel code
paths (reduce-scatter, all-gather, per-rank ownership) really run. That option
must be set before JAX starts its backends, so :func:`local_mesh` is called
before any other JAX work. It only sizes the CPU backend: on a machine with
GPUs, ``jax.devices()`` still returns the GPUs and those are used.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

DEFAULT_CPU_DEVICES = 8


def request_cpu_devices(count: int) -> bool:
    """Ask for ``count`` virtual CPU devices; return whether the request took effect.

    Does nothing when ``JAX_PLATFORMS`` names only accelerators, or once JAX's
    backends are running with another count (then the existing devices are kept).
    """
    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    if platforms and "cpu" not in platforms.split(","):
        return False
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # backends already started
        return False
    return True


def local_mesh(num_devices: int | None = None, *, axis: str = "dp") -> Mesh:
    """A 1-D data-parallel mesh over this process's devices.

    In a multi-process job the mesh spans every process's devices.

    Args:
      num_devices: How many devices to use; ``None`` means all of them, with
        ``DEFAULT_CPU_DEVICES`` virtual devices when the platform is CPU.
      axis: The mesh axis name.

    Returns:
      ``Mesh`` of shape ``{axis: n}``.

    Raises:
      ValueError: More devices asked for than there are.
    """
    if num_devices is not None and num_devices < 1:
        raise ValueError(f"local_mesh: num_devices must be >= 1; got {num_devices=}.")
    request_cpu_devices(num_devices or DEFAULT_CPU_DEVICES)
    from lwjax import distributed

    distributed.initialize()  # joins a job started by `lwjax launch` or a cluster; no-op otherwise
    if jax.process_count() > 1:
        return distributed.global_mesh(
            num_devices, axis=axis
        )  # every process's devices, an equal share each
    devices = jax.devices()
    if num_devices is not None:
        if num_devices > len(devices):
            raise ValueError(
                f"local_mesh: asked for num_devices={num_devices}; only {len(devices)} "
                f"{devices[0].platform} devices are available."
            )
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (axis,))


def bytes_per_device(tree) -> int:
    """Largest number of bytes any one device holds of a pytree of ``jax.Array`` leaves."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)
