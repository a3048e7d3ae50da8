"""The training-step benchmark: its Llama forward against a naive reference, its steps
against ground truth, the CLI."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lwjax
from lwjax import RoutingRules
from lwjax.logical import to_logical
from lwjax.megatron.gpt import tree_from_keys
from lwjax.megatron.model import init_params, unstack_layers
from lwjax.muon import MuonConfig
from lwjax.optimizer import OptimizerConfig, layerwise_muon, named_shardings
from lwjax.tools import bench as tb
from lwjax.tools.bench import PGLE_RUNS, train_contenders, workload_config
from lwjax.tools.bench import config as bench_config
from lwjax.tools.cli import main
from lwjax.tools.demo.devices import bytes_per_device

# fp32 everywhere and fp32 Newton–Schulz, so that the dp=4 and the single-device steps agree
# to rounding.
CFG = tb.TrainBenchConfig(
    workload="small",
    layers=1,
    seq_len=16,
    micro_batch=2,
    param_dtype="float32",
    ns_precision="highest",
    clip_grad=None,
)


def mesh_of(dp):
    return Mesh(np.array(jax.devices()[:dp]), ("dp",))


def test_model_flops_per_token_counts_matmuls_and_causal_attention():
    model = workload_config("1b")
    shapes = model.param_shapes()
    matmul = sum(
        math.prod(s)
        for k, s in shapes.items()
        if k.startswith("decoder.layers.") and k.endswith(".weight")
    ) + math.prod(shapes["output_layer.weight"])
    assert tb.model_flops_per_token(model, 2048) == 6 * matmul + 6 * 16 * 2048 * 2048


_GRAD = jax.jit(jax.grad(CFG.loss()))  # compiled once: every test's parameters have one shape


def _grad(params, batch):
    """The full-batch gradient of the benchmark's loss."""
    return _GRAD(params, batch)


def _one_step(contender, params, batch, dp):
    """One step of a benchmark contender at ``dp``: new params and the state (logical for lwjax)."""
    mesh = mesh_of(dp)
    loss = CFG.loss()
    batch = jax.device_put(batch, NamedSharding(mesh, P("dp")))
    if contender == tb.ADAMW_REPLICATED:
        tx = tb.optax_adamw(CFG)
        new, state, _ = tb.optax_step(loss, tx, mesh)(params, tx.init(params), batch)
        return new, state, None
    opt = tb.lwjax_optimizer(params, mesh, CFG, muon=contender == tb.MUON)
    new, state, _, grad_norm = tb.lwjax_step(loss, opt)(params, opt.init(params), batch)
    return new, to_logical(opt, state), grad_norm


def _assert_trees_close(got, want, tol, where=None):
    """Per leaf, max |got - want| over max |want| is at most ``tol`` (only at elements
    ``where`` is true)."""
    where = jax.tree.leaves(where) if where is not None else [True] * len(jax.tree.leaves(want))
    for (path, a), b, mask in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), where
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.max(np.abs(a - b) * mask) / max(np.max(np.abs(b)), 1e-30)
        assert err <= tol, (jax.tree_util.keystr(path), err)


def _adam_well_conditioned(grads, eps=1e-8):
    """Where Adam's first step :math:`g / (|g| + \\epsilon)` is insensitive to rounding of ``g``.

    Gradients agree to ~1e-6 of the largest one, whatever the batch split; at
    elements with :math:`0 < |g| < 100 \\epsilon` that rounding moves the update by up to
    the learning rate, so those few are left out (zero gradients are exact on both sides).
    """
    return jax.tree.map(lambda g: (np.abs(np.asarray(g)) > 100 * eps) | (np.asarray(g) == 0), grads)


@pytest.mark.parametrize("contender", [tb.ADAMW_SHARDED, tb.ADAMW_REPLICATED])
def test_adamw_step_at_dp4_is_the_single_device_full_batch_step(
    contender, lwjax_step_at_dp4, zero1_step_at_dp4
):
    """Ground truth: full-batch mean gradient on one device, then optax AdamW (decay on
    matrices only)."""
    params, batch, *_ = lwjax_step_at_dp4
    batch = np.asarray(batch)
    grads = _grad(params, batch)
    decay = tree_from_keys(
        {
            "embedding.word_embeddings.weight": True,
            "output_layer.weight": True,
            "decoder.final_layernorm.weight": False,
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": False,
            "decoder.layers.self_attention.linear_qkv.weight": True,
            "decoder.layers.self_attention.linear_proj.weight": True,
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": False,
            "decoder.layers.mlp.linear_fc1.weight": True,
            "decoder.layers.mlp.linear_fc2.weight": True,
        }
    )
    tx = optax.adamw(
        CFG.learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=CFG.weight_decay, mask=decay
    )
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    want = optax.apply_updates(params, updates)

    if contender == tb.ADAMW_SHARDED:
        got, got_state, _ = zero1_step_at_dp4
    else:
        got, got_state, _ = _one_step(contender, jax.tree.map(np.array, params), batch, dp=4)
    _assert_trees_close(got, want, 1e-5, where=_adam_well_conditioned(grads))
    # Adam's first moment is (1 - b1) g: the gradient itself, mean over the global batch
    # (Adam's step is scale-free).
    mu = got_state.elementwise.mu if contender == tb.ADAMW_SHARDED else got_state[0].mu
    _assert_trees_close(mu, state[0].mu, 1e-5)


