"""Layer-sharded data parallelism against the replicated ZeRO-1 training step (an experiment).

Device ``d`` of ``n`` owns layers ``d, d + n, ...`` whole: each stacked leaf is stored
``[L / n, n, ...]`` and split over ``fsdp`` on its second axis. The forward scans over the
``L / n`` groups of ``n`` consecutive layers and all-gathers a group (one layer from each
device) before running it; the transpose reduce-scatters the group's gradients inside the
backward scan. The embedding, output layer and final norm are split on their last axis and
gathered once (``--vocab``: the embedding and output layer split on the vocabulary instead,
so only tokens and activations move). ``layerwise_muon(..., param_axes="fsdp")`` with two
stacked axes then finds every matrix whole on its owner: Newton–Schulz runs there, with no
all-to-all and no gather of the model.

Timing (GPU; one JSON line per contender: step ms and ``profile_steps``' kernel summary)::

    python3 docs/scripts/layer_sharded.py --workload 1b --devices 4 [--vocab]

Check (CPU, 4 virtual devices, fp32, 8 layers): the layer-sharded steps against ZeRO-1's::

    python3 docs/scripts/layer_sharded.py --check

Numbers: docs/benchmarks.md, 2026-11-27 (fifth session).
"""

import argparse
import json
import os
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--workload", default="1b")
ARGS.add_argument("--devices", type=int, default=4)
ARGS.add_argument("--iters", type=int, default=10)
ARGS.add_argument("--modes", default="zero1,layers", help="zero1, layers, or both")
ARGS.add_argument("--vocab", action="store_true", help="vocabulary-parallel embedding and logits")
ARGS.add_argument("--check", action="store_true", help="CPU check against ZeRO-1 instead")
OPTIONS = ARGS.parse_args()
if OPTIONS.check:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from lwjax import LayoutConfig, RoutingRules, layerwise_muon  # noqa: E402
from lwjax.megatron.model import (  # noqa: E402
    _layer,
    attention_implementation,
    init_params,
    rms_norm,
    rope_tables,
)
from lwjax.muon import MuonConfig  # noqa: E402
from lwjax.optimizer import OptimizerConfig, named_shardings  # noqa: E402
from lwjax.tools import train_bench as tb  # noqa: E402
from lwjax.tools.bench import MATRIX_CONVENTION, profile_steps, time_steps  # noqa: E402

n = 4 if OPTIONS.check else OPTIONS.devices
small = dict(layers=8, param_dtype="float32", ns_precision="highest", seq_len=16, micro_batch=2)
cfg = tb.TrainBenchConfig(
    workload="small" if OPTIONS.check else OPTIONS.workload,
    dp_sizes=(n,),
    iters=OPTIONS.iters,
    baselines=False,
    **(small if OPTIONS.check else {}),
)
config = cfg.model()
L = config.num_layers
if L % n:
    sys.exit(f"{n} devices do not divide the {L} layers.")
devices = np.array(jax.devices()[:n])
flat_mesh = Mesh(devices, ("dp",))
mesh = Mesh(devices.reshape(1, n), ("dp", tb.FSDP_AXIS))
implementation = attention_implementation("auto", cfg.param_dtype)
dtype = jnp.dtype(cfg.param_dtype)


def run_group(x, p, cos, sin):
    """One scan step: this device's layer of the group, gathered into the group's ``n``."""
    group = jax.tree.map(lambda a: lax.all_gather(a, tb.FSDP_AXIS, axis=0, tiled=True), p)
    for k in range(n):
        x = _layer(x, jax.tree.map(lambda a, k=k: a[k], group), config, cos, sin, implementation)
    return x


def vocabulary_parallel_ends(params, tokens, labels, layers_fn):
    """Embedding lookup and cross-entropy over vocabulary blocks: tokens and activations move."""
    table, output = (
        params["embedding"]["word_embeddings"]["weight"],
        params["output_layer"]["weight"],
    )
    rows, index = table.shape[0], lax.axis_index(tb.FSDP_AXIS)
    first = index * rows

    def everyone(x):
        return lax.all_gather(x, tb.FSDP_AXIS, axis=0, tiled=True)

    local = everyone(tokens) - first
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[..., None], table[jnp.clip(local, 0, rows - 1)], 0).astype(dtype)
    x = lax.psum_scatter(x, tb.FSDP_AXIS, scatter_dimension=0, tiled=True)
    x = layers_fn(x)
    logits = jnp.einsum("bth,vh->btv", everyone(x), output, preferred_element_type=jnp.float32)
    top = lax.pmax(jnp.max(lax.stop_gradient(logits), axis=-1), tb.FSDP_AXIS)
    total = lax.psum(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1), tb.FSDP_AXIS)
    local = everyone(labels) - first
    hit = (local >= 0) & (local < rows)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)[..., 0]
    per_token = jnp.log(total) + top - lax.psum(jnp.where(hit, picked, 0.0), tb.FSDP_AXIS)
    batch = tokens.shape[0]  # this device's own tokens' losses
    return jnp.mean(lax.dynamic_slice_in_dim(per_token, index * batch, batch, axis=0))


