"""``make_train_step`` with what real loops carry: aux values, per-device RNG keys, mutable model
state (BatchNorm statistics averaged over dp), micro-batch accumulation, the step index."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from reference import Reference

import lwjax

DP = 8


def _mesh():
    return Mesh(np.array(jax.devices()[:DP]), ("dp",))


def _linear_problem():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)) / 3, jnp.float32), "b": jnp.zeros(4)}
    x = rng.standard_normal((64, 8)).astype(np.float32)
    return params, (x, np.tanh(x[:, :4]).astype(np.float32))


def _mse(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def test_accumulated_micro_batches_equal_one_big_batch():
    params, batch = _linear_problem()
    opt = lwjax.layerwise_muon(params, _mesh())
    runs = []
    for accumulate in (1, 4):
        step = lwjax.make_train_step(_mse, opt, accumulate=accumulate, donate=False)
        p, state, losses = params, opt.init(params), []
        for _ in range(3):
            p, state, metrics = step(p, state, batch)
            losses.append(float(metrics["loss"]))
        runs.append((p, losses, int(metrics["step"])))
    (p1, l1, s1), (p4, l4, s4) = runs
    np.testing.assert_allclose(l4, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert s1 == s4 == 3
    with pytest.raises(ValueError, match=r"leading axis must divide by dp=8 times accumulate=3"):
        lwjax.make_train_step(_mse, opt, accumulate=3)(params, opt.init(params), batch)
    with pytest.raises(ValueError, match="accumulate must be a positive integer"):
        lwjax.make_train_step(_mse, opt, accumulate=0)


def test_aux_is_averaged_and_keys_differ_across_devices_and_steps():
    """``aux`` here is each device's dropout-style mask of its key: averaged over 8 devices it
    takes fractional values only if the devices' keys differ, and it changes from step to step."""
    params, batch = _linear_problem()
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, batch, key):
        mask = jax.random.bernoulli(key, 0.5, (256,)).astype(jnp.float32)
        return _mse(params, batch), {"mask": mask, "x_mean": jnp.mean(batch[0])}

    step = lwjax.make_train_step(loss_fn, opt, has_aux=True, rng=True, donate=False)
    state, masks = opt.init(params), []
    for _ in range(2):
        _, state, metrics = step(params, state, batch, jax.random.key(0))  # the same key each call
        masks.append(np.asarray(metrics["aux"]["mask"]))
    assert set(np.unique(masks[0] * DP)) - {0.0, float(DP)}  # devices drew different masks
    assert not np.array_equal(masks[0], masks[1])  # the step count is folded in
    np.testing.assert_allclose(metrics["aux"]["x_mean"], np.mean(batch[0]), rtol=1e-5)
    with pytest.raises(TypeError, match=r"takes \(params, state, batch, key\)"):
        step(params, state, batch)


def test_a_loss_returning_aux_without_has_aux_is_refused_naming_has_aux():
    """``(loss, aux)`` without ``has_aux=True`` would meet jax's "Gradient only defined for
    scalar-output functions"; both entry points say which option is missing, and
    ``lwjax.value_and_grad(..., has_aux=True)`` returns ``((loss, aux), grads)`` as jax does."""
    params, batch = _linear_problem()
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, batch):
        return _mse(params, batch), {"x_mean": jnp.mean(batch[0])}

    message = r"loss_fn returned a tuple of 2, not a scalar loss; .* pass has_aux=True"
    with pytest.raises(TypeError, match=f"make_train_step: {message}"):
        lwjax.make_train_step(loss_fn, opt, donate=False)(params, opt.init(params), batch)
    with pytest.raises(TypeError, match=f"lwjax.value_and_grad: {message}"):
        jax.jit(lwjax.value_and_grad(loss_fn, opt))(params, batch)
    (loss, aux), grads = jax.jit(lwjax.value_and_grad(loss_fn, opt, has_aux=True))(params, batch)
    want_loss, want_grads = jax.value_and_grad(_mse)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["x_mean"], np.mean(batch[0]), rtol=1e-5)
    np.testing.assert_allclose(np.mean(grads["w"], axis=0), want_grads["w"], rtol=1e-4, atol=1e-6)


