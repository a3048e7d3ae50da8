"""Expert parallelism: an MoE model at dp x ep against an unsharded reference;
broadcast param sync."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from reference import reference_train

from lwjax import LayoutConfig, RoutingRules, TrainStepOptions
from lwjax.logical import from_logical, to_logical
from lwjax.muon import MuonConfig
from lwjax.optimizer import OptimizerConfig, layerwise_muon
from lwjax.train import make_train_step

MUON = MuonConfig(momentum=0.9, nesterov=True, fp32_matmul_prec="highest", extra_scale_factor=0.2)
CONFIG = OptimizerConfig(weight_decay=0.1, clip_grad=1.0)
LR = 0.02
# Sharded and unsharded gradients differ by summation order (~4e-9 here). Adam's direction
# g / (|g| + eps) has slope ~1/eps where |g| ~ eps, and expert biases get such gradients
# (1e-7, 1e-4, ...): a larger eps keeps that noise below the 1e-5 tolerance without changing
# what is compared.
ADAM = (0.9, 0.999, 1e-3)
EXPERTS, TOP_K, VOCAB, D, FF = 8, 2, 32, 8, 16
ROUTING = {"expert": ["*/experts/*"]}  # [E, ...] leaves: one parameter per expert


def moe_params(seed=0, layers=2):
    rng = np.random.default_rng(seed)
    w = lambda *s, fan: jnp.asarray(rng.standard_normal(s) / np.sqrt(fan), jnp.float32)  # noqa: E731
    params = {
        "embed": {"embedding": w(VOCAB, D, fan=1)},
        "head": {"kernel": w(D, VOCAB, fan=D)},
        "norm": {"scale": jnp.ones(D)},
    }
    for i in range(layers):
        params[f"layer{i}"] = {
            "mix": w(D, D, fan=D),
            "router": w(D, EXPERTS, fan=D),
            "ln": {"scale": jnp.ones(D)},
            "experts": {
                "up": w(EXPERTS, D, FF, fan=D),
                "down": w(EXPERTS, FF, D, fan=FF),
                "b_up": jnp.zeros((EXPERTS, FF)),
            },
        }
    return params


def _rms(x):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _moe(h, p, ep_axis):
    """Top-k MoE. With ``ep_axis``: gather the group's tokens, run the local experts,
    scatter the sum back."""
    up, down, bias = p["experts"]["up"], p["experts"]["down"], p["experts"]["b_up"]
    local = up.shape[0]
    h_all = lax.all_gather(h, ep_axis, tiled=True) if ep_axis else h
    first = lax.axis_index(ep_axis) * local if ep_axis else 0
    top, index = lax.top_k(h_all @ p["router"], TOP_K)
    gates = jnp.sum(
        jax.nn.one_hot(index, EXPERTS) * jax.nn.softmax(top, axis=-1)[..., None], axis=1
    )
    gates = lax.dynamic_slice_in_dim(gates, first, local, axis=1)
    hidden = jax.nn.gelu(jnp.einsum("nd,edf->enf", h_all, up) + bias[:, None, :])
    out = jnp.einsum("enf,efd,ne->nd", hidden, down, gates)
    return lax.psum_scatter(out, ep_axis, tiled=True) if ep_axis else out


def moe_loss(params, batch, ep_axis=None):
    tokens, targets = batch
    x = params["embed"]["embedding"][tokens]
    for name in sorted(k for k in params if k.startswith("layer")):
        p = params[name]
        x = x + jnp.tanh(_rms(x) * p["ln"]["scale"] @ p["mix"])
        x = x + _moe(_rms(x), p, ep_axis)
    logits = _rms(x) * params["norm"]["scale"] @ params["head"]["kernel"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1))


def batches(steps=3, tokens=64, seed=3):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.integers(0, VOCAB // 2, tokens).astype(np.int32),
            rng.integers(0, VOCAB, tokens).astype(np.int32),
        )
        for _ in range(steps)
    ]


def mesh_of(dp, ep):
    return Mesh(np.array(jax.devices()[: dp * ep]).reshape(dp, ep), ("dp", "ep"))


def trained(
    dp,
    ep,
    param_sync="all_gather",
    pipeline_muon=False,
    clip_grad=CONFIG.clip_grad,
    seed=3,
    overlap_param_gather=False,
):
    """Three steps at ``dp`` x ``ep``: the optimizer, parameters, state and metrics; each setting
    trained once in the module however its arguments are spelled (the results are read only)."""
    return _trained(dp, ep, param_sync, pipeline_muon, clip_grad, seed, overlap_param_gather)


@functools.cache
def _trained(dp, ep, param_sync, pipeline_muon, clip_grad, seed, overlap_param_gather):
    params = moe_params()
    config = OptimizerConfig(
        weight_decay=CONFIG.weight_decay,
        clip_grad=clip_grad,
        param_sync=param_sync,
        pipeline_muon=pipeline_muon,
    )
    opt = layerwise_muon(
        params,
        mesh_of(dp, ep),
        expert_axis="ep",
        learning_rate=LR,
        muon=MUON,
        config=config,
        elementwise=optax.scale_by_adam(*ADAM),
        layout=LayoutConfig(bucket_size=1500),
        routing=RoutingRules(**ROUTING),
    )
    step = make_train_step(
        functools.partial(moe_loss, ep_axis="ep"),
        opt,
        donate=False,
        options=TrainStepOptions(overlap_param_gather=overlap_param_gather),
    )
    state, metrics = opt.init(params), []
    if overlap_param_gather:  # the parameters live in the state's masters between steps
        params = None
    for batch in batches(seed=seed):
        params, state, m = step(params, state, batch)
        metrics.append(jax.device_get(m))
    if overlap_param_gather:
        params = opt.gather_params(state)
    return opt, params, state, metrics


def _assert_close(got, want, what):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (what, jax.tree_util.keystr(path))
        err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
        assert err <= 1e-5, (what, jax.tree_util.keystr(path), err)


@pytest.mark.parametrize("dp,ep", [(2, 4), (4, 2)], ids=["dp2xep4", "dp4xep2"])
def test_moe_at_dp_x_ep_matches_unsharded_reference(dp, ep):
    opt, params, state, metrics = trained(dp, ep)
    ref, stats = reference_train(
        moe_params(),
        moe_loss,
        batches(),
        opt.plan.routes,
        lr=LR,
        weight_decay=CONFIG.weight_decay,
        clip_grad=CONFIG.clip_grad,
        muon_config=MUON,
        adam=ADAM,
    )
    # Expert leaves: local experts in the plan, split over ep in the parameters; dense and
    # expert buffers.
    routes = {r.path: r for r in opt.plan.routes}
    assert (
        routes["layer0/experts/up"].local_shape == (EXPERTS // ep, D, FF)
        and routes["layer0/experts/up"].is_muon
    )
    assert params["layer0"]["experts"]["up"].sharding.spec == P("ep")
    keys = {(b.key.is_expert_parallel, b.key.is_layer_wise): b.dp for b in opt.plan.buffers}
    assert keys == {
        (False, True): dp * ep,
        (False, False): dp * ep,
        (True, True): dp,
        (True, False): dp,
    }
    # The state equals the reference's, leaf by leaf (expert leaves with all experts).
    masters, momenta, mu, nu = ref.logical()
    logical = to_logical(opt, state)
    _assert_close(params, masters, "params")
    _assert_close(logical.masters, masters, "masters")
    _assert_close(logical.momenta, momenta, "momenta")
    _assert_close((logical.elementwise.mu, logical.elementwise.nu), (mu, nu), "adam")
    # Each parameter counted once: global norm and zero count equal the unsharded ones.
    for m, (norms, zeros) in zip(metrics, stats):
        np.testing.assert_allclose(m["grad_norm"], norms[None], rtol=1e-5)
        assert int(m["num_zeros"]) == zeros and not m["skipped"]
    assert stats[0][1] > 0
    # from_logical inverts to_logical, expert buckets included.
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(from_logical(opt, logical))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "clip_grad, seed, clips, flags",
    [
        # Norms 0.87, 0.86, 0.70 (seed 3): the clip never binds; speculation from step 2 holds.
        (CONFIG.clip_grad, 3, [0, 0, 0], [(0, 0), (0, 0), (1, 0)]),
        # Norms about 0.751, 0.756, 0.784 (seed 20): idle, idle, binds: serial, serial, and a
        # speculation that fails, so the expert buckets are recomputed.
        (0.76, 20, [0, 0, 1], [(0, 0), (0, 0), (1, 1)]),
    ],
    ids=["clip_not_binding", "clip_idles_then_binds"],
)
def test_pipelined_step_is_the_serial_step_with_experts(clip_grad, seed, clips, flags):
    """Per step (speculated, recomputed): make_train_step speculates after the step before
    last did not clip (the host's guess, lwjax.speculation), and the speculation fails where
    the step clips."""
    opt, params, state, metrics = trained(4, 2, pipeline_muon=True, clip_grad=clip_grad, seed=seed)
    _, want_params, want_state, want_metrics = trained(4, 2, clip_grad=clip_grad, seed=seed)
    assert [int(float(m["clip_coef"]) < 1) for m in want_metrics] == clips
    assert [(int(m["speculated"]), int(m["recomputed"])) for m in metrics] == flags
    assert bool(state.speculate) == (not clips[-1])
    _assert_close(params, want_params, "params")
    _assert_close(state._replace(speculate=None), want_state, "state")
    for m, w in zip(metrics, want_metrics):
        np.testing.assert_allclose(m["grad_norm"], w["grad_norm"], rtol=1e-6)


@pytest.mark.parametrize(
    "param_sync, pipeline_muon, clip_grad, seed",
    [("all_gather", False, CONFIG.clip_grad, 3), ("broadcast", True, 0.76, 20)],
    ids=["serial", "broadcast_pipelined_idles_then_binds"],
)
def test_overlapped_param_gather_is_bitwise_the_default_step(
    param_sync, pipeline_muon, clip_grad, seed
):
    """The step that gathers each bucket at the start of the next step, experts local over
    ``ep``: parameters (``gather_params``, expert leaves split over ``ep``), state and metrics
    bitwise the default step's, which the test above holds against the reference."""
    run = functools.partial(
        trained, 4, 2, param_sync, pipeline_muon=pipeline_muon, clip_grad=clip_grad, seed=seed
    )
    _, want_params, want_state, want_metrics = run()
    _, params, state, metrics = run(overlap_param_gather=True)
    assert params["layer0"]["experts"]["up"].sharding.spec == P("ep")
    for got, want in [(params, want_params), (state, want_state), (metrics, want_metrics)]:
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_broadcast_param_sync_is_bitwise_the_all_gather():
    _, p_gather, s_gather, _ = trained(4, 2)
    _, p_bcast, s_bcast, _ = trained(4, 2, "broadcast")
    for a, b in zip(jax.tree.leaves((p_gather, s_gather)), jax.tree.leaves((p_bcast, s_bcast))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_broadcast_keeps_signed_zeros_and_nan_payloads(dtype):
    from lwjax.shards import _broadcast

    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    values = np.array([-0.0, 0.0, np.nan, -np.inf, 1.5, -2.25, 3e-8, -0.0], np.float32)
    x = jnp.asarray(values, dtype)
    out = jax.jit(
        jax.shard_map(
            lambda s: _broadcast(s, "dp", lax.axis_index("dp"), 4),
            mesh=mesh,
            in_specs=P("dp"),
            out_specs=P(),
            check_vma=False,
        )
    )(x)
    assert np.asarray(out).tobytes() == np.asarray(x).tobytes()


def test_bad_expert_setup_gets_clear_errors():
    params = moe_params(layers=1)
    dense_mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    with pytest.raises(ValueError, match="no expert-parallel axis 'ep'"):
        layerwise_muon(params, dense_mesh, expert_axis="ep", routing=RoutingRules(**ROUTING))
    with pytest.raises(
        ValueError, match="axis, expert_axis, replica_axis and param_axes must differ"
    ):
        layerwise_muon(params, mesh_of(2, 4), expert_axis="dp", routing=RoutingRules(**ROUTING))
    with pytest.raises(
        ValueError,
        match=r"layer0/experts/b_up: 8 experts \(axis 0 of shape=\(8, 16\)\) "
        r"do not divide by expert_parallel=3",
    ):
        layerwise_muon(params, mesh_of(2, 3), expert_axis="ep", routing=RoutingRules(**ROUTING))
    with pytest.raises(ValueError, match="OptimizerConfig.param_sync must be one of"):
        OptimizerConfig(param_sync="ring")
    # Without an expert axis, expert leaves keep their own buffers, laid out over dp
    # (expert_dp = dp).
    opt = layerwise_muon(params, dense_mesh, routing=RoutingRules(**ROUTING))
    assert {b.key.is_expert_parallel: b.dp for b in opt.plan.buffers} == {False: 4, True: 4}
    opt = layerwise_muon(params, mesh_of(2, 4), expert_axis="ep", routing=RoutingRules(**ROUTING))
    train_step = make_train_step(moe_loss, opt)
    with pytest.raises(
        ValueError,
        match=r"leading axis must divide by dp\*ep=8 \(dp=2, ep=4\) .*; got shape \(12,\)",
    ):
        train_step(params, opt.init(params), (np.zeros(12, np.int32), np.zeros(12, np.int32)))
