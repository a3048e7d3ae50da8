"""How the benchmarks time a step: synchronised medians, back-to-back windows, warm-up, PGLE.

A timed step is a function ``args = fn(*args)``: it returns the arguments of its next
call (donated parameters and state), so a chain of calls runs as a training loop runs it.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import jax

# Untimed calls before timing. A freshly compiled pipelined training step (1b, dp 4, 4 x H100)
# ran its 2nd to 5th calls 7-11% slower than from the 6th on; 2 warm-up calls put three slow
# ones into a median of 5.
WARMUP_STEPS = 8
PGLE_RUNS = 2  # calls JAX profiles before it recompiles a step under PGLE


def time_steps(fn, args, iters: int, warmup: int):
    """Median wall time of ``args = fn(*args)`` steps, synchronised on the outputs.

    ``fn`` returns the next call's arguments (e.g. donated params and state).
    """
    for _ in range(warmup):
        args = fn(*args)
        jax.block_until_ready(args)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        args = fn(*args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), args


def time_back_to_back(fn, args, iters: int):
    """Wall time per step of ``iters`` steps ``args = fn(*args)`` dispatched back to back.

    The steps are synchronised once, at the end.

    The host runs ahead of the devices as it does in a training loop, so the
    latency of each dispatch and of each wake-up after a synchronisation
    (about 1 ms each for a multi-device JAX step, which :func:`time_steps`
    counts in every step) is paid once per ``iters`` steps instead. Closer to
    device time, as CUDA-event timings are.
    """
    jax.block_until_ready(args)
    start = time.perf_counter()
    for _ in range(iters):
        args = fn(*args)
    jax.block_until_ready(args)
    return (time.perf_counter() - start) / iters, args


@contextlib.contextmanager
def pgle():
    """JAX's profile-guided latency estimation for the jitted calls made inside."""
    saved = jax.config.jax_enable_pgle, jax.config.jax_pgle_profiling_runs
    jax.config.update("jax_enable_pgle", True)
    jax.config.update("jax_pgle_profiling_runs", PGLE_RUNS)
    try:
        yield
    finally:
        jax.config.update("jax_enable_pgle", saved[0])
        jax.config.update("jax_pgle_profiling_runs", saved[1])


def warmup_calls(warmup: int, pgle_on: bool, first_call: int = 0) -> int:
    """Untimed calls before timing: ``warmup``, and at least enough that every compiled step
    is past its compiling call, and under PGLE past its profiled calls, where one of them is
    first called only at call ``first_call`` (a host-chosen speculative step:
    :data:`lwjax.speculation.FIRST_SPECULATION`)."""
    if pgle_on:
        return max(warmup, first_call + PGLE_RUNS + 1)
    return max(warmup, first_call + 1) if first_call else warmup
