"""The sharded step against an unsharded reference, its communication, memory and errors."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import reference_run

from lwjax import LayoutConfig, RoutingRules, TrainStepOptions, shards
from lwjax.layout import POLICIES
from lwjax.muon import MuonConfig
from lwjax.optimizer import ALONE_BUCKET_SIZE, OptimizerConfig, layerwise_muon
from lwjax.schedule import schedule_buckets
from lwjax.state import LayerwiseState
from lwjax.train import make_train_step

MUON = MuonConfig(momentum=0.9, nesterov=True, fp32_matmul_prec="highest", extra_scale_factor=0.2)
CONFIG = OptimizerConfig(weight_decay=0.1, clip_grad=1.0)
LR = 0.02


def toy_params(seed=0, layers=4, d=16, ff=48, vocab=64):
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)  # noqa: E731
    params = {
        "embed": {"embedding": w(vocab, d)},
        "head": {"kernel": w(d, vocab)},
        "norm": {"scale": jnp.ones(d)},
    }
    for i in range(layers):
        params[f"layer{i}"] = {
            "wq": w(d, d),
            "wo": w(d, d),
            "up": w(d, ff),
            "down": w(ff, d),
            "ln": {"scale": jnp.ones(d)},
            "b_up": jnp.zeros(ff),
        }
    return params


def mesh_of(dp):
    return Mesh(np.array(jax.devices()[:dp]), ("dp",))


def random_grads(params, dp, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        [
            jax.tree.map(lambda x: np.asarray(rng.standard_normal(x.shape), np.float32), params)
            for _ in range(dp)
        ]
        for _ in range(steps)
    ]


_OPTIMIZERS = {}


def _optimizer(params, dp, **options):
    """``layerwise_muon(params, mesh_of(dp), **options)``, built once per parameter shapes and
    options: tests that build the same optimizer share it, and so its step's compilation."""
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    key = (repr(shapes), dp, repr(sorted(options.items())))
    if key not in _OPTIMIZERS:
        _OPTIMIZERS[key] = layerwise_muon(params, mesh_of(dp), **options)
    return _OPTIMIZERS[key]


def _replicated(opt, tree):
    """``tree`` whole on every device of the optimizer's mesh, as the step returns parameters:
    the step's first call then compiles the program its later calls run."""
    return jax.device_put(tree, NamedSharding(opt.mesh, P()))


_STEPS = {}


def _step_fn(opt):
    """The jitted sharded step of ``opt``, built once per optimizer object: a test that steps an
    optimizer another test stepped reuses that compilation."""
    if id(opt) not in _STEPS:  # (the entry holds opt, so no other object takes its id)
        step = jax.shard_map(
            lambda p, s, g: opt.local_update(jax.tree.map(lambda x: x[0], g), s, p),
            mesh=opt.mesh,
            in_specs=(P(), opt.state_specs, P("dp")),
            out_specs=(P(), opt.state_specs, P()),
            check_vma=False,
        )
        _STEPS[id(opt)] = opt, jax.jit(step)
    return _STEPS[id(opt)][1]


def run_sharded(opt, params, grads_per_step, history=None):
    """The last step's parameters, state and metrics; every step's metrics appended to
    ``history`` if given."""
    dp = opt.mesh.shape["dp"]
    step = _step_fn(opt)
    state, params = opt.init(params), _replicated(opt, params)
    for device_grads in grads_per_step:
        stacked = jax.tree.map(lambda *g: np.stack(g), *device_grads)
        stacked = jax.device_put(stacked, NamedSharding(opt.mesh, P("dp")))
        params, state, metrics = step(params, state, stacked)
        if history is not None:
            history.append(metrics)
        assert dp == len(device_grads)
    return params, state, metrics


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_step_matches_unsharded_reference(policy, dp):
    params = toy_params()
    grads = random_grads(params, dp, steps=5)
    opt = layerwise_muon(
        params,
        mesh_of(dp),
        learning_rate=LR,
        muon=MUON,
        config=CONFIG,
        layout=LayoutConfig(policy=policy, bucket_size=2000),
    )
    got, _, metrics = run_sharded(opt, params, grads)
    want = reference_run(
        params,
        grads,
        opt.plan.routes,
        lr=LR,
        weight_decay=CONFIG.weight_decay,
        clip_grad=CONFIG.clip_grad,
        muon_config=MUON,
    )
    for path, a, b in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(got), jax.tree.leaves(want)
    ):
        err = np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b))
        assert err <= 1e-5, (jax.tree_util.keystr(path[0]), err)
    assert not bool(metrics["skipped"])


def _stacked(opt, device_grads):
    return jax.device_put(
        jax.tree.map(lambda *g: np.stack(g), *device_grads), NamedSharding(opt.mesh, P("dp"))
    )


def test_step_uses_reduce_scatter_and_all_gather_not_all_reduce():
    params = toy_params()
    opt = layerwise_muon(
        params, mesh_of(4), muon=MUON, config=CONFIG, layout=LayoutConfig(bucket_size=2000)
    )
    state = opt.init(params)
    grads = _stacked(opt, random_grads(params, 4, steps=1)[0])
    hlo = _step_fn(opt).lower(params, state, grads).compile().as_text()
    ops = re.findall(r"= (\S+) (reduce-scatter|all-gather|all-reduce)(?:-start)?\(", hlo)
    kinds = {kind for _, kind in ops}
    assert {"reduce-scatter", "all-gather"} <= kinds
    for shape, kind in ops:
        if kind == "all-reduce":
            sizes = [
                int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                for dims in re.findall(r"\[([\d,]*)\]", shape)
            ]
            assert sum(sizes) <= 8, f"all-reduce of {shape} is more than a few scalars"
    gathered = sum(b.numel for b in opt.plan.buffers)
    scattered = [s for s, k in ops if k == "reduce-scatter"]
    assert sum(int(d) for s in scattered for d in re.findall(r"\[(\d+)\]", s)) * 4 == gathered
    assert len(scattered) == sum(b.num_buckets for b in opt.plan.buffers) > len(opt.plan.buffers)


@pytest.mark.parametrize("stacked", [False, True])
def test_each_vector_gradient_is_summed_before_its_bucket_is_packed(stacked):
    """Every norm scale's and bias's gradient, and no matrix's, passes its own optimization
    barrier before packing: XLA fused such sums over tokens into a packing concatenation,
    which then ran them serially (about 16 ms per step of the 8b workload's AdamW on H200)."""
    params = toy_params()
    routing = RoutingRules()
    if stacked:  # a scanned model's layers: [L, d] vectors and [L, m, n] matrices
        layers = [params.pop(f"layer{i}") for i in range(4)]
        params["layers"] = jax.tree.map(lambda *x: jnp.stack(x), *layers)
        routing = RoutingRules(stacked={"layers/*": 1})
    opt = _optimizer(params, 4, muon=MUON, config=CONFIG, routing=routing)
    grads = _stacked(opt, random_grads(params, 4, steps=1)[0])
    text = _step_fn(opt).lower(params, opt.init(params), grads).as_text()
    alone = re.findall(r"optimization_barrier %\w+ : tensor<([\dx]+)xf32>", text)
    vectors = [
        x.shape
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if x.ndim - (stacked and path[0].key == "layers") == 1
    ]
    assert sorted(alone) == sorted("x".join(map(str, shape)) for shape in vectors)


