"""Checkpoints of the logical (per-parameter) training state, restorable at any dp size.

A checkpoint holds the parameters and the :class:`~lwjax.logical.LogicalState`
(fp32 masters, Muon momenta, elementwise moments, step count) as named,
global arrays, never the per-rank packed buffers. So any optimizer over the
same parameters and routing restores it, whatever its mesh, dp size, layout
policy or bucket size: :func:`restore` reads the arrays straight into the
target's logical shardings and packs them with
:func:`~lwjax.logical.from_logical`.

The logical state never sits on the devices whole: :func:`save` converts it a
chunk of leaves at a time into host memory (``pinned_host``,
:func:`~lwjax.logical.host_memory_kind`), and :func:`restore` reads it into host
memory and moves one chunk at a time onto the devices to pack it. So on every
device saving holds what it held before plus one chunk's staging, and restoring
holds the parameters, the packed state it builds and one chunk's staging; a
chunk's staging is at most ``2 × max(STAGING_BYTES, largest leaf block)``
(:mod:`lwjax.logical_shards`). Each host holds its devices' parts of the logical
state meanwhile.

On disk (orbax-checkpoint, one composite checkpoint)::

    <path>/arrays/   every array, named ``params/<leaf path>``, ``state/masters/<leaf path>``,
                     ``state/momenta/...``, ``state/elementwise/...``, ``state/count``
    <path>/lwjax/    a JSON record (:mod:`lwjax.checkpoint_record`): format version, step,
                     leaf routing, elementwise transform, and each array's shape, dtype
                     and fingerprint

Saves are atomic (the directory mechanics live in :mod:`lwjax.checkpoint_files`):
orbax writes ``<path>.orbax-checkpoint-tmp`` and renames it when complete, so an
interrupted save leaves nothing at ``<path>``;
:func:`restore` refuses a temporary or uncommitted directory. An overwrite
writes the new checkpoint beside the old one (``<path>.lwjax-new``) and swaps
it in only once it has committed (the old one goes through
``<path>.lwjax-old``), so a crash at any point leaves a complete checkpoint
that :func:`restore` finds: the old one, or the new one between the two
renames of the swap. The next save to ``<path>`` finishes or clears what an
interrupted overwrite left. Before anything is read, the record is checked
against the target (missing or unexpected arrays, shapes, dtypes, routing,
another elementwise transform); after reading, every array's fingerprint
(position-weighted sums of its bits) is checked, so a truncated or corrupted
file raises ``ValueError`` instead of restoring damaged state. Saving works on
multi-host global arrays (orbax writes each host's shards) and, with
``async_save=True``, in the background.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax import checkpoint_files as files
from lwjax.checkpoint_record import (
    FORMAT,
    FORMAT_VERSION,
    build_contents,
    check_record,
    mismatches,
    named_leaves,
    state_structure,
    transform_name,
)
from lwjax.checkpoint_record import fingerprints as fingerprints
from lwjax.logical import (
    LogicalState,
    from_logical,
    host_memory_kind,
    logical_shardings,
    to_logical,
)
from lwjax.optimizer import LayerwiseOptimizer
from lwjax.routing import LeafRoute, path_name
from lwjax.state import LayerwiseState


class AsyncSave:
    """A save running in the background; :meth:`wait` blocks until it is committed."""

    def __init__(self, checkpointer, path: epath.Path, written: epath.Path):
        self._checkpointer = checkpointer
        self.path = path
        self._written = written

    def wait(self) -> epath.Path:
        """Block until the checkpoint is complete at :attr:`path`; return it."""
        self._checkpointer.wait_until_finished()
        if self._written != self.path:
            files.swap_in(self._written, self.path)
        return self.path


def save_logical(
    path,
    params,
    logical: LogicalState,
    routes: Sequence[LeafRoute],
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    async_save: bool = False,
    overwrite: bool = False,
    matrix_convention: str = "in_out",
    elementwise_transform: str | None = None,
) -> AsyncSave | None:
    """Save parameters and a :class:`LogicalState` (see :func:`save`, which calls this).

    Args:
      path: Checkpoint directory to create.
      params: The parameter pytree (jax or numpy arrays; numpy arrays are
        stored in the dtype jax holds them in, e.g. float64 as float32 while
        ``jax_enable_x64`` is off, as ``init`` and the step see them).
      logical: The logical optimizer state (jax or numpy leaves).
      routes: The parameters' routing (``optimizer.plan.routes``), recorded so
        a restore can name routing differences.
      step: Training step to record; defaults to ``logical.count``.
      metadata: JSON-serialisable extra record (e.g. where a conversion came from).
      async_save: Return while orbax writes in the background.
      overwrite: Replace an existing checkpoint at ``path``; it stays there
        until the new one has committed (see the module docstring).
      matrix_convention: How the saved 2-D parameters are stored (``"in_out"``
        or ``"out_in"``, :class:`~lwjax.optimizer.OptimizerConfig`); a restore
        into an optimizer of the other convention is refused.
      elementwise_transform: Name of the elementwise optax transform that made
        ``logical.elementwise``
        (:func:`~lwjax.checkpoint_record.transform_name`), or ``None`` if
        unknown; a restore into an optimizer with another one is refused.

    Returns:
      An :class:`AsyncSave` when ``async_save``, else ``None`` once committed.
    """
    path = files.as_path(path)
    files.check_new_path(path, overwrite)
    arrays, record = build_contents(
        params,
        logical,
        routes,
        step=step,
        metadata=metadata,
        matrix_convention=matrix_convention,
        elementwise_transform=elementwise_transform,
    )
    # An overwrite writes beside the old checkpoint and swaps the new one in once committed.
    written = files.sibling(path, files.NEW_SUFFIX) if path.exists() else path
    if written != path:
        files.remove(written)
    checkpointer = _write(written, arrays, record, async_save)
    if async_save:
        return AsyncSave(checkpointer, path, written)
    if written != path:
        files.swap_in(written, path)
    return None


def checkpoint_args(
    params,
    state: LayerwiseState,
    optimizer: LayerwiseOptimizer,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
):
    """The orbax ``Composite`` args that :func:`save` writes for ``(params, state)``.

    For orbax APIs that take args, such as the step directories of
    :class:`lwjax.checkpoint_manager.CheckpointManager`. Arguments as :func:`save`'s.
    """
    logical = _logical_in_host_memory(optimizer, state)
    fields = dict(step=step, metadata=metadata, **_options(optimizer))
    return _composite(*build_contents(params, logical, optimizer.plan.routes, **fields))


def _host_memory(optimizer: LayerwiseOptimizer) -> str | None:
    """Where the logical state of a save or restore lives: host memory, or (with a warning,
    where the devices have none) the devices."""
    kind = host_memory_kind(optimizer)
    if kind is None:
        device = optimizer.mesh.devices.flat[0]
        warnings.warn(
            f"lwjax checkpoint: {device.platform} devices have no 'pinned_host' memory, so the "
            "logical state is held on the devices while it is saved or restored (about twice "
            "the optimizer state per device).",
            stacklevel=3,
        )
    return kind


def _logical_in_host_memory(optimizer: LayerwiseOptimizer, state: LayerwiseState):
    """The logical state of ``state``, each chunk moved to host memory as it is converted."""
    return to_logical(optimizer, state, memory_kind=_host_memory(optimizer))


def _options(optimizer: LayerwiseOptimizer) -> dict[str, Any]:
    """What a record notes about the optimizer besides routes (checked by :func:`restore`)."""
    return {
        "matrix_convention": optimizer.plan.config.matrix_convention,
        "elementwise_transform": transform_name(optimizer.plan.elementwise),
    }


def _write(path: epath.Path, arrays: Mapping[str, Any], record: Mapping, async_save: bool):
    """Start orbax's save of the arrays and the record to the new ``path``; the checkpointer."""
    ocp = files.ocp()
    handler = ocp.CompositeCheckpointHandler()
    checkpointer = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
    checkpointer.save(path, _composite(arrays, record))
    return checkpointer


