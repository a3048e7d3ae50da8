"""Run 6 of docs/scripts/multi_gpu_runs.sh: a fully sharded training state saved on one mesh and
restored on another, each device's peak memory during both, and a bitwise check.

Save and restore run as two processes, because JAX gives a device's peak memory only since its
process started (``memory_stats()["peak_bytes_in_use"]``; CPUs give none: ``n/a``):

* ``save`` builds a workload's parameters split over ``fsdp`` (as ``lwjax bench --train-step
  --fsdp`` splits them) and the bench's lwjax Muon on a ``dp x fsdp`` mesh, takes one step with
  fixed random gradients, saves with :func:`lwjax.save` to ``DIR/checkpoint`` and writes
  ``DIR/fingerprints.json``: the SHA-256 of every leaf of the parameters and of the logical
  (per-parameter) optimizer state, each leaf gathered to the host alone.
* ``restore`` builds the optimizer on its own mesh, reads the checkpoint onto it with
  :func:`lwjax.restore`, fingerprints what it got the same way and exits with status 1 naming
  the first leaf whose fingerprint differs.

Each prints one record: the state's bytes per device (parameters plus packed optimizer state),
the devices' peak before and after, seconds, and (restore) whether every leaf is bitwise equal.
The fingerprints are taken after the peak is read, so their gathers do not count in it.
One process only (the fingerprints gather each leaf onto this host)::

    python3 docs/scripts/checkpoint_at_scale.py save --workload small --layers 2 --fsdp 8 \\
        --dir /tmp/ckpt --json --out /tmp/ckpt
    python3 docs/scripts/checkpoint_at_scale.py restore --workload small --layers 2 --dp 2 \\
        --fsdp 4 --dir /tmp/ckpt --json --out /tmp/ckpt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

import lwjax
from lwjax.checkpoint_record import named_leaves
from lwjax.logical import host_memory_kind, to_logical
from lwjax.tools.bench import (
    FSDP_AXIS,
    WORKLOADS,
    TrainBenchConfig,
    constant_params,
    fsdp_specs,
    lwjax_optimizer,
    workload_shapes,
)
from lwjax.tools.demo.devices import bytes_per_device, request_cpu_devices

GRAD_STD = 1e-2  # the gradients' standard deviation (lwjax bench's --grad-std default)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode, what in (("save", "build, step and save"), ("restore", "restore and compare")):
        p = modes.add_parser(mode, help=what)
        p.add_argument("--workload", choices=tuple(WORKLOADS), required=True)
        p.add_argument("--layers", type=int, default=None, help="default: the workload's own")
        p.add_argument("--dp", type=int, default=1, help="data-parallel devices of the mesh")
        p.add_argument("--fsdp", type=int, required=True, help="devices a parameter is split over")
        p.add_argument("--dir", type=pathlib.Path, required=True, help="checkpoint, fingerprints")
        p.add_argument("--json", action="store_true", help="print the record as JSON")
        p.add_argument("--out", type=pathlib.Path, help=f"also write {mode}.json into this folder")
    return parser


def _setting(args):
    """The mesh ``("dp", "fsdp")``, the bench's fully sharded training config, and the abstract
    parameters split as ``lwjax bench --train-step --fsdp`` splits them."""

    devices = args.dp * args.fsdp
    request_cpu_devices(devices)
    if devices > len(jax.devices()):
        raise SystemExit(
            f"--dp {args.dp} --fsdp {args.fsdp}: {devices} devices asked for; "
            f"{len(jax.devices())} are available."
        )
    mesh = Mesh(np.array(jax.devices()[:devices]).reshape(args.dp, args.fsdp), ("dp", FSDP_AXIS))
    cfg = TrainBenchConfig(workload=args.workload, layers=args.layers, fsdp=True, baselines=False)
    model = cfg.model()
    abstract = jax.tree.map(
        lambda shape, spec: jax.ShapeDtypeStruct(
            shape, cfg.param_dtype, sharding=NamedSharding(mesh, spec)
        ),
        workload_shapes(model),
        fsdp_specs(model, args.fsdp),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return mesh, cfg, abstract


def _device_bytes(mesh, key: str) -> int | None:
    """The largest ``memory_stats()[key]`` over this process's devices of ``mesh``; ``None``
    where a device gives no statistics (CPU)."""
    stats = [d.memory_stats() for d in mesh.local_devices]
    return None if any(s is None for s in stats) else max(s[key] for s in stats)


def fingerprints(params, state, optimizer) -> dict[str, str]:
    """SHA-256 of each leaf's shape, dtype and bytes, by checkpoint name: the parameters and
    the logical state (:func:`lwjax.to_logical`, in host memory where the devices have it), each
    leaf gathered whole to this host alone."""

    logical = to_logical(optimizer, state, memory_kind=host_memory_kind(optimizer))
    named, _ = named_leaves({"params": params, "state": logical})
    out = {}
    for name, leaf in named.items():
        whole = np.asarray(jax.device_get(leaf))
        digest = hashlib.sha256(f"{whole.shape} {whole.dtype}".encode())
        digest.update(np.ascontiguousarray(whole).reshape(-1).view(np.uint8).data)  # no copy
        out[name] = digest.hexdigest()
    return out


def _step(params, state, optimizer):
    """One optimizer step with gradients of ``GRAD_STD`` drawn from a fixed key, each placed as
    its parameter (parameters and state donated)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))

    def gradient(key, x):
        draw = lambda k: GRAD_STD * jax.random.normal(k, x.shape, jnp.float32)  # noqa: E731
        return jax.jit(lambda k: draw(k).astype(x.dtype), out_shardings=x.sharding)(key)

    grads = jax.tree.unflatten(treedef, [gradient(k, x) for k, x in zip(keys, leaves)])

    def step(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.block_until_ready(jax.jit(step, donate_argnums=(0, 1))(params, state, grads))


def _check_disk(path: pathlib.Path, params, optimizer) -> int:
    """The bytes the checkpoint will hold (parameters and logical state); raise if the disk
    under ``path`` has less free space (before anything is stepped or written)."""
    logical = jax.eval_shape(lambda p: to_logical(optimizer, optimizer.init(p)), params)
    size = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((params, logical)))
    free = shutil.disk_usage(path).free
    if size > free:
        raise SystemExit(
            f"--dir {path}: the checkpoint needs {size / 2**30:.1f} GiB; the disk has "
            f"{free / 2**30:.1f} GiB free."
        )
    return size


