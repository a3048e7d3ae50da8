"""Checkpoints of the logical (per-parameter) training state, restorable at any dp size.

A checkpoint holds the parameters and the :class:`~lwjax.logical.LogicalState`
(fp32 masters, Muon momenta, elementwise moments, step count) as named,
global arrays, never the per-rank packed buffers. So any optimizer over the
same parameters and routing restores it, whatever its mesh, dp size, layout
policy or bucket size: :func:`restore` reads the arrays straight into the
target's logical shardings and packs them with
:func:`~lwjax.logical.from_logical`.

On disk (orbax-checkpoint, one composite checkpoint)::

    <path>/arrays/   every array, named ``params/<leaf path>``, ``state/masters/<leaf path>``,
                     ``state/momenta/...``, ``state/elementwise/...``, ``state/count``
    <path>/lwjax/    a JSON record: format version, step, leaf routing, and each
                     array's shape, dtype and fingerprint

Saves are atomic: orbax writes ``<path>.orbax-checkpoint-tmp`` and renames it
when complete, so an interrupted save leaves nothing at ``<path>``;
:func:`restore` refuses a temporary or uncommitted directory. An overwrite
writes the new checkpoint beside the old one (``<path>.lwjax-new``) and swaps
it in only once it has committed (the old one goes through
``<path>.lwjax-old``), so a crash at any point leaves a complete checkpoint
that :func:`restore` finds: the old one, or the new one between the two
renames of the swap. The next save to ``<path>`` finishes or clears what an
interrupted overwrite left. Before anything
is read, the record is checked against the target (missing or unexpected
arrays, shapes, dtypes, routing); after reading, every array's fingerprint
(position-weighted sums of its bits) is checked, so a truncated or corrupted
file raises ``ValueError`` instead of restoring damaged state. Saving works on
multi-host global arrays (orbax writes each host's shards) and, with
``async_save=True``, in the background.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib.metadata import version as _version
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.logical import LogicalState, from_logical, logical_sharding, to_logical
from lwjax.optimizer import LayerwiseOptimizer
from lwjax.routing import LeafRoute, path_name
from lwjax.step import LayerwiseState

FORMAT = "lwjax.checkpoint"
FORMAT_VERSION = 1
ARRAYS_ITEM = "arrays"
RECORD_ITEM = "lwjax"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
NEW_SUFFIX = ".lwjax-new"  # an overwrite's new checkpoint, until it is swapped in
OLD_SUFFIX = ".lwjax-old"  # the overwritten checkpoint, while the new one is swapped in
_MIX = (0x9E3779B1, 0x7F4A7C15, 0x85EBCA77)


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
            _swap_in(self._written, self.path)
        return self.path


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _bits_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).astype(np.uint32)
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return x.view(view).astype(np.uint32)


def _fingerprint_np(x) -> str:
    bits = _bits_np(np.asarray(x)).reshape(-1)
    with np.errstate(over="ignore"):
        mix = np.arange(bits.size, dtype=np.uint32) * np.uint32(_MIX[0]) + np.uint32(_MIX[1])
        h1 = np.sum(bits * (mix | np.uint32(1)), dtype=np.uint32)
        h2 = np.sum((bits ^ mix) * np.uint32(_MIX[2]) + (bits >> np.uint32(13)), dtype=np.uint32)
    return f"{int(h1):08x}{int(h2):08x}"


def _bits_jnp(x):
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    view = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, view).astype(jnp.uint32)


@jax.jit
def _fingerprints_jnp(arrays: dict):
    """Two uint32 position-weighted sums of each array's bits; exact under any sharding."""
    out = {}
    for name, x in arrays.items():
        bits = _bits_jnp(x).reshape(-1)
        mix = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(_MIX[0]) + jnp.uint32(_MIX[1])
        h1 = jnp.sum(bits * (mix | jnp.uint32(1)), dtype=jnp.uint32)
        h2 = jnp.sum(
            (bits ^ mix) * jnp.uint32(_MIX[2]) + (bits >> jnp.uint32(13)), dtype=jnp.uint32
        )
        out[name] = jnp.stack([h1, h2])
    return out


