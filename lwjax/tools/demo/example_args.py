"""The command-line options the example training scripts share."""

from __future__ import annotations

import argparse


def example_parser(description: str, *, scan_help: str) -> argparse.ArgumentParser:
    """An argument parser with the examples' options: model shape, steps, batch and devices.

    Args:
      description: The script's one-line description.
      scan_help: Help text of ``--scan`` (how the script stacks its blocks).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--size", default="small", help="tiny, small or base (lwjax.tools.demo.model.MODEL_SIZES)"
    )
    p.add_argument("--scan", action="store_true", help=scan_help)
    p.add_argument(
        "--separate-qkv", action="store_true", help="three Q/K/V projections instead of one fused"
    )
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--devices", type=int, default=None, help="data-parallel devices (default: all)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    return p
