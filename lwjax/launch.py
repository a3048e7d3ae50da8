"""Run one command as N local processes of a ``jax.distributed`` job (``lwjax launch``).

For trying multi-host code on one machine and for tests. The launcher picks a
free coordinator port and starts N copies of the command, child ``i`` with

* ``LWJAX_COORDINATOR_ADDRESS=127.0.0.1:<port>``, ``LWJAX_NUM_PROCESSES=N``,
  ``LWJAX_PROCESS_ID=i``, read by :func:`lwjax.distributed.initialize`;
* ``LWJAX_CPU_DEVICES=K`` (virtual CPU devices per process) and the init and
  heartbeat timeouts;
* with ``bind_gpus``, ``CUDA_VISIBLE_DEVICES`` set to its own block of K GPUs.

It forwards every child's output line by line as ``[p<i>] <line>`` (gloo's
per-connection chatter filtered out unless asked for), and watches them: the
first child that fails (non-zero exit or a signal, e.g. SIGABRT from JAX when
a peer stops sending heartbeats) ends the others (SIGTERM, then SIGKILL after
a grace period, each child by its own handle), and the launcher reports which
process failed and how. An overall timeout bounds the whole run.

Exit status, as a shell reports it: 0 when every process succeeded; the first
failed process's exit status, or ``128 + signal`` when a signal ended it;
``124`` on the overall timeout.

Imports no jax: the children start JAX, the launcher never does.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from lwjax import distributed as _dist

EXIT_TIMEOUT = 124  # as coreutils `timeout`
DEFAULT_HEARTBEAT_TIMEOUT = 10  # s: local processes; a dead peer ends the job within seconds
DEFAULT_INIT_TIMEOUT = 60  # s
POLL_INTERVAL = 0.05  # s: how often the launcher checks its timeout
_GLOO_NOISE = re.compile(
    r"\[Gloo\] Rank|is connected to \d+ peer ranks"
)  # gloo's threads interleave these


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Options of :func:`launch` (and of ``lwjax launch``).

    Attributes:
      command: The program and its arguments, run once per process (no shell).
      nproc: Number of processes.
      devices_per_proc: Virtual CPU devices per process (``LWJAX_CPU_DEVICES``);
        with ``bind_gpus``, also GPUs per process. ``None``: JAX's default.
      timeout: Seconds before every process is killed and the launch fails;
        ``None``: no limit.
      heartbeat_timeout: Seconds of silence after which JAX declares a process
        dead and aborts the rest (``LWJAX_HEARTBEAT_TIMEOUT``).
      init_timeout: Seconds for all processes to connect (``LWJAX_INIT_TIMEOUT``).
      stop_on_failure: End the other processes as soon as one fails. Off, the
        launcher waits for every process (JAX's heartbeat still ends them).
      grace: Seconds between SIGTERM and SIGKILL when ending processes.
      bind_gpus: Give process ``i`` the ``i``-th block of ``devices_per_proc``
        GPUs of ``CUDA_VISIBLE_DEVICES`` (or of ``0, 1, ...``).
      host: Coordinator host (this machine).
      port: Coordinator port; ``None``: a free one.
      env: Extra environment variables for every process.
      show_gloo: Forward gloo's "connected to N peer ranks" lines too.
    """

    command: tuple[str, ...]
    nproc: int = 2
    devices_per_proc: int | None = None
    timeout: float | None = None
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
    init_timeout: int = DEFAULT_INIT_TIMEOUT
    stop_on_failure: bool = True
    grace: float = 3.0
    bind_gpus: bool = False
    host: str = "127.0.0.1"
    port: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    show_gloo: bool = False

    def __post_init__(self):
        object.__setattr__(self, "command", tuple(self.command))
        if not self.command:
            raise ValueError(
                "LaunchConfig.command must name a program; got an empty command. "
                "Example: lwjax launch --nproc 2 -- python train.py"
            )
        for name in ("nproc", "heartbeat_timeout", "init_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"LaunchConfig.{name} must be a positive int; got {name}={value!r}."
                )
        if self.devices_per_proc is not None and (
            not isinstance(self.devices_per_proc, int) or self.devices_per_proc < 1
        ):
            raise ValueError(
                f"LaunchConfig.devices_per_proc must be a positive int or None; "
                f"got devices_per_proc={self.devices_per_proc!r}."
            )
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(
                f"LaunchConfig.timeout must be > 0 seconds or None; got timeout={self.timeout!r}."
            )
        if self.grace < 0:
            raise ValueError(f"LaunchConfig.grace must be >= 0 seconds; got grace={self.grace!r}.")
        if self.bind_gpus and self.devices_per_proc is None:
            raise ValueError(
                "LaunchConfig.bind_gpus needs devices_per_proc (GPUs per process); got None."
            )