def fingerprints(arrays: Mapping[str, Any]) -> dict[str, str]:
    """A 64-bit fingerprint of every array (numpy and jax agree bit for bit)."""
    device = {k: v for k, v in arrays.items() if isinstance(v, jax.Array) and v.dtype.itemsize <= 4}
    out = {k: _fingerprint_np(v) for k, v in arrays.items() if k not in device}
    if device:
        for name, pair in jax.device_get(_fingerprints_jnp(device)).items():
            out[name] = f"{int(pair[0]):08x}{int(pair[1]):08x}"
    return {k: out[k] for k in arrays}


def _named(tree) -> tuple[dict[str, Any], Any]:
    """``name -> leaf`` (names from key paths, ``/``-joined) and the tree's structure."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = {}
    for key_path, leaf in leaves:
        name = path_name(key_path)
        if name in named:
            raise ValueError(
                f"{name}: two leaves share this checkpoint name; leaf names must be unique."
            )
        named[name] = leaf
    return named, treedef


def _route_record(route: LeafRoute) -> dict:
    return {
        "path": route.path,
        "shape": list(route.shape),
        "dtype": route.dtype,
        "stack_dims": route.stack_dims,
        "is_muon": route.is_muon,
        "qkv_split_shapes": list(route.qkv_split_shapes or []) or None,
    }


def _as_path(path) -> epath.Path:
    """An absolute local path, or a remote one (``gs://...``) as orbax takes it."""
    path = epath.Path(path)
    return path if "://" in str(path) else epath.Path(path.resolve())


def _check_new_path(path: epath.Path, overwrite: bool) -> None:
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
    resolved = _resolved(path)
    if resolved != path and jax.process_index() == 0:
        resolved.rename(path)
    _sync("lwjax_checkpoint_recover")
    for suffix in (NEW_SUFFIX, OLD_SUFFIX):
        _remove(_sibling(path, suffix))
    if path.exists() and not overwrite:
        raise ValueError(
            f"{path}: already exists; pass overwrite=True (--overwrite) to replace it."
        )


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
) -> AsyncSave | None:
    """Save parameters and a :class:`LogicalState` (see :func:`save`, which calls this).

    Args:
      path: Checkpoint directory to create.
      params: The parameter pytree (jax or numpy arrays).
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

    Returns:
      An :class:`AsyncSave` when ``async_save``, else ``None`` once committed.
    """
    path = _as_path(path)
    _check_new_path(path, overwrite)
    arrays, _ = _named({"params": params, "state": logical})
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lwjax_version": _version("lwjax"),
        "jax_version": jax.__version__,
        "step": int(step if step is not None else np.asarray(jax.device_get(logical.count))),
        "matrix_convention": matrix_convention,
        "routes": [_route_record(r) for r in routes],
        "arrays": {
            name: {"shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name, "fingerprint": fp}
            for (name, x), fp in zip(arrays.items(), fingerprints(arrays).values())
        },
        "metadata": dict(metadata or {}),
    }
    json.dumps(record)  # fail before writing anything if metadata is not JSON
    # An overwrite writes beside the old checkpoint and swaps the new one in once committed.
    written = _sibling(path, NEW_SUFFIX) if path.exists() else path
    if written != path:
        _remove(written)
    checkpointer = _write(written, arrays, record, async_save)
    if async_save:
        return AsyncSave(checkpointer, path, written)
    if written != path:
        _swap_in(written, path)
    return None


def _write(path: epath.Path, arrays: Mapping[str, Any], record: Mapping, async_save: bool):
    """Start orbax's save of the arrays and the record to the new ``path``; the checkpointer."""
    ocp = _ocp()
    handler = ocp.CompositeCheckpointHandler()
    checkpointer = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
    args = ocp.args.Composite(
        **{ARRAYS_ITEM: ocp.args.StandardSave(arrays), RECORD_ITEM: ocp.args.JsonSave(record)}
    )
    checkpointer.save(path, args)
    return checkpointer


def _sibling(path: epath.Path, suffix: str) -> epath.Path:
    return path.parent / (path.name + suffix)


def _remove(path: epath.Path) -> None:
    """Delete a directory tree (on the first process of a multi-process job), if it exists."""
    if jax.process_index() == 0 and path.exists():
        path.rmtree()
    _sync("lwjax_checkpoint_remove")