def test_state_holds_only_this_devices_share():
    params = toy_params(layers=8)
    dp = 4
    opt = layerwise_muon(params, mesh_of(dp), muon=MUON, config=CONFIG)
    state = opt.init(params)
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    per_device = {}
    for leaf in jax.tree.leaves(state):
        if leaf.ndim == 0:
            continue
        assert leaf.sharding.spec == P("dp")
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert len(per_device) == dp
    # fp32 master + Muon momentum or Adam mu and nu: 8 to 12 bytes per element, split over dp.
    muon_numel = sum(int(np.prod(r.shape)) for r in opt.plan.routes if r.is_muon)
    unsharded = 8 * muon_numel + 12 * (total - muon_numel)
    for nbytes in per_device.values():
        assert nbytes <= 1.10 * unsharded / dp


def test_nonfinite_grads_skip_the_step_and_keep_state():
    params = toy_params()
    opt = layerwise_muon(params, mesh_of(2), muon=MUON, config=CONFIG)
    step = _step_fn(opt)
    state, params = opt.init(params), _replicated(opt, params)
    good = random_grads(params, 2, steps=1)[0]
    params1, state1, m1 = step(params, state, _stacked(opt, good))
    bad = [jax.tree.map(np.copy, g) for g in good]
    bad[1]["layer0"]["wq"][3, 4] = np.nan
    params2, state2, m2 = step(params1, state1, _stacked(opt, bad))
    assert bool(m2["skipped"]) and not bool(m1["skipped"])
    for a, b in zip(jax.tree.leaves((params2, state2)), jax.tree.leaves((params1, state1))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_params_come_back_as_rounded_fp32_masters():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), toy_params())
    opt = layerwise_muon(params, mesh_of(4), muon=MUON, config=CONFIG)
    params1, state1, _ = _step_fn(opt)(
        params, opt.init(params), _stacked(opt, random_grads(params, 4, 1)[0])
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params1))
    from lwjax.buffers import unpack

    gathered = [tuple(np.asarray(m) for m in ms) for ms in state1.masters]
    masters = unpack(opt.plan, gathered, dtypes=[np.float32] * len(opt.plan.routes))
    for p, m in zip(jax.tree.leaves(params1), jax.tree.leaves(masters)):
        np.testing.assert_array_equal(
            np.asarray(p), np.asarray(jnp.asarray(m).astype(jnp.bfloat16))
        )
    assert any(
        np.any(np.asarray(a) != np.asarray(b))
        for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params))
    )


def _mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _mlp_setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 32)) / 3, jnp.float32),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.standard_normal((32, 4)) / 6, jnp.float32),
    }
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = np.sin(x[:, :4]).astype(np.float32)
    return params, (x, y)


