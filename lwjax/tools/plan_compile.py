"""``lwjax plan --compile``: the training step compiled on abstract shapes, and what XLA says of it.

:func:`compiled_figures` builds the step for a GPT preset on a mesh of the current process's
devices, lowers it on ``jax.ShapeDtypeStruct`` arguments (nothing is allocated) and returns
XLA's memory estimate and the collectives one call runs
(:func:`lwjax.tools.bench.compiled.step_collectives`). :func:`compile_in_subprocess` runs it
in a fresh Python on N virtual CPU devices, so a laptop can compile a 64-device step; or,
with ``backend="gpu"`` on a machine with one GPU, on N GPUs that JAX mocks
(``mock_num_gpu_processes``: compiled for that GPU, never run), which gives the GPU
compiler's estimate: the CPU backend's differs (it computes and moves bf16 in fp32).

The step is the benchmark's (:func:`_training_step`, the one place that chooses it):
:func:`lwjax.tools.bench.train_steps.lwjax_step` over replicated parameters (``dp``) or
parameters split over ``fsdp``; with ``tp``, where lwjax has no tensor-parallel forward,
the optimizer's step alone (its ``local_update`` on local gradients).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from lwjax.tools.plan_model import PlanMesh, PlanOptions, gpt_model, partition_specs

OPTIMIZER_STEP = "optimizer step (lwjax has no tensor-parallel forward)"


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What to compile: a GPT preset, its layers, a mesh and the step's options."""

    preset: str
    layers: int | None
    mesh: PlanMesh
    options: PlanOptions
    backend: str = "cpu"  # "cpu" (virtual devices) or "gpu" (mocked GPUs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CompileRequest:
        obj = json.loads(text)
        return cls(
            obj["preset"],
            obj["layers"],
            PlanMesh(**obj["mesh"]),
            PlanOptions(**obj["options"]),
            obj.get("backend", "cpu"),
        )


def compiled_figures(request: CompileRequest) -> dict:
    """Compile the step of ``request`` on this process's first ``mesh.devices`` devices.

    Returns:
      ``step`` (which step was compiled), ``backend`` (``"cpu"`` or ``"gpu"``),
      ``held_bytes`` (parameters and optimizer state per device: the training step's
      arguments less its batch, or what the optimizer step returns), XLA's
      ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (donated) and ``temp_bytes``
      per device, ``widened_bytes`` (of the temporaries, the
      CPU backend's fp32 copies of bf16 weights, which a GPU does not make:
      :func:`~lwjax.tools.bench.compiled.widened_arguments`), and ``collectives``
      (:func:`~lwjax.tools.bench.compiled.step_collectives`).
    """
    import jax

    from lwjax.tools.bench.compiled import step_collectives, widened_arguments

    if request.mesh.replica > 1:
        raise ValueError(
            "--compile: the benchmark's step has no sharding groups; plan --replica without "
            "--compile."
        )
    if len(jax.devices()) < request.mesh.devices:
        raise ValueError(
            f"--compile: {request.mesh.devices} devices needed, {len(jax.devices())} present."
        )
    step, args, name, batch_bytes = _training_step(request)
    compiled = step.lower(*args).compile()
    stats, text = compiled.memory_analysis(), compiled.as_text()
    if batch_bytes is None:  # the optimizer step returns the parameters and the state
        held = stats.output_size_in_bytes
    else:  # the training step takes them, with the batch
        held = stats.argument_size_in_bytes - batch_bytes
    return dict(
        step=name,
        backend=jax.default_backend(),
        held_bytes=int(held),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        widened_bytes=widened_arguments(text),
        collectives={k: list(v) for k, v in step_collectives(text).items()},
    )


