"""A jitted ``shard_map`` whose donated buffers take their own outputs, call after call."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from lwjax.parallel.shardings import named_shardings


def jit_shard_map(
    fn: Callable, mesh: Mesh, in_specs, out_specs, *, donate_argnums=(), compiler_options=None
) -> Callable:
    """``jax.jit(jax.shard_map(fn, ..., check_vma=False))``, donated arguments paired with outputs.

    The jit is given ``out_shardings`` (``out_specs`` on ``mesh``), so JAX
    aliases each donated argument to the output of the same shape and
    sharding. Without them JAX leaves the pairing to XLA, which matches
    donated buffers with outputs of the same byte size in output order: one
    output of a coincident size (a bf16 parameter block as large as an fp32
    state bucket) shifts every later pair, and XLA then copies the buffers it
    crossed (0.9 GB a step for the 1b benchmark workload at dp 4).

    Arguments are kept when the function never reads them (``keep_unused``)
    wherever something is donated: an optimizer step rebuilds the parameters
    from its fp32 masters and never reads the old ones, and pruned, their
    donated buffers could not take the new parameters. Those would then land
    at new addresses every call, and XLA re-records the step's CUDA graph
    whenever a buffer moves (2.6 ms of host time before each 1b step starts
    on one H200).

    Args:
      fn: The per-device function, as for ``shard_map``.
      mesh: The device mesh.
      in_specs, out_specs: ``PartitionSpec`` pytrees (prefixes) of the
        arguments and results, as for ``shard_map``.
      donate_argnums: Arguments whose buffers the call may reuse, as for ``jax.jit``.
      compiler_options: XLA's options, as for ``jax.jit``.

    Returns:
      The jitted function.
    """
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False),
        out_shardings=named_shardings(mesh, out_specs),
        donate_argnums=donate_argnums,
        keep_unused=bool(donate_argnums),
        compiler_options=compiler_options,
    )
