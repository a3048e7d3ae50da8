"""Tensor parallelism: leaves split over a ``tp`` mesh axis as their shardings say.

``duplicated`` and ``distributed`` must equal the unsharded reference (the
update of the whole matrix, scaled by its whole shape); ``blockwise`` must
equal the unsharded optimizer run on each device's blocks as matrices of
their own. The Megatron-Core comparison per mode is in
``test_megatron_tensor_parallel.py``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import Reference

import lwjax
from lwjax.dims import MatrixDims
from lwjax.logical import from_logical, to_logical
from lwjax.muon import MuonConfig
from lwjax.optimizer import OptimizerConfig, group_mesh, route_params
from lwjax.routing import RoutingRules

L, D, HEADS, HEAD_DIM, FFN, VOCAB = 2, 16, 4, 8, 48, 64
QKV = (8, 4, 4)  # q, k and v rows per query group (4 groups: 64 output rows)
RULES = RoutingRules(
    stacked={"layers/*": 1},
    qkv_split={"layers/qkv": QKV},
    dims={"layers/w[qk]": MatrixDims(reduction=1, output=(2, 3))},
)


def _model(seed=0):
    """A flax-style (``in_out``) model: per leaf its array and its sharding over ``tp``."""
    rng = np.random.default_rng(seed)
    leaves = {
        "embed": ((VOCAB, D), P("tp")),  # vocabulary-parallel, AdamW
        "layers/qkv": ((L, D, 4 * sum(QKV)), P(None, None, "tp")),  # column-parallel, QKV split
        "layers/wq": ((L, D, HEADS, HEAD_DIM), P(None, None, "tp")),  # heads split, merged view
        "layers/wk": ((L, D, HEADS, HEAD_DIM), P(None, None, None, "tp")),  # inner axis split
        "layers/proj": ((L, HEADS * HEAD_DIM, D), P(None, "tp")),  # row-parallel
        "layers/up": ((L, D, FFN), P(None, None, "tp")),
        "layers/up_bias": ((L, FFN), P(None, "tp")),  # column-parallel bias, AdamW
        "layers/down": ((L, FFN, D), P(None, "tp")),
        "layers/norm": ((L, D), P()),  # whole on every device
        "layers/gate": ((L, D, D), P()),  # a Muon matrix whole on every device
        "head": ((D, VOCAB), P(None, "tp")),
    }
    params, specs = {}, {}
    for name, (shape, spec) in leaves.items():
        params[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        specs[name] = spec
    return params, specs


def _grads_like(params, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}


def _grads(params, seed):
    grads = _grads_like(params, seed)
    grads["layers/up_bias"][0, :5] = 0.0  # zeros, counted once
    grads["layers/norm"][1, :3] = 0.0  # zeros of a leaf every tensor-parallel device holds
    return grads


def _put(tree, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def _metrics_step(opt):
    """``(grads, state, params) -> (params, state, metrics)`` on global arrays, reduced grads."""
    leaf_specs = jax.tree.map(lambda _: P(), opt.plan.treedef.unflatten([0] * len(opt.plan.routes)))
    specs = opt.param_specs if opt.param_specs != P() else leaf_specs
    return jax.jit(
        jax.shard_map(
            lambda g, s, p: opt.local_update(g, s, p, reduced=True),
            mesh=opt.mesh,
            in_specs=(specs, opt.state_specs, specs),
            out_specs=(specs, opt.state_specs, P()),
            check_vma=False,
        )
    )


MESHES = {
    "dp4xtp2": lambda: Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp")),
    "replica2xdp2xtp2": lambda: group_mesh(
        Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("dp", "tp")), 2
    ),
}


@pytest.mark.parametrize(
    "mesh_name,mode,scale_mode",
    [("dp4xtp2", "duplicated", "spectral"), ("replica2xdp2xtp2", "distributed", "unit_rms_norm")],
)
def test_whole_matrix_modes_match_the_unsharded_reference(mesh_name, mode, scale_mode):
    """Two steps at dp x tp against the float32 reference on global arrays: parameters,
    gradient norm (leaves held whole counted once), zero count, update RMS, and the
    logical state (which checkpoints save)."""
    mesh = MESHES[mesh_name]()
    replica = "replica" if "replica" in mesh.axis_names else None
    params, specs = _model()
    muon = MuonConfig(tp_mode=mode, scale_mode=scale_mode, fp32_matmul_prec="highest")
    config = OptimizerConfig(clip_grad=40.0, weight_decay=0.1)
    sharded = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(
        sharded,
        mesh,
        param_axes="tp",
        replica_axis=replica,
        learning_rate=0.01,
        muon=muon,
        config=config,
        routing=RULES,
    )
    routes = route_params(params, RULES)
    assert {r.path: r.tensor_dims for r in opt.plan.routes} == {
        k: (next((i for i, e in enumerate(s) if e == "tp"), None),) for k, s in specs.items()
    }
    ref = Reference(
        params, routes, lr=0.01, weight_decay=0.1, clip_grad=40.0, muon_config=muon, in_out=True
    )
    state = opt.init(sharded)
    step = _metrics_step(opt)
    current = sharded
    for seed in (1, 2):
        grads = _grads(params, seed)
        norms, zeros = ref.step(jax.tree.leaves(grads))
        current, state, metrics = step(_put(grads, specs, mesh), state, current)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norms[None], rtol=1e-6)
        assert float(metrics["clip_coef"]) < 1  # the clip binds, so the norm matters
        assert int(metrics["num_zeros"]) == zeros == 8
        for k, want in ref.params().items():
            np.testing.assert_allclose(np.asarray(current[k]), want, atol=2e-6, err_msg=k)
    logical = to_logical(opt, state)
    masters, momenta, mu, _ = ref.logical()
    for k in params:
        np.testing.assert_allclose(np.asarray(logical.masters[k]), masters[k], atol=2e-6)
        if momenta[k] is not None:
            np.testing.assert_allclose(np.asarray(logical.momenta[k]), momenta[k], atol=2e-6)
    # The logical state restores into an optimizer without tensor parallelism, and back.
    plain = lwjax.layerwise_muon(
        params,
        Mesh(np.array(jax.devices()[:2]), ("dp",)),
        muon=muon,
        config=config,
        routing=RULES,
    )
    again = to_logical(opt, from_logical(opt, to_logical(plain, from_logical(plain, logical))))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(logical)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_optax_update_matches_the_step_with_metrics():
    """``opt.update`` under plain ``jax.jit`` (reduced gradients, sharded global arrays) gives the
    parameters the step gives, and keeps each leaf's sharding; so does ``gather_params`` of the
    step's new state, bit for bit."""
    mesh = MESHES["dp4xtp2"]()
    params, specs = _model()
    sharded = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(sharded, mesh, param_axes="tp", routing=RULES)
    state = opt.init(sharded)
    grads = _put(_grads(params, 3), specs, mesh)
    updates, _ = jax.jit(opt.update)(grads, state, sharded)
    new = jax.tree.map(lambda p, u: p + u, sharded, updates)
    expected, new_state, _ = _metrics_step(opt)(grads, state, sharded)
    gathered = opt.gather_params(new_state)  # the parameters a state holds, each block split
    for k in params:
        np.testing.assert_allclose(np.asarray(new[k]), np.asarray(expected[k]), atol=1e-6)
        assert new[k].sharding.spec == NamedSharding(mesh, specs[k]).spec, k
        assert np.asarray(gathered[k]).tobytes() == np.asarray(expected[k]).tobytes(), k
        assert gathered[k].sharding.spec == NamedSharding(mesh, specs[k]).spec, k


