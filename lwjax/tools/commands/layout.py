"""``lwjax layout``: how a model's parameters are laid out over data-parallel ranks.

Shows buckets, per-shard loads in elements and Newton–Schulz FLOPs, padding
overhead and max/mean balance, for one layout policy, for all of them side by
side (``--compare``), or for every sharding-group size and policy (``--groups``).
With ``--json`` it prints machine-readable layouts in the
format of ``tests/fixtures/layouts``. Runs without jax.

Examples::

    lwjax layout --preset llama8b --dp 8
    lwjax layout --preset moe --dp 8 --expert-dp 4 --bucket-size 40000000 --compare
    lwjax layout --spec params.json --policy lpt --dp 4 --json
    lwjax layout --preset llama8b --dp 1024 --groups --devices-per-rank 8 --devices-per-host 8
"""

from __future__ import annotations

import argparse
import json
import pathlib

from lwjax.cost import DEFAULT_NUM_NS_STEPS
from lwjax.groups import MAX_NS_RATIO, MAX_PADDING, choose_groups, consecutive_hosts
from lwjax.layout import DEFAULT_POLICY, POLICIES, LayoutConfig
from lwjax.policies import compute_layout
from lwjax.tools.commands.bench import bucket_size_arg
from lwjax.tools.layout_report import (
    compare_policies,
    evaluate_policy,
    full_layout_to_json,
    layout_to_json,
)
from lwjax.tools.presets import PRESETS, preset_specs, specs_from_json
from lwjax.tools.render import print_json
from lwjax.tools.render_layout import (
    comparison_json,
    groups_json,
    print_comparison,
    print_groups,
    print_layout,
)


def _load_spec_file(path: str):
    try:
        text = pathlib.Path(path).read_text()
    except OSError as err:
        raise ValueError(f"--spec: cannot read {path}: {err.strerror or err}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--spec: {path} is not valid JSON: {err}") from None
    return specs_from_json(obj)


def _cmd_layout(args: argparse.Namespace) -> int:
    """Show (or print as JSON) the layout of a preset or a spec file."""
    if args.preset is None and args.spec is None:
        raise ValueError(
            f"the model to lay out is required: --preset NAME (one of {', '.join(PRESETS)}) "
            "or --spec FILE.json."
        )
    if args.spec is not None and args.layers is not None:
        raise ValueError("--layers applies to --preset only.")
    if args.preset is not None:
        specs = preset_specs(args.preset, layers=args.layers)
        model = f"preset {args.preset}"
    else:
        specs = _load_spec_file(args.spec)
        model = args.spec
    layout = LayoutConfig(
        policy=args.policy, bucket_size=args.bucket_size, high_busbw=args.high_busbw
    )
    options = dict(
        expert_dp=args.expert_dp,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        num_ns_steps=args.ns_steps,
    )
    shown = dict(model=model, specs=specs, dp=args.dp, expert_dp=args.expert_dp, layout=layout)
    if args.groups:
        if args.expert_dp is not None:
            raise ValueError("--groups: sharding groups of expert buffers are not supported.")
        hosts = None
        if args.devices_per_host is not None:
            hosts = consecutive_hosts(args.dp, args.devices_per_rank, args.devices_per_host)
        choice = choose_groups(
            specs,
            args.dp,
            layout,
            devices_per_rank=args.devices_per_rank,
            hosts=hosts,
            max_padding=args.max_padding,
            max_ns_ratio=args.max_ns_ratio,
            num_ns_steps=args.ns_steps,
        )
        if args.json:
            print_json(groups_json(choice))
        else:
            print_groups(choice, model=model, specs=specs, dp=args.dp)
        return 0
    if args.compare:
        results = compare_policies(specs, args.dp, layout, **options)
        if args.json:
            print_json(comparison_json(results))
        else:
            print_comparison(results, **shown)
        return 0
    if args.json and args.spec is not None and not args.full:
        # One layer-wise buffer holding every parameter, exactly as the fixtures do.
        print_json(layout_to_json(compute_layout(specs, args.dp, layout)))
        return 0
    result = evaluate_policy(specs, args.dp, layout, **options)
    if args.json:
        print_json(full_layout_to_json(result.layout))
    else:
        print_layout(result, **shown, num_ns_steps=args.ns_steps)
    return 0