def test_train_step_is_independent_of_dp_and_lowers_loss():
    results = {}
    for dp in (1, 4):
        params, batch = _mlp_setup()
        opt = layerwise_muon(params, mesh_of(dp), learning_rate=0.05, muon=MUON, config=CONFIG)
        train_step = make_train_step(_mlp_loss, opt)
        state = opt.init(params)
        losses = []
        for _ in range(4):
            params, state, metrics = train_step(params, state, batch)
            losses.append(float(metrics["loss"]))
        results[dp] = (params, losses)
    assert results[1][1][-1] < results[1][1][0]
    np.testing.assert_allclose(results[1][1], results[4][1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[4][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_bad_input_gets_clear_errors():
    params, batch = _mlp_setup()
    with pytest.raises(ValueError, match="no data-parallel axis 'dp'"):
        layerwise_muon(params, Mesh(np.array(jax.devices()[:2]), ("data",)))
    with pytest.raises(ValueError, match="step: parameters must be floating point"):
        layerwise_muon({**params, "step": jnp.zeros((), jnp.int32)}, mesh_of(2))
    opt = layerwise_muon(params, mesh_of(4))
    state = opt.init(params)
    train_step = make_train_step(_mlp_loss, opt)
    with pytest.raises(
        ValueError, match=r"leading axis must divide by dp=4 and not be empty; got shape \(6, 8\)"
    ):
        train_step(params, state, (batch[0][:6], batch[1][:6]))
    bad_grads = {"w1": params["w1"], "b1": params["b1"]}
    with pytest.raises(ValueError, match="update\\(grads\\): the tree does not match"):
        jax.shard_map(
            lambda g, s, p: opt.local_update(g, s, p),
            mesh=opt.mesh,
            in_specs=(P(), opt.state_specs, P()),
            out_specs=P(),
            check_vma=False,
        )(bad_grads, state, params)
    wrong_shape = {**params, "w2": jnp.zeros((32, 5))}
    with pytest.raises(ValueError, match=r"w2: expected shape \(32, 4\); got \(32, 5\)"):
        opt.init(wrong_shape)


@pytest.mark.parametrize(
    "src,dst", [(4, 2), (2, 4), (1, 8), (8, 1)], ids=["4to2", "2to4", "1to8", "8to1"]
)
def test_logical_state_reshards_and_training_continues_identically(src, dst):
    from lwjax.logical import from_logical, to_logical

    params, batch = _mlp_setup()

    def make(dp, policy):
        return layerwise_muon(
            params,
            mesh_of(dp),
            learning_rate=0.05,
            muon=MUON,
            config=CONFIG,
            layout=LayoutConfig(policy=policy, bucket_size=300),
        )

    a, b = make(src, "lpt"), make(dst, "size_matching")
    step_a, step_b = (
        make_train_step(_mlp_loss, a, donate=False),
        make_train_step(_mlp_loss, b, donate=False),
    )
    state = a.init(params)
    p = params
    for _ in range(2):
        p, state, _ = step_a(p, state, batch)
    logical = to_logical(a, state)
    moved = from_logical(b, logical)
    back = to_logical(b, moved)
    for x, y in zip(jax.tree.leaves(logical), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert logical.momenta["b1"] is None and logical.elementwise[1]["w1"] is None
    pa, sa, pb, sb = p, state, jax.device_put(p, NamedSharding(b.mesh, P())), moved
    for _ in range(2):
        pa, sa, _ = step_a(pa, sa, batch)
        pb, sb, _ = step_b(pb, sb, batch)
    for x, y in zip(
        jax.tree.leaves((pa, to_logical(a, sa))), jax.tree.leaves((pb, to_logical(b, sb)))
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_logical_state_of_bf16_params_is_lossless():
    from lwjax.logical import from_logical, to_logical

    params, batch = _mlp_setup()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    opt = layerwise_muon(params, mesh_of(2), learning_rate=0.05, muon=MUON, config=CONFIG)
    train_step = make_train_step(
        lambda p, b: _mlp_loss(jax.tree.map(lambda x: x.astype(jnp.float32), p), b), opt
    )
    state = opt.init(params)
    for _ in range(2):
        params, state, _ = train_step(params, state, batch)
    logical = to_logical(opt, state)
    assert logical.momenta["w1"].dtype == jnp.float32 and logical.masters["b1"].dtype == jnp.float32
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(from_logical(opt, logical))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_logical_state_of_a_pipelined_optimizer_resets_its_speculation_flag():
    """The flag is a guess, not state: to_logical drops it, from_logical starts it off, and
    the restored state steps as the one it came from."""
    from lwjax.logical import from_logical, to_logical

    params, batch = _mlp_setup()
    config = dataclasses.replace(CONFIG, pipeline_muon=True, clip_grad=100.0)  # never binds
    opt = layerwise_muon(params, mesh_of(2), learning_rate=0.05, muon=MUON, config=config)
    train_step = make_train_step(_mlp_loss, opt, donate=False)
    state = opt.init(params)
    params, state, _ = train_step(params, state, batch)
    assert bool(state.speculate)
    restored = from_logical(opt, to_logical(opt, state))
    assert not bool(restored.speculate)
    for x, y in zip(
        jax.tree.leaves(state._replace(speculate=None)),
        jax.tree.leaves(restored._replace(speculate=None)),
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Neither is the state the step handed back last, so each step guesses from its own flag.
    (p2, s2, m2), (p1, s1, m1) = (train_step(params, s, batch) for s in (restored, state))
    assert bool(m1["speculated"]) and not bool(m2["speculated"])
    _assert_same_steps((p1, s1), (p2, s2))


@pytest.mark.parametrize("pipelined", [False, True])
def test_each_gather_lands_before_the_update_after_the_one_that_hides_it(pipelined):
    params = toy_params(layers=8)
    config = OptimizerConfig(weight_decay=0.1, clip_grad=1.0, pipeline_muon=pipelined)
    opt = layerwise_muon(
        params, mesh_of(4), muon=MUON, config=config, layout=LayoutConfig(bucket_size=2000)
    )
    state = opt.init(params)
    grads = _stacked(opt, random_grads(params, 4, steps=1)[0])
    text = _step_fn(opt).lower(params, state, grads).as_text()
    steps = schedule_buckets(
        opt.plan
    ).steps  # no QKV split here, so the orientation does not matter
    paired = {
        j: s.gathered_during
        for j, s in enumerate(steps)
        if s.gathered_during is not None and s.gathered_during + 1 < len(steps)
    }
    assert paired, "the toy model should give the schedule gathers to pin"
    lines = text.splitlines()
    # All-gathers in program order: one per bucket, in the schedule's order (pipelined too: a
    # recomputation under clipping redoes the directions only). With clipping the pipelined
    # step is a conditional of the speculative and the serial step: each branch gathers so
    # (the conditional prints its branches one after the other).
    gathers = [
        (n, re.match(r"\s*(%\S+) = \"?stablehlo\.all_gather", line).group(1))
        for n, line in enumerate(lines)
        if re.match(r"\s*%\S+ = \"?stablehlo\.all_gather", line)
    ]
    branches = 2 if pipelined else 1
    assert len(gathers) == branches * len(steps)
    for b in range(branches):
        own = gathers[b * len(steps) : (b + 1) * len(steps)]
        landed = {}
        for n, line in enumerate(lines):
            if "stablehlo.optimization_barrier" in line and n < own[-1][0]:
                operands = set(re.findall(r"%[\w#.]+", line.split("optimization_barrier", 1)[1]))
                for j, (_, name) in enumerate(own):
                    if name in operands:
                        landed[j] = n
        assert set(landed) == set(paired)
        for j, during in paired.items():
            # Pinned after the update that hides it (whose own gather comes next) and before
            # the one after.
            assert own[during][0] < landed[j] < own[during + 1][0]


def test_pipelined_step_carries_each_unscaled_direction_in_bf16_through_its_recomputation_loop():
    """Under "medium" a speculative direction waits for its apply as muon_polar's bf16 Q,
    not as fp32."""
    params = toy_params()
    config = OptimizerConfig(clip_grad=1.0, pipeline_muon=True)
    opt = layerwise_muon(
        params, mesh_of(4), muon=MuonConfig(), config=config, layout=LayoutConfig(bucket_size=2000)
    )
    grads = _stacked(opt, random_grads(params, 4, steps=1)[0])
    text = _step_fn(opt).lower(params, opt.init(params), grads).as_text()
    loops = [line.split(" : ", 1)[1] for line in text.splitlines() if "stablehlo.while" in line]
    assert loops
    for types in loops:
        matrices = re.findall(r"tensor<(\d+x\d+x\d+)x(bf16|f32)>", types)
        directions = sorted(shape for shape, dtype in matrices if dtype == "bf16")
        momenta = sorted(shape for shape, dtype in matrices if dtype == "f32")
        assert directions and directions == momenta, types


def _toy_optimizer(
    params, pipelined, clip_grad=1.0, muon=MUON, matrix_convention="in_out", **routing
):
    """The speculation tests' optimizer at dp 4, serial or pipelined."""
    config = OptimizerConfig(
        weight_decay=0.1,
        clip_grad=clip_grad,
        pipeline_muon=pipelined,
        matrix_convention=matrix_convention,
    )
    return _optimizer(
        params,
        4,
        learning_rate=LR,
        muon=muon,
        config=config,
        layout=LayoutConfig(bucket_size=2000),
        routing=RoutingRules(**routing),
    )


def _serial_and_pipelined(
    params, grads, clip_grad=1.0, muon=MUON, matrix_convention="in_out", **routing
):
    """The same steps with the serial and the pipelined step: per step, ``(optimizer,
    params, state, metrics, every step's metrics)``."""
    out = []
    for pipelined in (False, True):
        opt = _toy_optimizer(params, pipelined, clip_grad, muon, matrix_convention, **routing)
        history = []
        out.append((opt, *run_sharded(opt, params, grads, history), history))
    return out


SPECULATION_METRICS = ("speculated", "recomputed")


def _comparable(tree):
    """A step's results without what only the pipelined step has: its speculation flag
    and metrics."""
    if isinstance(tree, LayerwiseState):
        return tree._replace(speculate=None)
    if isinstance(tree, dict) and "skipped" in tree:
        return {k: v for k, v in tree.items() if k not in SPECULATION_METRICS}
    return tree


def _assert_same_steps(a, b):
    """The same state and parameters up to rounding: XLA may fuse (and so sum) a
    reduction differently."""
    a, b = [_comparable(x) for x in a], [_comparable(x) for x in b]
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=0, atol=1e-6 * np.max(np.abs(x))
        )


def _scaled(grads, scale_of):
    """``grads`` with each step's top-level key ``k`` scaled by ``scale_of(step, k)``."""
    return [
        [
            {
                k: jax.tree.map(lambda g, t=t, k=k: g * np.float32(scale_of(t, k)), v)
                for k, v in d.items()
            }
            for d in step
        ]
        for t, step in enumerate(grads)
    ]


# The speculation tests' toy: two layers, so still several layer-wise buckets (more layers only
# add leaves to compile).
SPECULATION_LAYERS = 2
IDLE, BINDS = 1e-3, 1.0  # The toy's mean gradient has norm ~40 at scale 1; the clip is 1.
# Each case, over three steps: (scale per step and top-level key, norm groups, per step whether
# the step speculated and whether that failed, so it recomputed the layer-wise buckets). A fresh
# state does not speculate; a step speculates after one that needed no Muon clip. No norm groups
# is None, as the toy's other tests leave grad_norm_group: the same optimizers, so their steps
# compile once.
SPECULATION_CASES = {
    "clip_never_binds": (lambda t, k: IDLE, None, [(0, 0), (1, 0), (1, 0)]),
    "clip_binds_every_step": (lambda t, k: BINDS, None, [(0, 0), (0, 0), (0, 0)]),
    "clip_binds_after_idle_steps": (
        lambda t, k: BINDS if t == 2 else IDLE,
        None,
        [(0, 0), (1, 0), (1, 1)],
    ),
    "clip_idle_after_binding": (
        lambda t, k: BINDS if t == 0 else IDLE,
        None,
        [(0, 0), (0, 0), (1, 0)],
    ),
    "only_a_muon_group_clips": (
        lambda t, k: BINDS if (t, k) == (2, "layer1") else IDLE,
        {"layer1/*": "mtp"},
        [(0, 0), (1, 0), (1, 1)],
    ),
    "only_an_elementwise_group_clips": (
        lambda t, k: BINDS if k == "head" else IDLE,
        {"head/*": "out"},
        [(0, 0), (1, 0), (1, 0)],
    ),
}


@pytest.mark.parametrize("case", SPECULATION_CASES)
def test_pipelined_step_equals_the_serial_step(case):
    scale_of, norm_groups, flags = SPECULATION_CASES[case]
    params = toy_params(layers=SPECULATION_LAYERS)
    grads = _scaled(random_grads(params, 4, 3), scale_of)
    (opt, p0, s0, m0, _), (_, p1, s1, m1, history) = _serial_and_pipelined(
        params, grads, grad_norm_group=norm_groups
    )
    assert [(int(m["speculated"]), int(m["recomputed"])) for m in history] == flags
    # The flag the next step reads: whether this one needed no Muon clip.
    muon_clipped = any(
        float(v) < 1 for k, v in m1.items() if k.startswith("clip_coef") and k != "clip_coef/out"
    )
    assert bool(s1.speculate) == (not muon_clipped)
    _assert_same_steps((p0, s0, m0), (p1, s1, m1))
    if not norm_groups:
        want = reference_run(
            params, grads, opt.plan.routes, lr=LR, weight_decay=0.1, clip_grad=1.0, muon_config=MUON
        )
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(want)):
            assert np.max(np.abs(np.asarray(a) - b)) <= 1e-5 * np.max(np.abs(b))


def _linear_loss(params, batch):
    """A loss whose gradient on each device is that device's slice of ``batch``."""
    return sum(jnp.vdot(p, g[0]) for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(batch)))


# Idle, idle, idle, binds, binds, idle. Flag after each step (no Muon clip): 1 1 1 0 0 1. The
# conditional guesses from the step before (a fresh state's flag is off); the host from the
# step before that, so that it never waits for the step in flight.
HOST_CLIPS = [IDLE, IDLE, IDLE, BINDS, BINDS, IDLE]
GUESSES = {
    "host": [(0, 0), (0, 0), (1, 0), (1, 1), (1, 1), (0, 0)],
    "conditional": [(0, 0), (1, 0), (1, 0), (1, 1), (0, 0), (0, 0)],
}


# make_train_step's options per form: the host's choice with and without donation, and with
# the state alone between steps; and the train step called inside jax.jit.
HOST_FORMS = {
    "host": dict(donate=False),
    "host_donated": dict(donate=True),
    "host_state_only": dict(donate=True, options=TrainStepOptions(overlap_param_gather=True)),
    "conditional": dict(donate=False),
}


def _run_train_steps(opt, params, grads, *, traced=False, **options):
    """Every step's metrics, and the last parameters and state."""
    train_step = make_train_step(_linear_loss, opt, **options)
    if traced:
        train_step = jax.jit(train_step)
    state_only = "options" in options  # the parameters live in the state's masters
    state, history = opt.init(params), []
    # Placed as the step returns them, so that a jitted step compiles once, not again on step 2.
    params = None if state_only else _replicated(opt, jax.tree.map(jnp.copy, params))
    for device_grads in grads:
        batch = jax.tree.map(lambda *g: np.stack(g), *device_grads)
        params, state, metrics = train_step(params, state, batch)
        history.append(metrics)
    return history, opt.gather_params(state) if state_only else params, state


@functools.cache
def _host_clips_serial_and_reference():
    """The host tests' parameters and gradients, the serial step's last parameters and state
    on them, and the reference's parameters: the same for every form, so computed once (only
    read: nothing donates them)."""
    params = toy_params(layers=SPECULATION_LAYERS)
    grads = _scaled(random_grads(params, 4, len(HOST_CLIPS), seed=3), lambda t, k: HOST_CLIPS[t])
    _, *serial = _run_train_steps(_toy_optimizer(params, False), params, grads)
    want = reference_run(
        params,
        grads,
        _toy_optimizer(params, True).plan.routes,
        lr=LR,
        weight_decay=0.1,
        clip_grad=1.0,
        muon_config=MUON,
    )
    return params, grads, serial, want


@pytest.mark.parametrize("form", HOST_FORMS)
def test_train_step_chooses_speculation_on_the_host_and_equals_the_serial_step(form):
    """make_train_step runs a pipelined, clipping step as two compiled steps and chooses
    between them on the host from the flag of the step before last (each step returns
    its flag apart from the donated state); traced inside a jit, it falls back to the
    conditional. Either way it computes the serial step."""
    params, grads, serial, want = _host_clips_serial_and_reference()
    traced = form == "conditional"
    opt = _toy_optimizer(params, True)
    history, *pipelined = _run_train_steps(opt, params, grads, traced=traced, **HOST_FORMS[form])
    flags = [(int(m["speculated"]), int(m["recomputed"])) for m in history]
    assert flags == GUESSES["conditional" if traced else "host"]
    _assert_same_steps(serial, pipelined)
    for a, b in zip(jax.tree.leaves(pipelined[0]), jax.tree.leaves(want)):
        assert np.max(np.abs(np.asarray(a) - b)) <= 1e-5 * np.max(np.abs(b))


def test_train_step_refuses_a_pipelined_state_without_its_speculation_flag():
    params = toy_params(layers=SPECULATION_LAYERS)
    opt = _toy_optimizer(params, True)
    batch = jax.tree.map(lambda x: np.zeros((4, *x.shape), np.float32), params)
    with pytest.raises(ValueError, match=r"state\.speculate: .* got None"):
        make_train_step(_linear_loss, opt)(params, opt.init(params)._replace(speculate=None), batch)


def test_serial_and_pipelined_steps_under_medium_precision_match_the_per_matrix_reference():
    """bf16 Newton–Schulz: the bf16 Q each step carries to its apply is scaled there in
    fp32, per QKV piece."""
    muon = dataclasses.replace(MUON, fp32_matmul_prec="medium")
    params = toy_params(layers=2)
    # Gradients on a 2^-18 grid sum exactly in any order, and the clip does not bind, so the sharded
    # step orthogonalises the reference's fp32 matrices bit for bit: the bf16 roundings inside
    # Newton–Schulz then match too, and one step leaves only fp32 rounding between the two.
    grads = [
        [
            jax.tree.map(lambda g: np.round(g * 256) / 2**18, d)
            for d in random_grads(params, 4, steps=1)[0]
        ]
    ]
    # [out, in] storage, as the reference orthogonalises. down's pieces scale by sqrt(24),
    # 4, 4 (whole: sqrt(48)).
    split = {"qkv_split": {"layer*/down": (24, 12, 12)}}
    runs = _serial_and_pipelined(params, grads, muon=muon, matrix_convention="out_in", **split)
    assert {r.path: r.qkv_split_shapes for r in runs[0][0].plan.routes}["layer0/down"] == (
        24,
        12,
        12,
    )
    want = reference_run(
        params,
        grads,
        runs[0][0].plan.routes,
        lr=LR,
        weight_decay=0.1,
        clip_grad=1.0,
        muon_config=muon,
    )
    for pipelined, (opt, got, _, metrics, _) in zip((False, True), runs):
        assert ("recomputed" in metrics) == pipelined and not bool(metrics.get("recomputed", False))
        assert float(metrics["clip_coef"]) == 1.0
        for path, a, b, p in zip(
            opt.plan.routes, jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(params)
        ):
            # Measured against the step's change: bf16 scaling in the apply is off by ~1e-3 of it.
            err = np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b - np.asarray(p)))
            assert err <= 1e-4, (path.path, pipelined, err)


def test_pipelined_step_recomputes_each_layer_wise_bucket_in_its_own_loop():
    """One at-most-once loop per layer-wise bucket, so each bucket's update can follow
    its own loop."""
    params = toy_params(layers=8)
    config = OptimizerConfig(weight_decay=0.1, clip_grad=1.0, pipeline_muon=True)
    opt = layerwise_muon(
        params, mesh_of(4), muon=MUON, config=config, layout=LayoutConfig(bucket_size=2000)
    )
    grads = _stacked(opt, random_grads(params, 4, steps=1)[0])
    text = _step_fn(opt).lower(params, opt.init(params), grads).as_text()
    layer_wise = sum(s.layer_wise for s in schedule_buckets(opt.plan).steps)
    assert layer_wise > 1
    assert len(re.findall(r"= \"?stablehlo\.while", text)) == layer_wise


@pytest.mark.parametrize(
    "clip_grad, first", [(1.0, IDLE), (1.0, BINDS), (None, IDLE)], ids=["idle", "binds", "no_clip"]
)
def test_pipelined_step_skips_nonfinite_gradients(clip_grad, first):
    """A first step that clips or not, then one with an infinite gradient: skipped by the
    speculative step (after an idle step: its loops hand back the old momenta) or by the
    serial one (after a clipping step), which keeps the guess the first step left."""
    params = toy_params(layers=SPECULATION_LAYERS)
    grads = _scaled(
        random_grads(params, 4, steps=2, seed=5), lambda t, k: first if t == 0 else IDLE
    )
    grads[1][2]["layer1"]["up"][0, 0] = np.inf
    (_, p0, s0, m0, _), (_, p1, s1, m1, history) = _serial_and_pipelined(
        params, grads, clip_grad=clip_grad
    )
    assert bool(m0["skipped"]) and bool(m1["skipped"])
    if clip_grad:
        assert (float(history[0]["clip_coef"]) < 1) == (first == BINDS)
        speculated = first == IDLE
        assert bool(m1["speculated"]) == speculated and not bool(m1["recomputed"])
        assert bool(s1.speculate) == speculated  # the skipped step kept the guess
    _assert_same_steps((p0, s0), (p1, s1))
    (_, p2, s2, _, _), _ = _serial_and_pipelined(params, grads[:1], clip_grad=clip_grad)
    _assert_same_steps((p1, s1), (p2, s2))  # the skipped step changed nothing


def test_pipelined_step_refuses_a_state_without_its_speculation_flag():
    params = toy_params()
    config = OptimizerConfig(clip_grad=1.0, pipeline_muon=True)
    opt = layerwise_muon(params, mesh_of(4), muon=MUON, config=config)
    grads = _stacked(opt, random_grads(params, 4, steps=1)[0])
    state = opt.init(params)._replace(speculate=None)  # e.g. a serial optimizer's state
    with pytest.raises(ValueError, match=r"LayerwiseState\.speculate"):
        _step_fn(opt).lower(params, state, grads)


def test_pipelined_step_without_clipping_matches_reference():
    params = toy_params(layers=SPECULATION_LAYERS)
    grads = random_grads(params, 4, steps=3)
    (opt, p0, s0, m0, _), (_, p1, s1, m1, _) = _serial_and_pipelined(params, grads, clip_grad=None)
    assert not set(SPECULATION_METRICS) & set(m1) and s1.speculate is None  # nothing to guess
    _assert_same_steps((p0, s0), (p1, s1))
    want = reference_run(
        params, grads, opt.plan.routes, lr=LR, weight_decay=0.1, clip_grad=None, muon_config=MUON
    )
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(want)):
        assert np.max(np.abs(np.asarray(a) - b)) <= 1e-5 * np.max(np.abs(b))