def _composite(arrays: Mapping[str, Any], record: Mapping):
    ocp = files.ocp()
    return ocp.args.Composite(
        **{
            files.ARRAYS_ITEM: ocp.args.StandardSave(dict(arrays)),
            files.RECORD_ITEM: ocp.args.JsonSave(record),
        }
    )


def save(
    path,
    params,
    state: LayerwiseState,
    optimizer: LayerwiseOptimizer,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    async_save: bool = False,
    overwrite: bool = False,
) -> AsyncSave | None:
    """Save parameters and optimizer state as logical per-parameter arrays.

    The state is unpacked with :func:`~lwjax.logical.to_logical` first, so the
    checkpoint does not depend on this optimizer's dp size, layout or buckets;
    each chunk of it goes to host memory as it is converted, so a device holds what
    it held before plus one chunk's staging (module docstring). Inverse of :func:`restore`.

    Args:
      path: Checkpoint directory to create (atomically).
      params: The parameter pytree.
      state: The optimizer's :class:`~lwjax.state.LayerwiseState`.
      optimizer: The :class:`~lwjax.optimizer.LayerwiseOptimizer` that owns ``state``.
      step: Training step to record; defaults to ``state.count``.
      metadata: JSON-serialisable extra record.
      async_save: Return an :class:`AsyncSave` while writing in the background
        (an overwrite is swapped in by :meth:`AsyncSave.wait`).
      overwrite: Replace an existing checkpoint at ``path``; it stays there
        until the new one has committed (see the module docstring).

    Returns:
      An :class:`AsyncSave` when ``async_save``, else ``None`` once committed.

    Raises:
      ValueError: ``path`` exists (without ``overwrite``) or names an unfinished save.

    Examples:
      >>> save("/tmp/ckpt/step_100", params, state, opt)            # doctest: +SKIP
      >>> params, state = restore("/tmp/ckpt/step_100", other_opt)  # doctest: +SKIP
    """
    logical = _logical_in_host_memory(optimizer, state)
    return save_logical(
        path,
        params,
        logical,
        optimizer.plan.routes,
        step=step,
        metadata=metadata,
        async_save=async_save,
        overwrite=overwrite,
        **_options(optimizer),
    )