def test_muon_step_at_dp4_is_the_single_device_full_batch_step(lwjax_step_at_dp4):
    """lwjax Muon's step at dp 4 (the fixture's) against layerwise_muon on one device given
    the full-batch gradient."""
    params, batch, got_opt, _, got, got_state, grad_norm = lwjax_step_at_dp4
    batch = np.asarray(batch)

    mesh = mesh_of(
        1
    )  # the reference: one device, full-batch gradients, layerwise_muon built directly
    opt = layerwise_muon(
        params,
        mesh,
        learning_rate=CFG.learning_rate,
        muon=MuonConfig(fp32_matmul_prec="highest"),
        config=OptimizerConfig(clip_grad=None, matrix_convention="out_in"),
        routing=RoutingRules(
            stacked={"decoder/layers/*": 1},
            qkv_split={"*linear_qkv/weight": CFG.model().qkv_split_shapes},
        ),
    )
    grads = _grad(params, batch)
    step = jax.jit(
        jax.shard_map(
            lambda g, s, p: opt.local_update(g, s, p)[:2],
            mesh=mesh,
            in_specs=(P(), opt.state_specs, P()),
            out_specs=(P(), opt.state_specs),
            check_vma=False,
        )
    )
    want, want_state = step(grads, opt.init(params), params)
    assert sum(r.is_muon for r in opt.plan.routes) == 4  # qkv, proj, fc1, fc2

    assert float(grad_norm) == pytest.approx(
        float(optax.tree.norm(grads)), rel=1e-5
    )  # the full-batch gradient's
    masks = jax.tree.leaves(
        _adam_well_conditioned(grads)
    )  # Adam leaves where conditioned, Muon matrices everywhere
    where = [np.ones(m.shape, bool) if r.is_muon else m for r, m in zip(opt.plan.routes, masks)]
    _assert_trees_close(got, want, 1e-5, where=where)
    _assert_trees_close(
        to_logical(got_opt, got_state).momenta, to_logical(opt, want_state).momenta, 1e-5
    )  # (1 - beta) g


@pytest.fixture(scope="module")
def lwjax_step_at_dp4():
    """lwjax's own contender's step at dp=4, taken once for the tests below: the parameters,
    batch and optimizer, the elements to compare, the new parameters and state, and the
    gradient norm."""
    params = init_params(CFG.model(), jax.random.key(1))
    mesh = mesh_of(4)
    batch = tb.synthetic_batch(mesh, CFG.micro_batch, CFG.seq_len, CFG.model().vocab_size, seed=1)
    opt = tb.lwjax_optimizer(params, mesh, CFG)
    masks = jax.tree.leaves(_adam_well_conditioned(_grad(params, np.asarray(batch))))
    copy = lambda: jax.tree.map(np.array, params)  # noqa: E731  (the step donates)
    want, want_state, _, grad_norm = tb.lwjax_step(CFG.loss(), opt)(copy(), opt.init(params), batch)
    where = [np.ones(m.shape, bool) if r.is_muon else m for r, m in zip(opt.plan.routes, masks)]
    return params, batch, opt, where, want, want_state, grad_norm


@pytest.fixture(scope="module")
def zero1_step_at_dp4(lwjax_step_at_dp4):
    """lwjax AdamW's (ZeRO-1) step at dp=4 from the same parameters and batch, taken once: the
    new parameters, the logical state and the gradient norm."""
    params, batch, *_ = lwjax_step_at_dp4
    copy = jax.tree.map(np.array, params)  # the step donates
    return _one_step(tb.ADAMW_SHARDED, copy, np.asarray(batch), dp=4)


@pytest.mark.parametrize("per_device", [False, True], ids=["jax_grad", "lwjax_value_and_grad"])
def test_optax_form_step_at_dp4_is_the_per_device_step(per_device, lwjax_step_at_dp4):
    """The optax-form contenders take the step lwjax's own contender takes."""
    params, batch, opt, where, want, want_state, _ = lwjax_step_at_dp4
    copy = lambda: jax.tree.map(np.array, params)  # noqa: E731  (the step donates)
    got, got_state, _ = tb.lwjax_optax_step(CFG.loss(), opt, per_device=per_device)(
        copy(), opt.init(params), batch
    )
    _assert_trees_close(got, want, 1e-5, where=where)
    assert int(got_state.count) == int(want_state.count) == 1


