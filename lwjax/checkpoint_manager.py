"""A directory of step checkpoints: keep the last N, restore the latest complete one.

:class:`CheckpointManager` is orbax's :class:`orbax.checkpoint.CheckpointManager`
writing lwjax checkpoints. Each step directory (``<directory>/<step>``) holds
exactly what :func:`lwjax.save` writes (the args of
:func:`~lwjax.checkpoint.checkpoint_args`), so :func:`lwjax.restore` reads any of
them, at any dp size, and :meth:`CheckpointManager.restore` is that function on
the chosen step. orbax keeps the steps:

- A step is written under a temporary name and renamed (on object stores:
  marked) once complete; an interrupted save never becomes the latest and the
  previous latest stays restorable. The next manager opened on the directory
  removes what the interruption left.
- Steps beyond ``max_to_keep`` are deleted only after the new step has
  committed (for ``async_save``, when its background write has).
- Every process of a multi-process job calls :meth:`~CheckpointManager.save`;
  orbax synchronises them and each writes its hosts' shards.

A step counts only when its directory is complete and its own
(:func:`incomplete_reason`): a real directory (not a symbolic link), with
orbax's commit record, both items, and a record whose step is the directory's.
Anything else named like a step (a stray empty directory, a damaged step, a
copy of another step) is never listed, restored or counted by retention;
:meth:`~CheckpointManager.restore` skips it with a warning, and the next save
moves it aside to ``<name>.lwjax-incomplete`` (never deleted), so retention
never deletes a complete step while keeping an incomplete one.

One writer per directory: a manager that may write holds an exclusive lock on
``<directory>/.lwjax-writer.lock`` (``flock``; on process 0 of a job) until
:meth:`~CheckpointManager.close`, and a second one raises ``ValueError``
naming the holder. ``read_only`` managers take no lock.

Why orbax's manager rather than a loop over :func:`lwjax.save`: the step
directories are then orbax's own (its step names, retention, commit marks and
clean-up, synchronised across processes and with async writes), while the
checkpoint format and its checks stay in :mod:`lwjax.checkpoint` alone.
"""

from __future__ import annotations

import fcntl
import json
import numbers
import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from lwjax import checkpoint, checkpoint_files
from lwjax.checkpoint_record import FORMAT
from lwjax.optimizer import LayerwiseOptimizer
from lwjax.state import LayerwiseState

LOCK_FILE = ".lwjax-writer.lock"  # held (flock) by the one manager that may write
ASIDE_SUFFIX = ".lwjax-incomplete"  # an incomplete step directory, moved aside by a save
_RECORD_FILE = "metadata"  # the file orbax's JsonSave writes in the record item


def _check_count(name: str, value, minimum: int) -> None:
    if value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or None, but got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} or None; got {value!r}.")


def _is_local(path: epath.Path) -> bool:
    return "://" not in str(path)