def read_record(path) -> dict:
    """The JSON record of a complete checkpoint (format, step, routes, arrays, metadata).

    Raises:
      ValueError: an incomplete checkpoint, or a record of another format or version.
    """
    path = files.checked_path(path)
    ocp = files.ocp()
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, ocp.args.Composite(**{files.RECORD_ITEM: ocp.args.JsonRestore()})
        )
        record = restored[files.RECORD_ITEM]
    except Exception as err:  # orbax raises many types for unreadable files
        raise ValueError(f"{path}: unreadable checkpoint record: {err}") from None
    if not isinstance(record, Mapping) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, Mapping) else type(record).__name__
        raise ValueError(
            f"{path}: not an lwjax checkpoint record (format={found!r}; expected {FORMAT!r})."
        )
    if record.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format version {record.get('format_version')!r}; this lwjax reads "
            f"version {FORMAT_VERSION}."
        )
    check_record(record, path)
    return dict(record)


def _target(optimizer: LayerwiseOptimizer, params_like):
    """Abstract ``{"params", "state"}`` tree of the optimizer, with target shardings: the
    parameters as the optimizer holds them, the logical state in host memory."""
    if params_like is None:
        leaves = [jax.ShapeDtypeStruct(r.shape, jnp.dtype(r.dtype)) for r in optimizer.plan.routes]
        params_like = jax.tree_util.tree_unflatten(optimizer.plan.treedef, leaves)
    # In the dtypes jax holds (init casts float64 to float32 while x64 is off), as saved; where
    # params_like gives no sharding, as the optimizer holds them (split leaves split).
    shardings = optimizer.leaf_shardings()
    abstract_params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape,
            jax.dtypes.canonicalize_dtype(x.dtype),
            sharding=getattr(x, "sharding", None)
            or shardings.get(path_name(path), NamedSharding(optimizer.mesh, P())),
        ),
        params_like,
    )
    abstract_state = jax.eval_shape(
        optimizer.init,
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params),
    )
    abstract_logical = jax.eval_shape(lambda s: to_logical(optimizer, s), abstract_state)
    memory_kind = _host_memory(optimizer)
    abstract_logical = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=s.with_memory_kind(memory_kind)
        ),
        abstract_logical,
        logical_shardings(optimizer, abstract_logical),
    )
    return {"params": abstract_params, "state": abstract_logical}


