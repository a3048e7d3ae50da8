"""The optax form: ``init``/``update`` on global arrays in a plain ``jax.jit`` loop.

Compared with ``make_train_step`` (the per-device form, itself checked against the unsharded
reference elsewhere), for ``flax.nnx.Optimizer``, ``optax.apply_updates`` and ``optax.chain``;
the compiled step reduce-scatters per-device gradients; bf16 parameters come back exactly
``bf16(master)``; bad trees name their first wrong path.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lwjax
from lwjax.tools.train_bench import collectives

STEPS = 6


def _mesh(dp=8):
    return Mesh(np.array(jax.devices()[:dp]), ("dp",))


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.l3 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l3(jnp.tanh(self.l2(jnp.tanh(self.l1(x)))))


def _batch(mesh):
    keys = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(keys[0], (64, 16)), jax.random.normal(keys[1], (64, 8))
    return jax.device_put((x, y), NamedSharding(mesh, P("dp")))


def _loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _replicated(tree, mesh):
    """``tree`` whole on every device of ``mesh``, as a step returns parameters: a jitted step's
    first call then compiles the program its later calls run (not one for uncommitted arrays
    first)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def _placed(model, optimizer, mesh):
    """The nnx model and optimizer with every leaf not yet on ``mesh`` (the parameters, the step
    counters) whole on each device, as the step returns them (see :func:`_replicated`)."""
    for node in (model, optimizer):
        state = nnx.state(node)
        nnx.update(
            node,
            jax.tree.map(
                lambda x: x if isinstance(x.sharding, NamedSharding) else _replicated(x, mesh),
                state,
            ),
        )


@functools.cache
def _reference_params():
    """``make_train_step`` on the same model and ``_batch(_mesh())``, as pure parameter arrays
    per step (computed once: only read)."""
    mesh = _mesh()
    batch = _batch(mesh)
    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
    params = nnx.as_pure(params)
    opt = lwjax.layerwise_muon(params, mesh)
    step = lwjax.make_train_step(lambda p, b: _loss(nnx.merge(graphdef, p), b), opt, donate=False)
    state, out = opt.init(params), []
    for _ in range(STEPS):
        params, state, _ = step(params, state, batch)
        out.append(params)
    return out


def _close(a, b, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)


@pytest.mark.parametrize("per_device", [False, True], ids=["nnx_grad", "lwjax_value_and_grad"])
def test_nnx_optimizer_trains_as_make_train_step(per_device):
    mesh = _mesh()
    batch = _batch(mesh)
    model = _MLP(nnx.Rngs(0))
    tx = lwjax.layerwise_muon(nnx.state(model, nnx.Param), mesh)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        if per_device:
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            loss_fn = lambda p, b: _loss(nnx.merge(graphdef, p, rest), b)  # noqa: E731
            _, grads = lwjax.value_and_grad(loss_fn, tx)(params, batch)
        else:
            grads = nnx.grad(_loss)(model, batch)
        optimizer.update(model, grads)

    _placed(model, optimizer, mesh)
    for want in _reference_params():
        train_step(model, optimizer, batch)
        _close(nnx.as_pure(nnx.state(model, nnx.Param)), want)
    assert int(optimizer.opt_state.count[...]) == STEPS


def test_per_device_gradients_compile_to_reduce_scatter_and_all_gather():
    """With ``lwjax.value_and_grad`` the jitted nnx step reduce-scatters the gradients and
    all-gathers the parameters; the only all-reduces are the few scalars of the norms and loss."""
    mesh = _mesh()
    model = _MLP(nnx.Rngs(0))
    tx = lwjax.layerwise_muon(nnx.state(model, nnx.Param), mesh)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss_fn = lambda p, b: _loss(nnx.merge(graphdef, p, rest), b)  # noqa: E731
        loss, grads = lwjax.value_and_grad(loss_fn, tx)(params, batch)
        optimizer.update(model, grads)
        return loss

    found = collectives(train_step.lower(model, optimizer, _batch(mesh)).compile().as_text())
    numel = sum(int(np.prod(r.shape)) for r in tx.plan.routes)
    assert found["reduce-scatter"][0] >= 1 and found["all-gather"][0] >= 1, found
    assert found["reduce-scatter"][1] * 8 >= numel  # every gradient element is scattered
    assert found["all-reduce"][1] < 8, found  # only the norm, the zero count and the loss


