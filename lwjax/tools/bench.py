"""Benchmark of the optimizer step: lwjax vs. replicated ``optax.contrib.muon``.

Workloads are Megatron-shaped transformers (fused ``linear_qkv`` with QKV split,
fused SwiGLU ``linear_fc1``, untied embedding and output layer), stored the
way Megatron stores them (``[out, in]``) with the layers stacked ``[L, ...]``.
Only the optimizer path is timed: every device is handed its local gradients
(the dp-mean is taken inside the step), the step runs, results are
synchronised. Both contenders run in the same process on the same devices:

* ``lwjax``: reduce-scatter, norm/clip, Muon/Adam on owned blocks, all-gather;
* ``optax``: ``pmean`` of the gradients (all-reduce) and ``optax.contrib.muon``
  with the same routing on every device (the JAX status quo).

With tensor parallelism (``BenchConfig.tp > 1``) the devices form a ``dp x tp``
mesh and the parameters are split over ``tp`` as Megatron-Core splits them
(:meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`); lwjax runs with
``tensor_axis="tp"``, Megatron-Core with ``tensor_model_parallel_size=tp``, both in
``BenchConfig.tp_mode``. The no-overlap floor and the replicated optax baseline are
not measured there (the record says so).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import gram
from lwjax.cost import DEFAULT_NUM_NS_STEPS, ns_flops
from lwjax.layout import LayoutConfig
from lwjax.megatron.gpt import MATRIX_CONVENTION, GPTConfig, keys_from_tree, tree_from_keys
from lwjax.muon import TP_MODES, MuonConfig
from lwjax.optimizer import (
    LayerwiseOptimizer,
    OptimizerConfig,
    layerwise_muon,
    resolved_layout,
)
from lwjax.speculation import FIRST_SPECULATION, chosen_on_host
from lwjax.state import speculates
from lwjax.train import jit_shard_map

# Megatron-Core GPTs (lwjax.megatron.gpt): 8b is Llama-3-8B's layer with 4 layers; 1b has 16
# heads of 128. (layers, hidden, heads, query groups, SwiGLU width, vocabulary) each.
WORKLOADS = {
    name: GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
    )
    for name, (layers, hidden, heads, groups, ffn, vocab) in {
        "8b": (4, 4096, 32, 8, 14336, 128256),
        "1b": (16, 2048, 16, 8, 8192, 128256),
        "small": (4, 256, 8, 4, 704, 4096),
    }.items()
}

# Untimed calls before timing. A freshly compiled pipelined training step (1b, dp 4, 4 x H100)
# ran its 2nd to 5th calls 7-11% slower than from the 6th on; 2 warm-up calls put three slow
# ones into a median of 5.
WARMUP_STEPS = 8


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What :func:`run_bench` measures.

    Attributes:
      workload: A key of :data:`WORKLOADS`.
      layers: Transformer layers (``None``: the workload's default).
      dp_sizes: Data-parallel sizes to run (each ≤ the device count).
      iters: Timed steps per measurement (median reported), and steps of the
        back-to-back window (:func:`time_back_to_back`).
      warmup: Untimed steps first (:data:`WARMUP_STEPS`).
      param_dtype: Parameter (compute) dtype.
      grad_reduce_in_fp32: Reduce gradients in fp32, else in ``param_dtype``.
      ns_precision: Newton–Schulz precision (``"medium"`` = bf16, Megatron's default).
      policy: lwjax layout policy.
      bucket_size: lwjax bucket size in elements, ``None`` (one bucket per
        buffer) or ``"auto"`` (the optimizer's default). Megatron always runs
        with one bucket per buffer, its default without overlapped reduction.
      baselines: Also time replicated ``optax.contrib.muon``.
      megatron_script: Path of ``megatron_bench.py`` (``shared/perf``); when
        set, Megatron-Core's layer-wise optimizer is timed too, one ``torchrun``
        per dp size, before JAX touches the devices.
      profile_dir: Also trace a few lwjax steps there and summarise kernel
        time per kind and communication/compute overlap (GPU).
      pgle: Compile lwjax's step with XLA's profile-guided latency estimates
        (JAX's PGLE: the first :data:`PGLE_RUNS` calls are profiled, then the
        step is recompiled), so XLA's scheduler knows what the all-gathers and
        updates really cost.
      grad_std: Standard deviation of every device's random gradients (as
        ``megatron_bench.py``'s ``--grad-std``, passed on to it). The mean
        gradient's norm is about ``grad_std * sqrt(N / dp)`` for ``N``
        parameters (reported): the default 1e-2 puts it far above the clip
        (1.0), so clipping binds on every step; 2e-5 keeps it below for the 8b
        and 1b workloads at dp ≥ 2, as in most steps of a pretraining run.
      pipeline_muon: lwjax's ``OptimizerConfig.pipeline_muon``.
      tp: Tensor-parallel size: each dp size runs on ``dp * tp`` devices, the
        parameters split over ``tp`` by
        :meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`. At ``tp > 1`` the floor
        and the optax baseline are skipped (named in the record).
      tp_mode: How a split Muon matrix is orthogonalised
        (``MuonConfig.tp_mode``, Megatron's ``--muon-tp-mode``; passed to both).
    """

    workload: str = "small"
    layers: int | None = None
    dp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    iters: int = 10
    warmup: int = WARMUP_STEPS
    param_dtype: str = "bfloat16"
    grad_reduce_in_fp32: bool = True
    ns_precision: str = "medium"
    policy: str = "ns_cost"
    bucket_size: int | str | None = "auto"
    baselines: bool = True
    megatron_script: str | None = None
    profile_dir: str | None = None
    pgle: bool = False
    grad_std: float = 1e-2
    pipeline_muon: bool = False
    tp: int = 1
    tp_mode: str = "duplicated"

    def __post_init__(self):
        if not self.grad_std > 0:
            raise ValueError(f"BenchConfig.grad_std must be positive; got {self.grad_std!r}.")
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"BenchConfig.workload must be one of {tuple(WORKLOADS)}; got {self.workload!r}."
            )
        if not self.dp_sizes or min(self.dp_sizes) < 1:
            raise ValueError(
                f"BenchConfig.dp_sizes must be positive integers; got {self.dp_sizes!r}."
            )
        if not (isinstance(self.tp, int) and self.tp >= 1):
            raise ValueError(f"BenchConfig.tp must be a positive integer; got {self.tp!r}.")
        if self.tp_mode not in TP_MODES:
            raise ValueError(
                f"BenchConfig.tp_mode must be one of {TP_MODES}; got {self.tp_mode!r}."
            )


