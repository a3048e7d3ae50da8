"""Where a training step's compile time goes, and how first-step time grows with the leaves.

``steps WORKLOAD [LAYERS]`` builds the training bench's lwjax Muon, lwjax AdamW and replicated
``optax.contrib.muon`` steps (``lwjax.tools.bench``, dp 1 on the first device) and times each
stage of ``jax.jit``'s compilation apart: ``trace`` (Python to jaxpr), ``lower`` (jaxpr to
StableHLO) and ``compile`` (XLA's passes, on GPU the GEMM autotuner and the Pallas kernels' Triton
compiles included), with the compiled module's size and custom calls. Every step compiles with
``make_train_step``'s XLA options (``lwjax.train_options.STEP_COMPILER_OPTIONS``: Triton GEMM
fusions off). Environment switches, one process each: ``XLA_DEFAULTS=1`` (XLA's default
options instead), ``XLA_FLAGS=--xla_gpu_autotune_level=0`` (no autotuning), ``NO_GRAM_KERNEL=1``
(Newton–Schulz's symmetric products as plain matmuls, ``lwjax.gram.fits`` false).

``kernels WORKLOAD [LAYERS]`` lowers the same lwjax Muon step for CUDA on any host (abstract
parameters; Pallas lowers its kernels to Triton in Python) and prints, per function of the module
that launches Pallas' Triton kernels, how many times the step calls it, each kernel's result
types, the size of its Triton IR and its accumulation loops (``tt.dot`` operations): the
kernels XLA will compile, counted before a GPU is needed. A kernel's loops compile as one
program: the 1b step's factor kernel with three loops took 2.5 s of the step's compile (LLVM to
PTX, then ptxas), with one loop 0.8 s (docs/benchmarks.md, thirty-seventh session).

``leaves COUNTS SECONDS`` trains one step of a model of ``n`` leaves (``n/2`` ``[32, 32]``
matrices and ``n/2`` biases) on 8 virtual CPU devices, with ``lwjax.make_train_step`` and with
replicated ``optax.contrib.muon`` in ``shard_map``, each count and contender in a process of its
own, and prints the build time, the first step's time (tracing, compiling, running) and the
process's peak RSS. Numbers: docs/benchmarks.md (thirteenth session).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time


def _timed_stages(step, args) -> dict:
    import jax

    from lwjax.train_options import STEP_COMPILER_OPTIONS

    options = {} if os.environ.get("XLA_DEFAULTS") else dict(STEP_COMPILER_OPTIONS)
    jax.clear_caches()
    start = time.perf_counter()
    traced = step.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    done = time.perf_counter()
    text = compiled.as_text()
    return {
        "trace_s": traced_at - start,
        "lower_s": lowered_at - traced_at,
        "compile_s": done - lowered_at,
        "stablehlo_lines": len(lowered.as_text().splitlines()),
        "optimized_hlo_lines": len(text.splitlines()),
        "custom_calls": text.count("custom-call("),
    }


def steps(workload: str, layers: int | None) -> dict:
    """The compile stages of the three training steps of one workload."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from lwjax.megatron.model import init_params
    from lwjax.tools import bench

    if os.environ.get("NO_GRAM_KERNEL"):
        import lwjax.gram

        lwjax.gram.fits = lambda *args, **kwargs: False
    cfg = bench.TrainBenchConfig(workload=workload, layers=layers)
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    config, loss = cfg.model(), cfg.loss()
    params = bench.replicated(init_params(config, jax.random.key(0), cfg.param_dtype), mesh)
    batch = bench.synthetic_batch(
        mesh, cfg.micro_batch or 4, cfg.seq_len or 2048, config.vocab_size
    )
    out = {}
    for name, muon in (("lwjax_muon", True), ("lwjax_adamw", False)):
        optimizer = bench.lwjax_optimizer(params, mesh, cfg, muon=muon)
        out[name] = _timed_stages(
            bench.lwjax_step(loss, optimizer), (params, optimizer.init(params), batch)
        )
    stacked = optax.contrib.MuonDimensionNumbers(reduction_axis=2, output_axis=1)
    dims = jax.tree.map(
        lambda x: stacked if x.ndim == 3 and x.shape[0] == config.num_layers else None, params
    )
    tx = optax.contrib.muon(
        learning_rate=1e-3, weight_decay=0.01, muon_weight_dimension_numbers=dims
    )
    out["optax_muon"] = _timed_stages(
        bench.optax_step(loss, tx, mesh), (params, jax.jit(tx.init)(params), batch)
    )
    return out


