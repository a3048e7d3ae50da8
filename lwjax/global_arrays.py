"""Global arrays over the processes of a ``jax.distributed`` job: the mesh, the batch, the
parameters.

A mesh over every process's devices is ordered by process, then device id
(:func:`global_mesh`), so process ``p`` owns a contiguous block of it and feeds
rows ``p·B/P … (p+1)·B/P`` of a global batch of ``B`` rows over ``P`` processes
(:func:`process_rows`, :func:`global_batch`; :func:`shard_batch` when every
process holds the whole batch). Host values equal on every process become
global arrays with :func:`place` / :func:`replicate`, and come back whole with
:func:`gather_to_host`. In one process all of this is plain ``jax.device_put``.
:mod:`lwjax.distributed` re-exports every name here beside the process setup.
"""

from __future__ import annotations


def global_mesh(num_devices: int | None = None, *, axis: str = "dp"):
    """A 1-D data-parallel ``Mesh`` over every process's devices, ordered by process.

    Args:
      num_devices: Use ``num_devices`` devices, the first ``num_devices / P``
        of each of the ``P`` processes (every process takes part); ``None``: all.
      axis: The mesh axis name.

    Returns:
      ``Mesh`` of shape ``{axis: num_devices}``.

    Raises:
      ValueError: ``num_devices`` is out of range or does not divide by the process count.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if num_devices is None:
        return Mesh(np.array(devices), (axis,))
    processes = jax.process_count()
    if not 1 <= num_devices <= len(devices) or num_devices % processes:
        raise ValueError(
            f"global_mesh: num_devices must be a multiple of the {processes} process(es) in "
            f"[1, {len(devices)}]; got {num_devices=}."
        )
    per_process = num_devices // processes
    chosen = [
        d
        for p in range(processes)
        for d in [d for d in devices if d.process_index == p][:per_process]
    ]
    return Mesh(np.array(chosen), (axis,))


def _row_blocks(mesh, axis) -> tuple[list[int], int]:
    """``(starts, n)``: the batch splits into ``n`` row blocks over ``axis``; this process
    holds those at ``starts``.
    """
    import math

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = (axis,) if isinstance(axis, str) else tuple(axis)
    n = math.prod(mesh.shape[name] for name in names)
    index_map = NamedSharding(mesh, P(axis)).addressable_devices_indices_map((n,))
    starts = sorted({index[0].start or 0 for index in index_map.values()})
    if not starts:
        raise ValueError(f"this process has no devices in the mesh {dict(mesh.shape)}.")
    return starts, n


def process_rows(global_rows: int, mesh, *, axis: str | tuple[str, ...] = "dp") -> slice:
    """The rows of a global batch of ``global_rows`` that this process feeds.

    Args:
      global_rows: Leading-axis size of the global batch.
      mesh: The mesh the batch is split over.
      axis: The mesh axis (or axes, e.g. ``optimizer.data_axes``) the batch is split over.

    Returns:
      ``slice(start, stop)`` into the global batch.

    Raises:
      ValueError: ``global_rows`` does not divide by the axis size, or this
        process's devices are not one contiguous block of the axis.
    """
    starts, n = _row_blocks(mesh, axis)
    if global_rows % n:
        raise ValueError(
            f"process_rows: the global batch must divide by {axis}={n}; got {global_rows=}."
        )
    rows = global_rows // n
    if starts != list(range(starts[0], starts[-1] + 1)):
        raise ValueError(
            f"process_rows: this process's devices are not contiguous along {axis!r}; "
            "order the mesh's devices by process, as global_mesh() does."
        )
    return slice(starts[0] * rows, (starts[-1] + 1) * rows)


def global_batch(local_batch, mesh, *, axis: str | tuple[str, ...] = "dp"):
    """Assemble each process's rows into global arrays split over ``axis``.

    Inverse of taking :func:`process_rows` of a global batch: process ``p``
    passes rows ``process_rows(B, mesh)`` of the global batch of ``B`` rows.

    Args:
      local_batch: A pytree of host arrays, each with this process's rows on
        axis 0 (equal row counts on every process).
      mesh: The mesh of the train step.
      axis: The mesh axis (or axes, e.g. ``optimizer.data_axes``) the batch is split over.

    Returns:
      The same pytree of global ``jax.Array``\\ s sharded ``P(axis)``.

    Raises:
      ValueError: A leaf has no leading axis.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P(axis))
    starts, n = _row_blocks(mesh, axis)
    share = n // len(starts)  # global rows per local row

    def make(x):
        x = np.asarray(x)
        if not x.ndim:
            raise ValueError(
                f"global_batch: every leaf needs a leading batch axis; got a scalar {x=}."
            )
        return jax.make_array_from_process_local_data(
            sharding, x, (x.shape[0] * share, *x.shape[1:])
        )

    return jax.tree.map(make, local_batch)


def shard_batch(full_batch, mesh, *, axis: str | tuple[str, ...] = "dp"):
    """Split a global batch that every process holds whole into global arrays over ``axis``.

    For data loaders that produce the same global batch on every process (same
    seed): each process keeps only its :func:`process_rows`.
    """
    import jax
    import numpy as np

    leaves = jax.tree.leaves(full_batch)
    if not leaves:
        return full_batch
    rows = process_rows(np.shape(leaves[0])[0], mesh, axis=axis)
    return global_batch(jax.tree.map(lambda x: np.asarray(x)[rows], full_batch), mesh, axis=axis)


def place(tree, mesh, specs=None):
    """Host values, equal on every process, as global arrays on ``mesh`` laid out by ``specs``.

    Args:
      tree: A pytree of host (or single-device) arrays.
      mesh: The target mesh.
      specs: A ``PartitionSpec`` for every leaf, or a pytree of them shaped
        like ``tree`` (e.g. ``optimizer.param_specs`` with expert
        parallelism); ``None``: replicated, ``P()``.

    Returns:
      The same pytree of global ``jax.Array``\\ s; each process fills only its own shards.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def make(x, spec):
        x = np.asarray(x)
        return jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, spec), lambda index: x[index]
        )

    specs = P() if specs is None else specs
    if isinstance(specs, P):
        return jax.tree.map(lambda x: make(x, specs), tree)
    return jax.tree.map(make, tree, specs)


def replicate(tree, mesh):
    """Host values, equal on every process, as fully replicated global arrays
    (``P()``) on ``mesh``.
    """
    return place(tree, mesh)


def gather_to_host(tree):
    """Every leaf as a whole host ``numpy`` array, on every process.

    Arrays that span processes are gathered with
    ``multihost_utils.process_allgather`` (a collective: every process must
    call this together); local and replicated arrays are read directly.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (no-op in a single process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
