"""Several processes, one data-parallel mesh: a thin layer over ``jax.distributed``.

JAX is multi-controller: every process runs the same program on its own
devices, and a computation over a mesh that spans processes is one SPMD
program. lwjax needs nothing beyond that. The step of
:func:`lwjax.make_train_step` runs unchanged once its inputs are *global*
``jax.Array``\\ s on a mesh over every process's devices:

* parameters replicated (``P()``): :func:`replicate` (or ``jax.device_put``
  of host values that are equal on every process);
* the batch split over ``dp``: :func:`global_batch` from the rows this
  process loaded, or :func:`shard_batch` when every process holds the whole
  global batch (same seed, same order);
* the optimizer state, made by ``optimizer.init`` from global parameters.

Process ``p`` owns a contiguous block of the mesh (devices are ordered by
process, then id), so it feeds rows ``p·B/P … (p+1)·B/P`` of a global batch of
``B`` rows over ``P`` processes (:func:`process_rows`).

The global arrays (:func:`global_mesh`, :func:`global_batch`, :func:`place`, …) live in
:mod:`lwjax.global_arrays` and are re-exported here; this module sets the processes up.

Who starts the processes is not this module's business. :func:`initialize`
reads its settings from arguments, else from the ``LWJAX_*`` environment
variables that ``lwjax launch`` (:mod:`lwjax.launch`) sets, else, when asked
(``cluster_detection="auto"`` or ``LWJAX_CLUSTER_DETECTION=auto``), from the
cluster through JAX's own detection (SLURM, Open MPI, Kubernetes, Cloud TPU
VMs; mpi4py when named). Without any of these it does nothing: a script that calls it runs as one
ordinary process. Timeouts are short by default, so a dead peer ends every
process within seconds (JAX aborts the survivors, exit status ``-6``) instead
of hanging.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

from lwjax.global_arrays import barrier as barrier
from lwjax.global_arrays import gather_to_host as gather_to_host
from lwjax.global_arrays import global_batch as global_batch
from lwjax.global_arrays import global_mesh as global_mesh
from lwjax.global_arrays import place as place
from lwjax.global_arrays import process_rows as process_rows
from lwjax.global_arrays import replicate as replicate
from lwjax.global_arrays import shard_batch as shard_batch

ENV_COORDINATOR = "LWJAX_COORDINATOR_ADDRESS"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "LWJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "LWJAX_PROCESS_ID"
ENV_CPU_DEVICES = "LWJAX_CPU_DEVICES"  # virtual CPU devices per process
ENV_CLUSTER_DETECTION = "LWJAX_CLUSTER_DETECTION"  # "auto" or a JAX cluster name ("slurm", ...)
ENV_INIT_TIMEOUT = "LWJAX_INIT_TIMEOUT"  # seconds
ENV_HEARTBEAT_TIMEOUT = "LWJAX_HEARTBEAT_TIMEOUT"  # seconds
ENV_SHUTDOWN_TIMEOUT = "LWJAX_SHUTDOWN_TIMEOUT"  # seconds

DEFAULT_INIT_TIMEOUT = 120  # s: all processes must have connected by then (JAX: 300)
DEFAULT_HEARTBEAT_TIMEOUT = 30  # s: a silent process is declared dead after this (JAX: 100)
DEFAULT_SHUTDOWN_TIMEOUT = 60  # s: the exit barrier waits this long for the others (JAX: 300)
CLUSTERS = (
    "auto",
    "slurm",
    "ompi",
    "mpi4py",
    "gcetpu",
    "gketpu",
)  # JAX's names; Kubernetes: "auto" only


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Settings of :func:`initialize`; ``None`` fields are looked up in the environment.

    Attributes:
      coordinator_address: ``host:port`` of process 0, reachable from every process.
      num_processes: Processes in the job.
      process_id: This process's index, ``0 <= process_id < num_processes``.
      cpu_devices: Virtual CPU devices per process (``jax_num_cpu_devices``);
        ``None`` keeps JAX's default. Has no effect on GPU or TPU devices.
      local_device_ids: Accelerators this process uses; ``None``: JAX decides
        (all visible ones, or one per process under cluster detection).
      cluster_detection: ``"auto"`` or a JAX cluster name to take unset
        fields from the cluster; ``None``/``"off"``: no detection.
      initialization_timeout: Seconds to wait for every process to connect.
      heartbeat_timeout: Seconds of silence after which a process counts as
        dead; JAX then aborts every other process.
      shutdown_timeout: Seconds the exit barrier waits for the other processes.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cpu_devices: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cluster_detection: str | None = None
    initialization_timeout: int = DEFAULT_INIT_TIMEOUT
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT

    def __post_init__(self):
        for name in (
            "num_processes",
            "cpu_devices",
            "initialization_timeout",
            "heartbeat_timeout",
            "shutdown_timeout",
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(
                    f"DistributedConfig.{name} must be a positive int or None; "
                    f"got {name}={value!r}."
                )
        if self.process_id is not None and (
            not isinstance(self.process_id, int) or self.process_id < 0
        ):
            raise ValueError(
                "DistributedConfig.process_id must be an int >= 0; "
                f"got process_id={self.process_id!r}."
            )
        if (
            self.num_processes is not None
            and self.process_id is not None
            and self.process_id >= self.num_processes
        ):
            raise ValueError(
                f"DistributedConfig.process_id must be < num_processes; got {self.process_id=}, "
                f"{self.num_processes=}."
            )
        if self.cluster_detection not in (None, "off", *CLUSTERS):
            raise ValueError(
                f"DistributedConfig.cluster_detection must be one of None, 'off', "
                f"{', '.join(map(repr, CLUSTERS))}; got {self.cluster_detection!r}."
            )
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise ValueError(
                f"DistributedConfig.coordinator_address must be 'host:port'; "
                f"got {self.coordinator_address!r}."
            )

    @property
    def is_explicit(self) -> bool:
        """Whether any of coordinator, process count or process id was given."""
        return any(
            x is not None for x in (self.coordinator_address, self.num_processes, self.process_id)
        )

    @property
    def is_distributed(self) -> bool:
        """Whether :func:`initialize` starts ``jax.distributed`` with these settings."""
        return self.is_explicit or self.cluster_detection not in (None, "off")


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"environment variable {name} must be an integer; got {name}={text!r}."
        ) from None


def config_from_env(environ: Mapping[str, str] | None = None, **overrides) -> DistributedConfig:
    """A :class:`DistributedConfig` from ``LWJAX_*`` variables; non-``None`` ``overrides`` win.

    Args:
      environ: The environment to read; ``None``: ``os.environ``.
      **overrides: :class:`DistributedConfig` fields; ``None`` values are ignored.

    Returns:
      The merged config (timeouts default to ``DEFAULT_*_TIMEOUT``).

    Raises:
      ValueError: A variable is not an integer where one is expected, or a field is invalid.
    """
    environ = os.environ if environ is None else environ
    fields = {
        "coordinator_address": environ.get(ENV_COORDINATOR) or None,
        "num_processes": _env_int(environ, ENV_NUM_PROCESSES),
        "process_id": _env_int(environ, ENV_PROCESS_ID),
        "cpu_devices": _env_int(environ, ENV_CPU_DEVICES),
        "cluster_detection": environ.get(ENV_CLUSTER_DETECTION) or None,
        "initialization_timeout": _env_int(environ, ENV_INIT_TIMEOUT),
        "heartbeat_timeout": _env_int(environ, ENV_HEARTBEAT_TIMEOUT),
        "shutdown_timeout": _env_int(environ, ENV_SHUTDOWN_TIMEOUT),
    }
    known = {f.name for f in dataclasses.fields(DistributedConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(
            f"config_from_env: unknown field(s) {unknown}; expected some of {sorted(known)}."
        )
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if fields.get("local_device_ids") is not None:
        fields["local_device_ids"] = tuple(fields["local_device_ids"])
    return DistributedConfig(**{k: v for k, v in fields.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the job (what :func:`initialize` returns).

    Attributes:
      process_id: ``jax.process_index()``.
      num_processes: ``jax.process_count()``.
      is_distributed: Whether ``jax.distributed`` is running.
    """

    process_id: int
    num_processes: int
    is_distributed: bool

    @property
    def is_main(self) -> bool:
        """Whether this is process 0 (the one that writes logs and reports)."""
        return self.process_id == 0