def _mlp_loss(p, batch):
    x, y = batch
    h = jax.nn.gelu((x * p["norm"]) @ p["up"])
    return jnp.mean((h @ p["down"] - y) ** 2)


@pytest.mark.parametrize("pipeline_muon", [False, True])
def test_value_and_grad_trains_like_the_unsharded_optimizer(pipeline_muon):
    """A GSPMD loop: ``lwjax.value_and_grad`` (each data-parallel device's gradient, partitioned
    over ``tp`` by XLA) and ``opt.update``, three steps, against the optimizer without tensor
    parallelism given ``jax.grad`` of the whole batch; also in the pipelined mode, whose
    speculation fails on every step here (the clip binds). Newton–Schulz in fp32: in bf16 the
    two sides' different summation orders round some products apart, which moves the loss at
    the 1e-5 level."""
    rng = np.random.default_rng(0)
    params = {
        "up": (rng.standard_normal((D, FFN)) / 4).astype(np.float32),
        "down": (rng.standard_normal((FFN, D)) / 7).astype(np.float32),
        "norm": np.ones(D, np.float32),
    }
    specs = {"up": P(None, "tp"), "down": P("tp"), "norm": P()}
    mesh = MESHES["dp4xtp2"]()
    config = OptimizerConfig(clip_grad=0.05, pipeline_muon=pipeline_muon)
    fp32 = MuonConfig(fp32_matmul_prec="highest")
    opt = lwjax.layerwise_muon(
        _put(params, specs, mesh), mesh, param_axes="tp", config=config, muon=fp32
    )
    plain = lwjax.layerwise_muon(
        params,
        Mesh(np.array(jax.devices()[:1]), ("dp",)),
        config=OptimizerConfig(clip_grad=0.05),
        muon=fp32,
    )

    def step_with(optimizer, grad_fn):
        def step(p, s, batch):
            loss, g = grad_fn(p, batch)
            updates, s = optimizer.update(g, s, p)
            return jax.tree.map(lambda a, b: a + b, p, updates), s, loss

        return jax.jit(step)

    tp_step = step_with(opt, lwjax.value_and_grad(_mlp_loss, opt))
    plain_step = step_with(plain, jax.value_and_grad(_mlp_loss))
    a, sa = _put(params, specs, mesh), opt.init(_put(params, specs, mesh))
    b, sb = params, plain.init(params)
    batches = [
        tuple(rng.standard_normal((32, D)).astype(np.float32) for _ in range(2)) for _ in range(3)
    ]
    for batch in batches:
        a, sa, loss_a = tp_step(a, sa, batch)
        b, sb, loss_b = plain_step(b, sb, batch)
        np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=2e-6, err_msg=k)
        assert a[k].sharding.spec == specs[k]
    # make_train_step runs the same loss the same way (tp left to XLA) and steps the optimizer.
    c, sc = _put(params, specs, mesh), opt.init(_put(params, specs, mesh))
    train_step = lwjax.make_train_step(_mlp_loss, opt)
    for batch in batches:
        c, sc, metrics = train_step(c, sc, batch)
    for k in params:
        np.testing.assert_allclose(np.asarray(c[k]), np.asarray(b[k]), atol=2e-6, err_msg=k)
        assert c[k].sharding.spec == specs[k]


