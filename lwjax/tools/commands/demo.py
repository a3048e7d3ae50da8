"""``lwjax demo``: train the demo GPT with lwjax, then with a baseline, and compare.

The flags are :class:`~lwjax.tools.demo.config.DemoConfig`'s fields (with their
defaults); :func:`~lwjax.tools.demo.run.run_demo` trains, prints the summary and
writes ``metrics.json`` and ``loss.png``; ``--json`` prints the metrics.
"""

from __future__ import annotations

import argparse
import dataclasses

from lwjax.tools.demo.config import BASELINES, DemoConfig  # jax-free module
from lwjax.tools.render import console, print_json, require_rich


def _cmd_demo(args: argparse.Namespace) -> int:
    """Train the demo GPT with lwjax and a baseline; print the summary, write the outputs."""
    from lwjax.tools.demo.run import run_demo

    require_rich()  # flax, which DemoConfig's checks import, needs it too
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    options = {name: value for name, value in vars(args).items() if name in fields}
    config = DemoConfig(**{**options, "progress": args.progress and not args.json})
    metrics = run_demo(config, console=console())
    if args.json:
        print_json(metrics)
    return 0


def add_parser(subparsers) -> None:
    """Add ``demo`` and its flags (``DemoConfig``'s fields) to the ``lwjax`` subparsers."""
    default = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on Python-stdlib bytes with lwjax, then with AdamW, and compare",
        description=(
            "Train a small GPT (flax nnx) on the bytes of the Python standard library with "
            "layer-wise Muon on all local devices (8 virtual CPU devices without an accelerator), "
            "then the same model from the same initial weights on the same batches with a "
            "replicated optax baseline. Prints a summary table and writes metrics.json and "
            "loss.png into --out."
        ),
    )
    p.add_argument(
        "--steps",
        type=int,
        default=default["steps"],
        help="training steps per run (default %(default)s)",
    )
    p.add_argument(
        "--model-size",
        "--size",
        dest="model_size",
        default=default["model_size"],
        help="tiny, small or base (default %(default)s)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="data-parallel devices (default: all local devices)",
    )
    p.add_argument(
        "--batch-size",
        "--global-batch-size",
        dest="batch_size",
        type=int,
        default=default["batch_size"],
        help="global batch in sequences, a multiple of the device count (default %(default)s)",
    )
    p.add_argument(
        "--seq-len",
        "--seq-length",
        dest="seq_len",
        type=int,
        default=default["seq_len"],
        help="bytes per sequence (default %(default)s)",
    )
    _add_optimizer_flags(p, default)
    _add_eval_and_model_flags(p, default)
    _add_output_flags(p, default)
    p.set_defaults(command=_cmd_demo, command_name="demo")


def _add_optimizer_flags(p: argparse.ArgumentParser, default: dict) -> None:
    """lwjax's and the baseline's learning rates and the options they share."""
    p.add_argument(
        "--learning-rate",
        "--lr",
        dest="learning_rate",
        type=float,
        default=default["learning_rate"],
        help="lwjax peak learning rate (default %(default)s)",
    )
    p.add_argument(
        "--baseline",
        choices=BASELINES,
        default=default["baseline"],
        help="the comparison run (default %(default)s)",
    )
    p.add_argument(
        "--baseline-learning-rate",
        "--baseline-lr",
        dest="baseline_learning_rate",
        type=float,
        default=None,
        help="baseline peak learning rate (default: tuned per baseline)",
    )
    p.add_argument("--warmup-steps", type=int, default=default["warmup_steps"])
    p.add_argument("--weight-decay", type=float, default=default["weight_decay"])
    p.add_argument("--clip-grad", type=float, default=default["clip_grad"])


def _add_eval_and_model_flags(p: argparse.ArgumentParser, default: dict) -> None:
    """Evaluation, the seed and the model variant."""
    p.add_argument(
        "--eval-every",
        type=int,
        default=default["eval_every"],
        help="validation period in steps; 0: only at the start and the end (default %(default)s)",
    )
    p.add_argument(
        "--eval-windows",
        type=int,
        default=default["eval_windows"],
        help="validation sequences (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=default["seed"])
    p.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=default["scan_layers"],
        help="the scan-over-layers model variant",
    )
    p.add_argument(
        "--fused-qkv",
        action=argparse.BooleanOptionalAction,
        default=default["fused_qkv"],
        help="one fused QKV projection, routed with qkv_split (default on)",
    )
    p.add_argument(
        "--tied-embedding",
        action=argparse.BooleanOptionalAction,
        default=default["tied_embedding"],
        help="tie the output head to the embedding",
    )


def _add_output_flags(p: argparse.ArgumentParser, default: dict) -> None:
    """Where the outputs go, how much corpus to read and what to print."""
    p.add_argument(
        "--out",
        default=default["out"],
        metavar="DIR",
        help="directory for metrics.json and loss.png (default %(default)s)",
    )
    p.add_argument(
        "--max-corpus-bytes", type=int, default=None, help="read at most this many stdlib bytes"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bars and the summary table (default on)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the metrics as JSON instead of the table"
    )
