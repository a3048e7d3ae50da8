"""``lwjax bench``: time lwjax's optimizer step (or, ``--train-step``, a training step).

The optimizer step runs :func:`lwjax.tools.bench.run_bench` (lwjax against
replicated optax Muon and, optionally, Megatron-Core); ``--train-step`` runs
:func:`lwjax.tools.bench.run_train_bench` (lwjax Muon, lwjax AdamW and
optax AdamW). Both print a table, or their records as JSON, and can write
``bench.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from lwjax.layout import DEFAULT_POLICY, POLICIES
from lwjax.megatron.gpt import ATTENTIONS
from lwjax.tools.render import print_bench, print_json, print_train_bench, require_rich
from lwjax.train_options import STEP_COMPILER_OPTIONS

# lwjax.muon.TP_MODES (that module imports jax; this command is parsed without it)
TP_MODES = ("duplicated", "distributed", "blockwise")
# lwjax.tools.bench.WORKLOADS's names (that module imports jax too)
WORKLOAD_NAMES = ("small", "1b", "8b", "70b", "405b")


def _cmd_bench(args: argparse.Namespace) -> int:
    """Time lwjax's optimizer step (or, with --train-step, a training step) and its baselines."""
    if args.train_step:
        if args.grad_std is not None:
            raise ValueError(
                "--grad-std applies to the optimizer step only; drop it with --train-step."
            )
        if (args.tp, args.tp_mode) != (1, None):
            raise ValueError("--tp and --tp-mode apply to the optimizer step only.")
        if args.replica != 1:
            raise ValueError("--replica applies to the optimizer step only.")
    elif (
        args.seq_len,
        args.micro_batch,
        args.remat,
        args.adamw,
        args.attention,
        args.fsdp,
        args.overlap_param_gather,
        args.scan_layers,
    ) != (None, None, False, True, "auto", False, False, True):
        raise ValueError(
            "--seq-len, --micro-batch, --remat, --no-adamw, --attention, --fsdp, "
            "--overlap-param-gather and --no-scan-layers apply to --train-step only."
        )
    if args.tp < 1:
        raise ValueError(f"--tp must be a positive integer; got {args.tp}.")
    undivided = [dp for dp in args.dp if args.replica != "auto" and dp % args.replica]
    if undivided:
        raise ValueError(
            f"--replica {args.replica} must divide every --dp size (it runs dp devices as "
            f"{args.replica} groups of dp / {args.replica}); dp {undivided[0]} does not."
        )
    if not args.json:
        require_rich()  # before the benchmark runs, not after
    from lwjax.tools.demo.devices import request_cpu_devices

    request_cpu_devices(max(args.dp) * args.tp)
    if args.train_step:
        return _bench_train_step(args)
    from lwjax.tools.bench import BenchConfig, run_bench

    config = BenchConfig(
        workload=args.workload,
        layers=args.layers,
        dp_sizes=tuple(args.dp),
        iters=args.iters,
        warmup=BenchConfig.warmup if args.warmup is None else args.warmup,
        param_dtype=args.param_dtype,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        ns_precision=args.ns_precision,
        policy=args.policy,
        bucket_size=args.bucket_size,
        baselines=args.baselines,
        megatron_script=args.megatron,
        profile_dir=args.profile,
        pgle=args.pgle,
        grad_std=BenchConfig.grad_std if args.grad_std is None else args.grad_std,
        pipeline_muon=args.pipeline_muon,
        tp=args.tp,
        tp_mode=BenchConfig.tp_mode if args.tp_mode is None else args.tp_mode,
        replica=args.replica,
    )
    records = run_bench(config)
    if not _emit_records(args, records):
        print_bench(records)
    return 0