@pytest.mark.parametrize("pipeline_muon", [False, True])
@pytest.mark.parametrize("matrix_convention", ["out_in", "in_out"])
def test_stacked_qkv_matrices_read_as_one_block_match_the_reference(
    matrix_convention, pipeline_muon
):
    """Each rank's QKV and output matrices lie back to back: one slice in, one update
    out, either storage."""
    rng = np.random.default_rng(3)
    layers = 8
    w = lambda *s: jnp.asarray(rng.standard_normal(s) / 4, jnp.float32)  # noqa: E731
    params = {
        "embed": w(64, 16),
        "layers": {"qkv": w(layers, 32, 16), "o": w(layers, 16, 16)},
    }  # [out, in]
    grads = [
        [
            jax.tree.map(lambda x: np.asarray(rng.standard_normal(x.shape), np.float32), params)
            for _ in range(2)
        ]
        for _ in range(3)
    ]
    stored = (
        (lambda t: t)
        if matrix_convention == "out_in"
        # noqa: E731
        else (
            lambda t: {
                "embed": t["embed"],
                "layers": jax.tree.map(lambda x: x.swapaxes(-1, -2), t["layers"]),
            }
        )
    )
    config = OptimizerConfig(
        weight_decay=0.1,
        clip_grad=1.0,
        pipeline_muon=pipeline_muon,
        matrix_convention=matrix_convention,
    )
    opt = layerwise_muon(
        stored(params),
        mesh_of(2),
        learning_rate=LR,
        muon=MUON,
        config=config,
        layout=LayoutConfig(bucket_size=None),
        routing=RoutingRules(stacked={"layers/*": 1}, qkv_split={"layers/qkv": (4, 2, 2)}),
    )
    blocks = [
        (g.shape, g.width)
        for b in opt.plan.buffers
        for g in b.slot_groups
        if all(r == g.offsets[0] for r in g.offsets)
        and shards.block_start(np.asarray(g.offsets[0]), g.shape) is not None
    ]
    assert {width for _, width in blocks} == {4} and len(
        blocks
    ) == 2  # the QKV group and the output group
    got, _, metrics = run_sharded(
        opt, stored(params), [[stored(g) for g in step] for step in grads]
    )
    reference = layerwise_muon(
        params,
        mesh_of(2),
        config=dataclasses.replace(config, matrix_convention="out_in"),
        layout=LayoutConfig(bucket_size=None),
        routing=RoutingRules(stacked={"layers/*": 1}, qkv_split={"layers/qkv": (4, 2, 2)}),
    )
    want = reference_run(
        params,
        grads,
        reference.plan.routes,
        lr=LR,
        weight_decay=0.1,
        clip_grad=1.0,
        muon_config=MUON,
    )
    assert float(metrics["clip_coef"]) < 1  # the clip binds: the pipelined step recomputes
    for a, b in zip(
        jax.tree.leaves(stored(got) if matrix_convention == "in_out" else got),
        jax.tree.leaves(want),
    ):
        assert np.max(np.abs(np.asarray(a) - b)) <= 1e-5 * np.max(np.abs(b))