def _blocks(x, spec):
    """A leaf split on its ``tp`` axis into two blocks, stacked in front: [2, *block]."""
    dim = next((i for i, e in enumerate(spec) if e == "tp"), None)
    return np.stack(np.split(x, 2, axis=dim)), dim


def test_blockwise_orthogonalises_each_block_as_its_own_matrix():
    """``blockwise`` at tp 2 equals the unsharded optimizer on a model whose split matrices are
    replaced by their two blocks, stacked (Megatron-Core 0.19's default mode)."""
    rng = np.random.default_rng(0)
    params = {
        "qkv": rng.standard_normal((D, 4 * sum(QKV))).astype(np.float32),
        "proj": rng.standard_normal((HEADS * HEAD_DIM, D)).astype(np.float32),
        "norm": np.ones(D, np.float32),
    }
    specs = {"qkv": P(None, "tp"), "proj": P("tp"), "norm": P()}
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    muon = MuonConfig(tp_mode="blockwise", scale_mode="unit_rms_norm", fp32_matmul_prec="highest")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    opt = lwjax.layerwise_muon(
        _put(params, specs, mesh),
        mesh,
        param_axes="tp",
        muon=muon,
        routing=RoutingRules(qkv_split={"qkv": QKV}),
    )
    state = opt.init(_put(params, specs, mesh))
    new, _, _ = _metrics_step(opt)(_put(grads, specs, mesh), state, _put(params, specs, mesh))

    split = {k: _blocks(v, specs[k])[0] if k != "norm" else v for k, v in params.items()}
    split_grads = {k: _blocks(v, specs[k])[0] if k != "norm" else v for k, v in grads.items()}
    whole = lwjax.layerwise_muon(
        split,
        Mesh(np.array(jax.devices()[:2]), ("dp",)),
        muon=muon,
        routing=RoutingRules(stacked={"qkv": 1, "proj": 1}, qkv_split={"qkv": QKV}),
    )
    updates, _ = jax.jit(whole.update)(split_grads, whole.init(split), split)
    for k in ("qkv", "proj"):
        dim = _blocks(params[k], specs[k])[1]
        want = np.concatenate(list(np.asarray(split[k] + updates[k])), axis=dim)
        np.testing.assert_allclose(np.asarray(new[k]), want, atol=1e-6, err_msg=k)
    # The modes really differ: the whole matrix's update is not the blocks'.
    dup = lwjax.layerwise_muon(
        _put(params, specs, mesh),
        mesh,
        param_axes="tp",
        muon=MuonConfig(scale_mode="unit_rms_norm", fp32_matmul_prec="highest"),
        routing=RoutingRules(qkv_split={"qkv": QKV}),
    )
    other, _, _ = _metrics_step(dup)(
        _put(grads, specs, mesh), dup.init(_put(params, specs, mesh)), _put(params, specs, mesh)
    )
    assert np.abs(np.asarray(other["proj"]) - np.asarray(new["proj"])).max() > 1e-3