def _read_arrays(
    path: epath.Path, target: Mapping[str, jax.ShapeDtypeStruct], record: Mapping
) -> dict:
    ocp = files.ocp()
    files.drop_late_loop_callbacks()
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, ocp.args.Composite(**{files.ARRAYS_ITEM: ocp.args.StandardRestore(dict(target))})
        )[files.ARRAYS_ITEM]
    except Exception as err:  # tensorstore / orbax errors on damaged files
        raise ValueError(files.unreadable(path, err)) from None
    got = fingerprints(restored)
    bad = [name for name in target if got[name] != record["arrays"][name]["fingerprint"]]
    if bad:
        raise ValueError(
            f"{path}: corrupted checkpoint: the data of {len(bad)} array(s) does not match the "
            f"fingerprints recorded at save time: {bad}. Nothing was restored."
        )
    return restored


def restore(path, optimizer: LayerwiseOptimizer, params_like=None) -> tuple[Any, LayerwiseState]:
    """Restore parameters and optimizer state onto ``optimizer``'s mesh, dp size and layout.

    Inverse of :func:`save`. The target optimizer defines where everything
    goes: parameters come back on its mesh as it holds them (replicated, or
    split over its expert and tensor-parallel axes; or with ``params_like``'s
    shardings), the state packed for its layout. The logical state is read into
    host memory and packed a chunk at a time, so a device holds its parameters,
    its packed state and one chunk's staging (module docstring).

    Args:
      path: A checkpoint written by :func:`save` or :func:`save_logical`.
      optimizer: The target :class:`~lwjax.optimizer.LayerwiseOptimizer`.
      params_like: Optional parameter pytree of arrays or ``jax.ShapeDtypeStruct``
        (with ``sharding``) giving the parameters' dtypes and placement;
        defaults to the optimizer's routed shapes and dtypes, placed as it holds them.

    Returns:
      ``(params, state)``.

    Raises:
      ValueError: an incomplete, truncated or corrupted checkpoint, or one that
        does not match the target (missing or unexpected arrays, shapes,
        dtypes, routing); the message lists every problem. Nothing is returned
        half-restored.
    """
    path = files.checked_path(path)
    record = read_record(path)
    tree = _target(optimizer, params_like)
    target, treedef = named_leaves(tree)
    elementwise = {
        "transform": transform_name(optimizer.plan.elementwise),
        "state": state_structure(tree["state"].elementwise, tree["params"]),
    }
    problems = mismatches(
        record,
        target,
        optimizer.plan.routes,
        optimizer.plan.config.matrix_convention,
        elementwise,
    )
    if problems:
        raise ValueError(
            f"{path}: the checkpoint does not match the target optimizer:\n  "
            + "\n  ".join(problems)
        )
    restored = _read_arrays(path, target, record)
    restored_tree = jax.tree_util.tree_unflatten(treedef, [restored[name] for name in target])
    state = from_logical(optimizer, restored_tree["state"])
    return restored_tree["params"], state


def load_arrays(path) -> tuple[dict[str, np.ndarray], dict]:
    """Every array of a checkpoint as host numpy arrays, by name, plus the record (for converters).

    Raises:
      ValueError: an incomplete, truncated or corrupted checkpoint, or 64-bit
        arrays while ``jax_enable_x64`` is off.
    """
    path = files.checked_path(path)
    record = read_record(path)
    wide = [
        n
        for n, e in record["arrays"].items()
        if jax.dtypes.canonicalize_dtype(e["dtype"]) != e["dtype"]
    ]
    if wide:
        raise ValueError(
            f"{path}: {wide} are 64-bit, which jax holds only with jax_enable_x64; set "
            "JAX_ENABLE_X64=1 to read this checkpoint."
        )
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {
        name: jax.ShapeDtypeStruct(tuple(e["shape"]), jnp.dtype(e["dtype"]), sharding=device)
        for name, e in record["arrays"].items()
    }
    restored = _read_arrays(path, target, record)
    return {name: np.asarray(restored[name]) for name in target}, record