def _swap_in(new: epath.Path, path: epath.Path) -> None:
    """Replace the checkpoint at ``path`` by the committed one at ``new``.

    Two renames with the old checkpoint set aside in between, so ``path``
    holds a complete checkpoint before, after, and (through
    :func:`_resolved`) between them.
    """
    old = _sibling(path, OLD_SUFFIX)
    _remove(old)
    if jax.process_index() == 0:
        path.rename(old)
        new.rename(path)
    _sync("lwjax_checkpoint_swap")
    _remove(old)


def _sync(name: str) -> None:
    """A barrier over the job's processes (nothing to wait for in one process)."""
    if jax.process_count() > 1:
        _ocp().multihost.sync_global_processes(name)


def _is_committed(path: epath.Path) -> bool:
    """Whether ``path`` is a checkpoint orbax finished writing (committed metadata)."""
    try:
        meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(meta, Mapping) and meta.get("commit_timestamp_nsecs") is not None


def _resolved(path: epath.Path) -> epath.Path:
    """``path``, or, where an overwrite was interrupted between its two renames, the
    committed checkpoint it left beside: the new one if it committed, else the old one."""
    if path.exists():
        return path
    for suffix in (NEW_SUFFIX, OLD_SUFFIX):
        candidate = _sibling(path, suffix)
        if _is_committed(candidate):
            return candidate
    return path


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
    checkpoint does not depend on this optimizer's dp size, layout or buckets.
    Inverse of :func:`restore`.

    Args:
      path: Checkpoint directory to create (atomically).
      params: The parameter pytree.
      state: The optimizer's :class:`~lwjax.step.LayerwiseState`.
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
    logical = to_logical(optimizer, state)
    return save_logical(
        path,
        params,
        logical,
        optimizer.plan.routes,
        step=step,
        metadata=metadata,
        async_save=async_save,
        overwrite=overwrite,
        matrix_convention=optimizer.plan.config.matrix_convention,
    )


def _checked_path(path) -> epath.Path:
    """The checkpoint directory, after refusing missing, temporary and uncommitted ones.

    Where an overwrite was interrupted between its renames, the committed
    checkpoint it left beside ``path`` (:func:`_resolved`).
    """
    path = _resolved(_as_path(path))
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
        not _is_committed(path)
        or not (path / RECORD_ITEM).is_dir()
        or not (path / ARRAYS_ITEM).is_dir()
    ):
        raise ValueError(
            f"{path}: not a complete lwjax checkpoint (no committed orbax metadata, "
            f"{RECORD_ITEM}/ or {ARRAYS_ITEM}/)."
        )
    return path


def read_record(path) -> dict:
    """The JSON record of a complete checkpoint (format, step, routes, arrays, metadata).

    Raises:
      ValueError: an incomplete checkpoint, or a record of another format or version.
    """
    path = _checked_path(path)
    ocp = _ocp()
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, ocp.args.Composite(**{RECORD_ITEM: ocp.args.JsonRestore()})
        )
        record = restored[RECORD_ITEM]
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
    _check_record(record, path)
    return dict(record)


def _check_record(record: Mapping, path: epath.Path) -> None:
    """Refuse a record whose fields a bit flip or an edit has damaged, naming the field."""
    arrays = record.get("arrays")
    if not isinstance(arrays, Mapping):
        raise ValueError(f"{path}: damaged checkpoint record: 'arrays' is not a mapping.")
    for name, entry in arrays.items():
        ok = (
            isinstance(entry, Mapping)
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("fingerprint"), str)
        )
        if not ok:
            raise ValueError(
                f"{path}: damaged checkpoint record: arrays[{name!r}] needs a shape (list of "
                f"sizes), a dtype and a fingerprint; got {entry!r}."
            )
    if not isinstance(record.get("step"), int) or not isinstance(record.get("routes"), list):
        raise ValueError(f"{path}: damaged checkpoint record: 'step' or 'routes' is missing.")


def _target(optimizer: LayerwiseOptimizer, params_like):
    """Abstract ``{"params", "state"}`` tree of the optimizer, with target shardings."""
    replicated = NamedSharding(optimizer.mesh, P())
    if params_like is None:
        leaves = [jax.ShapeDtypeStruct(r.shape, jnp.dtype(r.dtype)) for r in optimizer.plan.routes]
        params_like = jax.tree_util.tree_unflatten(optimizer.plan.treedef, leaves)
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=getattr(x, "sharding", None) or replicated
        ),
        params_like,
    )
    abstract_state = jax.eval_shape(
        optimizer.init,
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params),
    )
    abstract_logical = jax.eval_shape(lambda s: to_logical(optimizer, s), abstract_state)
    abstract_logical = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=logical_sharding(optimizer, x)),
        abstract_logical,
    )
    return {"params": abstract_params, "state": abstract_logical}