def _with_bits(x: jax.Array, rng) -> jax.Array:
    """``x`` with -0.0 and subnormal entries scattered in (arithmetic on them would not
    keep their bits)."""
    values = np.asarray(x).copy()
    picks = rng.choice(values.size, size=(2, max(1, values.size // 16)), replace=False)
    values[picks[0]], values[picks[1]] = -0.0, np.float32(1e-40)
    return jax.device_put(values, x.sharding)


@pytest.mark.parametrize("pipeline_muon, clip_grad", [(False, 1.0), (True, 1.0), (True, None)])
def test_a_skipped_step_keeps_the_state_bit_for_bit(pipeline_muon, clip_grad):
    params = toy_params(layers=SPECULATION_LAYERS)
    config = OptimizerConfig(weight_decay=0.1, clip_grad=clip_grad, pipeline_muon=pipeline_muon)
    opt = _optimizer(  # the optimizers (and compiled steps) of the serial and pipelined tests
        params,
        4,
        learning_rate=LR,
        muon=MUON,
        config=config,
        layout=LayoutConfig(bucket_size=2000),
        routing=RoutingRules(),
    )
    rng = np.random.default_rng(4)
    state = opt.init(params)
    state = state._replace(
        momenta=jax.tree.map(lambda m: _with_bits(m, rng), state.momenta),
        masters=jax.tree.map(lambda m: _with_bits(m, rng), state.masters),
    )
    bad = random_grads(params, 4, steps=1)[0]
    bad[3]["layer1"]["wo"][1, 1] = np.nan
    _, new_state, metrics = _step_fn(opt)(_replicated(opt, params), state, _stacked(opt, bad))
    assert bool(metrics["skipped"])
    for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
        assert np.asarray(old).tobytes() == np.asarray(new).tobytes()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learning_rate": float("nan")}, "learning_rate must be a finite number >= 0"),
        ({"adam_learning_rate": -1.0}, "adam_learning_rate must be a finite number >= 0"),
        ({"config": "master_int8"}, "master_dtype must be a floating dtype"),
        ({"config": "decay_nan"}, "weight_decay must be a finite number >= 0"),
        ({"config": "clip_inf"}, "clip_grad must be a finite number >= 0 or None"),
    ],
    ids=["nan_lr", "negative_adam_lr", "int8_masters", "nan_decay", "inf_clip"],
)
def test_bad_hyper_parameters_are_refused_at_construction(kwargs, match):
    configs = {
        "master_int8": dict(master_dtype="int8"),
        "decay_nan": dict(weight_decay=float("nan")),
        "clip_inf": dict(clip_grad=float("inf")),
    }
    with pytest.raises(ValueError, match=match):
        if "config" in kwargs:
            OptimizerConfig(**configs[kwargs["config"]])
        else:
            layerwise_muon({"w": jnp.ones((4, 4))}, mesh_of(1), **kwargs)


def _bad_at_one(bad):
    return lambda count: jnp.where(count == 1, bad, 0.01)


@pytest.mark.parametrize(
    "schedule, pipeline_muon",
    [
        ({"learning_rate": _bad_at_one(jnp.nan)}, False),
        ({"learning_rate": _bad_at_one(jnp.nan)}, True),
        ({"weight_decay": _bad_at_one(jnp.nan)}, False),
        ({"weight_decay": _bad_at_one(jnp.nan)}, True),
        ({"weight_decay": _bad_at_one(-0.01)}, False),
    ],
    ids=["nan_lr", "nan_lr_pipelined", "nan_wd", "nan_wd_pipelined", "negative_wd"],
)
def test_an_unusable_scheduled_value_skips_the_step(schedule, pipeline_muon):
    """A schedule that returns NaN at count 1 (a weight decay also: infinite or negative; it is
    not clipped) leaves the state as it was: the count does not advance on a skipped step
    (Megatron's scheduler does not either), so it stays skipped."""
    params = toy_params(layers=2)
    grads = random_grads(params, 2, steps=3, seed=2)
    opt = layerwise_muon(
        params,
        mesh_of(2),
        learning_rate=schedule.get("learning_rate", 0.01),
        config=OptimizerConfig(
            weight_decay=schedule.get("weight_decay", 0.01), pipeline_muon=pipeline_muon
        ),
    )
    step = _step_fn(opt)
    state, p = opt.init(params), _replicated(opt, params)
    history = []
    for device_grads in grads:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *device_grads)
        p, state, metrics = step(p, state, stacked)
        history.append((bool(metrics["skipped"]), int(state.count), p))
    assert [h[:2] for h in history] == [(False, 1), (True, 1), (True, 1)]
    for later in history[1:]:
        for a, b in zip(jax.tree.leaves(later[2]), jax.tree.leaves(history[0][2])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state))