def workload_config(name: str, layers: int | None = None) -> GPTConfig:
    """The GPT of a :data:`WORKLOADS` entry, with ``layers`` layers instead of its own if given."""
    config = WORKLOADS[name]
    return dataclasses.replace(config, num_layers=layers) if layers else config


def workload_shapes(config: GPTConfig) -> dict:
    """The GPT's parameter tree with shape tuples as leaves (Megatron's keys, layers stacked)."""
    return tree_from_keys(config.param_shapes())


def _check_tensor_split(config: GPTConfig, tp: int) -> None:
    """Raise if a split axis of the GPT does not divide by ``tp`` (or splits a query group)."""
    if config.num_query_groups % tp:
        raise ValueError(
            f"BenchConfig.tp: tp={tp} does not divide the {config.num_query_groups} query groups."
        )
    specs = keys_from_tree(config.tensor_specs())
    for key, shape in config.param_shapes().items():
        for dim, entry in enumerate(specs[key]):
            if entry is not None and shape[dim] % tp:
                raise ValueError(
                    f"BenchConfig.tp: tp={tp} does not divide axis {dim} of {key} {shape}."
                )


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


PGLE_RUNS = 2
MATMUL_CHAIN = 8  # products per timed call when measuring the floor's matmul rate


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


def workload_optimizer(
    params,
    mesh: Mesh,
    config: GPTConfig,
    *,
    ns_precision: str,
    grad_reduce_in_fp32: bool,
    policy: str,
    bucket_size,
    muon: bool = True,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float | None = 1.0,
    pipeline_muon: bool = False,
    tensor_axis: str | None = None,
    tp_mode: str = "duplicated",
    stacked: bool = True,
) -> LayerwiseOptimizer:
    """lwjax's optimizer for a workload: layers stacked (``stacked=False``: a list of
    per-layer trees), Megatron's ``[out, in]``, QKV split.

    With ``muon=False`` every leaf goes to the elementwise Adam (ZeRO-1 AdamW:
    the same reduce-scatter, clip and all-gather, no Newton–Schulz). With
    ``tensor_axis``, leaves whose shardings name it are split over it
    (:meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`) and orthogonalised as ``tp_mode`` says.
    """
    return layerwise_muon(
        params,
        mesh,
        tensor_axis=tensor_axis,
        learning_rate=learning_rate,
        muon=MuonConfig(fp32_matmul_prec=ns_precision, tp_mode=tp_mode),
        config=OptimizerConfig(
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            matrix_convention=MATRIX_CONVENTION,
            pipeline_muon=pipeline_muon,
        ),
        layout=LayoutConfig(policy=policy, bucket_size=bucket_size),
        routing=config.routing_rules(muon=muon, stacked=stacked),
    )