def test_routing_table_shows_the_split():
    mesh = MESHES["dp4xtp2"]()
    params, specs = _model()
    opt = lwjax.layerwise_muon(_put(params, specs, mesh), mesh, param_axes="tp", routing=RULES)
    table = opt.routing_table()
    assert "[16, 32] (cols / 2)" in table  # wq: heads x head_dim merged, split on heads
    assert "[32, 16] (rows / 2)" in table  # proj
    routes = {r.path: r for r in opt.plan.routes}
    assert routes["layers/wq"].param_shape == (D, HEADS * HEAD_DIM // 2)
    assert routes["layers/wk"].tensor_split == ((), (0,))
    assert routes["layers/gate"].tensor_dims == (None,) and routes["layers/gate"].tensor_whole == (
        0,
    )


def test_bad_shardings_are_named():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "fsdp", "tp"))
    params = {"w": jnp.zeros((16, 16))}
    fsdp = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("fsdp")))}
    with pytest.raises(ValueError, match=r"w is sharded over mesh axis 'fsdp' on axis 0"):
        lwjax.layerwise_muon(fsdp, mesh, param_axes="tp")
    qkv = {"qkv": jax.device_put(jnp.zeros((16, 48)), NamedSharding(mesh, P(None, "tp")))}
    # 48 output rows = 3 groups of (8, 4, 4): a device's 24 rows are not whole groups.
    with pytest.raises(ValueError, match=r"qkv: split over tensor parallelism on axes \(1,\)"):
        lwjax.layerwise_muon(
            qkv, mesh, param_axes="tp", routing=RoutingRules(qkv_split={"qkv": QKV})
        )
    with pytest.warns(UserWarning, match="no parameter's sharding splits over it"):
        lwjax.layerwise_muon({"w": np.zeros((16, 16), np.float32)}, mesh, param_axes="tp")
    with pytest.raises(ValueError, match="no tensor-parallel axis 'model'"):
        lwjax.layerwise_muon(params, mesh, param_axes="model")