def _wd_schedule(count):
    """0.05, 0.08, 0.11, ...: a float32 weight decay that changes every step."""
    return jnp.float32(0.05) + jnp.float32(0.03) * jnp.asarray(count, jnp.float32)


WD_ROUTING = RoutingRules(wd_mult={"layer0/wq": 0.5, "embed/*": 2.0})


def _wd_params():
    """One toy layer's attention only: Muon matrices with and without a wd_mult (wq, wo), 2-D
    elementwise leaves with and without one (embed, head) and a vector (norm, no decay); the MLP
    would add only more of the same leaves to compile."""
    params = toy_params(layers=1)
    params["layer0"] = {k: params["layer0"][k] for k in ("wq", "wo")}
    return params


def _wd_optimizer(params, weight_decay, pipeline_muon):
    return layerwise_muon(
        params,
        mesh_of(2),
        learning_rate=LR,
        muon=MUON,
        config=OptimizerConfig(
            weight_decay=weight_decay, clip_grad=1.0, pipeline_muon=pipeline_muon
        ),
        layout=LayoutConfig(bucket_size=2000),
        routing=WD_ROUTING,
    )


def _wd_stepper(opt, form):
    """One step ``(params, state, device_grads) -> (params, state)`` in the given form."""
    if form == "local_update":
        step = _step_fn(opt)
        return lambda p, s, g: step(p, s, _stacked(opt, g))[:2]
    update = jax.jit(opt.update)

    def optax_step(p, s, device_grads):
        mean = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *device_grads)
        updates, s = update(mean, s, p)
        return optax.apply_updates(p, updates), s

    return optax_step


