"""Does a change leave the compiled step alone? Dump and compare optimized HLO.

``dump OUT [--only NAME ...]`` builds each configuration below in a process of its own (8
virtual CPU devices, XLA's ``--xla_dump_to``), runs or compiles its steps, and writes every
module XLA optimized, normalized, to ``OUT/NAME/``: source metadata dropped, instructions and
computations renamed by order of first appearance, the module's own name dropped.
``diff BASE NEW`` compares two dumps configuration by configuration, as multisets of modules
(the order in which jax compiles small helpers is not the step's), and exits 1 on any
difference. Run ``dump`` once on the tree before the change, once after::

    PYTHONPATH=$OLD python docs/scripts/hlo_compare.py dump /tmp/hlo-before
    PYTHONPATH=$NEW python docs/scripts/hlo_compare.py dump /tmp/hlo-after
    python docs/scripts/hlo_compare.py diff /tmp/hlo-before /tmp/hlo-after

The configurations: the 1b workload's optimizer step at dp 4 (serial, pipelined, without
clipping, AdamW only, and ``init``), compiled on abstract shapes; small models for a fused QKV
split, parameter groups, broadcast sync, dp 3, groups (replica 2 x dp 2), an expert-parallel
MoE at dp 2 x ep 2; the optax form (``opt.update`` under ``jax.jit``, reduced and per-device
gradients); FSDP, dp 2 x tp 2 in each tensor-parallel mode and dp 2 x fsdp 2 x tp 2; and
``make_train_step`` with its options (aux, mutable + rng + accumulate, overlapped gather, the
host-chosen pipelined step). Only public names are used, so both trees run the same script.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

D, L, FFN, VOCAB = 32, 2, 64, 64


# --------------------------------------------------------------------------- configurations


def _jax():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    return jax


def _mesh(shape, names):
    import numpy as np
    from jax.sharding import Mesh

    jax = _jax()
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _small_params(seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = {
        "embed": (VOCAB, D),
        "layers/qkv": (L, D, 3 * D),
        "layers/proj": (L, D, D),
        "layers/up": (L, D, FFN),
        "layers/down": (L, FFN, D),
        "layers/norm": (L, D),
        "layers/bias": (L, FFN),
        "head": (D, VOCAB),
    }
    return {
        k: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) for k, s in shapes.items()
    }


def _small_rules(**extra):
    import lwjax

    return lwjax.RoutingRules(
        stacked={"layers/*": 1},
        qkv_split={"layers/qkv": (8, 4, 4)},
        is_muon={"embed": False, "head": False},
        **extra,
    )


def _grads(params, seed=1):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}


def _local_step(opt, params):
    """Compile ``opt.local_update`` in ``shard_map`` as the bench does: per-device gradients."""
    import jax
    from jax.sharding import PartitionSpec as P

    import lwjax

    specs = opt.param_specs if opt.param_specs is not None else P()
    data = opt.data_axes if isinstance(opt.data_axes, tuple) else (opt.data_axes,)

    def lead(spec):  # the data axes the leaf is not already split over (experts: over ep)
        used = {
            a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))
        }
        return P(tuple(a for a in data if a not in used), *spec)

    if isinstance(specs, P):
        grad_specs = lead(specs)
    else:
        grad_specs = jax.tree.map(lead, specs, is_leaf=lambda x: isinstance(x, P))

    def local(p, s, g):
        return opt.local_update(jax.tree.map(lambda x: x[0], g), s, p)

    step = lwjax.jit_shard_map(
        local, opt.mesh, (specs, opt.state_specs, grad_specs), (specs, opt.state_specs, P())
    )
    return step, grad_specs


def _workload(name="1b", **options):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwjax.tools import bench

    mesh = _mesh((4,), ("dp",))
    config = bench.workload_config(name)
    shapes = bench.workload_shapes(config)
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P())),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    opt = bench.workload_optimizer(
        params,
        mesh,
        config,
        ns_precision="medium",
        grad_reduce_in_fp32=True,
        policy="ns_cost",
        bucket_size="auto",
        **options,
    )
    return opt, params, mesh


def _compile_workload(**options):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    opt, params, mesh = _workload(**options)
    state = jax.eval_shape(opt.init, params)
    state = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        state,
        opt.state_specs,
    )
    grads = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (4, *x.shape), x.dtype, sharding=NamedSharding(mesh, P("dp"))
        ),
        params,
    )
    _local_step(opt, params)[0].lower(params, state, grads).compile()


def c_1b_serial():
    _compile_workload()


def c_1b_pipelined():
    _compile_workload(pipeline_muon=True)


def c_1b_noclip():
    _compile_workload(clip_grad=None)


def c_1b_adamw():
    _compile_workload(muon=False)


def c_1b_init():
    import jax

    opt, params, _ = _workload()
    jax.jit(opt.init).lower(params).compile()


def _run_local(opt, params, steps=1):
    """Run ``local_update`` on per-device gradients for a few steps (real arrays, small)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = opt.param_specs if opt.param_specs is not None else P()
    put = lambda t, s: jax.device_put(t, NamedSharding(opt.mesh, s))  # noqa: E731
    p = put(params, specs) if isinstance(specs, P) else jax.tree.map(put, params, specs)
    s = opt.init(p)
    step, grad_specs = _local_step(opt, params)
    if isinstance(grad_specs, P):
        grad_specs = {k: grad_specs for k in params}
    for i in range(steps):
        grads = _grads(params, seed=i + 1)
        g = {}
        for k, v in grads.items():  # every device its own gradient: a leading axis over the data
            lead = grad_specs[k][0]
            lead = lead if isinstance(lead, tuple) else (lead,)
            n = int(np.prod([opt.mesh.shape[a] for a in lead]))
            g[k] = np.stack([v * (1 + 0.1 * j) for j in range(n)])
        p, s, _ = step(p, s, g)
    jax.block_until_ready(p)