def _training_step(request: CompileRequest):
    """``(jitted step, abstract arguments, what it is, bytes of its batch)``: the benchmark's
    step for the request (see the module's docstring); the optimizer step's batch is
    ``None``: it takes gradients and the state and returns the parameters and the state."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwjax.optimizer import state_shardings
    from lwjax.parallel.gather import gather_params
    from lwjax.parallel.jit import jit_shard_map
    from lwjax.tools.bench.config import TrainBenchConfig
    from lwjax.tools.bench.train_steps import lwjax_optimizer, lwjax_step
    from lwjax.tools.bench.workloads import workload_optimizer

    mesh_shape, options = request.mesh, request.options
    model = gpt_model(request.preset, request.layers)
    names = [a for a in ("dp", "fsdp", "tp") if a == "dp" or mesh_shape.sizes[a] > 1]
    devices = np.array(jax.devices()[: mesh_shape.devices])
    mesh = Mesh(devices.reshape([mesh_shape.sizes[a] for a in names]), tuple(names))
    split = tuple(a for a in names if a != "dp")
    specs = partition_specs(model, mesh_shape)
    params = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        model.params,
        specs,
    )
    cfg = TrainBenchConfig(
        workload=model.workload,
        layers=model.layers,
        remat=options.remat_on(mesh_shape),
        seq_len=options.seq_len,
        micro_batch=options.micro_batch,
        grad_reduce_in_fp32=options.grad_reduce_in_fp32,
        ns_precision=options.ns_precision,
        policy=options.policy,
        bucket_size=options.bucket_size,
        fsdp="fsdp" in split,
        baselines=False,
    )
    if "tp" in split:  # lwjax_optimizer names fsdp alone
        optimizer = workload_optimizer(
            params,
            mesh,
            cfg.model(),
            ns_precision=cfg.ns_precision,
            grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            policy=cfg.policy,
            bucket_size=cfg.bucket_size,
            param_axes=split,
        )
    else:
        optimizer = lwjax_optimizer(params, mesh, cfg)
    state = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        jax.eval_shape(optimizer.init, params),
        state_shardings(optimizer),
    )
    if "tp" in split:  # no tensor-parallel forward in lwjax: the optimizer's step alone
        step = jit_shard_map(  # the parameters' dtypes are all it reads of them
            lambda grads, state: optimizer.local_update(grads, state, params)[:2],
            mesh,
            (optimizer.param_specs, optimizer.state_specs),
            (optimizer.param_specs, optimizer.state_specs),
            donate_argnums=(1,),
        )
        grads = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
        )
        return step, (grads, state), OPTIMIZER_STEP, None
    data = ("dp", "fsdp") if cfg.fsdp else "dp"
    step = lwjax_step(
        cfg.loss(gather=gather_params if cfg.fsdp else None), optimizer, fsdp=cfg.fsdp
    )
    rows = mesh_shape.data_devices * cfg.micro_batch
    batch = jax.ShapeDtypeStruct(
        (rows, cfg.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, P(data))
    )
    name = "training step (benchmark's, FSDP)" if cfg.fsdp else "training step (benchmark's)"
    return step, (params, state, batch), name, cfg.micro_batch * (cfg.seq_len + 1) * 4


BACKENDS = ("cpu", "gpu")


def compile_in_subprocess(request: CompileRequest, timeout: float | None = None) -> dict:
    """:func:`compiled_figures` in a fresh Python on ``mesh.devices`` virtual CPU devices, or
    mocked GPUs (``request.backend``).

    Raises:
      ValueError: an unknown backend; the child failed (its last lines of stderr).
    """
    if request.backend not in BACKENDS:
        raise ValueError(f"--compile-on must be one of {BACKENDS}; got {request.backend!r}.")
    n = request.mesh.devices
    if request.backend == "gpu":
        # No autotuning: mocked GPUs cannot time kernels (with it, compiling waited past
        # minutes where it took 10 s without, on one H200); the estimate is the default kernels'.
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cuda",
            "LWJAX_MOCK_GPUS": str(n),
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip(),
        }
    else:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(n),
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={n}".strip(),
        }
    result = subprocess.run(
        [sys.executable, "-m", "lwjax.tools.plan_compile"],
        input=request.to_json(),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if result.returncode:
        tail = result.stderr.strip().splitlines()[-3:]
        raise ValueError(f"--compile failed: {' / '.join(tail)}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    """Read a :class:`CompileRequest` as JSON on stdin; print :func:`compiled_figures` as JSON."""
    import jax

    if "LWJAX_MOCK_GPUS" in os.environ:  # before the backend starts
        jax.config.update("mock_num_gpu_processes", int(os.environ["LWJAX_MOCK_GPUS"]))
        try:
            jax.devices("gpu")
        except Exception as err:  # noqa: BLE001 (jax raises several kinds when it has no GPU)
            sys.exit(f"--compile-on gpu needs a GPU on this machine ({type(err).__name__})")
    else:
        jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAX_NUM_CPU_DEVICES", "1")))
    try:
        figures = compiled_figures(CompileRequest.from_json(sys.stdin.read()))
    except ValueError as err:
        sys.exit(str(err))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