@pytest.mark.parametrize(
    "form, pipeline_muon",
    [("local_update", False), ("local_update", True), ("optax", False)],
    ids=["local_update", "local_update_pipelined", "optax"],
)
def test_a_weight_decay_schedule_steps_as_its_float_value_at_each_count(form, pipeline_muon):
    """A scheduled weight decay gives, step by step, what an optimizer built with that step's
    value as a float gives (Muon matrices and 2-D elementwise leaves, with wd_mult)."""
    params = _wd_params()
    grads = random_grads(params, 2, steps=2, seed=5)  # two counts: the value changes between
    scheduled = _wd_optimizer(params, _wd_schedule, pipeline_muon)
    step = _wd_stepper(scheduled, form)
    got, state = _replicated(scheduled, params), scheduled.init(params)
    want, want_state = got, state
    for count, device_grads in enumerate(grads):
        got, state = step(got, state, device_grads)
        fixed = _wd_optimizer(params, float(_wd_schedule(count)), pipeline_muon)
        want, want_state = _wd_stepper(fixed, form)(want, want_state, device_grads)
        assert int(state.count) == count + 1
        for a, b in zip(jax.tree.leaves((got, state)), jax.tree.leaves((want, want_state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weight_decay_schedule_is_accepted_and_a_float_stays_static():
    opt = _wd_optimizer(_wd_params(), _wd_schedule, False)
    assert opt.plan.config.weight_decay is _wd_schedule
    assert set(opt.plan.decay_of) == {0.0, 0.5, 1.0, 2.0}  # the multipliers the step scales
    fixed = _wd_optimizer(_wd_params(), 0.1, False)
    assert set(fixed.plan.decay_of) == {0.0, 0.1 * 0.5, 0.1, 0.1 * 2.0}  # constants of the step
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0 or a schedule"):
        OptimizerConfig(weight_decay="0.1")


@pytest.mark.parametrize("pipeline_muon", [False, True])
@pytest.mark.parametrize(("dp", "dtype"), [(1, jnp.float32), (1, jnp.bfloat16), (2, jnp.float32)])
def test_huge_finite_gradients_are_clipped_not_skipped(pipeline_muon, dp, dtype):
    """Gradients of 1e20 square to infinity in fp32; the norm is then computed scaled by the
    largest magnitude, so the step clips them like the same gradients at 2**-60 of the size
    (the update is the same up to rounding; only an infinite gradient skips). At dp 1 that
    pass packs the gradients again itself (``step.local_repack``), bf16 ones as the step
    keeps them (unpromoted)."""
    params = toy_params(layers=2)
    (device_grads,) = random_grads(params, dp, steps=1, seed=3)
    opt = layerwise_muon(
        params,
        mesh_of(dp),
        learning_rate=0.01,
        config=OptimizerConfig(clip_grad=1.0, pipeline_muon=pipeline_muon),
        routing=RoutingRules(grad_norm_group={"embed/*": "embed"}),
    )
    step = _step_fn(opt)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs).astype(dtype), *device_grads)
    scale = 2.0**60  # a power of two: the same values, in bf16 too
    cases = (
        jax.tree.map(lambda x: x * jnp.asarray(scale, dtype), stacked),
        stacked,
        jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.inf), stacked),  # this one skips
    )
    results = [step(params, opt.init(params), grads) for grads in cases]
    (big, _, big_metrics), (ref, _, ref_metrics), (_, _, inf_metrics) = results
    assert not bool(big_metrics["skipped"]) and bool(inf_metrics["skipped"])
    np.testing.assert_allclose(
        float(big_metrics["grad_norm"]), float(ref_metrics["grad_norm"]) * scale, rtol=1e-5
    )
    for a, b in zip(jax.tree.leaves(big), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("dp", [1, 2])
def test_rescaled_norm_pass_packs_the_gradients_itself_at_one_rank(dp):
    """The norm's rescaled pass (taken only when the squares overflow) is a conditional, and
    XLA writes a conditional's operands to memory. At dp 1 nothing but that pass would need the
    packed buckets written (their readers fuse the packing in), so it packs the gradients
    itself: its operands are the gradient leaves. At dp 2 they are the reduce-scattered
    shards, which the collectives wrote anyway."""
    params = toy_params(layers=2)
    opt = layerwise_muon(
        params, mesh_of(dp), learning_rate=0.01, config=OptimizerConfig(clip_grad=1.0)
    )
    (device_grads,) = random_grads(params, dp, steps=1, seed=3)
    grads = jax.tree.map(lambda *xs: jnp.stack(xs), *device_grads)
    jaxpr = jax.make_jaxpr(_step_fn(opt))(params, opt.init(params), grads).jaxpr
    (rescaled,) = [
        e
        for e in _eqns(jaxpr)
        if e.primitive.name == "cond"
        and any(i.primitive.name == "reduce_max" for b in e.params["branches"] for i in _eqns(b))
    ]
    operands = {tuple(v.aval.shape) for v in rescaled.invars[1:] if v.aval.size > 1}
    leaves = {tuple(x.shape) for x in jax.tree.leaves(params)}
    shards = {(size,) for b in opt.plan.buffers for size in b.shard_sizes}
    if dp == 1:
        assert operands and operands <= leaves, operands - leaves
    else:
        assert operands & shards - leaves, operands


# Abstract parameters past int32 (nothing is allocated): two bf16 matrices of 2**30 elements.
HUGE = {f"w{i}": jax.ShapeDtypeStruct((2**15, 2**15), jnp.bfloat16) for i in range(2)}


def _traced_local_update(opt, params):
    """The per-device step traced (not run) on ``params``' shapes: new params, state, metrics."""
    state = jax.eval_shape(opt.init, params)
    step = jax.shard_map(
        opt.local_update,
        mesh=opt.mesh,
        in_specs=(opt.param_specs, opt.state_specs, opt.param_specs),
        out_specs=(opt.param_specs, opt.state_specs, P()),
        check_vma=False,
    )
    return jax.eval_shape(step, params, state, params)


def test_a_bucket_past_int32_offsets_is_refused():
    """lwjax indexes a bucket's shard with int32 offsets: 2**31 elements in one shard (dp 1:
    the whole bucket) are refused, whether one leaf or two, naming the largest; buckets of
    2**30 hold the two leaves."""
    one = {"w": jax.ShapeDtypeStruct((2**16, 2**15 + 1), jnp.bfloat16)}
    for params, numel, largest in [
        (one, "2,147,549,184", "w, 2,147,549,184"),
        (HUGE, "2,147,483,648", "w1, 1,073,741,824"),
    ]:
        pattern = rf"holds {numel} elements \(its largest parameter: {largest}\).*int32 offsets"
        with pytest.raises(ValueError, match=pattern):
            layerwise_muon(params, mesh_of(1), layout=LayoutConfig(bucket_size=None))
    opt = layerwise_muon(HUGE, mesh_of(1), layout=LayoutConfig(bucket_size=2**30))
    assert [b.shard_sizes for b in opt.plan.buffers] == [(2**30, 2**30)]


@pytest.mark.parametrize("pipeline_muon", [False, True])
def test_a_bucket_of_ranks_past_int32_traces(pipeline_muon):
    """A bucket over dp ranks may hold 2**31 elements or more while each shard stays below:
    it is packed by one concatenate, cut into shards by row and read back by static slices, so
    no offset passes int32 (0.4 refused it: Llama-3-8B's linear_fc1 bucket over 32 ranks)."""
    opt = layerwise_muon(
        HUGE,
        mesh_of(2),
        config=OptimizerConfig(pipeline_muon=pipeline_muon),
        layout=LayoutConfig(bucket_size=None),
    )
    assert [(b.dp, b.shard_sizes) for b in opt.plan.buffers] == [(2, (2**30,))]
    new, _, metrics = _traced_local_update(opt, HUGE)
    assert jax.tree.map(lambda x: x.shape, new) == jax.tree.map(lambda x: x.shape, HUGE)
    assert metrics["update_rms"].shape == ()
    updates, _ = jax.eval_shape(opt.update, HUGE, jax.eval_shape(opt.init, HUGE), HUGE)
    assert updates["w1"].shape == (2**15, 2**15)


@pytest.mark.parametrize("pipeline_muon", [False, True])
def test_a_step_over_more_than_2_31_elements_traces(pipeline_muon):
    """Regression: the update RMS divided by the parameter count, an int past int32 for
    2**31 elements, overflowed while tracing (each bucket below the int32 limit). The zero
    count is summed in fp32 as Megatron's, so it cannot wrap as its int32 sum did."""
    opt = layerwise_muon(
        HUGE,
        mesh_of(1),
        config=OptimizerConfig(pipeline_muon=pipeline_muon),
        layout=LayoutConfig(bucket_size=2**30),
    )
    new, _, metrics = _traced_local_update(opt, HUGE)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), new) == jax.tree.map(
        lambda x: (x.shape, x.dtype), HUGE
    )
    for name in ("update_rms", "num_zeros"):
        assert (metrics[name].shape, metrics[name].dtype) == ((), jnp.float32), name
    updates, _ = jax.eval_shape(opt.update, HUGE, jax.eval_shape(opt.init, HUGE), HUGE)
    assert updates["w0"].shape == (2**15, 2**15)


