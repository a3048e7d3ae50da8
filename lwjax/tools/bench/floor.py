"""Floors: what no schedule can remove from a step, measured on the devices at hand.

:func:`newton_schulz_floor` is the busiest device's Newton–Schulz
(:func:`lwjax.parallel.ns_deal.device_ns_flops`) at the measured matmul rate (the compute
Muon adds to a step); :func:`step_bytes` at :func:`copy_bandwidth` is the memory traffic no
formulation of the update avoids; :func:`optimizer_step_floor` adds the bare reduce-scatter and
all-gather of the optimizer step's buffers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import gram
from lwjax.parallel.ns_deal import device_ns_flops
from lwjax.tools.bench.timing import time_back_to_back, time_steps

MATMUL_CHAIN = 8  # products per timed call when measuring the floor's matmul rate
GRADIENT_READS = 2  # the clip's global norm must be known before the update reads them again


def symmetric_share(device, ns_precision: str):
    """``ns_flops``' ``symmetric_share`` for the Newton–Schulz that runs on ``device``.

    ``None`` where it computes the full products.

    The upper-tile kernel (:mod:`lwjax.gram`) runs where ``newton_schulz`` takes
    its CUDA branch, under ``"medium"`` and with a folded coefficient table
    (the bench's quintic); asking ``lax.platform_dependent`` on the device
    itself tells CUDA from other GPUs.
    """
    probe = jax.jit(
        lambda x: jax.lax.platform_dependent(x, cuda=lambda x: x + 1, default=lambda x: x)
    )
    on_cuda = int(probe(jax.device_put(jnp.int32(0), device))) == 1
    return gram.computed_share if on_cuda and ns_precision == "medium" else None


def newton_schulz_floor(plan, mesh, ns_precision: str, iters: int, warmup: int) -> dict:
    """The busiest rank's Newton–Schulz time: its FLOPs over the device's measured matmul rate.

    The compute Muon adds to a step and no schedule can remove. The rate is
    that of a chain of large bf16 (fp32 under ``"highest"``) products in one
    call (:data:`MATMUL_CHAIN` per call), the best of three medians of
    ``iters`` calls. ``ns_ms`` counts Megatron's FLOPs (full products),
    ``ns_computed_ms`` those lwjax computes (fewer on CUDA in bf16,
    :mod:`lwjax.gram`); ``ns_gflop_per_rank`` lists Megatron's FLOPs of every
    rank of ``plan``.
    """
    device = mesh.devices.flat[0]
    # Per data-parallel rank, its busiest tensor-parallel device (lwjax.parallel.ns_deal).
    flops = [max(row) for row in device_ns_flops(plan)]
    computed = [max(row) for row in device_ns_flops(plan, symmetric_share(device, ns_precision))]
    # A chain of products in one call, so dispatch and synchronisation add nothing measurable
    # (one timed 8192^3 product gave 444 to 665 TFLOP/s between commands on one H200 host).
    # Entries of variance 1/size keep the chain's values from growing.
    size = 1024 if device.platform == "cpu" else 8192
    ns_dtype = jnp.bfloat16 if ns_precision == "medium" else jnp.float32
    a = jax.device_put(
        jax.random.normal(jax.random.key(1), (size, size), ns_dtype) / size**0.5, device
    )
    matmul = jax.jit(lambda x: functools.reduce(lambda y, _: x @ y, range(MATMUL_CHAIN), x))
    mm_s = _best_median(lambda: matmul(a), iters, warmup)
    rate = MATMUL_CHAIN * 2 * size**3 / mm_s
    return dict(
        ns_ms=max(flops) / rate * 1e3,
        ns_computed_ms=max(computed) / rate * 1e3,
        matmul_tflops=rate / 1e12,
        ns_gflop_max_rank=max(flops) / 1e9,
        ns_gflop_computed_max_rank=max(computed) / 1e9,
        ns_gflop_per_rank=[f / 1e9 for f in flops],
    )


def step_bytes(plan, dp: int, state_bytes: int, replicas: int = 1) -> int:
    r"""The fewest bytes one device's optimizer step moves through its memory, its layout
    spanning ``dp`` devices (one sharding group's, of ``replicas``).

    .. math:: B = 2 S + 2 G + W

    ``S``: the device's optimizer state (fp32 masters and moments), read and
    written once. ``G``: its share of the gradients, read twice (the clip's
    global norm is needed before the update can read them again); in the
    parameters' dtype on one device, where nothing reduces them, else in the
    reduction dtype the reduce-scatter leaves them in. ``W``: its share of
    the parameters, written once. Newton–Schulz's own operands are left to
    its FLOPs (:func:`newton_schulz_floor`): a product can read them as it
    computes.
    """
    grads = params = 0
    for b in plan.buffers:
        shard = b.numel // dp
        grad_dtype = b.key.param_dtype if dp * replicas == 1 else b.key.grad_dtype
        grads += shard * jnp.dtype(grad_dtype).itemsize
        params += shard * jnp.dtype(b.key.param_dtype).itemsize
    return 2 * state_bytes + GRADIENT_READS * grads + params


def copy_bandwidth(device, iters: int, warmup: int) -> float:
    """Bytes per second ``device`` streams through its memory: ``x + 1`` over a large fp32
    array (read once, written once; 4 GiB on a GPU), the best of three medians of ``iters``
    calls."""
    size = 2**22 if device.platform == "cpu" else 2**30
    x = jax.device_put(jnp.zeros((size,), jnp.float32), device)
    add = jax.jit(lambda x: x + 1)
    return 2 * x.nbytes / _best_median(lambda: add(x), iters, warmup)


def _best_median(call, iters: int, warmup: int) -> float:
    """Seconds of ``call()``: the best of three medians of ``iters`` synchronised calls."""
    return min(time_steps(lambda *_: (call(),), (), iters, warmup)[0] for _ in range(3))


def optimizer_step_floor(cfg, opt, mesh, state_bytes: int) -> dict:
    """The no-overlap floor of one optimizer step on these devices, measured in JAX.

    Communication: a bare ``psum_scatter`` of every gradient buffer plus a
    bare ``all_gather`` of every parameter block, at the step's exact sizes
    and dtypes, each timed as the step is (synchronised, and back to back).
    With sharding groups (``mesh`` has the optimizer's replica axis) both run
    within a group, and ``rs_ms`` also counts the ``psum`` of each
    reduce-scattered shard across the groups, as the step reduces it.
    Compute: :func:`newton_schulz_floor`. Memory: :func:`step_bytes` of the
    device holding ``state_bytes`` of optimizer state, at :func:`copy_bandwidth`
    (``bytes_ms``). ``floor_sum_computed_ms`` counts the
    Newton–Schulz FLOPs lwjax computes instead of Megatron's. ``cfg`` is the
    :class:`~lwjax.tools.bench.config.BenchConfig` (its ``iters``, ``warmup`` and
    ``ns_precision``).
    """
    plan, axes = opt.plan, opt.mesh_axes
    dp = mesh.shape["dp"]  # a group's devices
    grad_dtypes = [jnp.dtype(b.key.grad_dtype) for b in plan.buffers]
    param_dtypes = [jnp.dtype(b.key.param_dtype) for b in plan.buffers]
    grads = [
        jax.device_put(jnp.ones((axes.num_data, b.numel), d), NamedSharding(mesh, P(axes.data)))
        for b, d in zip(plan.buffers, grad_dtypes)
    ]

    def reduce(g):
        shard = jax.lax.psum_scatter(g[0], "dp", tiled=True)
        return shard if axes.replica is None else jax.lax.psum(shard, axes.replica)

    blocks = [
        jax.device_put(jnp.ones((b.numel,), d), NamedSharding(mesh, P("dp")))
        for b, d in zip(plan.buffers, param_dtypes)
    ]
    rs = jax.jit(
        jax.shard_map(
            lambda gs: [reduce(g) for g in gs],
            mesh=mesh,
            in_specs=(P(axes.data),),
            out_specs=P("dp"),
            check_vma=False,
        )
    )
    ag = jax.jit(
        jax.shard_map(
            lambda bs: [jax.lax.all_gather(b, "dp", tiled=True) for b in bs],
            mesh=mesh,
            in_specs=(P("dp"),),
            out_specs=P(),
            check_vma=False,
        )
    )

    def timed(collective, operands):
        """Seconds per call, synchronised and back to back (none on one device)."""
        if axes.num_data == 1:
            return 0.0, 0.0

        def call(*_):
            return (collective(operands),)

        return time_steps(call, (), cfg.iters, cfg.warmup)[0], time_back_to_back(
            call, (), cfg.iters
        )[0]

    (rs_s, rs_b2b), (ag_s, ag_b2b) = timed(rs, grads), timed(ag, blocks)
    ns = newton_schulz_floor(plan, mesh, cfg.ns_precision, cfg.iters, cfg.warmup)
    moved = step_bytes(plan, dp, state_bytes, axes.replica_size)
    bandwidth = copy_bandwidth(mesh.devices.flat[0], cfg.iters, cfg.warmup)
    rs_ms, ag_ms, bytes_ms = rs_s * 1e3, ag_s * 1e3, moved / bandwidth * 1e3
    return dict(
        rs_ms=rs_ms,
        ag_ms=ag_ms,
        **ns,
        step_gbytes=moved / 1e9,
        copy_gbytes_per_s=bandwidth / 1e9,
        bytes_ms=bytes_ms,
        floor_sum_ms=rs_ms + ag_ms + ns["ns_ms"] + bytes_ms,
        floor_sum_computed_ms=rs_ms + ag_ms + ns["ns_computed_ms"] + bytes_ms,
        floor_max_ms=max(rs_ms + ag_ms, ns["ns_ms"] + bytes_ms),
        rs_back_to_back_ms=rs_b2b * 1e3,
        ag_back_to_back_ms=ag_b2b * 1e3,
        floor_sum_back_to_back_ms=(rs_b2b + ag_b2b) * 1e3 + ns["ns_ms"] + bytes_ms,
    )


TP_FLOOR_SKIPPED = (
    "not measured at tp > 1: the floor times only the data-parallel reduce-scatter and "
    "all-gather and a rank's Newton-Schulz FLOPs, not the tensor-parallel gathers or Gram "
    "all-reduces of the tp mode, so it would not be a floor of this step"
)