def incomplete_reason(path: epath.Path, step: int) -> str | None:
    """Why ``path`` is not a complete checkpoint of ``step``, or ``None`` if it is one.

    Complete: a directory (a symbolic link is refused: the manager writes none,
    and retention would delete what it points to), committed by orbax, holding
    both items, whose record is an lwjax record of this very step (a copy of
    another step's directory is not this step). The record's format version is
    not checked here: a step of a newer lwjax is complete, and
    :func:`lwjax.restore` says that it cannot read it.
    """
    if _is_local(path) and os.path.islink(path):
        return f"a symbolic link to {os.readlink(path)!r} (the manager writes none)"
    if not path.is_dir():
        return "not a directory"
    if not checkpoint_files.is_committed(path):
        return "no committed orbax metadata (_CHECKPOINT_METADATA)"
    missing = [f"{item}/" for item in (checkpoint_files.RECORD_ITEM, checkpoint_files.ARRAYS_ITEM)]
    missing = [item for item in missing if not (path / item).is_dir()]
    if missing:
        return f"no {' or '.join(missing)}"
    try:
        record = json.loads((path / checkpoint_files.RECORD_ITEM / _RECORD_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"an unreadable record ({type(err).__name__})"
    if not isinstance(record, Mapping) or record.get("format") != FORMAT:
        return "not an lwjax checkpoint record"
    recorded = record.get("step")
    if type(recorded) is not int or recorded != step:
        return f"its record is of step {recorded!r} (a copy of another step?)"
    return None


def _lock_writer(directory: epath.Path):
    """Take the directory's writer lock: the open lock file (the lock lasts while it is open).

    ``None`` where no lock is taken: on other processes than the first, on
    object stores (no ``flock``), or where the file system refuses locks.

    Raises:
      ValueError: another manager holds the lock.
    """
    if not _is_local(directory) or jax.process_index() != 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / LOCK_FILE, "a+")  # kept open: the lock lasts while it is
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read(300).strip() or "unknown"
        lock.close()
        raise ValueError(
            f"{directory}: another CheckpointManager writes to this directory ({holder}); "
            "one writer per directory. Close it first, or open this one with read_only=True."
        ) from None
    except OSError:  # a file system without locks
        lock.close()
        return None
    lock.truncate(0)
    lock.write(f"held by pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


class CheckpointManager:
    """Save lwjax checkpoints as numbered steps of one directory, orbax-style.

    Examples:
      >>> manager = CheckpointManager("/tmp/run/ckpt", max_to_keep=3)  # doctest: +SKIP
      >>> manager.save(100, params, state, opt)                         # doctest: +SKIP
      >>> params, state = manager.restore(other_opt)  # the latest complete step  # doctest: +SKIP

    Args:
      directory: Where the step directories live (created unless ``read_only``).
      max_to_keep: Keep the newest this many complete steps; ``None`` keeps all.
      async_save: :meth:`save` returns while the arrays are written in the
        background; :meth:`wait_until_finished` (or the next save) waits.
      step_prefix: Name steps ``<prefix>_<step>`` instead of ``<step>``.
      step_format_fixed_length: Zero-pad step numbers to this many digits.
      read_only: Never write or clean up (e.g. an evaluator reading a
        directory that a training job is writing); takes no writer lock.

    Raises:
      ValueError: another manager that may write holds the directory (see the
        module docstring), or a bad argument.
    """

    def __init__(
        self,
        directory,
        *,
        max_to_keep: int | None = None,
        async_save: bool = False,
        step_prefix: str | None = None,
        step_format_fixed_length: int | None = None,
        read_only: bool = False,
    ):
        _check_count("CheckpointManager.max_to_keep", max_to_keep, 1)
        _check_count("CheckpointManager.step_format_fixed_length", step_format_fixed_length, 1)
        if step_prefix is not None and (not isinstance(step_prefix, str) or "/" in step_prefix):
            raise ValueError(
                f"CheckpointManager.step_prefix must be a name without '/' or None; "
                f"got {step_prefix!r}."
            )
        directory = epath.Path(directory)
        if _is_local(directory):  # a local path: absolute, as orbax keeps it
            directory = epath.Path(directory.resolve())
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{directory}: not a directory; CheckpointManager needs one.")
        self._name_format = ocp.path.step.standard_name_format(
            step_prefix=step_prefix, step_format_fixed_length=step_format_fixed_length
        )
        self._read_only = read_only
        # Before orbax opens the directory: opening a writer removes unfinished saves.
        self._lock = None if read_only else _lock_writer(directory)
        self._manager = ocp.CheckpointManager(
            directory,
            item_names=(checkpoint_files.ARRAYS_ITEM, checkpoint_files.RECORD_ITEM),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                step_name_format=self._name_format,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=not read_only,
                create=not read_only,
            ),
        )

    @property
    def directory(self) -> epath.Path:
        """The directory of the step checkpoints."""
        return self._manager.directory

    def _survey(self) -> tuple[list[int], dict[int, str], dict[int, epath.Path]]:
        """Complete steps (ascending), incomplete ones with the reason, and every step's path.

        A complete step must also be one orbax keeps (not one it is about to delete).
        """
        paths = {m.step: m.path for m in self._name_format.find_all(self.directory)}
        kept = set(self._manager.all_steps())
        reasons = {step: incomplete_reason(path, step) for step, path in paths.items()}
        complete = sorted(s for s, why in reasons.items() if why is None and s in kept)
        incomplete = {s: why for s, why in sorted(reasons.items()) if why is not None}
        return complete, incomplete, paths

    def all_steps(self) -> list[int]:
        """The complete steps, ascending: not one still being written, nor an incomplete or
        inconsistent step directory (:func:`incomplete_reason`)."""
        return self._survey()[0]

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> epath.Path:
        """The directory of a complete step: an ordinary lwjax checkpoint.

        Raises:
          ValueError: ``step`` is not a complete step of this directory.
        """
        complete, incomplete, paths = self._survey()
        if step in incomplete:
            raise ValueError(
                f"{self.directory}: step {step} is not a complete checkpoint: "
                f"{incomplete[step]}; complete steps: {complete}."
            )
        if step not in complete:
            raise ValueError(
                f"{self.directory}: no complete checkpoint for step {step!r}; complete steps: "
                f"{complete}."
            )
        return paths[step]

    def _set_aside_incomplete(self) -> None:
        """Move every incomplete step directory to ``<name>.lwjax-incomplete`` (warning), so
        that neither orbax's retention nor a new step of that number meets it. The first
        process decides and renames; every process then reloads orbax's list of steps."""
        if jax.process_index() == 0:
            incomplete, paths = self._survey()[1:]
            for step, why in incomplete.items():
                path = paths[step]
                aside = path.parent / (path.name + ASIDE_SUFFIX)
                n = 1
                while os.path.lexists(aside) if _is_local(aside) else aside.exists():
                    n += 1
                    aside = path.parent / f"{path.name}{ASIDE_SUFFIX}-{n}"
                path.rename(aside)  # a symbolic link is renamed, never followed
                warnings.warn(
                    f"{path}: step {step} is not a complete checkpoint ({why}); moved it to "
                    f"{aside.name}, where no retention or restore counts it.",
                    stacklevel=3,
                )
        checkpoint_files.sync("lwjax_manager_set_aside")
        self._manager.reload()

    def save(
        self,
        step: int,
        params,
        state: LayerwiseState,
        optimizer: LayerwiseOptimizer,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Save ``(params, state)`` as ``step``, then drop steps beyond ``max_to_keep``.

        Called by every process. With ``async_save`` it returns once the arrays
        are copied off the devices; the step becomes complete (and old steps
        are deleted) when the background write commits. Incomplete step
        directories are first moved aside (see the module docstring).

        Raises:
          ValueError: ``step`` is not after the latest complete step (steps are
            never overwritten), or the manager is ``read_only``.
        """
        if step is None:
            raise TypeError("CheckpointManager.save: step must be an int, but got NoneType.")
        _check_count("CheckpointManager.save: step", step, 0)
        if self._read_only:
            raise ValueError(f"{self.directory}: this CheckpointManager is read_only.")
        self._manager.wait_until_finished()
        self._set_aside_incomplete()
        latest = max(self._manager.all_steps(), default=None)
        if latest is not None and step <= latest:
            raise ValueError(
                f"{self.directory}: step {step} is not after the latest step {latest}; steps "
                "are never overwritten. Save a later step, or use another directory."
            )
        args = checkpoint.checkpoint_args(params, state, optimizer, step=step, metadata=metadata)
        self._manager.save(step, args=args, force=True)

    def restore(
        self, optimizer: LayerwiseOptimizer, *, step: int | None = None, params_like=None
    ) -> tuple[Any, LayerwiseState]:
        """:func:`lwjax.restore` of ``step``, by default the latest complete one.

        Without ``step``, newer step directories that are not complete
        checkpoints are skipped, with a warning naming each and why.

        Args:
          optimizer: The target optimizer (any mesh, dp size and layout).
          step: Which step; ``None`` for :meth:`latest_step`.
          params_like: As for :func:`lwjax.restore`.

        Returns:
          ``(params, state)``.

        Raises:
          ValueError: no complete step, ``step`` is not one, or any error of
            :func:`lwjax.restore`.
        """
        if step is None:
            complete, incomplete, _ = self._survey()
            if not complete:
                skipped = f"; not complete: {incomplete}" if incomplete else ""
                raise ValueError(
                    f"{self.directory}: no complete checkpoint to restore (an interrupted "
                    f"save does not count){skipped}."
                )
            step = complete[-1]
            newer = {s: why for s, why in incomplete.items() if s > step}
            if newer:
                skipped = "; ".join(f"step {s}: {why}" for s, why in newer.items())
                warnings.warn(
                    f"{self.directory}: restoring step {step}, the newest complete checkpoint; "
                    f"skipped newer step directories that are not complete ({skipped}).",
                    stacklevel=2,
                )
        return checkpoint.restore(self.step_path(step), optimizer, params_like)

    def wait_until_finished(self) -> None:
        """Block until a background save has committed and old steps are deleted."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for background work, release orbax's resources and the writer lock."""
        self._manager.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