def save(args) -> dict:

    mesh, cfg, abstract = _setting(args)
    params = constant_params(
        jax.tree.map(lambda x: x.shape, abstract),
        mesh,
        cfg.param_dtype,
        jax.tree.map(lambda x: x.sharding.spec, abstract),
    )
    optimizer = lwjax_optimizer(params, mesh, cfg)
    args.dir.mkdir(parents=True, exist_ok=True)
    record = _base(args, mesh, cfg, "save")
    record["checkpoint_bytes"] = _check_disk(args.dir, params, optimizer)
    params, state = _step(params, optimizer.init(params), optimizer)
    record["state_bytes_per_device"] = bytes_per_device((params, state))
    record["in_use_bytes_before"] = _device_bytes(mesh, "bytes_in_use")
    record["peak_bytes_before"] = _device_bytes(mesh, "peak_bytes_in_use")
    start = time.perf_counter()
    lwjax.save(args.dir / "checkpoint", params, state, optimizer)
    record["seconds"] = time.perf_counter() - start
    record["peak_bytes_after"] = _device_bytes(mesh, "peak_bytes_in_use")
    saved = {"mesh": record["mesh"], "workload": args.workload, "layers": record["layers"]}
    saved["fingerprints"] = fingerprints(params, state, optimizer)
    (args.dir / "fingerprints.json").write_text(json.dumps(saved, indent=1))
    record["leaves"] = len(saved["fingerprints"])
    return record


def restore(args) -> dict:

    saved = json.loads((args.dir / "fingerprints.json").read_text())
    mesh, cfg, abstract = _setting(args)
    record = _base(args, mesh, cfg, "restore")
    for key in ("workload", "layers"):
        if saved[key] != record[key]:
            raise SystemExit(
                f"--{key} {record[key]}: the checkpoint in {args.dir} was saved with {saved[key]}."
            )
    optimizer = lwjax_optimizer(abstract, mesh, cfg)
    record["saved_mesh"] = saved["mesh"]
    record["peak_bytes_before"] = _device_bytes(mesh, "peak_bytes_in_use")
    start = time.perf_counter()
    restored = lwjax.restore(args.dir / "checkpoint", optimizer, abstract)
    params, state = jax.block_until_ready(restored)
    record["seconds"] = time.perf_counter() - start
    record["peak_bytes_after"] = _device_bytes(mesh, "peak_bytes_in_use")
    record["state_bytes_per_device"] = bytes_per_device((params, state))
    got = fingerprints(params, state, optimizer)
    want = saved["fingerprints"]
    record["leaves"] = len(want)
    record["first_difference"] = next(
        (name for name in [*want, *got] if got.get(name) != want.get(name)), None
    )
    record["bitwise"] = record["first_difference"] is None
    return record


def _base(args, mesh, cfg, mode: str) -> dict:
    return dict(
        mode=mode,
        workload=args.workload,
        layers=cfg.model().num_layers,
        mesh=" x ".join(f"{name} {size}" for name, size in mesh.shape.items()),
        param_dtype=cfg.param_dtype,
        device=mesh.devices.flat[0].device_kind,
        jax=jax.__version__,
    )


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.3f} GiB"


def _line(r: dict) -> str:
    mesh = f"{r['saved_mesh']} -> {r['mesh']}" if "saved_mesh" in r else r["mesh"]
    parts = [
        f"{r['mode']} {r['workload']} ({r['layers']} layers), {mesh}:",
        f"state {_gib(r['state_bytes_per_device'])} per device,",
        f"peak {_gib(r['peak_bytes_before'])} before / {_gib(r['peak_bytes_after'])} after,",
        f"{r['seconds']:.1f} s, {r['leaves']} leaves",
    ]
    if "bitwise" in r:
        parts.append(
            "bitwise " + ("yes" if r["bitwise"] else f"NO (first {r['first_difference']})")
        )
    return " ".join(parts)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    record = (save if args.mode == "save" else restore)(args)
    print(json.dumps(record, indent=1) if args.json else _line(record))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.mode}.json").write_text(json.dumps(record, indent=1))
    if record.get("bitwise") is False:
        print(f"restore: {record['first_difference']} differs from what was saved", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