def triton_launches(text: str) -> dict[str, dict]:
    """Per function of a StableHLO module that launches Pallas' Triton kernels: ``calls`` (how
    many times the module calls it), and per kernel its ``results`` (types), ``ir_chars`` (its
    Triton IR as the module carries it, escaped) and ``dots`` (its ``tt.dot`` operations: one
    per accumulation loop the kernel's code holds)."""
    bodies = dict(re.findall(r"func\.func (?:private |public )?@(\w+)(.*?)\n  \}", text, re.S))
    out = {}
    for name, body in bodies.items():
        kernels = []
        for line in body.splitlines():
            if "custom_call @__gpu$xla.gpu.triton(" not in line:
                continue
            ir = re.search(r'\bir = "((?:[^"\\]|\\.)*)"', line)
            results = re.search(r"-> \(?(.*?)\)?$", line[ir.end() :])
            kernels.append(
                {
                    "results": results.group(1).split(", "),
                    "ir_chars": len(ir.group(1)),
                    "dots": _triton_text(ir.group(1)).count(" = tt.dot "),
                }
            )
        if kernels:
            out[name] = {"calls": len(re.findall(rf"call @{name}\(", text)), "kernels": kernels}
    return out


def _triton_text(escaped: str) -> str:
    """The Triton module a custom call carries (MLIR bytecode in an escaped string attribute:
    ``\\XX`` for a byte, ``\\\\`` for a backslash) as text."""
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir

    def byte(match):
        code = match.group(1)
        return b"\\" if code == b"\\" else bytes([int(code, 16)])

    data = re.sub(rb"\\(\\|[0-9A-Fa-f]{2})", byte, escaped.encode("latin-1"))
    with ir.Context() as context:
        triton.dialect.register_dialect(context)
        return str(ir.Module.parse(data))


def kernels(workload: str, layers: int | None) -> dict[str, dict]:
    """:func:`triton_launches` of the training bench's lwjax Muon step, lowered for CUDA."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwjax.megatron.model import init_params
    from lwjax.tools import bench

    cfg = bench.TrainBenchConfig(workload=workload, layers=layers)
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    config, loss = cfg.model(), cfg.loss()
    shapes = jax.eval_shape(
        lambda key: init_params(config, key, cfg.param_dtype), jax.random.key(0)
    )
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), shapes
    )
    batch = bench.synthetic_batch(
        mesh, cfg.micro_batch or 4, cfg.seq_len or 2048, config.vocab_size
    )
    optimizer = bench.lwjax_optimizer(params, mesh, cfg, muon=True)
    state = jax.eval_shape(optimizer.init, params)
    traced = bench.lwjax_step(loss, optimizer).trace(params, state, batch)
    return triton_launches(traced.lower(lowering_platforms=("cuda",)).as_text())


def _leaves_point(kind: str, n: int) -> dict:
    """One first step of an ``n``-leaf model under ``kind`` (``lwjax`` or ``optax``)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import lwjax

    mesh = Mesh(np.array(jax.devices()), ("dp",))
    rng = np.random.default_rng(0)
    params = {}
    for i in range(n // 2):
        params[f"block{i}/w"] = jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32)
        params[f"block{i}/b"] = jnp.zeros((32,), jnp.float32)

    def loss(p, x):
        return sum(jnp.mean((x @ p[f"block{i}/w"] + p[f"block{i}/b"]) ** 2) for i in range(n // 2))

    batch = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    start = time.perf_counter()
    if kind == "lwjax":
        optimizer = lwjax.layerwise_muon(params, mesh, learning_rate=0.02)
        state = optimizer.init(params)
        step = lwjax.make_train_step(loss, optimizer, donate=False)
    else:
        dims = {
            k: optax.contrib.MuonDimensionNumbers(0, 1) if k.endswith("/w") else None
            for k in params
        }
        tx = optax.contrib.muon(learning_rate=0.02, muon_weight_dimension_numbers=dims)
        state = tx.init(params)

        def local(p, s, x):
            grads = jax.lax.pmean(jax.grad(loss)(p, x), "dp")
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        step = lwjax.jit_shard_map(local, mesh, (P(), P(), P("dp")), (P(), P()))
    built = time.perf_counter()
    jax.block_until_ready(step(params, state, batch))
    return {
        "kind": kind,
        "leaves": n,
        "build_s": built - start,
        "first_step_s": time.perf_counter() - built,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def leaves(counts: list[int], seconds: float) -> None:
    """Each count and contender in a process of its own (peak RSS is per process)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for n in counts:
        for kind in ("optax", "lwjax"):
            command = [sys.executable, __file__, "_point", kind, str(n)]
            try:
                run = subprocess.run(
                    command, env=env, capture_output=True, text=True, timeout=seconds
                )
            except subprocess.TimeoutExpired:
                print(json.dumps({"kind": kind, "leaves": n, "timeout_s": seconds}), flush=True)
                continue
            lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else f"{kind} {n} failed: {run.stderr[-600:]}", flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["steps"]:
        print(json.dumps(steps(argv[1], int(argv[2]) if len(argv) > 2 else None), indent=1))
    elif argv[:1] == ["kernels"]:
        print(json.dumps(kernels(argv[1], int(argv[2]) if len(argv) > 2 else None), indent=1))
    elif argv[:1] == ["leaves"]:
        leaves([int(n) for n in argv[1].split(",")], float(argv[2]))
    elif argv[:1] == ["_point"]:
        print(json.dumps(_leaves_point(argv[1], int(argv[2]))), flush=True)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
