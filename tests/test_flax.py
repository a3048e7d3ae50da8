"""lwjax on flax models: scanned vs unrolled nnx GPT, the fused-QKV split in the
sharded step, linen names."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lwjax
from lwjax import muon as muon_lib
from lwjax.tools.demo.model import GPT, GPTConfig, lwjax_routing, make_loss_fn, stack_blocks

CONFIG = GPTConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_hidden=64)
EXACT = lwjax.MuonConfig(fp32_matmul_prec="highest")


def mesh_of(dp):
    return Mesh(np.array(jax.devices()[:dp]), ("dp",))


def batches(steps, batch_size=8, seq_len=16, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(0, 256, (batch_size, seq_len + 1)).astype(np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def split(config, seed=0):
    graphdef, params, rest = nnx.split(GPT(config, rngs=nnx.Rngs(seed)), nnx.Param, ...)
    return params, make_loss_fn(graphdef, rest)


def replicated(tree, mesh):
    """Place a tree as the step returns it, so its second call reuses the first compilation."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def max_rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def test_scanned_and_unrolled_gpt_train_identically_at_dp4():
    unrolled, loss_unrolled = split(CONFIG)
    scanned_config = dataclasses.replace(CONFIG, scan_layers=True)
    template, loss_scanned = split(scanned_config, seed=1)
    scanned = stack_blocks(unrolled, template)  # same initial weights, stacked [L, ...]
    data = list(batches(3))

    mesh = mesh_of(4)
    unrolled, scanned = replicated(unrolled, mesh), replicated(scanned, mesh)
    opt_u = lwjax.layerwise_muon(unrolled, mesh, muon=EXACT, routing=lwjax_routing(CONFIG))
    opt_s = lwjax.layerwise_muon(scanned, mesh, muon=EXACT, routing=lwjax_routing(scanned_config))
    muon_u = [name for r in opt_u.plan.routes if r.is_muon for name in r.param_names()]
    muon_s = [name for r in opt_s.plan.routes if r.is_muon for name in r.param_names()]
    assert len(muon_u) == len(muon_s) == 5 * CONFIG.num_layers  # qkv, out, gate, up, down per layer
    assert "blocks/attn/qkv/kernel[1]" in muon_s
    assert not any(r.is_muon for r in opt_s.plan.routes if r.path.endswith("norm/scale"))

    step_u, step_s = (
        lwjax.make_train_step(loss_unrolled, opt_u),
        lwjax.make_train_step(loss_scanned, opt_s),
    )
    state_u, state_s = opt_u.init(unrolled), opt_s.init(scanned)
    for batch in data:  # (the first step's loss is that of the shared initial weights)
        unrolled, state_u, metrics_u = step_u(unrolled, state_u, batch)
        scanned, state_s, metrics_s = step_s(scanned, state_s, batch)
        np.testing.assert_allclose(metrics_u["loss"], metrics_s["loss"], rtol=1e-5)
        np.testing.assert_allclose(metrics_u["grad_norm"], metrics_s["grad_norm"], rtol=1e-5)
    expected = stack_blocks(unrolled, scanned)
    for route, got, want in zip(
        opt_s.plan.routes, jax.tree.leaves(scanned), jax.tree.leaves(expected)
    ):
        # Scan and unrolled loops round differently; Adam's g/sqrt(v) passes that on at full size
        # for tiny gradients (seen: 1e-5 here, 4e-5 on another CPU). Muon matrices agree to ~1e-6.
        tolerance = 1e-5 if route.is_muon else 1e-4
        assert max_rel_err(got, want) <= tolerance, (route.path, max_rel_err(got, want))
    moved = max(
        max_rel_err(a, b) for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(template))
    )
    assert moved > 1e-3  # the parameters really trained


@pytest.mark.parametrize(
    "scale_mode", ["spectral", "unit_rms_norm"]
)  # the second scales each piece differently
@pytest.mark.parametrize("pipeline_muon", [False, True])
def test_fused_qkv_split_in_sharded_step_matches_per_piece_muon(pipeline_muon, scale_mode):
    """flax kernels are [in, out]; the step must split q/k/v along the *output* features."""
    config = dataclasses.replace(
        CONFIG, num_layers=1, tied_embedding=True
    )  # (the untied head starts at zero)
    params, loss_fn = split(config)
    batch = next(batches(1))
    lr = 0.05
    opt = lwjax.layerwise_muon(
        params,
        mesh_of(4),
        learning_rate=lr,
        muon=dataclasses.replace(EXACT, scale_mode=scale_mode),
        config=lwjax.OptimizerConfig(weight_decay=0.0, clip_grad=None, pipeline_muon=pipeline_muon),
        routing=lwjax_routing(config),
    )
    assert {r.path: r.qkv_split_shapes for r in opt.plan.routes}["blocks/0/attn/qkv/kernel"] == (
        16,
        8,
        8,
    )
    kernel = params["blocks"][0]["attn"]["qkv"]["kernel"][...]
    grad = jax.jit(jax.grad(loss_fn))(params, batch)["blocks"][0]["attn"]["qkv"]["kernel"][
        ...
    ]  # full-batch mean
    new_params, _, _ = lwjax.make_train_step(loss_fn, opt, donate=False)(
        params, opt.init(params), batch
    )
    got = np.asarray(new_params["blocks"][0]["attn"]["qkv"]["kernel"][...])

    def expected(split_shapes):
        # First step from zero momentum: NS normalises, so the momentum scale (1 - beta) drops out.
        direction = muon_lib.orthogonalize(
            grad.T, precision="highest", scale_mode=scale_mode, qkv_split_shapes=split_shapes
        )
        return np.asarray(kernel - lr * direction.T)

    assert max_rel_err(got, expected((16, 8, 8))) <= 1e-5
    assert max_rel_err(got, expected(None)) > 1e-3  # the split made a difference


def test_linen_params_route_by_the_same_paths():
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1], name="up")(nn.RMSNorm(name="norm")(x))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(64, 16, name="embed")
            x = embed(tokens)
            for i in range(3):
                x = Block(name=f"blocks_{i}")(x)
            return embed.attend(x)

    params = LM().init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    opt = lwjax.layerwise_muon(
        params, mesh_of(2), routing=lwjax.RoutingRules(tied=["embed/embedding"])
    )
    routes = {r.path: r for r in opt.plan.routes}
    assert sorted(p for p, r in routes.items() if r.is_muon) == [
        f"blocks_{i}/up/kernel" for i in range(3)
    ]
    assert routes["embed/embedding"].is_tied and not routes["embed/embedding"].is_muon
    assert not routes["blocks_0/up/bias"].is_muon and not routes["blocks_0/norm/scale"].is_muon