def test_checkpoints_move_between_tensor_parallel_and_not(tmp_path):
    """A checkpoint saved at dp 4 x tp 2 restores without tensor parallelism and back: the
    logical state is the same, and restored parameters are split as the optimizer holds them."""
    mesh = MESHES["dp4xtp2"]()
    params, specs = _model()
    sharded = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(sharded, mesh, param_axes="tp", routing=RULES)
    state = opt.init(sharded)
    new, state, _ = _metrics_step(opt)(_put(_grads(params, 1), specs, mesh), state, sharded)
    lwjax.save(tmp_path / "tp", new, state, opt)
    plain = lwjax.layerwise_muon(params, Mesh(np.array(jax.devices()[:2]), ("dp",)), routing=RULES)
    plain_params, plain_state = lwjax.restore(tmp_path / "tp", plain)
    for a, b in zip(
        jax.tree.leaves(to_logical(plain, plain_state)), jax.tree.leaves(to_logical(opt, state))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lwjax.save(tmp_path / "plain", plain_params, plain_state, plain)
    back_params, back_state = lwjax.restore(tmp_path / "plain", opt)
    for k in params:
        assert back_params[k].sharding.spec == specs[k], k
        np.testing.assert_array_equal(np.asarray(back_params[k]), np.asarray(new[k]))
    for a, b in zip(jax.tree.leaves(back_state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fully_sharded_parameters_train_like_the_unsharded_optimizer():
    """FSDP through the same option: every leaf split over an ``fsdp`` axis that also splits the
    batch, gradients from ``jax.grad`` under ``jax.jit`` (XLA reduce-scatters them into the
    parameters' sharding), Muon on whole matrices. At dp 1 x fsdp 8 the optimizer step gathers
    no parameter (its HLO has no all-gather: each matrix reaches one device by all-to-all) and
    a device holds 1/8 of the parameters and of the state (dp > 1 with fsdp: the two-axes
    test)."""
    rng = np.random.default_rng(0)
    layers = 4
    params = {
        "embed": (rng.standard_normal((VOCAB, D)) / 4).astype(np.float32),
        "layers/up": (rng.standard_normal((layers, D, FFN)) / 4).astype(np.float32),
        "layers/down": (rng.standard_normal((layers, FFN, D)) / 7).astype(np.float32),
        "layers/norm": np.ones((layers, D), np.float32),
    }
    specs = {k: P(None, "fsdp") if k.startswith("layers") else P("fsdp") for k in params}
    rules = RoutingRules(stacked={"layers/*": 1})

    def loss_fn(p, batch):
        tokens, targets = batch
        h = p["embed"][tokens]
        for i in range(layers):
            h = h + jax.nn.gelu((h * p["layers/norm"][i]) @ p["layers/up"][i]) @ p["layers/down"][i]
        return jnp.mean((h - p["embed"][targets]) ** 2)

    def apply(optimizer):
        def step(p, s, g):
            updates, s = optimizer.update(g, s, p)
            return jax.tree.map(lambda a, b: a + b, p, updates), s

        return jax.jit(step)

    muon = MuonConfig(fp32_matmul_prec="highest")  # bf16 would round 1-ulp input differences
    plain = lwjax.layerwise_muon(
        params, Mesh(np.array(jax.devices()[:1]), ("dp",)), muon=muon, routing=rules
    )
    batches = [
        tuple(jnp.asarray(rng.integers(0, VOCAB, (16, 4)), jnp.int32) for _ in range(2))
        for _ in range(2)
    ]
    # The optimizer given the same gradients (of the unsharded loss), sharded as the parameters.
    b, sb, grads, plain_step = params, plain.init(params), [], apply(plain)
    grad_fn = jax.jit(jax.grad(loss_fn))  # both optimizers are given these gradients
    for batch in batches:
        grads.append(grad_fn(b, batch))
        b, sb = plain_step(b, sb, grads[-1])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("dp", "fsdp"))
    opt = lwjax.layerwise_muon(
        _put(params, specs, mesh), mesh, param_axes="fsdp", muon=muon, routing=rules
    )
    a, sa, sharded_step = _put(params, specs, mesh), opt.init(_put(params, specs, mesh)), apply(opt)
    for g in grads:
        a, sa = sharded_step(a, sa, _put(g, specs, mesh))
    for k in params:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), atol=2e-6, err_msg=k)
        assert a[k].sharding.spec == specs[k]

    # A whole step under jit: XLA gathers each layer for the forward and reduce-scatters the
    # gradients into the parameters' sharding; the batch is split over dp and fsdp.
    def train_step(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = opt.update(g, s, p)
        return jax.tree.map(lambda x, u: x + u, p, updates), s, loss

    batch = jax.device_put(batches[0], NamedSharding(mesh, P(("dp", "fsdp"))))
    first = float(jax.jit(train_step)(a, sa, batch)[2])
    assert np.isfinite(first)
    # dp 1 x fsdp 8: nothing gathered by the optimizer, an eighth of everything on a device.
    # (The step compiled above, update plus the elementwise add: a hit of the compilation cache.)
    update_hlo = sharded_step.lower(a, sa, _put(grads[0], specs, mesh)).compile().as_text()
    assert "all-gather" not in update_hlo and "all-to-all" in update_hlo
    device = jax.devices()[0]
    held = lambda tree: sum(  # noqa: E731
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )
    total = sum(x.nbytes for x in params.values())
    assert held(a) == total // 8
    # An eighth of the unsharded optimizer's state, plus the 64-element alignment of every
    # parameter's block in the buckets (large here: a norm's block is 2 elements).
    assert held(sa) * 4 < held(sb)


def test_expert_leaves_split_over_tensor_and_expert_axes_match_the_reference():
    """dp 2 x ep 2 x tp 2: expert stacks split over ``ep`` (experts) and ``tp`` (a matrix
    axis), a dense matrix over ``tp``, a norm whole; two steps against the reference."""
    rng = np.random.default_rng(0)
    params = {
        "experts/up": (rng.standard_normal((4, D, FFN)) / 4).astype(np.float32),
        "experts/down": (rng.standard_normal((4, FFN, D)) / 7).astype(np.float32),
        "dense": (rng.standard_normal((D, 32)) / 4).astype(np.float32),
        "norm": np.ones(D, np.float32),
    }
    specs = {
        "experts/up": P("ep", None, "tp"),
        "experts/down": P("ep", "tp"),
        "dense": P(None, "tp"),
        "norm": P(),
    }
    rules = RoutingRules(expert={"experts/*": True}, stacked={"experts/*": 1})
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "ep", "tp"))
    muon = MuonConfig(fp32_matmul_prec="highest")
    config = OptimizerConfig(clip_grad=5.0)
    opt = lwjax.layerwise_muon(
        _put(params, specs, mesh),
        mesh,
        expert_axis="ep",
        param_axes="tp",
        muon=muon,
        config=config,
        routing=rules,
    )
    ref = Reference(
        params,
        route_params(params, rules),
        lr=0.02,
        weight_decay=0.01,
        clip_grad=5.0,
        muon_config=muon,
    )
    state, current = opt.init(_put(params, specs, mesh)), _put(params, specs, mesh)
    step = _metrics_step(opt)
    for seed in (1, 2):
        grads = _grads_like(params, seed)
        norms, _ = ref.step(jax.tree.leaves(grads))
        current, state, metrics = step(_put(grads, specs, mesh), state, current)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norms[None], rtol=1e-6)
        assert float(metrics["clip_coef"]) < 1
    for k, want in ref.params().items():
        np.testing.assert_allclose(np.asarray(current[k]), want, atol=2e-6, err_msg=k)


