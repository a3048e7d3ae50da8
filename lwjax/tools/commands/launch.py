"""``lwjax launch``: run a command as N local processes of one jax.distributed job.

Builds a :class:`~lwjax.launch.LaunchConfig` from the flags and returns the
exit status of :func:`~lwjax.launch.launch` (multi-host on one machine).
"""

from __future__ import annotations

import argparse
import sys

from lwjax.launch import (  # jax-free module
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_INIT_TIMEOUT,
    LaunchConfig,
    launch,
)


def _cmd_launch(args: argparse.Namespace) -> int:
    """Run the command as N local processes of one jax.distributed job; return its exit status."""
    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    config = LaunchConfig(
        command=tuple(command),
        nproc=args.nproc,
        devices_per_proc=args.devices_per_proc,
        timeout=args.timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        init_timeout=args.init_timeout,
        stop_on_failure=args.stop_on_failure,
        grace=args.grace,
        bind_gpus=args.bind_gpus,
        port=args.port,
        show_gloo=args.show_gloo,
    )
    try:
        return launch(config).returncode
    except FileNotFoundError as err:
        raise ValueError(f"{command[0]}: no such program ({err.strerror}).") from None
    except KeyboardInterrupt:
        print("lwjax launch: interrupted; stopped every process.", file=sys.stderr)
        return 130


def add_parser(subparsers) -> None:
    """Add ``launch`` and its flags to the ``lwjax`` subparsers."""
    p = subparsers.add_parser(
        "launch",
        help="run a script as N local processes of one jax.distributed job "
        "(multi-host on one machine)",
        description=(
            "Start N copies of a command on this machine as one jax.distributed job: a free "
            "coordinator port, LWJAX_* variables that lwjax.distributed.initialize() reads, K "
            "virtual CPU devices per process. Output is forwarded line by line as '[p<i>] ...'. "
            "When a process fails, the others are stopped and the exit status names the failure "
            "(the failed process's status, 128+signal, or 124 on --timeout)."
        ),
        epilog="example: lwjax launch --nproc 2 --devices-per-proc 4 -- "
        "python examples/nnx_gpt.py --steps 20",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default %(default)s)")
    p.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        metavar="K",
        help="virtual CPU devices per process; with --bind-gpus also GPUs per process",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="kill every process and fail after S seconds (default: no limit)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT,
        metavar="S",
        help="seconds before JAX declares a silent process dead (default %(default)s)",
    )
    p.add_argument(
        "--init-timeout",
        type=int,
        default=DEFAULT_INIT_TIMEOUT,
        metavar="S",
        help="seconds for all processes to connect (default %(default)s)",
    )
    p.add_argument(
        "--stop-on-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop the other processes when one fails (default on)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping processes (default %(default)s)",
    )
    p.add_argument(
        "--bind-gpus",
        action="store_true",
        help="give each process its own K GPUs through CUDA_VISIBLE_DEVICES",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument(
        "--show-gloo",
        action="store_true",
        help="also forward gloo's 'connected to N peer ranks' lines",
    )
    p.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        metavar="-- PROGRAM [ARGS ...]",
        help="the command each process runs, after --",
    )
    p.set_defaults(command=_cmd_launch, command_name="launch")
