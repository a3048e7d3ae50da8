r"""A worker for the multi-process tests: a small residual-MLP language model on random
tokens, trained with lwjax.

Run it directly (one process, ``LWJAX_CPU_DEVICES`` devices) or under
``lwjax launch`` (several processes; every process loads only its rows of each
global batch). The test imports it too, for the single-process reference and
to restore the checkpoint it writes.

    lwjax launch --nproc 2 --devices-per-proc 4 -- \
        python tests/workers/train_worker.py --steps 3 --out DIR

With ``--fsdp N`` the mesh is ``("dp", "fsdp")`` with ``N`` consecutive devices per ``fsdp``
group, every leaf split over ``fsdp`` on its last axis and gathered in the loss
(:func:`lwjax.gather_params`), the batch split over both axes.

Writes (process 0) ``DIR/result.npz``: parameters and the logical optimizer
state, gathered from every process; with ``--save``, the lwjax checkpoint
``DIR/ckpt`` (written by every process together); with ``--restore CKPT``,
``DIR/restored.npz``: CKPT restored on this job's mesh. ``--die-after K`` makes
process ``--die-process`` exit abruptly (``os._exit(1)``, or raise with
``--die-how raise``) after step K; ``--hang-process`` then sleeps on the host
(``--hang-seconds``) instead of entering the next step: longer than the heartbeat, only JAX's
heartbeat can notice; a second, and it meets the dead process at its next collective, after
that process has surely ended.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from lwjax import LayoutConfig

GLOBAL_BATCH = 32
SEQ_LEN = 8
VOCAB = 64
WIDTH = 32
HIDDEN = 64
LAYERS = 2
HANG_SECONDS = 120


def make_params(seed: int = 0) -> dict:
    """Host (numpy) parameters, the same on every process."""
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    params = {
        "embed": {"embedding": w(VOCAB, WIDTH)},
        "head": {"kernel": w(WIDTH, VOCAB)},
        "norm": {"scale": np.ones(WIDTH, np.float32)},
    }
    for i in range(LAYERS):
        params[f"layer{i}"] = {
            "up": w(WIDTH, HIDDEN),
            "down": w(HIDDEN, WIDTH),
            "b_up": np.zeros(HIDDEN, np.float32),
            "ln": {"scale": np.ones(WIDTH, np.float32)},
        }
    return params


def loss_fn(params, batch):
    import jax
    import jax.numpy as jnp

    import lwjax

    params = lwjax.gather_params(params)  # FSDP blocks whole (whole leaves pass through)

    def norm(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

    x = params["embed"]["embedding"][batch["inputs"]]
    for i in range(LAYERS):
        p = params[f"layer{i}"]
        x = x + jax.nn.gelu(norm(x, p["ln"]["scale"]) @ p["up"] + p["b_up"]) @ p["down"]
    logits = norm(x, params["norm"]["scale"]) @ params["head"]["kernel"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))


def global_batch_at(step: int) -> dict:
    """The whole global batch of ``step`` (any process can compute any rows of it)."""
    rng = np.random.default_rng(1000 + step)
    tokens = rng.integers(0, VOCAB, size=(GLOBAL_BATCH, SEQ_LEN + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def fsdp_mesh(fsdp: int):
    """``("dp", "fsdp")`` over every process's devices, ``fsdp`` consecutive ones a group."""
    from jax.sharding import Mesh

    from lwjax import distributed

    devices = distributed.global_mesh().devices
    return Mesh(devices.reshape(-1, fsdp), ("dp", "fsdp"))


def placed(params, mesh):
    """Host parameters on ``mesh``: split over ``fsdp`` on their last axis where it exists."""
    import jax
    from jax.sharding import PartitionSpec as P

    from lwjax import distributed

    if "fsdp" not in mesh.axis_names:
        return distributed.replicate(params, mesh)
    specs = jax.tree.map(lambda x: P(*[None] * (x.ndim - 1), "fsdp"), params)
    return distributed.place(params, mesh, specs)


def make_optimizer(params, mesh):
    import lwjax
    from lwjax.optimizer import OptimizerConfig

    if "fsdp" in mesh.axis_names:
        params = placed(params, mesh)
    return lwjax.layerwise_muon(
        params,
        mesh,
        param_axes="fsdp" if "fsdp" in mesh.axis_names else None,
        learning_rate=0.02,
        muon=lwjax.MuonConfig(
            momentum=0.9, nesterov=True, fp32_matmul_prec="highest", extra_scale_factor=0.2
        ),
        config=OptimizerConfig(weight_decay=0.1, clip_grad=1.0),
        layout=LayoutConfig(bucket_size=4096),
    )