def test_leaves_split_over_two_axes_match_the_unsharded_reference():
    """dp 2 x fsdp 2 x tp 2 with ``param_axes=("fsdp", "tp")``: matrices split over both axes
    on their two sides (a grid of blocks) or together on one, a fused QKV matrix, a stack split
    over ``fsdp`` on its layer axis, leaves whole over one axis or both. Two steps against the
    reference: parameters, norm (each leaf counted once), zeros, and the logical state."""
    rng = np.random.default_rng(0)
    leaves = {
        "layers/up": ((L, D, FFN), P(None, "fsdp", "tp")),  # rows over fsdp, cols over tp
        "layers/down": ((L, FFN, D), P(None, ("fsdp", "tp"))),  # rows over both, fsdp major
        "layers/qkv": ((L, D, 4 * sum(QKV)), P(None, "fsdp", "tp")),
        "layers/norm": ((L, D), P(None, "fsdp")),  # whole over tp
        "blocks": ((4, D, D), P("fsdp", None, "tp")),  # other matrices on each fsdp device
        "embed": ((VOCAB, D), P(("fsdp", "tp"))),
        "head": ((D, VOCAB), P()),  # whole over both
    }
    params = {k: (rng.standard_normal(s) / 4).astype(np.float32) for k, (s, _) in leaves.items()}
    specs = {k: spec for k, (_, spec) in leaves.items()}
    rules = RoutingRules(stacked={"layers/*": 1, "blocks": 1}, qkv_split={"layers/qkv": QKV})
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "fsdp", "tp"))
    muon = MuonConfig(fp32_matmul_prec="highest", scale_mode="unit_rms_norm")
    config = OptimizerConfig(clip_grad=40.0)
    sharded = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(
        sharded, mesh, param_axes=("fsdp", "tp"), muon=muon, config=config, routing=rules
    )
    routes = {r.path: r for r in opt.plan.routes}
    assert routes["layers/up"].tensor_split == ((0,), (1,))
    assert routes["layers/down"].tensor_split == ((0, 1), ())
    assert routes["blocks"].tensor_split == ((), (1,)) and routes["head"].tensor_whole == (0, 1)
    ref = Reference(
        params,
        route_params(params, rules),
        lr=0.02,
        weight_decay=0.01,
        clip_grad=40.0,
        muon_config=muon,
        in_out=True,
    )
    state, current, step = opt.init(sharded), sharded, _metrics_step(opt)
    for seed in (1, 2):
        grads = _grads_like(params, seed)
        grads["head"][:3] = 0.0  # zeros of a leaf every device holds: counted once
        norms, zeros = ref.step(jax.tree.leaves(grads))
        current, state, metrics = step(_put(grads, specs, mesh), state, current)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norms[None], rtol=1e-6)
        assert float(metrics["clip_coef"]) < 1
        assert int(metrics["num_zeros"]) == zeros == 3 * VOCAB
    for k, want in ref.params().items():
        np.testing.assert_allclose(np.asarray(current[k]), want, atol=2e-6, err_msg=k)
        assert current[k].sharding.spec == specs[k], k
    masters, momenta, _, _ = ref.logical()
    logical = to_logical(opt, state)
    for k in params:
        np.testing.assert_allclose(np.asarray(logical.masters[k]), masters[k], atol=2e-6)
    again = to_logical(opt, from_logical(opt, logical))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(logical)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"layers/\w+ is split over tensor-parallel axes on both"):
        lwjax.layerwise_muon(
            sharded,
            mesh,
            param_axes=("fsdp", "tp"),
            muon=MuonConfig(tp_mode="distributed"),
            routing=rules,
        )
    with pytest.raises(ValueError, match=r"name them in param_axes's order \('fsdp', 'tp'\)"):
        lwjax.layerwise_muon(
            {"w": jax.device_put(jnp.zeros((16, 16)), NamedSharding(mesh, P(("tp", "fsdp"))))},
            mesh,
            param_axes=("fsdp", "tp"),
        )


