"""A checkpoint directory on disk: what makes it complete, and saves that never leave half of one.

A checkpoint is one orbax composite directory, ``<path>/arrays/`` and
``<path>/lwjax/`` (:data:`ARRAYS_ITEM`, :data:`RECORD_ITEM`), complete once
orbax has committed its ``_CHECKPOINT_METADATA`` (:func:`is_committed`). orbax
writes ``<path>.orbax-checkpoint-tmp`` and renames it when complete. An
overwrite writes ``<path>.lwjax-new`` beside the old checkpoint and swaps it in
through ``<path>.lwjax-old`` (:func:`swap_in`), so at every moment one of the
three names holds a complete checkpoint, which :func:`resolved` finds. Every
change to the directory happens on the first process, between barriers over
the job's processes (:func:`sync`).
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from collections.abc import Mapping

import jax
from etils import epath

ARRAYS_ITEM = "arrays"
RECORD_ITEM = "lwjax"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
NEW_SUFFIX = ".lwjax-new"  # an overwrite's new checkpoint, until it is swapped in
OLD_SUFFIX = ".lwjax-old"  # the overwritten checkpoint, while the new one is swapped in


def ocp():
    """``orbax.checkpoint``, imported on first use."""
    import orbax.checkpoint as ocp

    return ocp


def as_path(path) -> epath.Path:
    """An absolute local path, or a remote one (``gs://...``) as orbax takes it."""
    path = epath.Path(path)
    return path if "://" in str(path) else epath.Path(path.resolve())


def check_new_path(path: epath.Path, overwrite: bool) -> None:
    """Refuse temporary names and (without ``overwrite``) existing checkpoints.

    An interrupted overwrite is finished first: a committed checkpoint it
    left beside ``path`` is moved to ``path``, and its other leftovers removed.
    """
    for suffix in (TMP_SUFFIX, NEW_SUFFIX, OLD_SUFFIX):
        if suffix in path.name:
            raise ValueError(
                f"{path}: a checkpoint path may not contain {suffix!r}; lwjax and orbax use it "
                "for unfinished saves."
            )
    found = resolved(path)
    if found != path and jax.process_index() == 0:
        found.rename(path)
    sync("lwjax_checkpoint_recover")
    for suffix in (NEW_SUFFIX, OLD_SUFFIX):
        remove(sibling(path, suffix))
    if path.exists() and not overwrite:
        raise ValueError(
            f"{path}: already exists; pass overwrite=True (--overwrite) to replace it."
        )


def sibling(path: epath.Path, suffix: str) -> epath.Path:
    return path.parent / (path.name + suffix)


def remove(path: epath.Path) -> None:
    """Delete a directory tree (on the first process of a multi-process job), if it exists."""
    if jax.process_index() == 0 and path.exists():
        path.rmtree()
    sync("lwjax_checkpoint_remove")


def swap_in(new: epath.Path, path: epath.Path) -> None:
    """Replace the checkpoint at ``path`` by the committed one at ``new``.

    Two renames with the old checkpoint set aside in between, so ``path``
    holds a complete checkpoint before, after, and (through
    :func:`resolved`) between them.
    """
    old = sibling(path, OLD_SUFFIX)
    remove(old)
    if jax.process_index() == 0:
        path.rename(old)
        new.rename(path)
    sync("lwjax_checkpoint_swap")
    remove(old)


def sync(name: str) -> None:
    """A barrier over the job's processes (nothing to wait for in one process)."""
    if jax.process_count() > 1:
        ocp().multihost.sync_global_processes(name)


def is_committed(path: epath.Path) -> bool:
    """Whether ``path`` is a checkpoint orbax finished writing (committed metadata)."""
    try:
        meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(meta, Mapping) and meta.get("commit_timestamp_nsecs") is not None


def resolved(path: epath.Path) -> epath.Path:
    """``path``, or, where an overwrite was interrupted between its two renames, the
    committed checkpoint it left beside: the new one if it committed, else the old one."""
    if path.exists():
        return path
    for suffix in (NEW_SUFFIX, OLD_SUFFIX):
        candidate = sibling(path, suffix)
        if is_committed(candidate):
            return candidate
    return path


def checked_path(path) -> epath.Path:
    """The checkpoint directory, after refusing missing, temporary and uncommitted ones.

    Where an overwrite was interrupted between its renames, the committed
    checkpoint it left beside ``path`` (:func:`resolved`).
    """
    path = resolved(as_path(path))
    if TMP_SUFFIX in path.name:
        raise ValueError(
            f"{path}: an unfinished save (orbax temporary directory); it cannot be restored."
        )
    if not path.is_dir():
        pending = (
            sorted(p.name for p in path.parent.glob(path.name + TMP_SUFFIX + "*"))
            if path.parent.is_dir()
            else []
        )
        if pending:
            raise ValueError(
                f"{path}: the save was interrupted before it completed (found {pending}); "
                "restore an earlier checkpoint."
            )
        raise ValueError(f"{path}: no such checkpoint.")
    if (
        not is_committed(path)
        or not (path / RECORD_ITEM).is_dir()
        or not (path / ARRAYS_ITEM).is_dir()
    ):
        raise ValueError(
            f"{path}: not a complete lwjax checkpoint (no committed orbax metadata, "
            f"{RECORD_ITEM}/ or {ARRAYS_ITEM}/)."
        )
    return path


def unreadable(path: epath.Path, err: Exception) -> str:
    """One line for a tensorstore read error: the damaged file first, without the JSON specs."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    text = re.sub(r" \[tensorstore_spec(\[\d+\])?='[^']*'\]", "", text)
    files = re.findall(r'local file "([^"]+)"', text)
    where = f" in {files[-1]}" if files else ""
    return f"{path}: array data{where} is unreadable (truncated or corrupted?): {text}"


def _is_late_loop_callback(unraisable) -> bool:
    """A tensorstore read finishing after orbax closed the event loop that awaited it.

    When one array of a damaged checkpoint fails, orbax raises and closes its
    event loop at once; reads still in flight finish later on tensorstore's
    threads, and each one's ``call_soon_threadsafe`` onto the closed loop
    raises, unraisable: hundreds of identical tracebacks that say nothing the
    raised error does not. Only a call entered from outside Python (first
    traceback frame) on a closed loop matches.
    """
    if unraisable.exc_type is not RuntimeError or str(unraisable.exc_value) != (
        "Event loop is closed"
    ):
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return bool(frames) and frames[0].name == "call_soon_threadsafe"


class _DropLateLoopCallbacks:
    """A :data:`sys.unraisablehook` that drops :func:`_is_late_loop_callback` reports only."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable):
        if not _is_late_loop_callback(unraisable):
            self.previous(unraisable)


def drop_late_loop_callbacks() -> None:
    """Install :class:`_DropLateLoopCallbacks` (once) before orbax reads arrays.

    It stays: the late callbacks arrive after the read has raised.
    """
    if not isinstance(sys.unraisablehook, _DropLateLoopCallbacks):
        sys.unraisablehook = _DropLateLoopCallbacks(sys.unraisablehook)
