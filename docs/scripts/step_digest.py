"""Whether a change kept the optimizer step's bits: a digest of the bench's step after a few calls.

Builds ``lwjax bench``'s optimizer step for a workload on one device (dp 1, the bench's
defaults: bf16 parameters, fp32 masters, bf16 Newton–Schulz, clip 1.0, gradients of std 1e-2),
runs it ``--steps`` times and prints one JSON line: the SHA-256 of every parameter and state
leaf after them, the seconds to lower and compile the step, and XLA's estimate of its argument
and temporary bytes. ``--save FILE`` also writes the parameters; ``--compare FILE`` reads them
back and prints, per leaf that differs, how many elements differ and by how much.

To compare two commits in one call, run the old one from a copy of its package, in its own
directory (``python -m`` and ``PYTHONPATH=.`` put the working tree's ``lwjax`` first)::

    git archive OLD lwjax | tar -x -C /tmp/old
    (cd /tmp/old && PYTHONPATH=. python $PWD/docs/scripts/step_digest.py 1b --save /tmp/old.npz)
    PYTHONPATH=. python docs/scripts/step_digest.py 1b --compare /tmp/old.npz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import jax
import numpy as np
from jax.sharding import Mesh

from lwjax.tools.bench.config import BenchConfig
from lwjax.tools.bench.optimizer_contenders import built_lwjax, optimizer_step
from lwjax.tools.bench.workloads import workload_config


def digest(workload: str, steps: int) -> tuple[dict, list]:
    """The JSON record of ``steps`` calls of the workload's step, and its parameter leaves
    ``(path, array)``."""
    cfg = BenchConfig(workload=workload, dp_sizes=(1,))
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    opt, mesh, params, state, grads = built_lwjax(cfg, workload_config(workload), mesh)
    step = optimizer_step(opt)
    start = time.perf_counter()
    memory = step.lower(params, state, grads).compile().memory_analysis()
    compile_s = time.perf_counter() - start
    for _ in range(steps):
        params, state = step(params, state, grads)
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves((params, state)):
        sha.update(np.asarray(jax.device_get(leaf)).tobytes())
    record = dict(
        workload=workload,
        steps=steps,
        sha256=sha.hexdigest(),
        compile_s=round(compile_s, 2),
        argument_gb=round(memory.argument_size_in_bytes / 1e9, 3),
        temp_gb=round(memory.temp_size_in_bytes / 1e9, 3),
    )
    leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(params)]
    return record, leaves


def differences(leaves, saved) -> list[dict]:
    """Per parameter leaf that differs from ``saved`` (``--save``'s file): the count of
    differing elements and the largest and median difference relative to the element."""
    out = []
    for k, (path, leaf) in enumerate(leaves):
        new = np.asarray(jax.device_get(leaf), np.float32)
        old = np.asarray(saved[str(k)], np.float32)
        differ = new != old
        if differ.any():
            relative = np.abs(new - old)[differ] / np.maximum(np.abs(old)[differ], 1e-30)
            out.append(
                dict(
                    leaf=path,
                    differing=int(differ.sum()),
                    of=new.size,
                    max_relative=float(relative.max()),
                    median_relative=float(np.median(relative)),
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", help="a key of lwjax.tools.bench.WORKLOADS")
    parser.add_argument("--steps", type=int, default=3)
    io = parser.add_mutually_exclusive_group()
    io.add_argument("--save", metavar="FILE", help="write the parameters (.npz)")
    io.add_argument("--compare", metavar="FILE", help="compare the parameters with a --save")
    args = parser.parse_args()
    record, leaves = digest(args.workload, args.steps)
    if args.save:
        arrays = {
            str(k): np.asarray(jax.device_get(x), np.float32) for k, (_, x) in enumerate(leaves)
        }
        np.savez(args.save, **arrays)
    if args.compare:
        with np.load(args.compare) as saved:
            record["differences"] = differences(leaves, saved)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