def _backends_started() -> bool:
    from jax._src import xla_bridge  # no public equivalent; present in jax 0.4 to 0.11

    return xla_bridge.backends_are_initialized()


def _set_cpu_devices(count: int) -> None:
    import jax

    if not _backends_started():
        jax.config.update("jax_num_cpu_devices", count)
        return
    have = len(jax.local_devices(backend="cpu"))
    if have != count:
        raise RuntimeError(
            f"initialize: asked for cpu_devices={count}, but JAX already started with {have} CPU "
            "devices. Call lwjax.distributed.initialize() before any other JAX call."
        )


def process_info() -> ProcessInfo:
    """This process's :class:`ProcessInfo` (starts JAX's backends)."""
    import jax

    return ProcessInfo(jax.process_index(), jax.process_count(), is_initialized())


def is_initialized() -> bool:
    """Whether ``jax.distributed`` is running in this process."""
    import jax

    return jax.distributed.is_initialized()


def initialize(config: DistributedConfig | None = None, **fields: Any) -> ProcessInfo:
    """Join the job's processes with ``jax.distributed``, or do nothing in a single process.

    Settings come from ``config``, else from ``fields`` (the
    :class:`DistributedConfig` field names) over the ``LWJAX_*`` environment
    (which ``lwjax launch`` sets). ``jax.distributed`` starts when a
    coordinator, process count or id is known, or when cluster detection is
    asked for; otherwise the call only applies ``cpu_devices`` and returns.
    Call it first, before any other JAX call: the CPU device count and the
    cross-process CPU collectives (gloo) must be set before JAX starts.
    Calling it again returns the running job's info.

    A distributed start also starts JAX's backends (so the device count is
    fixed from here on) and registers :func:`shutdown` to run at exit.

    Args:
      config: Complete settings; the environment is not read when given.
      **fields: :class:`DistributedConfig` fields over the environment.

    Returns:
      This process's :class:`ProcessInfo`.

    Raises:
      ValueError: Settings are invalid or incomplete (e.g. a coordinator but no process id).
      RuntimeError: JAX started before this call in a way that conflicts with the settings.

    Examples:
      >>> from lwjax import distributed                      # doctest: +SKIP
      >>> info = distributed.initialize()  # no-op unless launched  # doctest: +SKIP
      >>> mesh = distributed.global_mesh()  # dp over every process's devices  # doctest: +SKIP
    """
    import jax

    if config is not None and fields:
        raise TypeError(
            f"initialize: pass config or fields, not both; got config and {sorted(fields)}."
        )
    config = config if config is not None else config_from_env(**fields)
    if is_initialized():
        return process_info()
    if config.cpu_devices is not None:
        _set_cpu_devices(config.cpu_devices)
    if not config.is_distributed:
        return ProcessInfo(
            0, 1, False
        )  # JAX stays unstarted: the caller may still size its devices
    if config.is_explicit and config.cluster_detection in (None, "off"):
        missing = [
            name
            for name in ("coordinator_address", "num_processes", "process_id")
            if getattr(config, name) is None
        ]
        if missing:
            raise ValueError(
                f"initialize: without cluster detection, coordinator_address, num_processes and "
                f"process_id are all needed; missing {missing}. Set them (or {ENV_COORDINATOR}, "
                f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or pass cluster_detection='auto'."
            )
    if _backends_started():
        raise RuntimeError(
            "initialize: JAX already ran a computation or listed devices in this process; "
            "call lwjax.distributed.initialize() first, right after the imports."
        )
    # gloo is the default since jax 0.10; an older default (None) cannot run cross-process CPU
    # programs
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):
        pass
    detection = config.cluster_detection
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=list(config.local_device_ids)
        if config.local_device_ids is not None
        else None,
        cluster_detection_method=None if detection in (None, "off", "auto") else detection,
        initialization_timeout=config.initialization_timeout,
        heartbeat_timeout_seconds=config.heartbeat_timeout,
        shutdown_timeout_seconds=config.shutdown_timeout,
    )
    info = process_info()  # starts the backends: the device count is final from here on
    _install_failure_hook(info, config)
    atexit.register(shutdown)  # after the backends' own exit hooks, so it runs before them
    return info