def flat(tree) -> dict:
    """``{key path: leaf}`` of a pytree, ``None`` leaves dropped."""
    import jax

    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def train(
    mesh,
    steps: int,
    *,
    die_after: int | None = None,
    die_process: int = 1,
    die_how: str = "exit",
    hang_process: int | None = None,
    hang_seconds: float = HANG_SECONDS,
    log=print,
):
    """Train ``steps`` steps on ``mesh``; return ``(optimizer, params, state, losses)``.

    Each process loads only its rows of each global batch (``process_rows``).
    """
    import jax

    import lwjax
    from lwjax import distributed

    params = make_params()
    optimizer = make_optimizer(params, mesh)
    params = placed(params, mesh)
    state = optimizer.init(params)
    fsdp = ("fsdp",) if "fsdp" in mesh.axis_names else ()
    step_fn = lwjax.make_train_step(
        loss_fn, optimizer, options=lwjax.TrainStepOptions(fsdp_axes=fsdp)
    )
    axes = (*mesh.axis_names,) if fsdp else "dp"
    rows = distributed.process_rows(GLOBAL_BATCH, mesh, axis=axes)
    losses = []
    for step in range(steps):
        local = {k: v[rows] for k, v in global_batch_at(step).items()}
        batch = distributed.global_batch(local, mesh, axis=axes)
        params, state, metrics = step_fn(params, state, batch)
        losses.append(float(metrics["loss"]))
        log(f"step {step} loss {losses[-1]:.6f} rows {rows.start}:{rows.stop}")
        if die_after is not None and step + 1 == die_after and jax.process_index() == hang_process:
            log(f"process {hang_process} sleeps on the host, outside any collective")
            time.sleep(hang_seconds)
        if die_after is not None and step + 1 == die_after and jax.process_index() == die_process:
            log(f"simulated crash of process {die_process} after step {step + 1}")
            if die_how == "raise":
                raise RuntimeError(f"simulated failure of process {die_process}")
            os._exit(1)
    return optimizer, params, state, losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--save", action="store_true")
    p.add_argument(
        "--restore",
        default=None,
        metavar="CKPT",
        help="also restore this checkpoint on the job's mesh and write DIR/restored.npz",
    )
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--die-process", type=int, default=1)
    p.add_argument(
        "--die-how",
        choices=("exit", "raise"),
        default="exit",
        help="os._exit(1) (a crash) or an uncaught exception",
    )
    p.add_argument(
        "--hang-process",
        type=int,
        default=None,
        help="this process sleeps (outside any collective) after step --die-after",
    )
    p.add_argument("--hang-seconds", type=float, default=HANG_SECONDS)
    p.add_argument("--fsdp", type=int, default=None, help="devices per fsdp group")
    args = p.parse_args(argv)

    from lwjax import distributed

    start = time.perf_counter()
    info = distributed.initialize()
    import jax

    from lwjax import checkpoint
    from lwjax.logical import to_logical

    mesh = distributed.global_mesh() if args.fsdp is None else fsdp_mesh(args.fsdp)
    print(
        f"process {info.process_id}/{info.num_processes}: {jax.local_device_count()} local, "
        f"{jax.device_count()} global devices, init {time.perf_counter() - start:.2f}s",
        flush=True,
    )
    optimizer, params, state, losses = train(
        mesh,
        args.steps,
        die_after=args.die_after,
        die_process=args.die_process,
        die_how=args.die_how,
        hang_process=args.hang_process,
        hang_seconds=args.hang_seconds,
        log=lambda s: print(s, flush=True),
    )
    host = distributed.gather_to_host({"params": params, "state": to_logical(optimizer, state)})
    if args.save:
        checkpoint.save(os.path.join(args.out, "ckpt"), params, state, optimizer)
    if args.out and info.is_main:
        np.savez(os.path.join(args.out, "result.npz"), losses=np.asarray(losses), **flat(host))
    if args.restore:
        optimizer = make_optimizer(make_params(), mesh)
        params, state = checkpoint.restore(args.restore, optimizer)
        restored = distributed.gather_to_host(
            {"params": params, "state": to_logical(optimizer, state)}
        )
        if info.is_main:
            np.savez(os.path.join(args.out, "restored.npz"), **flat(restored))
    distributed.barrier("train_worker done")
    print(f"done in {time.perf_counter() - start:.2f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
