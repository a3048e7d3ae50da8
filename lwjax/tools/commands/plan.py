"""``lwjax plan``: size a run before it starts, from the optimizer's own plan.

For a model (a preset or a spec file) on a mesh (``--dp``, ``--fsdp``, ``--tp``,
``--replica``, hosts of ``--devices-per-host``) it prints what one device holds, the bytes
each collective of a training step moves inside and across hosts, and the Newton–Schulz
work of the busiest device (:mod:`lwjax.tools.plan_report`). ``--compile`` also compiles
the step on abstract shapes on as many virtual CPU devices (nothing is allocated), or with
``--compile-on gpu`` as many GPUs mocked on a machine with one, and sets XLA's memory
estimate and collectives beside the plan's. With ``--devices N`` and no mesh,
it plans every ``dp x fsdp x tp`` mesh of N devices and recommends one.

Examples::

    lwjax plan --preset small --layers 2 --dp 2 --fsdp 4 --devices-per-host 4
    lwjax plan --preset llama70b --dp 8 --fsdp 8 --devices-per-host 8
    lwjax plan --preset llama70b --devices 64 --devices-per-host 8 --memory-gb 80
"""

from __future__ import annotations

import argparse

from lwjax.layout import DEFAULT_POLICY, POLICIES
from lwjax.tools.commands.bench import bucket_size_arg
from lwjax.tools.commands.layout import _load_spec_file
from lwjax.tools.presets import PRESETS

MESH_FLAGS = ("dp", "fsdp", "tp", "replica")


def _model(args: argparse.Namespace):
    from lwjax.tools.plan_model import preset_model, specs_model

    if args.preset is None and args.spec is None:
        raise ValueError(
            f"the model to plan is required: --preset NAME (one of {', '.join(PRESETS)}) "
            "or --spec FILE.json."
        )
    if args.spec is not None:
        if args.layers is not None:
            raise ValueError("--layers applies to --preset only.")
        return specs_model(args.spec, _load_spec_file(args.spec))
    return preset_model(args.preset, args.layers)


def _cmd_plan(args: argparse.Namespace) -> int:
    """Print (or write as JSON) the plan of one mesh, or the ranking of a device count's."""
    from lwjax.tools.plan_model import PlanMesh, PlanOptions
    from lwjax.tools.plan_report import plan_run, rank_meshes
    from lwjax.tools.render import print_json, require_rich
    from lwjax.tools.render_plan import plan_json, print_plan, print_ranking

    if not args.json:
        require_rich()
    options = PlanOptions(
        policy=args.policy,
        bucket_size=args.bucket_size,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        remat=args.remat,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
    )
    model = _model(args)
    given = {name: getattr(args, name) for name in MESH_FLAGS if getattr(args, name) is not None}
    if not given:
        if args.devices is None:
            raise ValueError("give a mesh (--dp, --fsdp, --tp, --replica) or --devices N to rank.")
        if args.compile:
            raise ValueError("--compile compiles one mesh: give --dp, --fsdp or --tp.")
        ranked, skipped, why = rank_meshes(
            model, args.devices, args.devices_per_host, args.memory_gb, options
        )
        if args.json:
            print_json(
                dict(
                    recommended=ranked[0].mesh.describe(),
                    why=why,
                    ranked=[plan_json(run) for run in ranked],
                    skipped=[dict(mesh=m, why=w) for m, w in skipped],
                )
            )
        else:
            print_ranking(ranked, devices=args.devices, memory_gb=args.memory_gb, why=why)
        return 0
    mesh = PlanMesh(**given, devices_per_host=args.devices_per_host)
    if args.devices is not None and args.devices != mesh.devices:
        raise ValueError(
            f"--devices {args.devices}: the mesh {mesh.describe()} has {mesh.devices} devices; "
            "the sizes must multiply to --devices."
        )
    run = plan_run(model, mesh, options)
    compiled = None
    if args.compile:
        from lwjax.tools.plan_compile import CompileRequest, compile_in_subprocess

        if model.workload is None:
            raise ValueError(
                "--compile compiles the benchmark's GPT: use one of the presets "
                "small, llama8b, llama70b, llama405b."
            )
        compiled = compile_in_subprocess(
            CompileRequest(args.preset, args.layers, mesh, options, args.compile_on)
        )
    if args.json:
        print_json(plan_json(run, compiled))
    else:
        print_plan(run, compiled)
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    """Add ``plan`` and its flags to the ``lwjax`` subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="size a run: memory, bytes inside/across hosts and Newton-Schulz per device",
        description=(
            "Plan a model on a mesh from the optimizer's own plan: memory per device, bytes per "
            "step of each collective inside and across hosts, Newton-Schulz FLOPs of the "
            "busiest device; or rank every mesh of --devices N."
        ),
    )
    model = p.add_mutually_exclusive_group()  # one is required: _cmd_plan says so
    model.add_argument("--preset", choices=tuple(PRESETS), help="a built-in model")
    model.add_argument("--spec", metavar="FILE.json", help="parameters as JSON (see lwjax layout)")
    p.add_argument(
        "--layers", type=_positive, default=None, metavar="L", help="layers of the preset"
    )
    for name, what in (
        ("dp", "data-parallel devices of a sharding group (the optimizer's layout)"),
        ("fsdp", "devices every parameter is split over (last axis); the batch too"),
        ("tp", "tensor-parallel devices (Megatron's split; GPT presets)"),
        ("replica", "sharding groups (copies of the optimizer state)"),
    ):
        p.add_argument(f"--{name}", type=_positive, default=None, metavar="N", help=what)
    p.add_argument(
        "--devices-per-host",
        type=_positive,
        default=None,
        metavar="H",
        help="consecutive devices per host (default: one host); axes run replica, dp, fsdp, tp "
        "from major to minor",
    )
    p.add_argument(
        "--devices",
        type=_positive,
        default=None,
        metavar="N",
        help="with no mesh: rank every dp x fsdp x tp mesh of N devices; with one: check it",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        metavar="G",
        help="with --devices: the memory of one device, for what fits",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help=f"layer-wise policy (default {DEFAULT_POLICY})",
    )
    p.add_argument(
        "--bucket-size",
        type=bucket_size_arg,
        default="auto",
        metavar="B",
        help="bucket size in elements, 'none' or 'auto' (the default)",
    )
    p.add_argument(
        "--grad-reduce-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce gradients in fp32 (default on)",
    )
    p.add_argument(
        "--remat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each layer in the backward pass (default: on with --fsdp, where the "
        "backward would otherwise keep every layer gathered whole)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also compile the training step on abstract shapes on virtual CPU devices and "
        "show XLA's memory estimate and collectives",
    )
    p.add_argument(
        "--compile-on",
        choices=("cpu", "gpu"),
        default="cpu",
        help="with --compile: virtual CPU devices (the default), or the mesh's devices as GPUs "
        "JAX mocks on a machine with one GPU (the GPU compiler's estimate; nothing runs)",
    )
    p.add_argument("--seq-len", type=_positive, default=128, metavar="T", help="with --compile")
    p.add_argument(
        "--micro-batch",
        type=_positive,
        default=1,
        metavar="B",
        help="with --compile: sequences per data-parallel device",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(command=_cmd_plan, command_name="plan")