def test_auto_buckets_of_duplicated_muon_alone_on_its_devices_stay_under_int32():
    """Layout on one device, duplicated tensor parallelism: ``"auto"`` buckets close at
    ALONE_BUCKET_SIZE, so three local blocks of 2**30 elements take three buckets where one
    bucket per buffer (``None``) is refused."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("dp", "tp"))
    split = NamedSharding(mesh, P(None, "tp"))
    params = {
        f"w{i}": jax.ShapeDtypeStruct((2**15, 2**16), jnp.bfloat16, sharding=split)
        for i in range(3)
    }
    with pytest.raises(ValueError, match="int32 offsets"):
        layerwise_muon(params, mesh, param_axes="tp", layout=LayoutConfig(bucket_size=None))
    opt = layerwise_muon(params, mesh, param_axes="tp")
    assert [b.shard_sizes for b in opt.plan.buffers] == [(ALONE_BUCKET_SIZE,) * 3]
    _, _, metrics = _traced_local_update(opt, params)
    assert metrics["update_rms"].shape == ()


def test_tensor_axis_is_a_deprecated_name_of_param_axes():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp"))
    params = {"w": jnp.zeros((8, 8))}
    with pytest.warns(DeprecationWarning, match="pass param_axes="):
        opt = layerwise_muon(params, mesh, tensor_axis="tp")
    assert opt.param_axes == opt.tensor_axis == "tp"
    assert opt.plan.axes == layerwise_muon(params, mesh, param_axes="tp").plan.axes
    with pytest.raises(TypeError, match="both param_axes and tensor_axis"):
        layerwise_muon(params, mesh, param_axes="tp", tensor_axis="tp")