def _small_opt(mesh, **kwargs):
    import lwjax

    params = _small_params()
    return params, lwjax.layerwise_muon(
        params,
        mesh,
        routing=kwargs.pop("routing", _small_rules()),
        layout=lwjax.LayoutConfig(bucket_size=4000),
        **kwargs,
    )


def c_small_qkv():
    params, opt = _small_opt(_mesh((4,), ("dp",)))
    _run_local(opt, params, steps=2)


def c_small_groups():
    import lwjax

    rules = _small_rules(
        lr_mult={"layers/up": 0.5},
        wd_mult={"layers/down": 0.0, "embed": 2.0},
        grad_norm_group={"head": "mtp"},
    )
    params, opt = _small_opt(
        _mesh((4,), ("dp",)), routing=rules, config=lwjax.OptimizerConfig(clip_grad=1.0)
    )
    _run_local(opt, params)


def c_small_broadcast():
    import lwjax

    params, opt = _small_opt(
        _mesh((4,), ("dp",)), config=lwjax.OptimizerConfig(param_sync="broadcast")
    )
    _run_local(opt, params)


def c_small_dp3():
    params, opt = _small_opt(_mesh((3,), ("dp",)))
    _run_local(opt, params)


def c_small_replica_groups():
    params, opt = _small_opt(_mesh((2, 2), ("replica", "dp")), replica_axis="replica")
    _run_local(opt, params)


def c_moe_dp2_ep2():
    import numpy as np

    import lwjax

    rng = np.random.default_rng(0)
    params = {
        "embed": rng.standard_normal((VOCAB, D)).astype(np.float32),
        "experts/up": rng.standard_normal((4, D, FFN)).astype(np.float32) / 8,
        "experts/down": rng.standard_normal((4, FFN, D)).astype(np.float32) / 8,
        "router": rng.standard_normal((D, 4)).astype(np.float32),
        "attn": rng.standard_normal((D, D)).astype(np.float32) / 8,
    }
    opt = lwjax.layerwise_muon(
        params,
        _mesh((2, 2), ("dp", "ep")),
        expert_axis="ep",
        config=lwjax.OptimizerConfig(clip_grad=1.0),
        layout=lwjax.LayoutConfig(bucket_size=3000),
        routing=lwjax.RoutingRules(
            expert={"experts/*": 0}, is_muon={"embed": False, "router": False}
        ),
    )
    _run_local(opt, params, steps=2)


def _optax_step(opt, per_device=False, loss=None):
    import jax
    import optax

    import lwjax

    if per_device:
        grad_fn = lwjax.value_and_grad(loss, opt)

        @jax.jit
        def step(p, s, batch):
            _, g = grad_fn(p, batch)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step


def _mlp_loss(p, batch):
    import jax.numpy as jnp

    x, y = batch
    h = jnp.tanh(x @ p["layers/up"][0]) @ p["layers/down"][0]
    return jnp.mean((h - y) ** 2)


def c_optax_reduced():
    params, opt = _small_opt(_mesh((4,), ("dp",)))
    s = opt.init(params)
    step = _optax_step(opt)
    for i in range(2):
        params, s = step(params, s, _grads(params, seed=i + 1))