@dataclasses.dataclass(frozen=True)
class ProcessExit:
    """How one process ended.

    Attributes:
      process_id: The process index.
      returncode: ``Popen.returncode``: the exit status, or ``-signal``.
      stopped_by_launcher: Ended by the launcher (after another failure or the timeout).
      end_s: Seconds from the launch until it ended.
    """

    process_id: int
    returncode: int
    stopped_by_launcher: bool = False
    end_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the process exited with status 0."""
        return self.returncode == 0

    def describe(self) -> str:
        """``exit status 1`` or ``killed by SIGABRT (signal 6)``, plus who stopped it."""
        how = describe_returncode(self.returncode)
        return f"{how}, stopped by the launcher" if self.stopped_by_launcher else how


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The outcome of :func:`launch`.

    Attributes:
      exits: How each process ended, by process index.
      failed: Index of the process that failed first; ``None`` if none did.
      timed_out: Whether the overall timeout ended the launch.
      wall_s: Seconds from the first start to the last exit.
      coordinator_address: The ``host:port`` the processes used.
    """

    exits: tuple[ProcessExit, ...]
    failed: int | None
    timed_out: bool
    wall_s: float
    coordinator_address: str

    @property
    def returncode(self) -> int:
        """The launcher's exit status: 0, the failed process's status (``128 + signal``), or 124."""
        if self.timed_out:
            return EXIT_TIMEOUT
        if self.failed is None:
            return 0
        code = self.exits[self.failed].returncode
        return 128 - code if code < 0 else code

    @property
    def message(self) -> str:
        """One line for the user: what succeeded, or which process failed and how."""
        n = len(self.exits)
        if self.timed_out:
            running = [e.process_id for e in self.exits if e.stopped_by_launcher]
            return (
                f"timed out after {self.wall_s:.1f} s; killed still-running process(es) {running}; "
                f"exit status {EXIT_TIMEOUT}."
            )
        if self.failed is None:
            return f"all {n} processes exited with status 0 in {self.wall_s:.1f} s."
        first = self.exits[self.failed]
        others = ", ".join(
            f"p{e.process_id}: {e.describe()}" for e in self.exits if e.process_id != self.failed
        )
        return (
            f"process {self.failed} of {n} failed first ({first.describe()})"
            + (f"; others: {others}" if others else "")
            + f"; exit status {self.returncode}."
        )


def describe_returncode(code: int) -> str:
    """``exit status N`` for ``N >= 0``, ``killed by SIGNAME (signal N)`` for ``-N``."""
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by {name} (signal {-code})"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _strip_device_count_flag(xla_flags: str) -> str:
    """``XLA_FLAGS`` without ``--xla_force_host_platform_device_count``
    (devices_per_proc decides).
    """
    return " ".join(
        f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")
    )


def _gpu_block(config: LaunchConfig, process_id: int, environ: Mapping[str, str]) -> str:
    """Process ``process_id``'s ``CUDA_VISIBLE_DEVICES``: its block of ``devices_per_proc``
    visible GPUs.
    """
    k = config.devices_per_proc
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [x for x in visible.split(",") if x]
        if visible
        else [str(i) for i in range(config.nproc * k)]
    )
    if len(ids) < config.nproc * k:
        raise ValueError(
            f"LaunchConfig.bind_gpus: {config.nproc} processes x {k} GPUs need "
            f"{config.nproc * k} GPUs; CUDA_VISIBLE_DEVICES lists {len(ids)}."
        )
    return ",".join(ids[process_id * k : (process_id + 1) * k])


def child_env(
    config: LaunchConfig, process_id: int, port: int, environ: Mapping[str, str] | None = None
) -> dict:
    """The environment of process ``process_id``: the launcher's, plus the ``LWJAX_*``
    job settings.
    """
    environ = dict(os.environ if environ is None else environ)
    env = {**environ, **config.env}
    env.update(
        {
            _dist.ENV_COORDINATOR: f"{config.host}:{port}",
            _dist.ENV_NUM_PROCESSES: str(config.nproc),
            _dist.ENV_PROCESS_ID: str(process_id),
            _dist.ENV_HEARTBEAT_TIMEOUT: str(config.heartbeat_timeout),
            _dist.ENV_INIT_TIMEOUT: str(config.init_timeout),
            "PYTHONUNBUFFERED": "1",  # lines arrive as they are printed
        }
    )
    env.pop(_dist.ENV_CLUSTER_DETECTION, None)  # the launcher, not the cluster, says who is who
    if config.devices_per_proc is not None:
        env[_dist.ENV_CPU_DEVICES] = str(config.devices_per_proc)
        if "XLA_FLAGS" in env:
            env["XLA_FLAGS"] = _strip_device_count_flag(env["XLA_FLAGS"])
    if config.bind_gpus:
        env["CUDA_VISIBLE_DEVICES"] = _gpu_block(config, process_id, environ)
    return env