def test_bf16_params_come_back_as_bf16_of_the_masters():
    mesh = _mesh()
    params = {"w": jax.random.normal(jax.random.key(0), (32, 32), jnp.bfloat16)}
    params["b"] = jnp.ones(32, jnp.bfloat16)
    tx = lwjax.layerwise_muon(params, mesh)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: (0.3 * p).astype(jnp.bfloat16), params)
    params = _replicated(params, mesh)
    for _ in range(3):
        updates, state = jax.jit(tx.update)(grads, state, params)
        assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
        params = optax.apply_updates(params, updates)
    masters = lwjax.to_logical(tx, state).masters
    for name in params:
        assert params[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(params[name], masters[name].astype(jnp.bfloat16))


def test_chain_with_clipping_before_it_clips_the_whole_gradient():
    """optax's clip sees the global gradient; it matches lwjax's own clipping (whose norm adds
    1e-6, Megatron's)."""
    mesh = _mesh()
    params = {"w": jax.random.normal(jax.random.key(0), (32, 16)), "b": jnp.zeros(16)}
    grads = jax.tree.map(lambda p: 5.0 * jnp.ones_like(p), params)
    unclipped = lwjax.OptimizerConfig(clip_grad=None)
    chained = optax.chain(
        optax.clip_by_global_norm(1.0), lwjax.layerwise_muon(params, mesh, config=unclipped)
    )
    own = lwjax.layerwise_muon(params, mesh)
    got, _ = jax.jit(chained.update)(grads, chained.init(params), params)
    want, _ = jax.jit(own.update)(grads, own.init(params), params)
    _close(got, want, atol=1e-6)


def test_state_is_split_over_dp():
    mesh = _mesh()
    params = {f"w{i}": jnp.ones((64, 64)) for i in range(8)}
    state = lwjax.layerwise_muon(params, mesh).init(params)
    for x in jax.tree.leaves(state.masters):
        assert {s.data.shape[0] for s in x.addressable_shards} == {x.shape[0] // 8}


def test_bad_trees_name_the_first_wrong_path():
    mesh = _mesh(2)
    params = {"a": jnp.ones((4, 4)), "b": jnp.ones(4)}
    tx = lwjax.layerwise_muon(params, mesh)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"update\(grads\): leaf 1 should be 'b'.*got 'c'"):
        tx.update({"a": jnp.ones((4, 4)), "c": jnp.ones(4)}, state, params)
    with pytest.raises(ValueError, match=r"update\(grads\): b: expected shape \(4,\); got \(5,\)"):
        tx.update({"a": jnp.ones((4, 4)), "b": jnp.ones(5)}, state, params)
    with pytest.raises(ValueError, match="params are required"):
        tx.update(params, state)
    with pytest.raises(ValueError, match=r"'z' is not a parameter"):
        tx.init({**params, "z": jnp.ones(3)})


def test_replace_keeps_the_plan():
    params = {"a": jnp.ones((4, 4))}
    tx = lwjax.layerwise_muon(params, _mesh(2))
    other = tx._replace(axis="dp")
    assert other.plan is tx.plan and other.update is tx.update
    with pytest.raises(ValueError, match="no field or attribute"):
        tx._replace(nope=1)


class _BatchNormDropout(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def test_nnx_quickstart_loop_with_batchnorm_and_dropout():
    """flax's quickstart loop, unchanged, on a model with rest state (batch statistics, RNG
    counts): under ``nnx.jit`` the statistics are the global batch's and the state updates."""
    mesh = _mesh()
    model = _BatchNormDropout(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, lwjax.layerwise_muon(nnx.state(model, nnx.Param), mesh), wrt=nnx.Param
    )

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    batch = _batch(mesh)
    _placed(model, optimizer, mesh)
    losses = [float(train_step(model, optimizer, batch)) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0], losses
    mean = np.asarray(model.bn.mean[...])
    assert np.all(np.isfinite(mean)) and np.any(mean != 0)
    assert int(optimizer.opt_state.count[...]) == 10


def _key_data(x):
    """``x``, with a PRNG key as its integer data (for comparing)."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


class _Stateful(nnx.Module):
    """An MLP with one layer that changes state as it runs: BatchNorm or Dropout."""

    def __init__(self, layer, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.mid = nnx.BatchNorm(32, rngs=rngs) if layer == "batchnorm" else None
        self.drop = nnx.Dropout(0.5, rngs=rngs) if layer == "dropout" else None
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        x = self.l1(x)
        x = jax.nn.relu(x if self.mid is None else self.mid(x))
        return self.l2(x if self.drop is None else self.drop(x))


@pytest.mark.parametrize("layer", ["batchnorm", "dropout"])
def test_per_device_gradients_of_an_nnx_model_with_state(layer):
    """docs/optax.md's per-device nnx step, with the model's rest passed through
    ``lwjax.value_and_grad(..., mutable=True, rng=True)``: each device's gradient is the one
    the model gives on one device for that device's slice and its key folded with the device's
    index; the running statistics are the mean of the devices'; and the ``nnx.Optimizer`` step
    equals ``make_train_step``'s (which folds the step count in first)."""
    mesh, key = _mesh(), jax.random.key(7)
    x, y = _batch(mesh)
    x = x + jnp.repeat(jnp.arange(8.0), 8)[:, None]  # each device's slice its own mean
    batch = jax.device_put((x, y), NamedSharding(mesh, P("dp")))
    with jax.set_mesh(mesh):
        model = _Stateful(layer, nnx.Rngs(0))
        tx = lwjax.layerwise_muon(nnx.state(model, nnx.Param), mesh)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, params, rest = jax.tree.map(jnp.copy, nnx.split(model, nnx.Param, ...))

    def loss_fn(params, rest, batch, key):
        model = nnx.merge(graphdef, params, rest)
        nnx.reseed(model, dropout=key)
        return _loss(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    @nnx.jit
    def train_step(model, optimizer, batch, key):
        _, params, rest = nnx.split(model, nnx.Param, ...)
        vg = lwjax.value_and_grad(loss_fn, tx, mutable=True, rng=True)
        (loss, rest), grads = vg(params, rest, batch, key)
        nnx.update(model, rest)
        optimizer.update(model, grads)
        return loss, grads

    loss, grads = train_step(model, optimizer, batch, jax.random.fold_in(key, 0))
    # The rest rebuilt inside the gradient's trace, where the model may change it.
    fresh = lambda p, r, b, k: loss_fn(p, jax.tree.map(lambda v: v, r), b, k)  # noqa: E731
    one_device = jax.jit(jax.value_and_grad(fresh, has_aux=True))
    losses, states = [], []
    for d in range(8):
        rows = slice(8 * d, 8 * d + 8)
        device_key = jax.random.fold_in(jax.random.fold_in(key, 0), d)
        (device_loss, device_rest), want = one_device(params, rest, (x[rows], y[rows]), device_key)
        _close(jax.tree.map(lambda g, d=d: g[d], grads), want)
        losses.append(float(device_loss))
        states.append(device_rest)
    np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-6)
    if layer == "batchnorm":
        means = np.mean([np.asarray(r["mid"]["mean"][...]) for r in states], axis=0)
        np.testing.assert_allclose(model.mid.mean[...], means, rtol=1e-5, atol=1e-6)
        assert np.all(means != 0)
    step = lwjax.make_train_step(loss_fn, tx, mutable=True, rng=True, donate=False)
    want_params, _, want_rest, metrics = step(params, tx.init(params), rest, batch, key)
    np.testing.assert_allclose(float(loss), float(metrics["loss"]), rtol=1e-6)
    _close(nnx.state(model, nnx.Param), want_params)
    got_rest = nnx.state(model, nnx.Not(nnx.Param))
    _close(*jax.tree.map(_key_data, (got_rest, want_rest)))


def test_none_leaves_train_checkpoint_and_copy():
    """A tree with a None leaf (an equinox filtered tree) goes through make_train_step,
    to_logical/from_logical and a checkpoint; the optimizer copies and tree-maps as itself."""
    import copy
    import tempfile

    params = {"a": jnp.ones((8, 8)), "n": None, "b": jnp.ones(8)}
    tx = lwjax.layerwise_muon(params, _mesh(2))
    assert copy.deepcopy(tx) is tx and copy.copy(tx) is tx and jax.tree.map(lambda x: x, tx) is tx
    step = lwjax.make_train_step(lambda p, x: jnp.mean(x @ p["a"] + p["b"]), tx, donate=False)
    params, state, _ = step(params, tx.init(params), jnp.ones((16, 8)))
    again = lwjax.from_logical(tx, lwjax.to_logical(tx, state))
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
        np.testing.assert_array_equal(x, y)
    with tempfile.TemporaryDirectory() as tmp:
        lwjax.save(f"{tmp}/ckpt", params, state, tx)
        restored, _ = lwjax.restore(f"{tmp}/ckpt", tx)
    assert restored["n"] is None
    np.testing.assert_array_equal(restored["a"], params["a"])


def test_pipelined_optax_form_trains_as_the_serial_step():
    """The speculation flag travels in the optax state through a plain jit loop; the steps it
    chooses (serial first, then speculative once a step needed no clip) equal the serial ones."""
    mesh = _mesh()
    batch = _batch(mesh)
    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
    params = nnx.as_pure(params)
    tx = lwjax.layerwise_muon(params, mesh, config=lwjax.OptimizerConfig(pipeline_muon=True))
    loss = lambda p: _loss(nnx.merge(graphdef, p), batch)  # noqa: E731

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, optax.tree.norm(grads)

    state = tx.init(params)
    assert not bool(state.speculate)  # a fresh state waits for the norm
    params = _replicated(params, mesh)
    for want in _reference_params():
        params, state, norm = step(params, state)
        _close(params, want)
        assert bool(state.speculate) == (float(norm) <= 1.0), float(norm)
    assert bool(state.speculate)  # the MLP's norm stays under the clip: later steps speculated


def _optax_steps(tx, params, grads_of, steps):
    """``steps`` jitted optax steps; per step the parameters apply_updates gave and the state."""
    update = jax.jit(tx.update)
    state, out = tx.init(params), []
    params = _replicated(params, tx.mesh)
    for i in range(steps):
        updates, state = update(grads_of(params, i), state, params)
        params = optax.apply_updates(params, updates)
        out.append((params, state))
    return out


def test_fp32_params_are_exactly_the_masters_and_a_skipped_step_moves_nothing():
    """``params + update`` is bit for bit the gathered masters (fp32: ``p + (new - p)`` does not
    always round to ``new``, so those masters take the sum); an infinite gradient then changes
    neither the state nor, through a zero update, the parameters."""
    mesh = _mesh()
    batch = _batch(mesh)
    graphdef, params = nnx.split(_MLP(nnx.Rngs(0)), nnx.Param)
    params = nnx.as_pure(params)
    tx = lwjax.layerwise_muon(params, mesh, learning_rate=0.05)
    grad = jax.jit(jax.grad(lambda p: _loss(nnx.merge(graphdef, p), batch)))

    def grads_of(p, i):
        g = grad(p)
        return jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), g) if i == 4 else g

    history = _optax_steps(tx, params, grads_of, 5)
    for params, state in history:
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(tx.gather_params(state))):
            np.testing.assert_array_equal(got, want)
    (before, old), (after, new) = history[-2:]
    assert int(new.count) == int(old.count) == 4
    for a, b in zip(jax.tree.leaves((after, new)), jax.tree.leaves((before, old))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rate", ["learning_rate", "adam_learning_rate"])
def test_a_negative_scheduled_learning_rate_skips_the_step(rate):
    """As a negative scheduled weight decay does: no gradient ascent, the count stays."""
    mesh = _mesh(2)
    params = {"w": jax.random.normal(jax.random.key(0), (16, 8)), "b": jnp.ones(8)}
    schedule = lambda count: jnp.where(count == 1, -0.01, 0.01)  # noqa: E731
    tx = lwjax.layerwise_muon(params, mesh, **{rate: schedule})
    history = _optax_steps(tx, params, lambda p, i: jax.tree.map(jnp.ones_like, p), 2)
    (first, state1), (second, state2) = history
    assert int(state1.count) == int(state2.count) == 1
    for a, b in zip(jax.tree.leaves(second), jax.tree.leaves(first)):
        np.testing.assert_array_equal(a, b)