def _describe(entry) -> str:
    return f"{entry['dtype']}{list(entry['shape'])}"


def _mismatches(
    record: Mapping,
    target: Mapping[str, jax.ShapeDtypeStruct],
    routes: Sequence[LeafRoute],
    convention: str,
) -> list[str]:
    saved = record["arrays"]
    problems = []
    saved_convention = record.get("matrix_convention")  # unrecorded (so unchecked) before 0.3
    if saved_convention is not None and saved_convention != convention:
        problems.append(
            f"matrix_convention: the checkpoint's matrices are {saved_convention!r}, the target "
            f"optimizer's {convention!r} (Muon's scale and QKV split would read the wrong axis)"
        )
    saved_routes = {r["path"]: r for r in record.get("routes", [])}
    for route in routes:
        old = saved_routes.get(route.path)
        if old is not None and bool(old["is_muon"]) != route.is_muon:
            kinds = ("Muon", "elementwise")
            problems.append(
                f"routing: {route.path} is {kinds[not old['is_muon']]} in the checkpoint but "
                f"{kinds[not route.is_muon]} in the target optimizer"
            )
    for name in target:
        if name not in saved:
            want = target[name]
            problems.append(
                f"missing: {name} (target {np.dtype(want.dtype).name}{list(want.shape)})"
            )
    for name in saved:
        if name not in target:
            problems.append(f"unexpected: {name} ({_describe(saved[name])}) is not in the target")
    for name, want in target.items():
        have = saved.get(name)
        if have is None:
            continue
        if tuple(have["shape"]) != tuple(want.shape):
            problems.append(
                f"shape: {name}: checkpoint {tuple(have['shape'])}, target {tuple(want.shape)}"
            )
        if have["dtype"] != np.dtype(want.dtype).name:
            problems.append(
                f"dtype: {name}: checkpoint {have['dtype']}, target {np.dtype(want.dtype).name}"
            )
    return problems


def _read_arrays(
    path: epath.Path, target: Mapping[str, jax.ShapeDtypeStruct], record: Mapping
) -> dict:
    ocp = _ocp()
    try:
        restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, ocp.args.Composite(**{ARRAYS_ITEM: ocp.args.StandardRestore(dict(target))})
        )[ARRAYS_ITEM]
    except Exception as err:  # tensorstore / orbax errors on damaged files
        raise ValueError(
            f"{path}: the checkpoint's array data is unreadable (truncated or corrupted?): "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
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
    goes: parameters come back replicated on its mesh (or with
    ``params_like``'s shardings), the state packed for its layout.

    Args:
      path: A checkpoint written by :func:`save` or :func:`save_logical`.
      optimizer: The target :class:`~lwjax.optimizer.LayerwiseOptimizer`.
      params_like: Optional parameter pytree of arrays or ``jax.ShapeDtypeStruct``
        (with ``sharding``) giving the parameters' dtypes and placement;
        defaults to the optimizer's routed shapes and dtypes, replicated.

    Returns:
      ``(params, state)``.

    Raises:
      ValueError: an incomplete, truncated or corrupted checkpoint, or one that
        does not match the target (missing or unexpected arrays, shapes,
        dtypes, routing); the message lists every problem. Nothing is returned
        half-restored.
    """
    path = _checked_path(path)
    record = read_record(path)
    tree = _target(optimizer, params_like)
    target, treedef = _named(tree)
    problems = _mismatches(
        record, target, optimizer.plan.routes, optimizer.plan.config.matrix_convention
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
      ValueError: an incomplete, truncated or corrupted checkpoint.
    """
    path = _checked_path(path)
    record = read_record(path)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {
        name: jax.ShapeDtypeStruct(tuple(e["shape"]), jnp.dtype(e["dtype"]), sharding=device)
        for name, e in record["arrays"].items()
    }
    restored = _read_arrays(path, target, record)
    return {name: np.asarray(restored[name]) for name in target}, record
