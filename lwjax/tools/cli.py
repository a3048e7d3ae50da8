"""The ``lwjax`` command line: one subcommand per job.

``lwjax layout`` shows how a model's parameters are laid out over data-parallel
ranks, ``lwjax bench`` times the optimizer step, ``lwjax convert`` converts
checkpoints, ``lwjax demo`` trains a small GPT with lwjax and a baseline, and
``lwjax launch`` runs N local processes of one jax.distributed job.

This module only assembles the parser and runs the chosen subcommand. Each
subcommand lives in :mod:`lwjax.tools.commands` as ``add_parser`` (its flags)
and ``_cmd_<name>(args) -> int``, which calls library functions and hands their
results to :mod:`lwjax.tools.render`. A user error prints one line, ``lwjax
<command>: <message>``, on stderr and exits with status 2. Nothing here imports
jax or rich; subcommands that need them import them themselves.

Examples::

    lwjax layout --preset llama8b --dp 8
    lwjax layout --preset moe --dp 8 --expert-dp 4 --bucket-size 40000000 --compare
    lwjax layout --spec params.json --policy lpt --dp 4 --json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lwjax.tools.commands import COMMANDS

EXIT_USAGE = 2


class _UsageError(Exception):
    """A user error; its message is printed as one line and the exit status is 2."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, raised instead of exiting."""

    def error(self, message: str):
        raise _UsageError(f"{self.prog}: {message}")


def _version() -> str:
    """The installed lwjax version (``lwjax.__version__``, read without importing jax)."""
    from lwjax import __version__

    return __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lwjax", description="Megatron-Core's layer-wise distributed Muon optimizer in JAX."
    )
    parser.add_argument("--version", action="version", version=f"lwjax {_version()}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lwjax`` command line; return the exit status.

    Args:
      argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
      0 on success, 2 on a user error (after printing one line on stderr).
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        return args.command(args)
    except ValueError as err:
        print(f"lwjax {args.command_name}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # stdout was closed early, e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