class _BatchNormMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def _shifted_batch():
    """Each device's slice has its own mean, so per-device statistics would differ."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 8)).astype(np.float32) + np.repeat(np.arange(DP), 8)[:, None]
    return x, rng.integers(0, 4, 64).astype(np.int32)


def test_nnx_batchnorm_and_dropout_train_with_the_rest_state():
    """The nnx pattern: split off the rest, reseed dropout with the step's key, return the rest."""
    model = _BatchNormMLP(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, rest, batch, key):
        model = nnx.merge(graphdef, params, rest)
        nnx.reseed(model, dropout=key)
        x, y = batch
        loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    step = lwjax.make_train_step(loss_fn, opt, mutable=True, rng=True)
    batch, state, losses = _shifted_batch(), opt.init(params), []
    for i in range(12):
        params, state, rest, metrics = step(params, state, rest, batch, jax.random.key(i))
        losses.append(float(metrics["loss"]))
        if i == 0:
            first_mean = np.asarray(rest["bn"]["mean"][...])
    assert losses[-1] < 0.7 * losses[0], losses
    assert np.all(np.isfinite(first_mean)) and np.any(first_mean != 0)
    assert np.any(np.asarray(rest["bn"]["mean"][...]) != first_mean)  # updated every step


def test_a_loss_that_closes_over_nnx_state_is_told_to_pass_it():
    """A loss that merges the model from a rest it closes over cannot change the rest's batch
    statistics inside the step (flax refuses); the error says how to pass the rest instead."""
    model = _BatchNormMLP(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, batch):
        x, y = batch
        logits = nnx.merge(graphdef, params, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    with pytest.raises(Exception, match="Cannot mutate") as caught:
        lwjax.make_train_step(loss_fn, opt)(params, opt.init(params), _shifted_batch())
    assert "mutable=True" in "".join(getattr(caught.value, "__notes__", []))


def test_batch_statistics_are_averaged_over_dp():
    """One step of a BatchNorm on the input: the running mean is the global batch mean times
    (1 - momentum), although each device saw only its own shifted slice."""
    model = nnx.BatchNorm(8, momentum=0.5, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        return jnp.mean(model(batch) ** 2), nnx.state(model, nnx.Not(nnx.Param))

    x = _shifted_batch()[0]
    _, _, rest, _ = lwjax.make_train_step(loss_fn, opt, mutable=True)(
        params, opt.init(params), rest, x
    )
    np.testing.assert_allclose(rest["mean"][...], 0.5 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(
        rest["var"][...], 0.5 + 0.5 * x.reshape(DP, 8, 8).var(1).mean(0), rtol=1e-4
    )


class _BatchNormNet(nnx.Module):
    """No bias before the BatchNorm: its gradient would be zero up to rounding, and Adam's
    direction of rounding noise is not comparable across implementations."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


def test_global_batch_statistics_train_as_one_device_on_the_whole_batch():
    """``batch_stats="global"``: a BatchNorm without ``axis_name`` normalises by the global
    batch, so two steps at dp=8 of two micro-batches equal the unsharded reference run on the
    whole batch on one device: parameters and running statistics. Per device (the default)
    each device normalises its own shifted slice, and the parameters differ."""
    graphdef, params, rest = nnx.split(_BatchNormNet(nnx.Rngs(0)), nnx.Param, ...)
    muon = lwjax.MuonConfig(fp32_matmul_prec="highest")
    opt = lwjax.layerwise_muon(params, _mesh(), learning_rate=0.02, muon=muon)

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        x, y = batch
        loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    def micro_loss(params, rest, micro_batches):
        """The mean loss over micro-batches, the statistics threaded through them."""
        losses = []
        for micro in micro_batches:
            loss, rest = loss_fn(params, jax.tree.map(lambda v: v, rest), micro)
            losses.append(loss)
        return sum(losses) / len(losses), rest

    grad_fn = jax.jit(jax.value_and_grad(micro_loss, has_aux=True))
    batch = _shifted_batch()

    def train(batch_stats):
        step = lwjax.make_train_step(
            loss_fn, opt, mutable=True, batch_stats=batch_stats, accumulate=2, donate=False
        )
        p, s, r = params, opt.init(params), rest
        for _ in range(2):
            p, s, r, metrics = step(p, s, r, batch)
        return p, r, float(metrics["loss"])

    def reference():
        """Micro-batch ``a`` holds the ``a``-th half of every device's slice."""
        ref = Reference(
            params, opt.plan.routes, lr=0.02, weight_decay=0.01, clip_grad=1.0, muon_config=muon
        )
        micro = [
            tuple(x.reshape(DP, 2, -1, *x.shape[1:])[:, a].reshape(-1, *x.shape[1:]) for x in batch)
            for a in range(2)
        ]
        r = rest
        for _ in range(2):
            (loss, r), grads = grad_fn(ref.params(), r, micro)
            ref.step(jax.tree.leaves(grads))
        return ref.params(), r, float(loss)

    want = reference()
    got = train("global")
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    errors = [
        np.max(np.abs(np.asarray(a) - np.asarray(b)))
        for a, b in zip(jax.tree.leaves(train("per_device")[0]), jax.tree.leaves(want[0]))
    ]
    assert max(errors) > 0.1, errors
    with pytest.raises(ValueError, match=r"batch_stats must be one of \('per_device', 'global'\)"):
        lwjax.make_train_step(loss_fn, opt, mutable=True, batch_stats="sync")


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(32)(x))
        x = nn.Dropout(0.2, deterministic=not train)(jax.nn.relu(x))
        return nn.Dense(4)(x)


def test_linen_batch_stats_and_dropout_rngs():
    net = _LinenNet()
    x, y = _shifted_batch()
    variables = net.init(jax.random.key(0), x[:2], train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, batch_stats, batch, key):
        x, y = batch
        logits, updates = net.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": key},
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    step = lwjax.make_train_step(loss_fn, opt, mutable=True, rng=True)
    state, losses = opt.init(params), []
    for i in range(12):
        params, state, batch_stats, metrics = step(
            params, state, batch_stats, (x, y), jax.random.key(i)
        )
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses
    assert np.all(np.asarray(batch_stats["BatchNorm_0"]["mean"]) != 0)


def test_an_empty_batch_is_refused():
    params, batch = _linear_problem()
    opt = lwjax.layerwise_muon(params, _mesh())
    empty = (batch[0][:0], batch[1][:0])
    with pytest.raises(ValueError, match=r"batch\[0\]: leading axis .* not be empty; got shape"):
        lwjax.make_train_step(_mse, opt)(params, opt.init(params), empty)


def _bytes(x) -> bytes:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def test_overlapped_param_gather_is_the_default_step_with_model_state_keys_and_micro_batches():
    """``overlap_param_gather``: the step keeps only the state and gathers the parameters from
    its masters at the start of the next step. With bf16 parameters, BatchNorm statistics,
    dropout keys, aux and two micro-batches, ``gather_params`` of its state, the state, the
    model state and the metrics are bitwise those of the default step."""
    model = _BatchNormMLP(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    opt = lwjax.layerwise_muon(params, _mesh())

    def loss_fn(params, rest, batch, key):
        model = nnx.merge(graphdef, params, rest)
        nnx.reseed(model, dropout=key)
        x, y = batch
        logits = model(x.astype(jnp.bfloat16)).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (nnx.state(model, nnx.Not(nnx.Param)), {"logit_mean": jnp.mean(logits)})

    options = dict(mutable=True, rng=True, has_aux=True, accumulate=2)
    default = lwjax.make_train_step(loss_fn, opt, **options)
    overlapped = lwjax.make_train_step(loss_fn, opt, overlap_param_gather=True, **options)
    batch, initial = _shifted_batch(), jax.device_get(params)
    s_o, r_o = opt.init(params), jax.tree.map(jnp.copy, rest)  # the default step donates
    p, s, r = params, opt.init(params), rest
    for i in range(3):
        key = jax.random.key(i)
        p, s, r, m = default(p, s, r, batch, key)
        s_o, r_o, m_o = overlapped(s_o, r_o, batch, key)
        assert jax.tree.structure(m_o) == jax.tree.structure(m)
        for a, b in zip(jax.tree.leaves((s_o, r_o, m_o)), jax.tree.leaves((s, r, m)), strict=True):
            assert _bytes(a) == _bytes(b)
    gathered = opt.gather_params(s_o)
    assert jax.tree.structure(gathered) == jax.tree.structure(p)
    for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(p), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert all(np.any(a != b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(initial)))
    with pytest.raises(
        TypeError, match=r"takes \(state, model_state, batch, key\) .*overlap_param_gather=True"
    ):
        overlapped(p, s_o, r_o, batch, key)
    # The default step's arguments, as many as the overlapped step takes with rng off.
    plain = lwjax.make_train_step(loss_fn, opt, overlap_param_gather=True, mutable=True)
    with pytest.raises(TypeError, match="argument 'state' must be the optimizer's LayerwiseState"):
        plain(p, s_o, r_o)


@pytest.mark.parametrize("rate", ["learning_rate", "adam_learning_rate"])
def test_a_negative_scheduled_learning_rate_skips_the_step(rate):
    """As a negative scheduled weight decay does: the step is skipped, not an ascent, and the
    count stays (a negative constant rate is refused when the optimizer is built)."""
    params, batch = _linear_problem()
    schedule = lambda count: jnp.where(count == 1, -0.01, 0.01)  # noqa: E731
    opt = lwjax.layerwise_muon(params, _mesh(), **{rate: schedule})
    step = lwjax.make_train_step(_mse, opt, donate=False)
    p1, state1, m1 = step(params, opt.init(params), batch)
    p2, state2, m2 = step(p1, state1, batch)
    assert not bool(m1["skipped"]) and bool(m2["skipped"])
    assert int(state1.count) == int(state2.count) == 1
    for a, b in zip(jax.tree.leaves((p2, state2)), jax.tree.leaves((p1, state1))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_overlapped_gather_keeps_the_signature_with_params_none_and_the_old_forms_warn():
    """``TrainStepOptions(overlap_param_gather=True)``: the step takes and returns ``None`` for
    the parameters, in the default step's signature. The old keyword and the old state-only
    call still work, each with a DeprecationWarning, and compute the same step."""
    params, batch = _linear_problem()
    opt = lwjax.layerwise_muon(params, _mesh())
    options = lwjax.TrainStepOptions(overlap_param_gather=True)
    step = lwjax.make_train_step(_mse, opt, options=options, donate=False)
    with pytest.warns(DeprecationWarning, match=r"overlap_param_gather=\.\.\.\) is deprecated"):
        old = lwjax.make_train_step(_mse, opt, overlap_param_gather=True, donate=False)
    state = opt.init(params)
    none, new_state, metrics = step(None, state, batch)
    with pytest.warns(DeprecationWarning, match=r"train_step\(state, .* is deprecated"):
        old_state, old_metrics = old(state, batch)
    assert none is None and int(metrics["step"]) == 1
    leaves = jax.tree.leaves((new_state, metrics)), jax.tree.leaves((old_state, old_metrics))
    for a, b in zip(*leaves, strict=True):
        assert _bytes(a) == _bytes(b)
    with pytest.raises(TypeError, match=r"params None, .* got params of type dict"):
        step(params, state, batch)
    with pytest.raises(TypeError, match="pass options=TrainStepOptions"):
        lwjax.make_train_step(_mse, opt, options=options, overlap_param_gather=True)
    with pytest.raises(TypeError, match="overlap_param_gather must be a bool; got 1"):
        lwjax.TrainStepOptions(overlap_param_gather=1)


def test_compiler_options_reach_xla_and_bad_ones_are_refused(tmp_path):
    """``TrainStepOptions.compiler_options`` are the step's own XLA options: asked to dump
    its modules, XLA writes this step's (and nothing else compiled here does); the same step
    with the default options (Triton GEMM fusions off, which the CPU ignores) computes the
    same bits, called from the host or inside a user's jit. A list, or names that are not
    strings, are refused by name."""
    params, batch = _linear_problem()
    opt = lwjax.layerwise_muon(params, _mesh())
    dump = tmp_path / "dump"
    options = lwjax.TrainStepOptions(compiler_options={"xla_dump_to": str(dump)})
    dumped = lwjax.make_train_step(_mse, opt, options=options, donate=False)
    default = lwjax.make_train_step(_mse, opt, donate=False)
    state = opt.init(params)
    out_default = default(params, state, batch)
    assert not dump.exists()
    out_dumped = dumped(params, state, batch)
    assert any("after_optimizations" in p.name for p in dump.iterdir())
    for a, b in zip(jax.tree.leaves(out_default), jax.tree.leaves(out_dumped), strict=True):
        assert _bytes(a) == _bytes(b)
    # Called inside a jit of the user's own, whose compilation owns the options (JAX takes them
    # only at the top level), the step compiles there and computes the same bits.
    out_nested = jax.jit(default)(params, state, batch)
    for a, b in zip(jax.tree.leaves(out_default), jax.tree.leaves(out_nested), strict=True):
        assert _bytes(a) == _bytes(b)
    assert dict(lwjax.TrainStepOptions().compiler_options) == {"xla_gpu_enable_triton_gemm": False}
    with pytest.raises(TypeError, match="compiler_options must be a mapping of XLA option names"):
        lwjax.TrainStepOptions(compiler_options=["xla_dump_to"])
    with pytest.raises(TypeError, match="compiler_options must be a mapping"):
        lwjax.TrainStepOptions(compiler_options={1: True})