def _leaf_specs(shapes, specs):
    """``specs`` flattened as ``shapes`` is (``None``: every leaf ``P()``)."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    if specs is None:
        return [P()] * len(jax.tree.leaves(shapes, is_leaf=is_shape))
    return jax.tree.leaves(
        jax.tree.map(lambda _, spec: spec, shapes, specs, is_leaf=is_shape),
        is_leaf=lambda x: isinstance(x, P),
    )


def _local_grads(shapes, mesh, dtype, std, specs=None):
    """Per-device gradients ``[dp, ...]`` of standard deviation ``std``, sharded over dp.

    Every data-parallel device's gradients differ. With ``specs``
    (:meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`) each leaf is also split as its spec says
    (``P("dp", *spec)``); a leaf it leaves whole has the same gradient on every
    tensor-parallel device, as backward gives it.
    """
    dp = mesh.shape["dp"]
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))

    def make(key, shape, spec):
        return jax.jit(
            lambda key: (std * jax.random.normal(key, (dp, *shape), jnp.float32)).astype(dtype),
            out_shardings=NamedSharding(mesh, P("dp", *spec)),
        )(key)

    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [make(k, s, sp) for k, s, sp in zip(keys, leaves, _leaf_specs(shapes, specs))]
    )


def _params(shapes, mesh, dtype, specs=None):
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


def optimizer_step(opt: LayerwiseOptimizer):
    """``step(params, state, grads) -> (params, state)``: the timed step, ``params`` and ``state``
    donated; ``grads`` are per-device gradients ``[dp, ...]`` split over dp (and, for leaves
    split over tensor parallelism, as ``opt.param_specs`` says: ``P("dp", *spec)``). A
    pipelined, clipping optimizer speculates as the host chooses, as in ``make_train_step``
    (:func:`lwjax.speculation.chosen_on_host`)."""
    param_specs = opt.param_specs
    if isinstance(param_specs, P):  # a prefix: nothing split
        grad_specs = P("dp", *param_specs)
    else:
        grad_specs = jax.tree.map(
            lambda spec: P("dp", *spec), param_specs, is_leaf=lambda x: isinstance(x, P)
        )

    def compiled(speculate=None):
        chosen, flag = ({}, ()) if speculate is None else ({"speculate": speculate}, (P(),))

        def local(p, s, g):
            p, s, _ = opt.local_update(jax.tree.map(lambda x: x[0], g), s, p, **chosen)
            return (p, s, s.speculate) if flag else (p, s)

        return jit_shard_map(
            local,
            opt.mesh,
            (param_specs, opt.state_specs, grad_specs),
            (param_specs, opt.state_specs, *flag),
            donate_argnums=(0, 1),
        )

    return chosen_on_host(compiled, 1) if speculates(opt.plan) else compiled()


def _first_call(opt: LayerwiseOptimizer) -> int:
    """The call at which :func:`optimizer_step`'s last compiled step may first run."""
    return FIRST_SPECULATION if speculates(opt.plan) else 0


def _bench_lwjax(cfg: BenchConfig, config: GPTConfig, mesh):
    dtype = jnp.dtype(cfg.param_dtype)
    shapes = workload_shapes(config)
    tensor_parallel = "tp" in mesh.axis_names
    specs = config.tensor_specs() if tensor_parallel else None
    params = _params(shapes, mesh, dtype, specs)
    opt = workload_optimizer(
        params,
        mesh,
        config,
        ns_precision=cfg.ns_precision,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        policy=cfg.policy,
        bucket_size=cfg.bucket_size,
        pipeline_muon=cfg.pipeline_muon,
        tensor_axis="tp" if tensor_parallel else None,
        tp_mode=cfg.tp_mode,
    )
    state = opt.init(params)
    grads = _local_grads(shapes, mesh, dtype, cfg.grad_std, specs)
    grad_norm = float(
        jax.jit(
            lambda g: optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32).mean(0), g))
        )(grads)
    )  # of the mean gradient, what the step clips by
    dp = mesh.shape["dp"]
    step = optimizer_step(opt)

    def call(p, s):
        return step(p, s, grads)

    # PGLE is part of jit's cache key: the timed and the traced steps both run under it.
    with pgle() if cfg.pgle else contextlib.nullcontext():
        seconds, (params, state) = time_steps(
            call, (params, state), cfg.iters, warmup_calls(cfg.warmup, cfg.pgle, _first_call(opt))
        )
        back_to_back, (params, state) = time_back_to_back(call, (params, state), cfg.iters)
        profile = {}
        if cfg.profile_dir:
            name = f"dp{dp}_tp{mesh.shape['tp']}" if tensor_parallel else f"dp{dp}"
            profile, (params, state) = profile_steps(
                call, (params, state), 3, f"{cfg.profile_dir}/{name}"
            )
    state_bytes = max(
        sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(state)
            for s in leaf.addressable_shards
            if s.device == d
        )
        for d in mesh.devices.flat
    )
    return seconds, back_to_back, state_bytes, opt, profile, grad_norm


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


def _bench_optax(cfg: BenchConfig, config: GPTConfig, mesh):
    dtype = jnp.dtype(cfg.param_dtype)
    shapes = workload_shapes(config)
    params = _params(shapes, mesh, jnp.float32)
    # The stacked [L, out, in] layer matrices are Muon's, everything else Adam's.
    stacked = optax.contrib.MuonDimensionNumbers(reduction_axis=2, output_axis=1)
    dims = jax.tree.map(
        lambda s: stacked if len(s) == 3 else None, shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    tx = optax.contrib.muon(
        learning_rate=1e-3, weight_decay=0.01, muon_weight_dimension_numbers=dims
    )
    opt_state = jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)
    grads = _local_grads(shapes, mesh, dtype, cfg.grad_std)
    state_spec = jax.tree.map(lambda _: P(), opt_state)

    def local(p, o, g):
        g = jax.tree.map(lambda x: jax.lax.pmean(x[0].astype(jnp.float32), "dp"), g)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    step = jit_shard_map(
        local, mesh, (P(), state_spec, P("dp")), (P(), state_spec), donate_argnums=(0, 1)
    )

    def call(p, o):
        return step(p, o, grads)

    seconds, (params, opt_state) = time_steps(call, (params, opt_state), cfg.iters, cfg.warmup)
    back_to_back, (params, opt_state) = time_back_to_back(call, (params, opt_state), cfg.iters)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state)) + sum(
        x.nbytes for x in jax.tree.leaves(params)
    )
    return seconds, back_to_back, state_bytes


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
    dp = plan.axes.dp_size
    device = mesh.devices.flat[0]
    share = symmetric_share(device, ns_precision)
    flops, computed = [0] * dp, [0] * dp
    for buffer in plan.buffers:
        for group in buffer.slot_groups:  # every matrix of a group costs the same
            args = (group.shape, DEFAULT_NUM_NS_STEPS, group.qkv_split_shapes)
            full, part = ns_flops(*args), ns_flops(*args, symmetric_share=share)
            for rank, names in enumerate(group.names):
                flops[rank] += len(names) * full
                computed[rank] += len(names) * part
    # A chain of products in one call, so dispatch and synchronisation add nothing measurable
    # (one timed 8192^3 product gave 444 to 665 TFLOP/s between commands on one H200 host).
    # Entries of variance 1/size keep the chain's values from growing.
    size = 1024 if device.platform == "cpu" else 8192
    ns_dtype = jnp.bfloat16 if ns_precision == "medium" else jnp.float32
    a = jax.device_put(
        jax.random.normal(jax.random.key(1), (size, size), ns_dtype) / size**0.5, device
    )
    matmul = jax.jit(lambda x: functools.reduce(lambda y, _: x @ y, range(MATMUL_CHAIN), x))
    mm_s = min(time_steps(lambda *_: (matmul(a),), (), iters, warmup)[0] for _ in range(3))
    rate = MATMUL_CHAIN * 2 * size**3 / mm_s
    return dict(
        ns_ms=max(flops) / rate * 1e3,
        ns_computed_ms=max(computed) / rate * 1e3,
        matmul_tflops=rate / 1e12,
        ns_gflop_max_rank=max(flops) / 1e9,
        ns_gflop_computed_max_rank=max(computed) / 1e9,
        ns_gflop_per_rank=[f / 1e9 for f in flops],
    )


def _floor(cfg: BenchConfig, opt, mesh) -> dict:
    """The no-overlap floor of one step on these devices, measured in JAX.

    Communication: a bare ``psum_scatter`` of every gradient buffer plus a
    bare ``all_gather`` of every parameter block, at the step's exact sizes
    and dtypes, each timed as the step is (synchronised, and back to back).
    Compute: :func:`newton_schulz_floor`. ``floor_sum_computed_ms`` counts the
    Newton–Schulz FLOPs lwjax computes instead of Megatron's.
    """
    plan = opt.plan
    dp = mesh.shape["dp"]
    grad_dtypes = [jnp.dtype(b.key.grad_dtype) for b in plan.buffers]
    param_dtypes = [jnp.dtype(b.key.param_dtype) for b in plan.buffers]
    grads = [
        jax.device_put(jnp.ones((dp, b.numel), d), NamedSharding(mesh, P("dp")))
        for b, d in zip(plan.buffers, grad_dtypes)
    ]
    blocks = [
        jax.device_put(jnp.ones((b.numel,), d), NamedSharding(mesh, P("dp")))
        for b, d in zip(plan.buffers, param_dtypes)
    ]
    rs = jax.jit(
        jax.shard_map(
            lambda gs: [jax.lax.psum_scatter(g[0], "dp", tiled=True) for g in gs],
            mesh=mesh,
            in_specs=(P("dp"),),
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
        """Seconds per call, synchronised and back to back (none at dp 1)."""
        if dp == 1:
            return 0.0, 0.0

        def call(*_):
            return (collective(operands),)

        return time_steps(call, (), cfg.iters, cfg.warmup)[0], time_back_to_back(
            call, (), cfg.iters
        )[0]

    (rs_s, rs_b2b), (ag_s, ag_b2b) = timed(rs, grads), timed(ag, blocks)
    ns = newton_schulz_floor(plan, mesh, cfg.ns_precision, cfg.iters, cfg.warmup)
    rs_ms, ag_ms = rs_s * 1e3, ag_s * 1e3
    return dict(
        rs_ms=rs_ms,
        ag_ms=ag_ms,
        **ns,
        floor_sum_ms=rs_ms + ag_ms + ns["ns_ms"],
        floor_sum_computed_ms=rs_ms + ag_ms + ns["ns_computed_ms"],
        floor_max_ms=max(rs_ms + ag_ms, ns["ns_ms"]),
        rs_back_to_back_ms=rs_b2b * 1e3,
        ag_back_to_back_ms=ag_b2b * 1e3,
        floor_sum_back_to_back_ms=(rs_b2b + ag_b2b) * 1e3 + ns["ns_ms"],
    )


TP_FLOOR_SKIPPED = (
    "not measured at tp > 1: the floor times only the data-parallel reduce-scatter and "
    "all-gather and a rank's Newton-Schulz FLOPs, not the tensor-parallel gathers or Gram "
    "all-reduces of the tp mode, so it would not be a floor of this step"
)
TP_BASELINE_SKIPPED = (
    "optax.contrib.muon (replicated) not run at tp > 1: it has no tensor parallelism "
    "(every device would hold whole matrices), so it is no baseline for a split step"
)


def run_torch_script(script: str, nproc: int, args: list[str], timeout: int) -> dict:
    """Run ``script`` under torchrun on ``nproc`` processes and return the JSON object of the
    last stdout line that starts with ``{`` (the Megatron scripts' result).

    ``OUT`` is removed from the environment, so the script writes no file of its own.

    Raises:
      RuntimeError: the script failed or printed no JSON line (its stderr's end attached).
    """
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", script]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(
            f"{os.path.basename(script)} failed (rc {done.returncode}): {done.stderr[-2000:]}"
        )
    return json.loads(lines[-1])


def _bench_megatron(cfg: BenchConfig, dp: int) -> dict:
    """Run Megatron-Core's layer-wise Muon on ``dp * cfg.tp`` GPUs (torchrun) and read its
    JSON line.

    At ``cfg.tp > 1`` the script (``docs/scripts/megatron_bench.py``; the copy
    in ``shared/perf`` has no tensor parallelism) gets ``--tp`` and
    ``--muon-tp-mode``; at tp 1 neither, so either script runs it.
    """
    if cfg.workload not in ("8b", "1b"):
        raise ValueError(
            "BenchConfig.megatron_script: Megatron runs the 8b and 1b workloads only; "
            f"got {cfg.workload!r}."
        )
    layers = workload_config(cfg.workload, cfg.layers).num_layers
    args = [
        "--preset",
        cfg.workload,
        "--layers",
        str(layers),
        "--iters",
        str(cfg.iters),
        "--warmup",
        str(cfg.warmup),
        "--ns-prec",
        cfg.ns_precision,
        "--grad-std",
        repr(cfg.grad_std),
    ]
    if not cfg.grad_reduce_in_fp32:
        args.append("--no-grad-reduce-in-fp32")
    if cfg.tp > 1:
        args += ["--tp", str(cfg.tp), "--muon-tp-mode", cfg.tp_mode]
    result = run_torch_script(cfg.megatron_script, dp * cfg.tp, args, timeout=900)
    if cfg.tp > 1 and result.get("tp_size") != cfg.tp:
        raise RuntimeError(
            f"megatron bench: asked for tp={cfg.tp}, the script ran tp={result.get('tp_size')} "
            "(use docs/scripts/megatron_bench.py, which has --tp)."
        )
    timing = result["timing"]
    return dict(
        step_ms=timing["total_ms"]["median"],
        reduce_ms=timing["reduce_ms"]["median"],
        optimizer_step_ms=timing["step_ms"]["median"],
        peak_mem_bytes=max(r.get("peak_mem_bytes", 0) for r in result["per_rank"]),
        breakdown_ms=result["step_breakdown_ms_median_per_rank"],
        versions=result["versions"],
    )


def run_bench(cfg: BenchConfig) -> list[dict]:
    """Time lwjax's optimizer step (and the optax baseline) at each dp size.

    Returns:
      One record per (contender, dp): ``step_ms`` (median of synchronised
      steps), ``back_to_back_ms`` (per step, back to back: :func:`time_back_to_back`; JAX
      contenders only), ``state_bytes_per_device`` (optimizer state plus fp32
      masters held by one device), and the settings (``warmup``: the untimed
      calls the contender made first; ``tp`` and ``tp_mode``). Megatron's ``step_ms`` is
      its CUDA-event time of the reduce-scatter plus ``optimizer.step()``.
      At ``tp > 1`` lwjax's record has ``floor_skipped`` (and, with
      ``baselines``, ``baseline_skipped``) instead of the floor and the optax
      record.
    """
    config = workload_config(cfg.workload, cfg.layers)
    devices = jax.devices()
    numel = sum(int(np.prod(s)) for s in config.param_shapes().values())
    tp = cfg.tp
    if tp > 1:
        _check_tensor_split(config, tp)
    for dp in cfg.dp_sizes:
        if dp * tp > len(devices):
            what = f"dp={dp}" if tp == 1 else f"dp={dp} x tp={tp}"
            raise ValueError(
                f"BenchConfig.dp_sizes: {what} exceeds the {len(devices)} available devices."
            )
    records = []
    megatron = {dp: _bench_megatron(cfg, dp) for dp in cfg.dp_sizes} if cfg.megatron_script else {}
    for dp in cfg.dp_sizes:
        if tp == 1:
            mesh = Mesh(np.array(devices[:dp]), ("dp",))
        else:
            mesh = Mesh(np.array(devices[: dp * tp]).reshape(dp, tp), ("dp", "tp"))
        base = dict(
            workload=cfg.workload,
            layers=config.num_layers,
            params=numel,
            dp=dp,
            tp=tp,
            tp_mode=cfg.tp_mode,
            device=devices[0].device_kind,
            jax=jax.__version__,
            iters=cfg.iters,
            warmup=cfg.warmup,
        )
        seconds, back_to_back, nbytes, opt, profile, grad_norm = _bench_lwjax(cfg, config, mesh)
        if tp == 1:
            floor = _floor(cfg, opt, mesh)
        else:
            floor = dict(floor_skipped=TP_FLOOR_SKIPPED)
            if cfg.baselines:
                floor["baseline_skipped"] = TP_BASELINE_SKIPPED
        bucket_size = resolved_layout(
            LayoutConfig(bucket_size=cfg.bucket_size), opt.mesh_axes, opt.plan.muon
        ).bucket_size_for(dp)
        records.append(
            dict(
                base,
                contender="lwjax",
                policy=cfg.policy,
                bucket_size=bucket_size,
                grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
                pgle=cfg.pgle,
                grad_std=cfg.grad_std,
                grad_norm=grad_norm,
                pipeline_muon=cfg.pipeline_muon,
                warmup=warmup_calls(cfg.warmup, cfg.pgle, _first_call(opt)),
                step_ms=seconds * 1e3,
                back_to_back_ms=back_to_back * 1e3,
                state_bytes_per_device=nbytes,
                **floor,
                **({"profile": profile} if profile else {}),
            )
        )
        if dp in megatron:
            records.append(
                dict(base, contender="Megatron-Core LayerWiseDistributedOptimizer", **megatron[dp])
            )
        if cfg.baselines and tp == 1:
            seconds, back_to_back, nbytes = _bench_optax(cfg, config, mesh)
            records.append(
                dict(
                    base,
                    contender="optax.contrib.muon (replicated)",
                    step_ms=seconds * 1e3,
                    back_to_back_ms=back_to_back * 1e3,
                    state_bytes_per_device=nbytes,
                )
            )
    return records