def test_overlapped_gather_takes_the_dp4_step(lwjax_step_at_dp4):
    """The gather-in-forward contender's step (parameters gathered from the masters at its
    start, none at its end) is bitwise lwjax's own."""
    params, batch, opt, _, want, want_state, _ = lwjax_step_at_dp4
    state, _, _ = tb.lwjax_step(CFG.loss(), opt, overlap_param_gather=True)(opt.init(params), batch)
    got, want = (opt.gather_params(state), state), (want, want_state)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_unrolled_layers_take_the_stacked_step_at_dp4():
    """Two layers unstacked (one leaf per layer's parameter, the layers run in a loop): each
    layer is a Muon matrix of its own and the step is the stacked model's, layer by layer."""
    cfg = dataclasses.replace(CFG, layers=2)
    unrolled = dataclasses.replace(cfg, scan_layers=False)
    params = init_params(cfg.model(), jax.random.key(2))
    mesh = mesh_of(4)
    batch = tb.synthetic_batch(mesh, cfg.micro_batch, cfg.seq_len, cfg.model().vocab_size, seed=2)
    copy = lambda: jax.tree.map(np.array, params)  # noqa: E731  (the steps donate)
    opt = tb.lwjax_optimizer(params, mesh, cfg)
    want, *_ = tb.lwjax_step(cfg.loss(), opt)(copy(), opt.init(params), batch)
    layers = unstack_layers(copy())
    opt = tb.lwjax_optimizer(layers, mesh, unrolled)
    routes = {r.path: r for r in opt.plan.routes}
    assert sum(r.is_muon for r in opt.plan.routes) == 4 * 2
    assert routes["decoder/layers/1/self_attention/linear_qkv/weight"].qkv_split_shapes
    got, *_ = tb.lwjax_step(unrolled.loss(), opt)(layers, opt.init(layers), batch)
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    got["decoder"]["layers"] = jax.tree.map(stack, *got["decoder"]["layers"])
    where = _adam_well_conditioned(jax.jit(jax.grad(cfg.loss()))(params, np.asarray(batch)))
    where = [np.ones(m.shape, bool) if m.ndim > 2 else m for m in jax.tree.leaves(where)]
    _assert_trees_close(got, want, 1e-5, where=where)
    first, second = (
        np.asarray(want["decoder"]["layers"]["mlp"]["linear_fc2"]["weight"][i]) for i in (0, 1)
    )
    assert np.abs(first - second).max() > 1e-3  # a swap of the two layers would show


# Fully sharded: every parameter split over the 4 devices of an ("dp", "fsdp") = (1, 4) mesh.
FSDP = dataclasses.replace(CFG, fsdp=True, baselines=False)


def fsdp_mesh(devices=4):
    return Mesh(np.array(jax.devices()[:devices]).reshape(1, devices), ("dp", tb.FSDP_AXIS))


def _fsdp_inputs(params, batch, devices=4):
    """The mesh, ``fsdp_specs``, a copy of ``params`` split as they say (the steps donate) and
    ``batch`` split over both data axes."""
    mesh = fsdp_mesh(devices)
    specs = tb.fsdp_specs(CFG.model(), devices)
    params = jax.device_put(jax.tree.map(np.array, params), named_shardings(mesh, specs))
    batch = jax.device_put(np.asarray(batch), NamedSharding(mesh, P(("dp", tb.FSDP_AXIS))))
    return mesh, specs, params, batch


def _muon_numel(config):
    """Elements of the layers' matrices (Muon's; every other leaf is Adam's)."""
    return sum(
        math.prod(s)
        for k, s in config.param_shapes().items()
        if k.startswith("decoder.layers.") and k.endswith(".weight")
    )