def loss(params, batch):
    """The bench's GPT loss over layer groups (per device, inside ``shard_map``)."""
    tokens, labels = batch[:, :-1], batch[:, 1:]
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    cos, sin = rope_tables(tokens.shape[1], config.head_dim, config.rotary_base)
    final = tb.fsdp_gather(params["decoder"]["final_layernorm"]["weight"])

    def layers_fn(x):
        x, _ = lax.scan(
            lambda x, p: (run_group(x, p, cos, sin), None), x, params["decoder"]["layers"]
        )
        return rms_norm(x, final, config.norm_epsilon)

    if OPTIONS.vocab:
        return vocabulary_parallel_ends(params, tokens, labels, layers_fn)
    table = tb.fsdp_gather(params["embedding"]["word_embeddings"]["weight"])
    output = tb.fsdp_gather(params["output_layer"]["weight"])
    x = layers_fn(table[tokens])
    logits = jnp.einsum("bth,vh->btv", x, output, preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def specs():
    """Layers split on their group axis; the rest on the last axis (or the vocabulary)."""
    out = tb.fsdp_specs(config, n)
    layer = P(None, tb.FSDP_AXIS)
    out["decoder"]["layers"] = jax.tree.map(
        lambda _: layer, out["decoder"]["layers"], is_leaf=lambda x: isinstance(x, P)
    )
    if OPTIONS.vocab:
        out["embedding"]["word_embeddings"]["weight"] = P(tb.FSDP_AXIS, None)
        out["output_layer"]["weight"] = P(tb.FSDP_AXIS, None)
    return out


def layer_sharded(params):
    """``params``' stacked leaves ``[L, ...]`` as ``[L / n, n, ...]``, placed by ``specs``."""
    decoder = params["decoder"]
    layers = jax.tree.map(lambda x: x.reshape(L // n, n, *x.shape[1:]), decoder["layers"])
    params = dict(params, decoder=dict(decoder, layers=layers))
    return jax.device_put(params, named_shardings(mesh, specs()))


def optimizer(params, muon: bool):
    rules = config.routing_rules(muon=muon)
    return layerwise_muon(
        params,
        mesh,
        param_axes=tb.FSDP_AXIS,
        learning_rate=cfg.learning_rate,
        muon=MuonConfig(fp32_matmul_prec=cfg.ns_precision),
        config=OptimizerConfig(
            weight_decay=cfg.weight_decay,
            clip_grad=cfg.clip_grad,
            grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            matrix_convention=MATRIX_CONVENTION,
        ),
        layout=LayoutConfig(policy=cfg.policy, bucket_size=cfg.bucket_size),
        routing=RoutingRules(
            stacked={"decoder/layers/*": 2}, qkv_split=rules.qkv_split, is_muon=rules.is_muon
        ),
    )


def contender(mode: str, name: str):
    """``(fn(a, b) -> (a, b), args, step, batch)`` of one contender: time_steps' form."""
    params = init_params(config, jax.random.key(0), cfg.param_dtype)
    if mode == "zero1":
        batch = tb.synthetic_batch(flat_mesh, cfg.micro_batch, cfg.seq_len, config.vocab_size)
        params = jax.device_put(params, NamedSharding(flat_mesh, P()))
        if name == "fwd_bwd":
            step = tb.forward_backward_step(cfg.loss(), flat_mesh)
            return (lambda p, _: (p, step(p, batch))), (params, None), step, batch
        opt = tb.lwjax_optimizer(params, flat_mesh, cfg, muon=name == "muon")
        step = tb.lwjax_step(cfg.loss(), opt)
        return (lambda p, s: step(p, s, batch)[:2]), (params, opt.init(params)), step, batch
    axes = ("dp", tb.FSDP_AXIS)
    batch = tb.synthetic_batch(mesh, cfg.micro_batch, cfg.seq_len, config.vocab_size, axis=axes)
    params = layer_sharded(params)
    if name == "fwd_bwd":
        step = tb.forward_backward_step(loss, mesh, axis=axes, param_specs=specs())
        return (lambda p, _: (p, step(p, batch))), (params, None), step, batch
    opt = optimizer(params, name == "muon")
    step = tb.lwjax_step(loss, opt, fsdp=True)
    return (lambda p, s: step(p, s, batch)[:2]), (params, opt.init(params)), step, batch


def check():
    """Two steps of each optimizer both ways: the parameters, loss and gradient norm agree."""
    for name in ("muon", "adamw"):
        out = {}
        for mode in ("zero1", "layers"):
            _, (params, state), step, batch = contender(mode, name)
            for _ in range(2):
                params, state, value, norm = step(params, state, batch)
            # [L / n, n, ...] in row-major order is [L, ...]: compare the leaves flattened.
            flat = [np.ravel(np.asarray(x)) for x in jax.tree.leaves(params)]
            out[mode] = flat, float(value), float(norm)
        (a, loss_a, norm_a), (b, loss_b, norm_b) = out["zero1"], out["layers"]
        diff = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
        print(
            json.dumps(
                dict(
                    optimizer=name, loss=(loss_a, loss_b), grad_norm=(norm_a, norm_b), max_diff=diff
                )
            )
        )


def timings():
    for mode in OPTIONS.modes.split(","):
        for name in ("fwd_bwd", "adamw", "muon"):
            start = time.time()
            fn, args, _, _ = contender(mode, name)
            seconds, args = time_steps(fn, args, cfg.iters, 5)
            profile, args = profile_steps(fn, args, 3, f"/tmp/layer_sharded_{mode}_{name}")
            stats = jax.devices()[0].memory_stats() or {}
            print(
                json.dumps(
                    dict(
                        workload=cfg.workload,
                        devices=n,
                        mode=mode + ("+vocab" if OPTIONS.vocab and mode == "layers" else ""),
                        contender=name,
                        step_ms=seconds * 1e3,
                        wall_s=time.time() - start,
                        xla_flags=os.environ.get("XLA_FLAGS", ""),
                        peak_bytes=stats.get("peak_bytes_in_use"),
                        device=jax.devices()[0].device_kind,
                        **{k: v for k, v in profile.items() if k != "top_other_ms"},
                    )
                ),
                flush=True,
            )
            del args, fn


check() if OPTIONS.check else timings()
