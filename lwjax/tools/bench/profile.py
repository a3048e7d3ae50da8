"""What a traced step spent its device time on: kernels by kind, and communication beside compute.

:func:`profile_steps` traces a few steps with ``jax.profiler``; :func:`kernel_summary` turns one
device's kernels into per-step times per kind and the overlap of communication with compute.
"""

from __future__ import annotations

import collections
import glob

import jax

# A kernel's kind: the first whose name fragments its name contains, else "other".
_KERNEL_KINDS = (
    ("reduce-scatter", ("reducescatter", "reduce_scatter", "reduce-scatter")),
    ("all-gather", ("allgather", "all_gather", "all-gather")),
    ("all-reduce", ("allreduce", "all_reduce", "all-reduce")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "dot")),
)
COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in _KERNEL_KINDS if any(k in low for k in keys)), "other")


def _union(intervals):
    """Total length covered by a set of (start, end) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def profile_steps(fn, args, steps: int, directory: str) -> tuple[dict, tuple]:
    """Trace ``steps`` calls of ``args = fn(*args)`` and summarise device 0's kernels per step.

    Returns :func:`kernel_summary` of device 0's stream kernels (empty without a
    GPU) and the last ``args`` (``fn`` may donate the ones it was given).
    """
    jax.block_until_ready(args := fn(*args))
    with jax.profiler.trace(directory):
        for _ in range(steps):
            args = fn(*args)
        jax.block_until_ready(args)
    path = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))[-1]
    data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU:0")]
    if not planes:
        return {}, args
    kernels = [
        (event.name, event.start_ns, event.start_ns + event.duration_ns)
        for line in planes[0].lines
        if "stream" in line.name.lower()
        for event in line.events
    ]
    return kernel_summary(kernels, steps), args


def kernel_summary(kernels, steps: int) -> dict:
    r"""Per step, what ``kernels`` (``(name, start_ns, end_ns)`` on one device) spent their time on.

    Returns ``kernel_ms`` (kernel time per kind: matmul, reduce-scatter,
    all-gather, all-reduce, other), ``comm_ms`` and ``compute_ms`` (the time
    covered by communication kernels and by the rest), ``overlap_ms`` (covered
    by both), ``exposed_ms`` (per communication kind, the time it covers while
    no compute kernel runs: :math:`|C_k \cup P| - |P|` for the kind's
    intervals :math:`C_k` and the compute intervals :math:`P`; kinds may
    overlap each other, so these can sum to more than ``comm_ms - overlap_ms``),
    and ``top_other_ms`` (the 12 costliest "other" kernels by name).
    """
    per_kind, other = collections.Counter(), collections.Counter()
    intervals = collections.defaultdict(list)
    for name, start, end in kernels:
        kind = _kind(name)
        per_kind[kind] += end - start
        intervals[kind].append((start, end))
        if kind == "other":
            other[name] += end - start
    compute = intervals["matmul"] + intervals["other"]
    comm = [iv for kind in COLLECTIVE_KINDS for iv in intervals[kind]]
    comm_ns, compute_ns = _union(comm), _union(compute)
    ms = lambda ns: ns / 1e6 / steps  # noqa: E731
    return dict(
        kernel_ms={k: ms(v) for k, v in per_kind.items()},
        comm_ms=ms(comm_ns),
        compute_ms=ms(compute_ns),
        overlap_ms=ms(comm_ns + compute_ns - _union(comm + compute)),
        exposed_ms={
            k: ms(_union(intervals[k] + compute) - compute_ns)
            for k in COLLECTIVE_KINDS
            if intervals[k]
        },
        top_other_ms={k: round(ms(v), 3) for k, v in other.most_common(12)},
    )