def test_fsdp_muon_step_at_4_devices_is_the_replicated_step_at_dp4(lwjax_step_at_dp4):
    """The same step as lwjax Muon on replicated parameters, each parameter and its state
    left split four ways."""
    params, batch, opt, where, want, want_state, _ = lwjax_step_at_dp4
    mesh, specs, split, split_batch = _fsdp_inputs(params, batch)
    fsdp_opt = tb.lwjax_optimizer(split, mesh, FSDP)
    assert sum(r.is_muon for r in fsdp_opt.plan.routes) == 4  # qkv, proj, fc1, fc2
    assert fsdp_opt.plan.config.grad_reduce_in_fp32  # the bench's default
    step = tb.lwjax_step(FSDP.loss(gather=lwjax.gather_params), fsdp_opt, fsdp=True)
    got, got_state, loss, grad_norm = step(split, fsdp_opt.init(split), split_batch)

    _assert_trees_close(got, want, 1e-5, where=where)
    _assert_trees_close(
        to_logical(fsdp_opt, got_state).momenta, to_logical(opt, want_state).momenta, 1e-5
    )
    # The full-batch loss and gradient norm (the mean over devices, not their sum).
    batch = np.asarray(batch)
    assert float(loss) == pytest.approx(float(jax.jit(CFG.loss())(params, batch)), rel=1e-6)
    assert float(grad_norm) == pytest.approx(float(optax.tree.norm(_grad(params, batch))), rel=1e-5)
    for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(got)[0],
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
    ):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), path
        assert {s.data.shape for s in leaf.addressable_shards} == {
            (*leaf.shape[:-1], leaf.shape[-1] // 4)
        }, path
    # Per device, a quarter of fp32 parameters, fp32 masters, Muon momenta and Adam's two
    # moments (up to the layout's padding and the step counts).
    numel, muon = sum(x.size for x in jax.tree.leaves(params)), _muon_numel(CFG.model())
    whole = 4 * (numel + numel + muon + 2 * (numel - muon))
    assert bytes_per_device((got, got_state)) == pytest.approx(whole / 4, rel=1e-3)


def test_fsdp_adamw_step_with_remat_is_the_zero1_step(lwjax_step_at_dp4, zero1_step_at_dp4):
    """lwjax AdamW fully sharded, each layer gathered inside the rematerialised body, takes
    the ZeRO-1 AdamW step at dp 4."""
    params, batch, *_ = lwjax_step_at_dp4
    want, want_state, want_norm = zero1_step_at_dp4
    cfg = dataclasses.replace(FSDP, remat=True)
    mesh, _, split, split_batch = _fsdp_inputs(params, batch)
    opt = tb.lwjax_optimizer(split, mesh, cfg, muon=False)
    assert not any(r.is_muon for r in opt.plan.routes)
    step = tb.lwjax_step(cfg.loss(gather=lwjax.gather_params), opt, fsdp=True)
    got, got_state, _, grad_norm = step(split, opt.init(split), split_batch)

    grads = _grad(params, np.asarray(batch))
    _assert_trees_close(got, want, 1e-5, where=_adam_well_conditioned(grads))
    # Adam's step is scale-free: the norm shows the gradient is the mean over devices.
    assert float(grad_norm) == pytest.approx(float(want_norm), rel=1e-5)
    assert float(grad_norm) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
    assert int(got_state.count) == 1
    # Adam's first moment is (1 - b1) g: the mean gradient, as ZeRO-1 holds it.
    _assert_trees_close(to_logical(opt, got_state).elementwise.mu, want_state.elementwise.mu, 1e-5)


def test_fsdp_forward_backward_with_remat_takes_the_full_batch_loss_and_gradient(
    lwjax_step_at_dp4,
):
    """forward+backward fully sharded: the loss of the replicated step at dp 4; its gradient
    blocks sum the devices' gradients (the gather's transpose), so their squares add up to
    ``4**2`` times the full-batch gradient's, where the replicated step adds up each device's
    own gradient's."""
    params, batch, *_ = lwjax_step_at_dp4
    mesh, specs, split, split_batch = _fsdp_inputs(params, batch)
    loss, square = tb.forward_backward_step(
        dataclasses.replace(FSDP, remat=True).loss(gather=lwjax.gather_params),
        mesh,
        axis=("dp", tb.FSDP_AXIS),
        param_specs=specs,
        gather=tb.fsdp_param_gather(CFG.model(), mesh, reduce_in_fp32=False),
    )(split, split_batch)
    want_loss, want_square = tb.forward_backward_step(CFG.loss(), mesh_of(4))(params, batch)

    batch = np.asarray(batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    full = float(optax.tree.norm(_grad(params, batch))) ** 2
    assert float(square) == pytest.approx(16 * full, rel=1e-5)
    per_device = jax.jit(jax.grad(CFG.loss()))
    own = sum(float(optax.tree.norm(per_device(params, b))) ** 2 for b in np.split(batch, 4))
    assert float(want_square) == pytest.approx(own, rel=1e-5)


def test_fsdp_init_params_are_init_params_split():
    config = CFG.model()
    mesh, specs = fsdp_mesh(4), tb.fsdp_specs(config, 4)
    got = tb.fsdp_params(config, jax.random.key(3), "float32", mesh, specs)
    want = init_params(config, jax.random.key(3), "float32")
    for (path, a), b, spec in zip(
        jax.tree_util.tree_flatten_with_path(got)[0],
        jax.tree.leaves(want),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), path


def test_fsdp_specs_name_the_leaves_the_devices_do_not_divide():
    # small workload: hidden 256 (every leaf but fc2's [256, 704]) and fc2's 704 = 2**6 * 11
    with pytest.raises(ValueError, match="3 devices do not divide") as error:
        tb.fsdp_specs(CFG.model(), 3)
    message = str(error.value)
    assert "decoder.layers.mlp.linear_fc2.weight (1, 256, 704)" in message
    assert "output_layer.weight (4096, 256)" in message
    with pytest.raises(ValueError) as error:
        tb.fsdp_specs(CFG.model(), 128)  # 704 is not a multiple of 128; 256 is
    assert "linear_fc2" in str(error.value) and "output_layer" not in str(error.value)
    specs = tb.fsdp_specs(CFG.model(), 8)
    assert specs["decoder"]["layers"]["mlp"]["linear_fc2"]["weight"] == P(None, None, "fsdp")
    assert specs["decoder"]["final_layernorm"]["weight"] == P("fsdp")


@pytest.mark.parametrize(
    "options, named",
    [
        ({}, "got baselines=True."),
        (dict(optax_form=True, baselines=False), "got optax_form=True."),
        (
            dict(workload="1b", baselines=False, megatron_script="x.py"),
            "got megatron_script='x.py'.",
        ),
    ],
)
def test_fsdp_config_refuses_the_contenders_that_replicate_the_model(options, named):
    with pytest.raises(ValueError, match="fully sharded steps only") as error:
        tb.TrainBenchConfig(fsdp=True, **options)
    assert str(error.value).endswith(named)


def test_cli_train_step_writes_bench_json(tmp_path, capsys):
    code = main(
        [
            "bench",
            "--train-step",
            "--workload",
            "small",
            "--layers",
            "1",
            "--dp",
            "2",
            "--seq-len",
            "16",
            "--micro-batch",
            "1",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    records = json.loads((tmp_path / "bench.json").read_text())
    assert [r["contender"] for r in records] == [*tb.CONTENDERS, tb.FORWARD_BACKWARD]
    muon = records[0]
    assert set(muon["muon_overhead_pct"]) == {tb.ADAMW_SHARDED, tb.ADAMW_REPLICATED}
    for r in records:
        assert (
            r["dp"] == 2
            and r["tokens_per_step"] == 32
            and r["step_ms"] > 0
            and r["tokens_per_s"] > 0
        )
        assert (r["iters"], r["warmup"]) == (1, 0)
    assert "Training step" in out and "Muon overhead" in out and tb.ADAMW_REPLICATED in out
    # Every step compiled with make_train_step's XLA options, and the table says so.
    assert all(r["compiler_options"] == {"xla_gpu_enable_triton_gemm": False} for r in records)
    assert "XLA options: xla_gpu_enable_triton_gemm=False" in " ".join(out.split())
    # Each contender's floor: forward+backward's step, and Muon's Newton-Schulz on top.
    fwd_bwd = records[-1]["step_ms"]
    ns = muon["newton_schulz"]
    assert muon["floor_ms"] == pytest.approx(fwd_bwd + ns["ns_computed_ms"])
    assert 0 < ns["ns_computed_ms"] and ns["ns_gflop_max_rank"] == max(ns["ns_gflop_per_rank"])
    assert all(r["floor_ms"] == fwd_bwd for r in records[1:-1])
    assert "floor_ms" not in records[-1] and "over floor" in out and "Newton-Schulz" in out


def test_cli_xla_defaults_compiles_the_steps_with_no_options(monkeypatch):
    """``--xla-defaults``: the bench's steps get ``{}`` (XLA's defaults) instead of
    ``make_train_step``'s options; without it, those options."""
    from lwjax.train_options import STEP_COMPILER_OPTIONS

    configs = []
    monkeypatch.setattr("lwjax.tools.bench.run_train_bench", lambda c: configs.append(c) or [])
    monkeypatch.setattr("lwjax.tools.commands.bench.print_train_bench", lambda records: None)
    argv = ["bench", "--train-step", "--workload", "small", "--dp", "1"]
    main([*argv, "--xla-defaults"])
    main(argv)
    assert [dict(c.compiler_options) for c in configs] == [{}, dict(STEP_COMPILER_OPTIONS)]


def test_newton_schulz_floor_counts_every_muon_matrix_once_on_its_owner():
    """The per-rank Newton-Schulz FLOPs add up to each Muon leaf's, counted from the
    routes (stacked layers as one parameter each), and the busiest rank's time is its
    FLOPs over the measured rate."""
    from lwjax.cost import ns_flops
    from lwjax.tools.bench import newton_schulz_floor

    mesh = mesh_of(2)
    config = dataclasses.replace(CFG, layers=2, ns_precision="medium")
    params = tb.replicated(init_params(config.model(), jax.random.key(0), "float32"), mesh)
    plan = tb.lwjax_optimizer(params, mesh, config).plan
    muon = [r for r in plan.routes if r.is_muon]
    assert muon, "the small workload has Muon matrices"
    expected = sum(
        math.prod(r.shape[: r.stack_dims])
        * ns_flops(r.shape[r.stack_dims :], 5, r.qkv_split_shapes)
        for r in muon
    )
    floor = newton_schulz_floor(plan, mesh, "medium", iters=2, warmup=1)
    per_rank = floor["ns_gflop_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == pytest.approx(expected / 1e9)
    assert min(per_rank) > 0  # both ranks own matrices
    rate = floor["matmul_tflops"] * 1e12
    assert floor["ns_ms"] == pytest.approx(max(per_rank) * 1e9 / rate * 1e3)


def test_cli_overlapped_gather_trains_as_the_default_step_with_unrolled_layers(tmp_path, capsys):
    """--overlap-param-gather --no-scan-layers --profile: the gather-in-forward contenders
    train bitwise as lwjax's own (the same loss and gradient norm after the same steps), each
    Muon against its own AdamW; the trace runs (empty on CPU)."""
    argv = "bench --train-step --workload small --layers 2 --dp 2 --seq-len 16 --micro-batch 1"
    argv += " --iters 1 --warmup 0 --no-baselines --overlap-param-gather --no-scan-layers"
    code = main([*argv.split(), "--profile", str(tmp_path / "trace"), "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    records = {r["contender"]: r for r in json.loads((tmp_path / "bench.json").read_text())}
    assert list(records) == [
        tb.MUON, tb.MUON_OVERLAP, tb.ADAMW_SHARDED, tb.ADAMW_OVERLAP, tb.FORWARD_BACKWARD
    ]  # fmt: skip
    for default, overlapped in [(tb.MUON, tb.MUON_OVERLAP), (tb.ADAMW_SHARDED, tb.ADAMW_OVERLAP)]:
        for key in ("loss", "grad_norm"):
            assert records[overlapped][key] == records[default][key] > 0
    assert set(records[tb.MUON]["muon_overhead_pct"]) == {tb.ADAMW_SHARDED}
    assert set(records[tb.MUON_OVERLAP]["muon_overhead_pct"]) == {tb.ADAMW_OVERLAP}
    assert all(r["scan_layers"] is False and r["profile"] == {} for r in records.values())
    assert tb.ADAMW_OVERLAP in out


def test_cli_fsdp_train_step_keeps_a_quarter_of_the_model_per_device(capsys):
    """--train-step --fsdp at 4 devices: lwjax's fully sharded contenders only, each device
    holding a quarter of the bf16 parameters and of the fp32 state."""
    argv = "bench --train-step --fsdp --workload small --layers 1 --seq-len 16 --micro-batch 1"
    argv += " --dp 4 --iters 1 --warmup 0 --no-baselines --json"
    code = main(argv.split())
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    records = {r["contender"]: r for r in json.loads(out)}
    assert list(records) == [tb.MUON_FSDP, tb.ADAMW_FSDP, tb.FORWARD_BACKWARD]
    config = workload_config("small", 1)
    numel = sum(math.prod(s) for s in config.param_shapes().values())
    muon = _muon_numel(config)
    for r in records.values():
        assert (r["fsdp"], r["dp"], r["param_dtype"], r["params"]) == (True, 4, "bfloat16", numel)
        assert r["replicated_bytes"] == numel * (2 + 4)  # bf16 parameters, fp32 gradients
        assert r["device_bytes_limit"] is None  # no memory stats on CPU
        # every parameter gathered but the embedding table, looked up by rows
        table = math.prod(config.param_shapes()["embedding.word_embeddings.weight"])
        assert r["collectives"]["all-gather"][1] >= numel - table
    # bf16 parameters; fp32 masters, Muon momenta and Adam's two moments: a quarter on each
    # device (up to padding), below ZeRO-1's replicated parameters plus a quarter of the state.
    state = 4 * (numel + muon + 2 * (numel - muon))
    got = records[tb.MUON_FSDP]["state_bytes_per_device"]
    assert got == pytest.approx((2 * numel + state) / 4, rel=1e-3)
    assert got < 2 * numel + state / 4
    got = records[tb.ADAMW_FSDP]["state_bytes_per_device"]
    assert got == pytest.approx((2 * numel + 4 * 3 * numel) / 4, rel=1e-3)
    assert records[tb.FORWARD_BACKWARD]["state_bytes_per_device"] == 2 * numel // 4
    for name in (tb.MUON_FSDP, tb.ADAMW_FSDP):
        assert math.isfinite(records[name]["loss"]) and records[name]["grad_norm"] > 0
    assert set(records[tb.MUON_FSDP]["muon_overhead_pct"]) == {tb.ADAMW_FSDP}


class _Recorded:
    """A jitted step that notes, at each call through jit, whether PGLE is on."""

    def __init__(self, step, calls):
        self.step, self.calls = step, calls

    def lower(self, *args):
        return self.step.lower(*args)

    def __call__(self, *args):
        self.calls.append(jax.config.jax_enable_pgle)
        return self.step(*args)


def _run_recorded(cfg, monkeypatch):
    """run_train_bench, with each contender's calls through jit and whether each lwjax
    update speculates."""
    calls, speculates = (
        [],
        set(),
    )  # calls: per step built, in contender order; speculates: (muon, "recomputed")
    lwjax_optimizer = tb.lwjax_optimizer

    def recorded(make):
        def build(*args, **kwargs):
            calls.append([])
            return _Recorded(make(*args, **kwargs), calls[-1])

        return build

    def optimizer(*args, muon=True, **kwargs):
        opt = lwjax_optimizer(*args, muon=muon, **kwargs)

        def update(grads, state, params, **options):
            new_params, new_state, metrics = opt.local_update(grads, state, params, **options)
            speculates.add((muon, "recomputed" in metrics))
            return new_params, new_state, metrics

        return opt._replace(local_update=update)

    with monkeypatch.context() as patch:
        patch.setattr(train_contenders, "lwjax_optimizer", optimizer)
        for name in ("lwjax_step", "optax_step", "forward_backward_step"):
            patch.setattr(train_contenders, name, recorded(getattr(train_contenders, name)))
        records = tb.run_train_bench(cfg)
    return records, calls, speculates


@pytest.mark.filterwarnings(
    "ignore:PGLE collected an empty trace"
)  # no kernel trace on CPU; the paths still run
def test_train_step_pipelined_under_pgle_trains_as_the_serial_step(monkeypatch):
    """--train-step --pipeline-muon --pgle: the same steps (the jit path PGLE recompiles,
    speculation and all)."""
    # XLA's default options for both runs: PGLE compiles through jit with those, so the serial
    # run's AdamW and forward+backward are the executables the PGLE run compiles up front.
    cfg = dataclasses.replace(
        CFG, dp_sizes=(2,), iters=1, warmup=3, baselines=False, clip_grad=1.0, compiler_options={}
    )
    (serial, serial_calls, serial_updates), (pipelined, calls, updates) = (
        _run_recorded(dataclasses.replace(cfg, pipeline_muon=on, pgle=on), monkeypatch)
        for on in (False, True)
    )
    assert [(r["pipeline_muon"], r["pgle"]) for r in pipelined] == [(True, True)] * 3
    # The flags took effect. Serial: every call goes to the executable compiled up front, and
    # Muon's update does not speculate. PGLE: every contender's calls go through jit with PGLE
    # on, enough of them to profile and recompile; pipelined: Muon's update speculates (AdamW
    # has no Muon bucket).
    assert serial_calls == [[], [], []] and serial_updates == {(True, False), (False, False)}
    assert len(calls) == 3 and not jax.config.jax_enable_pgle
    for contender_calls in calls:
        assert all(contender_calls) and len(contender_calls) > PGLE_RUNS
    assert updates == {(True, True), (False, False)}
    for a, b in zip(serial, pipelined):
        assert a["contender"] == b["contender"]
        if "loss" in a:  # after warmup + iters + 1 steps each
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        if a["contender"] in (tb.MUON, tb.ADAMW_SHARDED):
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and a["grad_norm"] > 0


ONLY_TRAIN_STEP = (
    "lwjax bench: --seq-len, --micro-batch, --remat, --no-adamw, --attention, --fsdp, "
    "--overlap-param-gather and --no-scan-layers apply to --train-step only."
)


@pytest.mark.parametrize(
    "argv, message",
    [
        ("bench --seq-len 16", ONLY_TRAIN_STEP),
        ("bench --fsdp", ONLY_TRAIN_STEP),
        ("bench --attention xla", ONLY_TRAIN_STEP),
        ("bench --no-adamw", ONLY_TRAIN_STEP),
        ("bench --overlap-param-gather", ONLY_TRAIN_STEP),
        ("bench --no-scan-layers", ONLY_TRAIN_STEP),
        (
            "bench --train-step --fsdp --no-baselines --overlap-param-gather",
            "lwjax bench: TrainBenchConfig.fsdp needs overlap_param_gather=False and "
            "scan_layers=True",
        ),
        (
            "bench --train-step --fsdp",  # baselines on by default: they replicate the model
            "lwjax bench: TrainBenchConfig.fsdp times lwjax's fully sharded steps only",
        ),
        (
            "bench --train-step --grad-std 0.1",
            "lwjax bench: --grad-std applies to the optimizer step only",
        ),
        (
            "bench --train-step --micro-batch 0",
            "lwjax bench: TrainBenchConfig.micro_batch must be >= 1; got 0.",
        ),
    ],
    ids=[
        "seq_len_without_train_step",
        "fsdp_without_train_step",
        "attention_without_train_step",
        "no_adamw_without_train_step",
        "overlap_without_train_step",
        "unrolled_without_train_step",
        "fsdp_with_overlap",
        "fsdp_with_baselines",
        "grad_std_with_train_step",
        "micro_batch_zero",
    ],
)
def test_cli_train_step_user_errors(argv, message, capsys):
    code = main(argv.split())
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize(
    "options",
    [dict(), dict(fsdp=True, baselines=False), dict(overlap_param_gather=True)],
    ids=["replicated", "fsdp", "overlapped"],
)
def test_no_adamw_leaves_out_every_lwjax_adamw_and_nothing_else(options):
    """``adamw=False`` (``--no-adamw``, run 2's step held to the memory Muon's plan asks for)
    drops exactly the lwjax AdamW contenders of the setting."""
    names = {
        flag: [
            c.name
            for c in train_contenders.TRAIN_STEP_CONTENDERS
            if c.runs(tb.TrainBenchConfig(adamw=flag, **options))
        ]
        for flag in (True, False)
    }
    adamw = {tb.ADAMW_SHARDED, tb.ADAMW_FSDP, tb.ADAMW_OVERLAP}
    assert set(names[True]) & adamw
    assert names[False] == [n for n in names[True] if n not in adamw]


def test_attention_reaches_every_contenders_loss(monkeypatch):
    """``attention`` is what the loss asks the model for (``--attention xla`` is how run 5 of
    docs/scripts/multi_gpu_runs.sh steps deterministically); an unknown one is refused."""
    seen = []
    monkeypatch.setattr(
        bench_config, "gpt_loss", lambda *args, **options: seen.append(options["attention"])
    )
    for attention in ("xla", "cudnn"):
        tb.TrainBenchConfig(attention=attention).loss()(None, jnp.zeros((1, 3), jnp.int32))
    assert seen == ["xla", "cudnn"]
    with pytest.raises(ValueError, match=r"TrainBenchConfig.attention must be one of \('auto'"):
        tb.TrainBenchConfig(attention="flash")


FAKE_MEGATRON = """
import json, os, sys
print("Megatron's own log lines come first")
times = {"fwd_bwd": 100.0, "adam": 110.0, "muon": 132.0, "adam_overlap": 105.0}
contenders = {k: {"median_ms": v, "peak_mem_bytes": 7} for k, v in times.items()}
contenders["muon"]["flags"] = {"argv": sys.argv[1:], "world": int(os.environ["WORLD_SIZE"])}
contenders["muon_overlap"] = {"skipped": "overlap_param_gather: not in this release"}
config = {"versions": {"megatron_core": "0.19.2"}, "attention": "local"}
if os.environ["RANK"] == "0":  # as the real script: two ranks' lines could interleave
    print(json.dumps({"config": config, "contenders": contenders}))
"""


def test_megatron_training_step_records_come_from_the_script_it_ran(tmp_path, capsys):
    """--train-step --megatron SCRIPT: the script runs under torchrun on dp ranks with the
    bench's shapes and settings; each contender becomes a record, its optimizer time against
    Megatron's own forward+backward and Muon's overhead against Megatron's Adam; a contender
    the script skipped is reported with its reason."""
    from lwjax.tools.render import print_train_bench

    script = tmp_path / "megatron_train_bench.py"
    script.write_text(FAKE_MEGATRON)
    cfg = dataclasses.replace(
        CFG,
        workload="1b",
        layers=2,
        clip_grad=0.5,
        param_dtype="bfloat16",
        megatron_script=str(script),
    )
    tokens = 2 * cfg.micro_batch * cfg.seq_len
    records = {r["contender"]: r for r in tb.megatron_train_records(cfg, 2, tokens)}
    names = tb.MEGATRON_CONTENDERS
    assert list(records) == list(names.values())
    muon = records[names["muon"]]
    argv = muon["flags"]["argv"]
    assert muon["flags"]["world"] == 2
    for flag, value in [
        ("--preset", "1b"),
        ("--layers", "2"),
        ("--seq-len", str(cfg.seq_len)),
        ("--micro-batch", str(cfg.micro_batch)),
        ("--clip-grad", "0.5"),
        ("--ns-prec", cfg.ns_precision),
        ("--iters", str(cfg.iters)),
    ]:
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--grad-reduce-in-fp32" in argv and "--recompute" not in argv
    assert muon["optimizer_ms"] == pytest.approx(32.0)
    assert muon["muon_overhead_pct"] == {names["adam"]: pytest.approx(20.0)}
    assert muon["tokens_per_s"] == pytest.approx(tokens / 0.132)
    assert records[names["adam_overlap"]]["optimizer_ms"] == pytest.approx(5.0)
    assert "optimizer_ms" not in records[names["fwd_bwd"]]
    assert "not in this release" in records[names["muon_overlap"]]["skipped"]
    assert records[names["adam"]]["measured_peak_bytes"] == 7
    with pytest.raises(ValueError, match="1b and 8b workloads in bfloat16 only"):
        dataclasses.replace(cfg, param_dtype="float32")
    base = dict(workload="1b", layers=2, params=1, micro_batch=2, seq_len=16, remat=False)
    base.update(param_dtype="bfloat16", device="cpu", jax=jax.__version__, dp=2, mfu=None)
    lwjax_muon = dict(base, contender=tb.MUON, step_ms=120.0, tokens_per_s=1.0)
    lwjax_muon.update(compiled_bytes_per_device=None, muon_overhead_pct={})
    print_train_bench([lwjax_muon, *(dict(base, **r) for r in records.values())])
    table = capsys.readouterr().out
    assert "skipped: overlap_param_gather" in table and "Megatron-Core Adam" in table
    adam_row = next(line for line in table.splitlines() if names["adam"] in line)
    assert "+20.0%" in adam_row  # Megatron's Muon over its own Adam


def test_collectives_count_every_array_of_a_combined_collective():
    """XLA prints a long tuple's shapes with ``/*index=5*/`` notes; their ``=`` once cut the
    match short, so a combined all-reduce was counted from its last note on, or not at all."""
    from lwjax.tools.bench.compiled import collectives

    shapes = ", ".join([*(f"f32[{n}]{{0}}" for n in (64, 64, 64, 64, 32)), "/*index=5*/f32[3]{0}"])
    line = f"  %all-reduce.1 = ({shapes}) all-reduce(%a, %b, %c, %d, %e, %f), to_apply=%add\n"
    gather = "  %all-gather.2 = f32[8,4]{1,0} all-gather(%g), dimensions={0}\n"
    found = collectives(line + gather)
    assert found["all-reduce"] == (1, 4 * 64 + 32 + 3)
    assert found["all-gather"] == (1, 32)
    assert found["reduce-scatter"] == (0, 0)
