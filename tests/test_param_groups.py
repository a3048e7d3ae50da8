"""Megatron's parameter groups: lr/wd multipliers, Muon opt-out, separate grad-norm
groups; tied embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from reference import Reference, reference_train
from test_optimizer import CONFIG, LR, MUON, mesh_of, random_grads, run_sharded, toy_params

from lwjax import LayoutConfig, RoutingRules
from lwjax.optimizer import OptimizerConfig, layerwise_muon
from lwjax.train import make_train_step

GROUPS = {
    "is_muon": {"layer1/wo": False},  # per-parameter opt-out (Megatron's use_muon=False)
    "lr_mult": {"layer0/*": 0.5, "head/*": 2.0, "norm/*": 3.0},
    "wd_mult": {"layer1/*": 0.0, "embed/*": 2.0, "layer2/up": 0.5},
    "grad_norm_group": {"layer3/*": "mtp", "head/*": "mtp"},
}


def _rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)


def test_multipliers_opt_out_and_norm_groups_match_reference():
    params = toy_params()
    grads = random_grads(params, 4, steps=3)
    opt = layerwise_muon(
        params,
        mesh_of(4),
        learning_rate=LR,
        muon=MUON,
        config=CONFIG,
        layout=LayoutConfig(bucket_size=2000),
        routing=RoutingRules(**GROUPS),
    )
    routes = {r.path: r for r in opt.plan.routes}
    assert not routes["layer1/wo"].is_muon and routes["layer0/wo"].is_muon
    assert (
        routes["layer0/up"].lr_mult,
        routes["layer1/up"].wd_mult,
        routes["head/kernel"].grad_norm_group,
    ) == (0.5, 0, "mtp")
    assert {(g.lr_mult, g.wd_mult) for b in opt.plan.buffers for g in b.slot_groups} >= {
        (0.5, 1.0),
        (1.0, 0.0),
        (1.0, 0.5),
    }
    got, _, metrics = run_sharded(opt, params, grads)
    ref = Reference(
        params,
        opt.plan.routes,
        lr=LR,
        weight_decay=CONFIG.weight_decay,
        clip_grad=CONFIG.clip_grad,
        muon_config=MUON,
    )
    for device_grads in grads:
        flat = [jax.tree.leaves(g) for g in device_grads]
        norms, _ = ref.step([sum(d[i] for d in flat) / len(flat) for i in range(len(flat[0]))])
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref.params())
    ):
        assert _rel_err(a, b) <= 1e-5, (jax.tree_util.keystr(path), _rel_err(a, b))
    np.testing.assert_allclose(metrics["grad_norm"], norms[None], rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm/mtp"], norms["mtp"], rtol=1e-5)
    assert float(metrics["clip_coef/mtp"]) < 1 and float(metrics["clip_coef"]) < 1


def test_norm_groups_clip_separately_by_hand():
    # Elementwise identity, lr 1, no decay: each parameter moves by exactly its clipped mean
    # gradient.
    params = {"a": jnp.zeros(6), "b": jnp.zeros(5), "mtp": {"w": jnp.zeros(4)}}
    per_device = [
        {
            "a": np.full(6, 2.0, np.float32),
            "b": np.full(5, 1.0, np.float32),
            "mtp": {"w": np.full(4, 0.5, np.float32)},
        },
        {
            "a": np.full(6, 0.0, np.float32),
            "b": np.full(5, 3.0, np.float32),
            "mtp": {"w": np.full(4, -0.25, np.float32)},
        },
    ]
    config = OptimizerConfig(weight_decay=0.0, clip_grad=1.0)
    opt = layerwise_muon(
        params,
        mesh_of(2),
        learning_rate=1.0,
        elementwise=optax.identity(),
        config=config,
        routing=RoutingRules(grad_norm_group={"mtp/*": "mtp"}),
    )
    got, _, metrics = run_sharded(opt, params, [per_device])
    # Mean gradients: a = 1 (x6), b = 2 (x5), w = 0.125 (x4).
    main, mtp = np.sqrt(6 * 1.0 + 5 * 4.0), np.sqrt(4 * 0.125**2)  # sqrt(26), 0.25
    np.testing.assert_allclose(
        [metrics["grad_norm"], metrics["grad_norm/mtp"]], [main, mtp], rtol=1e-6
    )
    np.testing.assert_allclose(
        [metrics["clip_coef"], metrics["clip_coef/mtp"]], [1 / (main + 1e-6), 1.0], rtol=1e-6
    )
    np.testing.assert_allclose(got["a"], np.full(6, -1.0 / (main + 1e-6)), rtol=1e-6)
    np.testing.assert_allclose(got["b"], np.full(5, -2.0 / (main + 1e-6)), rtol=1e-6)
    np.testing.assert_allclose(got["mtp"]["w"], np.full(4, -0.125), rtol=1e-6)


def _tied_params(seed=0, vocab=32, d=16, ff=32, layers=2):
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa: E731
    params = {"wte": {"embedding": jnp.asarray(rng.standard_normal((vocab, d)) * 0.5, jnp.float32)}}
    for i in range(layers):
        params[f"layer{i}"] = {"up": w(d, ff), "down": w(ff, d), "ln": {"scale": jnp.ones(d)}}
    return params


def _tied_loss(params, batch):
    """The embedding table is both the input lookup and the output projection."""
    tokens, targets = batch
    table = params["wte"]["embedding"]
    x = table[tokens]
    for name in sorted(k for k in params if k.startswith("layer")):
        p = params[name]
        h = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["ln"]["scale"]
        x = x + jnp.tanh(h @ p["up"]) @ p["down"]
    logits = x @ table.T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1))


def test_tied_embedding_model_matches_reference():
    params = _tied_params()
    rng = np.random.default_rng(5)
    batches = [
        (rng.integers(0, 32, 32).astype(np.int32), rng.integers(0, 32, 32).astype(np.int32))
        for _ in range(3)
    ]
    opt = layerwise_muon(
        params,
        mesh_of(4),
        learning_rate=LR,
        muon=MUON,
        config=CONFIG,
        layout=LayoutConfig(bucket_size=600),
        routing=RoutingRules(tied=["wte/embedding"]),
    )
    (route,) = [r for r in opt.plan.routes if r.path == "wte/embedding"]
    assert route.is_tied and not route.is_muon
    (buffer,) = [b for b in opt.plan.buffers if "wte/embedding" in b.layout.param_index_map]
    bucket = buffer.layout.param_index_map["wte/embedding"][2]
    # Not isolated, as megatron-core lays out a tied embedding at pipeline size 1.
    assert [n for n, (_, _, k) in buffer.layout.param_index_map.items() if k == bucket] != [
        "wte/embedding"
    ]
    assert_trains_like_the_reference(opt, params, opt.init(params), batches)


def assert_trains_like_the_reference(opt, params, state, batches):
    """``make_train_step`` on the tied model matches the unsharded reference (1e-5)."""
    step = make_train_step(_tied_loss, opt, donate=False)
    p = params
    for batch in batches:
        p, state, metrics = step(p, state, batch)
    ref, stats = reference_train(
        params,
        _tied_loss,
        batches,
        opt.plan.routes,
        lr=LR,
        weight_decay=CONFIG.weight_decay,
        clip_grad=CONFIG.clip_grad,
        muon_config=MUON,
    )
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(p)[0], jax.tree.leaves(ref.params())
    ):
        assert _rel_err(a, b) <= 1e-5, (jax.tree_util.keystr(path), _rel_err(a, b))
    np.testing.assert_allclose(metrics["grad_norm"], stats[-1][0][None], rtol=1e-5)


@pytest.mark.parametrize(
    "rule,match",
    [
        ({"lr_mult": {"a": -1.0}}, "a: lr_mult must be a finite number >= 0"),
        ({"wd_mult": {"a": float("nan")}}, "a: wd_mult must be a finite number >= 0"),
        ({"grad_norm_group": {"a": 3}}, "a: grad_norm_group must be a non-empty string"),
    ],
    ids=["negative_lr_mult", "nan_wd_mult", "int_group"],
)
def test_bad_group_options_name_the_parameter(rule, match):
    with pytest.raises(ValueError, match=match):
        layerwise_muon({"a": jnp.zeros((4, 4))}, mesh_of(2), routing=RoutingRules(**rule))
