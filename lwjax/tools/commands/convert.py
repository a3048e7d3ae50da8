"""``lwjax convert``: Megatron <-> lwjax checkpoints, or either to safetensors.

Builds a :class:`~lwjax.megatron.convert.ConvertConfig` and runs
:func:`~lwjax.megatron.convert.convert` under a progress bar, then prints a
table of the converted parameters (or, ``--json``, the summary; without the
``tools`` extra, the same parameters as plain text).
"""

from __future__ import annotations

import argparse

from lwjax.tools.render import (
    console,
    convert_json,
    convert_progress,
    convert_text,
    has_rich,
    print_convert,
    print_json,
)


def _cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint (Megatron <-> lwjax, or to safetensors); show progress and a table."""
    from lwjax.megatron.convert import ConvertConfig, convert

    config = ConvertConfig(
        src=args.src,
        dst=args.dst,
        to=args.to,
        reader=args.reader,
        iteration=args.iteration,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        overwrite=args.overwrite,
        weights_only=args.weights_only,
    )
    if args.json:
        print_json(convert_json(convert(config)))
        return 0
    if not has_rich():  # reading Megatron needs no extra: plain text without the tools extra
        print(convert_text(convert(config)))
        return 0
    out = console()
    with convert_progress(out) as report:
        summary = convert(config, progress=report)
    print_convert(out, summary)
    return 0


def add_parser(subparsers) -> None:
    """Add ``convert`` and its flags to the ``lwjax`` subparsers."""
    p = subparsers.add_parser(
        "convert",
        help="convert checkpoints: Megatron -> lwjax or safetensors, "
        "lwjax -> Megatron torch_dist or safetensors",
        description=(
            "Convert a Megatron-Core checkpoint (torch_dist or legacy torch) into an lwjax "
            "checkpoint, or into safetensors when DST ends in .safetensors; or an lwjax "
            "checkpoint into Megatron torch_dist."
        ),
    )
    p.add_argument(
        "src", metavar="SRC", help="Megatron checkpoint directory or lwjax checkpoint directory"
    )
    p.add_argument("dst", metavar="DST", help="output directory, or FILE.safetensors")
    p.add_argument(
        "--to",
        choices=("lwjax", "safetensors", "torch_dist"),
        default=None,
        help="output format (default: inferred from SRC and DST)",
    )
    p.add_argument(
        "--reader",
        choices=("numpy", "torch"),
        default="numpy",
        help="read Megatron files without torch (default) or through torch",
    )
    p.add_argument(
        "--iteration", type=int, default=None, help="Megatron iteration (default: the latest)"
    )
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="take a Megatron checkpoint's model weights alone; the output gets fresh optimizer "
        "state (without it, a checkpoint whose optimizer file is missing or empty is an error)",
    )
    p.add_argument(
        "--num-attention-heads",
        type=int,
        default=None,
        help="for checkpoints whose args do not record it",
    )
    p.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="for checkpoints whose args do not record it",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(command=_cmd_convert, command_name="convert")