def c_optax_per_device():
    import numpy as np

    params, opt = _small_opt(_mesh((4,), ("dp",)))
    s = opt.init(params)
    step = _optax_step(opt, per_device=True, loss=_mlp_loss)
    rng = np.random.default_rng(0)
    batch = (
        rng.standard_normal((8, D)).astype(np.float32),
        rng.standard_normal((8, D)).astype(np.float32),
    )
    step(params, s, batch)


def _sharded(mesh, spec_of, param_axes, **kwargs):
    """A small model split as ``spec_of`` says, its optax step under jit (reduced grads)."""
    import jax
    from jax.sharding import NamedSharding

    import lwjax

    params = _small_params()
    specs = {k: spec_of(k) for k in params}
    put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in t.items()}  # noqa: E731
    p = put(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = lwjax.layerwise_muon(
            p,
            mesh,
            tensor_axis=param_axes,
            routing=_small_rules(),
            layout=lwjax.LayoutConfig(bucket_size=4000),
            **kwargs,
        )
    s = opt.init(p)
    step = _optax_step(opt)
    for i in range(2):
        p, s = step(p, s, put(_grads(params, seed=i + 1)))
    jax.block_until_ready(p)


def _tp_spec(k):
    from jax.sharding import PartitionSpec as P

    return {
        "embed": P("tp"),
        "layers/qkv": P(None, None, "tp"),
        "layers/proj": P(None, "tp"),
        "layers/up": P(None, None, "tp"),
        "layers/down": P(None, "tp"),
        "layers/bias": P(None, "tp"),
        "head": P(None, "tp"),
    }.get(k, P())


def _tp(mode):
    import lwjax

    _sharded(_mesh((2, 2), ("dp", "tp")), _tp_spec, "tp", muon=lwjax.MuonConfig(tp_mode=mode))


def c_tp_duplicated():
    _tp("duplicated")


def c_tp_distributed():
    _tp("distributed")


def c_tp_blockwise():
    _tp("blockwise")


def c_fsdp():
    from jax.sharding import PartitionSpec as P

    def spec(k):
        return (
            P("fsdp")
            if k in ("embed", "head")
            else (P(None, "fsdp") if k.startswith("layers") else P())
        )

    _sharded(_mesh((2, 4), ("dp", "fsdp")), spec, "fsdp")


def c_fsdp_tp():
    from jax.sharding import PartitionSpec as P

    def spec(k):
        return {
            "layers/up": P(None, "fsdp", "tp"),
            "layers/down": P(None, ("fsdp", "tp")),
            "layers/qkv": P(None, "fsdp", "tp"),
            "layers/norm": P(None, "fsdp"),
            "embed": P(("fsdp", "tp")),
        }.get(k, P())

    _sharded(_mesh((2, 2, 2), ("dp", "fsdp", "tp")), spec, ("fsdp", "tp"))


def _train(options=None, loss_kind="plain", calls=2, config=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lwjax

    options = options or {}
    params, opt = _small_opt(_mesh((4,), ("dp",)), config=config or lwjax.OptimizerConfig())
    rng = np.random.default_rng(0)
    batch = (
        rng.standard_normal((16, D)).astype(np.float32),
        rng.standard_normal((16, D)).astype(np.float32),
    )

    if loss_kind == "plain":
        loss = _mlp_loss
    elif loss_kind == "aux":

        def loss(p, b):
            value = _mlp_loss(p, b)
            return value, {"twice": 2 * value}
    else:  # mutable, rng

        def loss(p, model_state, b, key):
            x, y = b
            keep = jax.random.bernoulli(key, 0.9, x.shape)
            value = _mlp_loss(p, (jnp.where(keep, x, 0.0), y))
            return value, {"mean": model_state["mean"] * 0.9 + 0.1 * jnp.mean(x)}

    step = lwjax.make_train_step(loss, opt, **options)
    state = opt.init(params)
    extra = [{"mean": jnp.zeros(())}] if loss_kind == "mutable" else []
    key = [jax.random.key(0)] if loss_kind == "mutable" else []
    overlap = options.get("overlap_param_gather", False)
    p = params
    for _ in range(calls):
        args = ([] if overlap else [p]) + [state] + extra + [batch] + key
        out = step(*args)
        if overlap:
            state = out[0]
        else:
            p, state = out[0], out[1]
        if extra:
            extra = [out[-2]]
    jax.block_until_ready(state)


def c_train_plain():
    _train()


def c_train_aux():
    _train(loss_kind="aux", options={"has_aux": True})


def c_train_mutable_rng_accumulate():
    _train(loss_kind="mutable", options={"mutable": True, "rng": True, "accumulate": 2})


def c_train_overlap_gather():
    _train(options={"overlap_param_gather": True}, calls=2)


def c_train_pipelined_host():
    import lwjax

    # A clip that never binds: calls 0-1 run the serial step, calls 2-3 the speculative one.
    _train(config=lwjax.OptimizerConfig(pipeline_muon=True, clip_grad=100.0), calls=4)


CONFIGS = {name[2:]: fn for name, fn in sorted(globals().items()) if name.startswith("c_")}


# --------------------------------------------------------------------------- normalisation

_METADATA = re.compile(r",?\s*metadata=\{[^{}]*\}")
# Instruction, parameter and computation names: "%name", "name.12", "%name.12.3".
_NAME = re.compile(r"%[A-Za-z0-9_.\-]+|\b[A-Za-z_][A-Za-z0-9_\-]*(?:\.\d+)+\b")
_COMPUTATION = re.compile(r"^(?:%|ENTRY |ROOT )")


def normalize(text: str) -> str:
    """One module's text with every name that carries no meaning renamed by first appearance:
    the module's name, source metadata and the stack-frame tables dropped."""
    lines, in_tables = [], False
    for line in text.splitlines():
        if line.startswith("HloModule"):
            line = "HloModule " + " ".join(line.split()[2:])
        elif line == "FileNames":
            in_tables = True
        elif in_tables and _COMPUTATION.match(line):
            in_tables = False
        if not in_tables:
            lines.append(_METADATA.sub("", line).rstrip())
    names: dict[str, str] = {}

    def rename(match):
        return names.setdefault(match.group(0).lstrip("%"), f"n{len(names)}")

    return _NAME.sub(rename, "\n".join(lines)) + "\n"


# --------------------------------------------------------------------------- commands


def _run_config(name: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix=f"hlo-{name}-") as raw:
        env = dict(os.environ)
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = " ".join(
            (
                "--xla_backend_optimization_level=0",
                "--xla_llvm_disable_expensive_passes=true",
                f"--xla_dump_to={raw}",
                "--xla_dump_hlo_as_text",
            )
        )
        if subprocess.run([sys.executable, __file__, "_one", name], env=env).returncode:
            print(f"{name}: FAILED to build (see above)", flush=True)
            return
        target = out / name
        target.mkdir(parents=True, exist_ok=True)
        for old in target.glob("*.txt"):
            old.unlink()
        texts = [
            normalize(p.read_text()) for p in sorted(Path(raw).glob("*after_optimizations.txt"))
        ]
        for text in texts:
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            (target / f"{digest}.txt").write_text(text)
        print(f"{name}: {len(texts)} modules", flush=True)


def _modules(directory: Path) -> collections.Counter:
    return collections.Counter({p.stem: 1 for p in directory.glob("*.txt")})


def diff(base: Path, new: Path) -> int:
    failed = 0
    for config in sorted({p.name for p in base.iterdir()} | {p.name for p in new.iterdir()}):
        a, b = base / config, new / config
        if not a.exists() or not b.exists():
            print(f"{config}: only in {'new' if b.exists() else 'base'}")
            continue
        ma, mb = _modules(a), _modules(b)
        if ma == mb:
            print(f"{config}: identical ({len(ma)} modules)")
            continue
        failed += 1
        print(f"{config}: DIFFERENT")
        for stem in sorted(ma - mb):
            print(
                f"  only before: {stem} ({len((a / f'{stem}.txt').read_text().splitlines())} lines)"
            )
        for stem in sorted(mb - ma):
            print(
                f"  only after:  {stem} ({len((b / f'{stem}.txt').read_text().splitlines())} lines)"
            )
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump")
    dump.add_argument("out", type=Path)
    dump.add_argument("--only", nargs="*", choices=sorted(CONFIGS))
    compare = sub.add_parser("diff")
    compare.add_argument("base", type=Path)
    compare.add_argument("new", type=Path)
    one = sub.add_parser("_one")
    one.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "_one":
        _jax()
        warnings.simplefilter("ignore", DeprecationWarning)
        CONFIGS[args.name]()
        return 0
    if args.command == "dump":
        for name in args.only or sorted(CONFIGS):
            _run_config(name, args.out)
        return 0
    return diff(args.base, args.new)


if __name__ == "__main__":
    sys.exit(main())