def _bench_train_step(args: argparse.Namespace) -> int:
    """``bench --train-step``: full training steps, lwjax Muon against AdamW."""
    from lwjax.tools.bench import TrainBenchConfig, run_train_bench

    config = TrainBenchConfig(
        workload=args.workload,
        layers=args.layers,
        dp_sizes=tuple(args.dp),
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        remat=args.remat,
        attention=args.attention,
        iters=args.iters,
        warmup=TrainBenchConfig.warmup if args.warmup is None else args.warmup,
        param_dtype=args.param_dtype,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        ns_precision=args.ns_precision,
        policy=args.policy,
        bucket_size=args.bucket_size,
        pipeline_muon=args.pipeline_muon,
        pgle=args.pgle,
        baselines=args.baselines,
        adamw=args.adamw,
        optax_form=args.optax_form,
        megatron_script=args.megatron,
        fsdp=args.fsdp,
        overlap_param_gather=args.overlap_param_gather,
        scan_layers=args.scan_layers,
        profile_dir=args.profile,
        compiler_options={} if args.xla_defaults else STEP_COMPILER_OPTIONS,
    )
    records = run_train_bench(config)
    if not _emit_records(args, records):
        print_train_bench(records)
    return 0


def _emit_records(args: argparse.Namespace, records: list[dict]) -> bool:
    """Write bench.json into ``--out``, if given; return whether ``--json`` printed the records."""
    if args.out:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "bench.json").write_text(json.dumps(records, indent=1) + "\n")
    if args.json:
        print_json(records)
    return args.json


def bucket_size_arg(text: str) -> int | str | None:
    """``--bucket-size`` (bench and layout): an element count, ``none`` or ``auto``."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, 'none' or 'auto'; got {text!r}"
        ) from None


def _replica_arg(text: str) -> int | str:
    """``--replica``: a positive number of sharding groups, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto'; got {text!r}")
    return value


def _dp_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers; got {text!r}"
        ) from None
    return values


def add_parser(subparsers) -> None:
    """Add ``bench`` and its flags to the ``lwjax`` subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="time the optimizer step against replicated optax Muon "
        "(--train-step: a full training step)",
        description=(
            "Time lwjax's optimizer step against replicated optax Muon on Megatron-shaped "
            "workloads: 'step ms' is the median of synchronised steps, 'back to back' the time "
            "per step of steps dispatched without synchronising, as a training loop runs them "
            "(Megatron's times are CUDA-event times). With --train-step, time a full training "
            "step (forward, backward, optimizer) of the workload's Llama with lwjax Muon, lwjax "
            "AdamW (ZeRO-1) and replicated optax AdamW, and report Muon's overhead."
        ),
    )
    p.add_argument(
        "--workload",
        choices=WORKLOAD_NAMES,
        default="small",
        help="the GPT (lwjax.tools.bench.WORKLOADS): 8b, 70b and 405b have the layers of "
        "Llama-3-8B, Llama-3-70B and Llama-3.1-405B, 4 of them unless --layers says",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument(
        "--dp", type=_dp_list, default=[1, 2, 4, 8], help="data-parallel sizes, e.g. 1,2,4,8"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: each dp size runs on dp*tp devices, the parameters split as "
        "Megatron-Core splits them (optimizer step only; no floor or optax baseline at tp > 1)",
    )
    p.add_argument(
        "--tp-mode",
        "--muon-tp-mode",
        dest="tp_mode",
        choices=TP_MODES,
        default=None,
        help="how a matrix split over tp is orthogonalised (MuonConfig.tp_mode, Megatron's "
        "--muon-tp-mode, passed to both; default duplicated)",
    )
    p.add_argument(
        "--replica",
        type=_replica_arg,
        default=1,
        help="lwjax in sharding groups (layerwise_muon's replica_axis): each --dp size runs as "
        "REPLICA groups of dp/REPLICA devices, each group holding a copy of the optimizer "
        "state; 'auto': the groups lwjax.groups.choose_groups picks for --policy. Unlike lwjax "
        "plan's --dp (one group's devices), --dp counts every data-parallel device "
        "(optimizer step only; the baselines are unaffected)",
    )
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls before timing (default 8: a pipelined step's first calls run slow)",
    )
    _add_optimizer_flags(p)
    _add_train_step_flags(p)
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--out", default=None, help="also write bench.json into this directory")
    p.set_defaults(command=_cmd_bench, command_name="bench")


def _add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    """The optimizer's options, its baselines and how its step is compiled and measured."""
    p.add_argument("--param-dtype", default="bfloat16")
    p.add_argument("--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--ns-precision",
        "--muon-fp32-matmul-prec",
        dest="ns_precision",
        choices=("highest", "high", "medium"),
        default="medium",
    )
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY)
    p.add_argument(
        "--bucket-size",
        "--ddp-bucket-size",
        dest="bucket_size",
        type=bucket_size_arg,
        default="auto",
        help="elements per bucket, 'none' for one bucket per buffer, or 'auto' (default)",
    )
    p.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--megatron",
        default=None,
        metavar="SCRIPT",
        help="also time Megatron-Core with this script on the same GPUs (megatron-core "
        "installed): docs/scripts/megatron_bench.py for the optimizer step, "
        "docs/scripts/megatron_train_bench.py with --train-step",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace lwjax steps (with --train-step: every JAX contender's) into DIR and "
        "summarise kernels",
    )
    p.add_argument(
        "--xla-defaults",
        action="store_true",
        help="with --train-step: compile every step with XLA's default options instead of "
        "make_train_step's (TrainStepOptions.compiler_options: Triton GEMM fusions off)",
    )
    p.add_argument(
        "--pgle",
        action="store_true",
        help="compile lwjax's step (with --train-step: every contender's) with profile-guided "
        "latency estimates (JAX's PGLE)",
    )
    p.add_argument(
        "--grad-std",
        type=float,
        default=None,
        help="std of each device's random gradients (default 1e-2: the clip binds every step); "
        "the mean gradient's norm is about std*sqrt(params/dp), reported; passed on to Megatron",
    )
    p.add_argument(
        "--pipeline-muon",
        action="store_true",
        help="lwjax's Newton-Schulz overlaps the reduce-scatters, speculating that clipping does "
        "not bind after steps that did not clip (OptimizerConfig.pipeline_muon); the optimizer "
        "step chooses on the host from the step before last (lwjax.speculation), --train-step's "
        "one jitted step by its conditional",
    )