def _install_failure_hook(info: ProcessInfo, config: DistributedConfig) -> None:
    """On an uncaught exception: print it, say which process failed, and exit at once with status 1.

    A normal exit would first wait in JAX's exit barrier for peers that are
    blocked on this very process (until the heartbeat timeout aborts everyone
    with SIGABRT). Exiting at once closes this process's connections, so the
    peers' pending collectives fail within moments instead.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        print(
            f"lwjax.distributed: process {info.process_id} of {info.num_processes} failed "
            f"({exc_type.__name__}); exiting with status 1 without the exit barrier. "
            "The other processes fail at their next collective or within the heartbeat timeout "
            f"({config.heartbeat_timeout} s).",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


def shutdown() -> None:
    """Leave the job: a barrier with the other processes (bounded by the shutdown timeout).

    Does nothing when ``jax.distributed`` is not running.
    """
    if is_initialized():
        import jax

        jax.distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python -m lwjax.distributed SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``): initialize,
    then run it.

    Runs an unmodified single-process script as one process of the job, e.g.
    ``lwjax launch --nproc 2 -- python -m lwjax.distributed train.py``. The
    script must be multi-process safe (same data order everywhere, writes
    only from process 0).
    """
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(
            "usage: python -m lwjax.distributed SCRIPT [ARGS ...] | -m MODULE [ARGS ...]",
            file=sys.stderr,
        )
        return 2
    initialize()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` does
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
