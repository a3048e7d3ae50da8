"""A directory of step checkpoints: keep the last N, restore the latest complete one.

:class:`CheckpointManager` is orbax's :class:`orbax.checkpoint.CheckpointManager`
writing lwjax checkpoints. Each step directory (``<directory>/<step>``) holds
exactly what :func:`lwjax.save` writes (the args of
:func:`~lwjax.checkpoint.checkpoint_args`), so :func:`lwjax.restore` reads any of
them, at any dp size, and :meth:`CheckpointManager.restore` is that function on
the chosen step. orbax keeps the steps:

- A step is written under a temporary name and renamed (on object stores:
  marked) once complete; only complete steps are listed, so an interrupted save
  never becomes the latest and the previous latest stays restorable. The next
  manager opened on the directory removes what the interruption left.
- Steps beyond ``max_to_keep`` are deleted only after the new step has
  committed (for ``async_save``, when its background write has).
- Every process of a multi-process job calls :meth:`~CheckpointManager.save`;
  orbax synchronises them and each writes its hosts' shards.

Why orbax's manager rather than a loop over :func:`lwjax.save`: the step
directories are then orbax's own (its step names, retention, commit marks and
clean-up, synchronised across processes and with async writes), while the
checkpoint format and its checks stay in :mod:`lwjax.checkpoint` alone.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from lwjax import checkpoint
from lwjax.optimizer import LayerwiseOptimizer
from lwjax.state import LayerwiseState


def _check_count(name: str, value, minimum: int) -> None:
    if value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or None, but got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} or None; got {value!r}.")


class CheckpointManager:
    """Save lwjax checkpoints as numbered steps of one directory, orbax-style.

    Examples:
      >>> manager = CheckpointManager("/tmp/run/ckpt", max_to_keep=3)  # doctest: +SKIP
      >>> manager.save(100, params, state, opt)                         # doctest: +SKIP
      >>> params, state = manager.restore(other_opt)  # the latest complete step  # doctest: +SKIP

    Args:
      directory: Where the step directories live (created unless ``read_only``).
      max_to_keep: Keep the newest this many steps; ``None`` keeps all.
      async_save: :meth:`save` returns while the arrays are written in the
        background; :meth:`wait_until_finished` (or the next save) waits.
      step_prefix: Name steps ``<prefix>_<step>`` instead of ``<step>``.
      step_format_fixed_length: Zero-pad step numbers to this many digits.
      read_only: Never write or clean up (e.g. an evaluator reading a
        directory that a training job is writing).
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
        if "://" not in str(directory):  # a local path: absolute, as orbax keeps it
            directory = epath.Path(directory.resolve())
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{directory}: not a directory; CheckpointManager needs one.")
        self._name_format = ocp.path.step.standard_name_format(
            step_prefix=step_prefix, step_format_fixed_length=step_format_fixed_length
        )
        self._read_only = read_only
        self._manager = ocp.CheckpointManager(
            directory,
            item_names=(checkpoint.ARRAYS_ITEM, checkpoint.RECORD_ITEM),
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

    def all_steps(self) -> list[int]:
        """The steps whose checkpoint is complete, ascending (not one still being written)."""
        complete = {m.step for m in self._name_format.find_all(self.directory)}
        return sorted(complete & set(self._manager.all_steps()))

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> epath.Path:
        """The directory of a complete step: an ordinary lwjax checkpoint.

        Raises:
          ValueError: ``step`` is not a complete step of this directory.
        """
        if step not in self.all_steps():
            raise ValueError(
                f"{self.directory}: no complete checkpoint for step {step!r}; complete steps: "
                f"{self.all_steps()}."
            )
        return self._name_format.find_step(self.directory, step).path

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
        are deleted) when the background write commits.

        Raises:
          ValueError: ``step`` is not after the latest step (steps are never
            overwritten), or the manager is ``read_only``.
        """
        if step is None:
            raise TypeError("CheckpointManager.save: step must be an int, but got NoneType.")
        _check_count("CheckpointManager.save: step", step, 0)
        if self._read_only:
            raise ValueError(f"{self.directory}: this CheckpointManager is read_only.")
        self._manager.wait_until_finished()
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

        Args:
          optimizer: The target optimizer (any mesh, dp size and layout).
          step: Which step; ``None`` for :meth:`latest_step`.
          params_like: As for :func:`lwjax.restore`.

        Returns:
          ``(params, state)``.

        Raises:
          ValueError: no complete step, or any error of :func:`lwjax.restore`.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise ValueError(
                    f"{self.directory}: no complete checkpoint to restore (an interrupted "
                    "save does not count)."
                )
        return checkpoint.restore(self.step_path(step), optimizer, params_like)

    def wait_until_finished(self) -> None:
        """Block until a background save has committed and old steps are deleted."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for background work, then release orbax's resources."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