def test_auto_buckets_are_whole_buffers_when_duplicated_muon_deals_matrices_on_one_device():
    """``bucket_size="auto"`` is one bucket per buffer (up to ``ALONE_BUCKET_SIZE`` elements)
    exactly where the layout spans one device and duplicated Muon deals matrices out over
    tensor-parallel devices (measured faster there, slower without tensor parallelism:
    ``docs/benchmarks.md``)."""
    from lwjax.layout import LayoutConfig
    from lwjax.optimizer import ALONE_BUCKET_SIZE, resolved_layout
    from lwjax.plan import MeshAxes

    def bucket(dp, tp, mode="duplicated", size="auto"):
        axes = MeshAxes("dp", dp_size=dp, tp=("tp",) if tp > 1 else (), tp_sizes=(tp,) * (tp > 1))
        return resolved_layout(LayoutConfig(bucket_size=size), axes, MuonConfig(tp_mode=mode))

    assert bucket(1, 2).bucket_size == ALONE_BUCKET_SIZE
    assert bucket(2, 2).bucket_size == "auto"
    assert bucket(1, 1).bucket_size == "auto"
    assert bucket(1, 2, "distributed").bucket_size == "auto"
    assert bucket(1, 2, size=1024).bucket_size == 1024


def test_adam_only_state_round_trips_through_logical_form_with_tensor_parallelism():
    """An optimizer with no Muon matrix (so no momenta) and a split leaf: to_logical gives the
    whole masters, from_logical the same state back."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("dp", "tp"))
    weights = np.arange(32, dtype=np.float32).reshape(4, 8)
    params = {"w": jax.device_put(weights, NamedSharding(mesh, P(None, "tp")))}
    opt = lwjax.layerwise_muon(
        params,
        mesh,
        param_axes="tp",
        learning_rate=1e-3,
        routing=RoutingRules(is_muon={"*": False}),
    )
    state = opt.init(params)
    logical = to_logical(opt, state)
    np.testing.assert_array_equal(np.asarray(logical.masters["w"]), weights)
    back = from_logical(opt, logical)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_no_collective_runs_over_a_group_of_one():
    """dp 1 x fsdp 8 (gradients reduced per device, as make_train_step passes them): the
    buckets' data-parallel groups hold one device each, so the step reduce-scatters and
    gathers nothing over them (0.4.0 reduce-scattered every bucket over groups {0}, ..., {7},
    copying every local gradient in fp32); its collectives all span several devices."""
    rng = np.random.default_rng(0)
    params = {
        "layers/up": (rng.standard_normal((4, D, FFN)) / 4).astype(np.float32),
        "norm": np.ones(D, np.float32),
    }
    specs = {"layers/up": P(None, None, "fsdp"), "norm": P()}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("dp", "fsdp"))
    sharded = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(
        sharded, mesh, param_axes="fsdp", routing=RoutingRules(stacked={"layers/*": 1})
    )
    step = jax.jit(
        jax.shard_map(
            lambda g, s, p: opt.local_update(g, s, p)[:2],
            mesh=mesh,
            in_specs=(opt.param_specs, opt.state_specs, opt.param_specs),
            out_specs=(opt.param_specs, opt.state_specs),
            check_vma=False,
        )
    )
    hlo = step.lower(sharded, opt.init(sharded), sharded).compile().as_text()
    groups = re.findall(
        r"(reduce-scatter|all-gather|all-reduce|all-to-all)(?:-start)?\(.*?replica_groups="
        r"\{\{([\d,]*)\}",
        hlo,
    )
    assert {kind for kind, _ in groups} == {"all-reduce", "all-to-all"}  # norm; Newton–Schulz
    assert all("," in first for _, first in groups)  # every group holds several devices