def _add_train_step_flags(p: argparse.ArgumentParser) -> None:
    """``--train-step`` and the training step's shape."""
    p.add_argument(
        "--train-step",
        action="store_true",
        help="time a full training step with lwjax Muon, lwjax AdamW and optax AdamW instead",
    )
    p.add_argument(
        "--seq-len",
        "--seq-length",
        dest="seq_len",
        type=int,
        default=None,
        help="with --train-step: tokens per sequence (default 2048; small workload 128)",
    )
    p.add_argument(
        "--micro-batch",
        "--micro-batch-size",
        dest="micro_batch",
        type=int,
        default=None,
        help="with --train-step: sequences per device per step "
        "(default 4 for 1b, 2 for 8b and small)",
    )
    p.add_argument(
        "--remat",
        action="store_true",
        help="with --train-step: recompute each layer's activations in the backward pass",
    )
    p.add_argument(
        "--adamw",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --train-step: also time lwjax AdamW (--no-adamw: lwjax Muon and "
        "forward+backward only, e.g. with the device memory held to what Muon's step needs)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="auto",
        help="with --train-step: every JAX contender's attention (default auto: cuDNN's fused "
        "attention on a GPU in bf16); xla lets --fsdp run under "
        "XLA_FLAGS=--xla_gpu_deterministic_ops=true, which aborts with cuDNN's on 2 GPUs",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="with --train-step: split every parameter over the dp devices (fully sharded: "
        "each layer gathered for its forward, gradients reduce-scattered in the backward) "
        "instead of replicating it; lwjax contenders only (add --no-baselines)",
    )
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="with --train-step: also time lwjax Muon and AdamW with each step's parameter "
        "all-gather moved to the start of the next step, under its forward pass "
        "(make_train_step(..., overlap_param_gather=True))",
    )
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --train-step: stack the layers and scan them (default); --no-scan-layers "
        "gives every layer its own leaves and runs the layers one after the other",
    )
    p.add_argument(
        "--optax-form",
        action="store_true",
        help="with --train-step: also time lwjax Muon as an optax transformation under jax.jit "
        "(gradients from jax.grad, and from lwjax.value_and_grad)",
    )