def _forward(stream, process_id: int, out: TextIO, lock: threading.Lock, show_gloo: bool) -> None:
    """Copy a child's output to ``out`` line by line, prefixed ``[p<i>] ``."""
    prefix = f"[p{process_id}] "
    for line in iter(stream.readline, ""):
        if not show_gloo and _GLOO_NOISE.search(line):
            continue
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


class _Child:
    """One started process: its handle, and when a waiter thread saw it end."""

    def __init__(self, proc: subprocess.Popen, events: queue.Queue, index: int):
        self.proc = proc
        self.done = threading.Event()
        self.end = None  # time.monotonic() at exit
        self._waiter = threading.Thread(target=self._wait, args=(events, index), daemon=True)
        self._waiter.start()

    def _wait(self, events: queue.Queue, index: int) -> None:
        self.proc.wait()
        self.end = time.monotonic()
        self.done.set()
        events.put(index)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (the child and anything it started),
        by its pid.
        """
        if self.done.is_set():
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def _stop(children: Sequence[_Child], grace: float) -> set[int]:
    """SIGTERM every running child, SIGKILL what is left after ``grace``;
    return whom it signalled.
    """
    running = {i for i, c in enumerate(children) if not c.done.is_set()}
    for i in running:
        children[i].signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for i in running:
        children[i].done.wait(max(0.0, deadline - time.monotonic()))
    for i in running:
        children[i].signal(signal.SIGKILL)
    for i in running:
        children[i].done.wait()
    return running


class _Interrupted(Exception):
    """SIGTERM reached the launcher."""


def launch(
    config: LaunchConfig, *, out: TextIO | None = None, report: TextIO | None = None
) -> LaunchResult:
    """Run ``config.command`` as ``config.nproc`` processes of one job; wait for them.

    Args:
      config: What to run and how (:class:`LaunchConfig`).
      out: Where the prefixed child output goes; ``None``: ``sys.stdout``.
      report: Where the launcher's own one-line report goes; ``None``: ``sys.stderr``.

    Returns:
      A :class:`LaunchResult`; its ``returncode`` is the launcher's exit status.

    Raises:
      FileNotFoundError: The command's program does not exist.
      KeyboardInterrupt: After stopping every child, when interrupted (or sent SIGTERM).
    """
    out = sys.stdout if out is None else out
    report = sys.stderr if report is None else report
    port = config.port or free_port(config.host)
    address = f"{config.host}:{port}"
    lock = threading.Lock()
    events: queue.Queue = queue.Queue()  # indices of children as they end, in order
    children: list[_Child] = []
    forwarders: list[threading.Thread] = []
    stopped: set[int] = set()
    failed, timed_out = None, False
    previous_handler = None
    if threading.current_thread() is threading.main_thread():

        def on_sigterm(signum, frame):
            raise _Interrupted()

        previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    start = time.monotonic()
    try:
        for i in range(config.nproc):
            proc = subprocess.Popen(
                list(config.command),
                env=child_env(config, i, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
                bufsize=1,
                # its own process group: stopped as a whole, spared the terminal's ^C
                start_new_session=True,
            )
            children.append(_Child(proc, events, i))
            thread = threading.Thread(
                target=_forward, args=(proc.stdout, i, out, lock, config.show_gloo), daemon=True
            )
            thread.start()
            forwarders.append(thread)
        deadline = None if config.timeout is None else start + config.timeout
        ended = 0
        while ended < config.nproc:
            try:
                i = events.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    stopped = _stop(children, config.grace)
                    break
                continue
            ended += 1
            if failed is None and children[i].proc.returncode != 0:
                failed = i  # the queue is in order of exit, so this one failed first
                if config.stop_on_failure:
                    stopped = _stop(children, config.grace)
                    break
    except (KeyboardInterrupt, _Interrupted):
        _stop(children, config.grace)
        raise KeyboardInterrupt from None
    finally:
        if any(
            not c.done.is_set() for c in children
        ):  # an unexpected error above: leave no child behind
            _stop(children, 0.0)
        for thread in forwarders:
            thread.join(timeout=5.0)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    wall = max(c.end for c in children) - start
    by_launcher = (-signal.SIGTERM, -signal.SIGKILL)
    exits = tuple(
        ProcessExit(
            i, c.proc.returncode, i in stopped and c.proc.returncode in by_launcher, c.end - start
        )
        for i, c in enumerate(children)
    )
    result = LaunchResult(exits, failed, timed_out, wall, address)
    if result.returncode:
        print(f"lwjax launch: {result.message}", file=report, flush=True)
    return result