def add_parser(subparsers) -> None:
    """Add ``layout`` and its flags to the ``lwjax`` subparsers."""
    p = subparsers.add_parser(
        "layout",
        help="show how a model's parameters are laid out over data-parallel ranks",
        description=(
            "Lay a model's parameters out over data-parallel ranks and show buckets, per-shard "
            "loads (elements and Newton-Schulz FLOPs), padding overhead and max/mean balance."
        ),
    )
    model = p.add_mutually_exclusive_group()  # one is required: _cmd_layout says so
    model.add_argument(
        "--preset", choices=tuple(PRESETS), help="a built-in model (this or --spec is required)"
    )
    model.add_argument(
        "--spec",
        metavar="FILE.json",
        help="parameters as JSON: a list of shapes, or the layout fixtures' 'params' list",
    )
    p.add_argument("--dp", type=int, required=True, help="data-parallel size (shards per bucket)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help=f"layer-wise policy (default {DEFAULT_POLICY})",
    )
    p.add_argument(
        "--bucket-size",
        "--ddp-bucket-size",
        dest="bucket_size",
        type=bucket_size_arg,
        default="auto",
        metavar="B",
        help="bucket size in elements (a soft minimum for layer-wise buffers), 'none' for one "
        "bucket per buffer, or 'auto' (the default, layerwise_muon's)",
    )
    p.add_argument(
        "--high-busbw",
        "--ddp-pad-buckets-for-high-nccl-busbw",
        dest="high_busbw",
        action="store_true",
        help="pad bucket ends to multiples of 2**16 for NCCL bus bandwidth",
    )
    p.add_argument(
        "--layers", type=int, default=None, metavar="L", help="number of layers of the preset"
    )
    p.add_argument(
        "--expert-dp",
        type=int,
        default=None,
        metavar="E",
        help="data-parallel size of expert buffers (default: --dp)",
    )
    p.add_argument(
        "--grad-reduce-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce gradients in fp32 (sets the buffers' grad dtype; default on)",
    )
    p.add_argument(
        "--ns-steps",
        "--muon-num-ns-steps",
        dest="ns_steps",
        type=int,
        default=DEFAULT_NUM_NS_STEPS,
        metavar="K",
        help="Newton-Schulz iterations per step for the FLOP counts "
        f"(default {DEFAULT_NUM_NS_STEPS})",
    )
    p.add_argument("--compare", action="store_true", help="compare all policies side by side")
    p.add_argument(
        "--groups",
        action="store_true",
        help="sharding groups (Megatron's num_optimizer_shards): lay the model out over every "
        "divisor of --dp worth weighing under every policy, and show the chosen group size",
    )
    p.add_argument(
        "--devices-per-rank",
        type=int,
        default=1,
        metavar="T",
        help="with --groups: tensor/FSDP devices per data-parallel rank; its matrices are dealt "
        "out to them (default 1)",
    )
    p.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        metavar="H",
        help="with --groups: devices per host (ranks' devices consecutive, dp major); groups "
        "inside a host are preferred (default: hosts not weighed)",
    )
    p.add_argument(
        "--max-ns-ratio",
        type=float,
        default=MAX_NS_RATIO,
        metavar="R",
        help="with --groups: the most busiest-device Newton-Schulz work, a multiple of the "
        f"least achievable (default {MAX_NS_RATIO})",
    )
    p.add_argument(
        "--max-padding",
        type=float,
        default=MAX_PADDING,
        metavar="F",
        help=f"with --groups: the largest padding, a fraction (default {MAX_PADDING})",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: with --spec the single-buffer layout in the fixtures' 'expected' format; "
        "with --preset (or --spec --full) every buffer",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="with --spec --json: lay out every buffer, as for a preset",
    )
    p.set_defaults(command=_cmd_layout, command_name="layout")
