"""make_train_step over parameters split over FSDP and tensor-parallel axes (lwjax.gather_params,
lwjax.sharded_gradients): the replicated step's result, and the communication in the HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lwjax
from lwjax.parallel.gather import ParamGather
from lwjax.tools.bench.compiled import collectives

L, D, F, V = 4, 16, 32, 64
RULES = lwjax.RoutingRules(stacked={"layers/*": 1})
MUON = lwjax.MuonConfig(fp32_matmul_prec="highest")  # bf16 passes would round block differences
TOLERANCE = 2e-6  # three steps; the sharded sums differ from the replicated ones in order only


def _params(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {
        "embed": (rng.standard_normal((V, D)) / 4).astype(dtype),
        "layers": {
            "up": (rng.standard_normal((L, D, F)) / 4).astype(dtype),
            "down": (rng.standard_normal((L, F, D)) / 6).astype(dtype),
            "norm": np.ones((L, D), dtype),
        },
    }


def _batches(count=3):
    rng = np.random.default_rng(1)
    return [
        tuple(jnp.asarray(rng.integers(0, V, (16, 4)), jnp.int32) for _ in range(2))
        for _ in range(count)
    ]


def loss_fn(params, batch):
    """A residual MLP stack, scanned and rematerialised: each layer gathered in the scan's body,
    the embedding (outside the scan) once."""
    tokens, targets = batch
    embed = lwjax.gather_params(params["embed"])
    h = embed[tokens].astype(jnp.float32)

    @jax.checkpoint
    def body(h, layer):
        layer = lwjax.gather_params(layer)
        return h + jax.nn.gelu((h * layer["norm"]) @ layer["up"]) @ layer["down"], None

    h, _ = jax.lax.scan(body, h, params["layers"])
    return jnp.mean((h - embed[targets]) ** 2)


def _put(tree, specs, mesh):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _train(loss, params, mesh, specs, *, param_axes=None, fsdp_axes=(), steps=3, **config):
    params = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(
        params,
        mesh,
        param_axes=param_axes,
        muon=MUON,
        routing=RULES,
        config=lwjax.OptimizerConfig(**config),
    )
    options = lwjax.TrainStepOptions(fsdp_axes=fsdp_axes)
    step = lwjax.make_train_step(loss, opt, options=options)
    state = opt.init(params)
    for batch in _batches(steps):
        params, state, metrics = step(params, state, batch)
    return params, metrics


def _replicated(loss=loss_fn, params=None, steps=3):
    """The reference: the same optimizer at dp 8, every leaf whole on every device."""
    params = _params() if params is None else params
    mesh = Mesh(np.array(jax.devices()[:8]), ("dp",))
    return _train(loss, params, mesh, jax.tree.map(lambda _: P(), params), steps=steps)


def _fsdp_specs(params, axis="fsdp"):
    """Every leaf split over ``axis`` on its last axis."""
    return jax.tree.map(lambda x: P(*[None] * (x.ndim - 1), axis), params)


MESHES = {
    "fsdp 8": ((1, 8), ("dp", "fsdp"), "fsdp", None),
    "dp 2 x fsdp 4": ((2, 4), ("dp", "fsdp"), "fsdp", None),
    # up: rows over fsdp, columns over tp; down: rows over tp, columns over fsdp
    "dp 2 x fsdp 2 x tp 2": (
        (2, 2, 2),
        ("dp", "fsdp", "tp"),
        ("fsdp", "tp"),
        {"up": P(None, "fsdp", "tp"), "down": P(None, "tp", "fsdp")},
    ),
}


@pytest.fixture(scope="module")
def replicated():
    return _replicated()


@pytest.mark.parametrize("name", MESHES)
def test_sharded_steps_take_the_replicated_step(name, replicated):
    """Three steps over split parameters give the replicated dp 8 step's parameters (within
    ``TOLERANCE``), loss and gradient norm, and keep each leaf split as it came."""
    shape, axes, param_axes, layer_specs = MESHES[name]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), axes)
    params = _params()
    specs = _fsdp_specs(params)
    specs["layers"].update(layer_specs or {})
    got, metrics = _train(loss_fn, params, mesh, specs, param_axes=param_axes, fsdp_axes="fsdp")
    want, want_metrics = replicated
    for (path, a), b, spec in zip(
        jax.tree_util.tree_flatten_with_path(got)[0],
        jax.tree.leaves(want),
        jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOLERANCE, err_msg=str(path))
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), path
    assert float(metrics["loss"]) == pytest.approx(float(want_metrics["loss"]), rel=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(float(want_metrics["grad_norm"]), rel=1e-5)
    moved = max(
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(_params()))
    )
    assert moved > 100 * TOLERANCE  # the steps moved the parameters well past the tolerance


def _computations(hlo: str) -> dict[str, str]:
    """An optimized HLO module's computations by name, each its instructions' text."""
    parts = re.split(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n", hlo, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def _groups(line: str) -> str:
    return re.search(r"replica_groups=(\{[{}0-9,]*\})", line)[1]


def test_fsdp_step_gathers_each_layer_in_the_scan_and_reduce_scatters_its_gradient():
    """The compiled dp 2 x fsdp 4 step: each layer's three leaves all-gathered over fsdp in the
    body of the forward scan and again (rematerialised) in the backward's, where their gradients
    are reduce-scattered; outside the loops fsdp gathers only the embedding; the optimizer
    reduce-scatters and gathers over dp only its blocks (a quarter of the model, padded); no
    all-reduce of more than a few scalars."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    params = _params()
    params = _put(params, _fsdp_specs(params), mesh)
    opt = lwjax.layerwise_muon(params, mesh, param_axes="fsdp", muon=MUON, routing=RULES)
    step = lwjax.make_train_step(
        loss_fn, opt, options=lwjax.TrainStepOptions(fsdp_axes="fsdp"), donate=False
    )
    hlo = jax.jit(step).lower(params, opt.init(params), _batches(1)[0]).compile().as_text()
    fsdp, dp = "{{0,1,2,3},{4,5,6,7}}", "{{0,4},{1,5},{2,6},{3,7}}"
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
    layer = {(D,), (D, F), (F, D)}  # one layer's leaves, whole
    in_loops, outside = [], []
    for name, text in _computations(hlo).items():
        for line in text.splitlines():
            if re.search(r" (all-gather|reduce-scatter|all-reduce)(-start)?\(", line):
                (in_loops if name in bodies else outside).append(line)

    def found(lines, kind, groups):
        picked = "\n".join(x for x in lines if f" {kind}(" in x and _groups(x) == groups)
        return collectives(picked)[kind]

    def shapes(lines, kind):
        return sorted(
            tuple(int(d) for d in re.search(r"= \w+\[([0-9,]*)\]", x)[1].split(","))
            for x in lines
            if f" {kind}(" in x
        )

    # 2 loop bodies (forward, backward) x 3 leaves, each a whole layer: 2 x 1,040 elements.
    assert found(in_loops, "all-gather", fsdp) == (6, 2 * (D + 2 * D * F))
    assert set(shapes(in_loops, "all-gather")) == layer
    # Each layer's gradient reduce-scattered in the backward's body: its blocks (a quarter).
    assert found(in_loops, "reduce-scatter", fsdp) == (3, (D + 2 * D * F) // 4)
    assert not [x for x in in_loops if " all-reduce(" in x]
    # Outside the loops, fsdp gathers the embedding alone and reduce-scatters its gradient.
    assert found(outside, "all-gather", fsdp) == (1, V * D)
    assert found(outside, "reduce-scatter", fsdp) == (1, V * D // 4)
    # The optimizer: over dp only, flat buckets of the device's blocks (1,296 elements, padded),
    # nothing like the whole model's 5,184.
    whole = V * D + L * (D + 2 * D * F)
    gathered = found(outside, "all-gather", dp)
    assert gathered[1] < whole / 2
    assert found(outside, "reduce-scatter", dp)[1] * 2 == gathered[1]  # each its dp shard
    others = [x for x in outside if " all-gather(" in x and _groups(x) not in (fsdp, dp)]
    assert not others
    assert collectives(hlo)["all-reduce"][1] <= 8  # the norm, zero count and finite flags


@pytest.mark.parametrize("reduce_dtype", [None, jnp.float32])
def test_gather_reduces_the_gradient_in_the_dtype_asked_for(reduce_dtype):
    """The gather's transpose: the sum of the devices' gradients of each block, reduce-scattered
    in fp32 when the step reduces in fp32 (``grad_reduce_in_fp32``) and rounded once, else in the
    leaf's bf16."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "fsdp"))
    scale = np.arange(1, 5, dtype=np.float32).repeat(2)[:, None] * np.ones((8, 8), np.float32)
    table = ParamGather((), ("fsdp",), reduce_dtype)

    def local(w, scale):
        def loss(w):
            return jnp.sum(lwjax.gather_params(w, P(None, "fsdp")).astype(jnp.float32) * scale)

        with table.active():
            return jax.grad(loss)(w)

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(None, "fsdp"), P(("dp", "fsdp"))),
            out_specs=P(None, "fsdp"),
            check_vma=False,
        )
    )
    w = jnp.ones((2, 8), jnp.bfloat16)
    text = step.lower(w, scale).as_text()
    reduced = re.findall(
        r"stablehlo\.reduce_scatter\".*?\}\) : \(tensor<[0-9x]+x(f32|bf16)>\)", text, re.DOTALL
    )
    assert reduced and set(reduced) == {"f32" if reduce_dtype else "bf16"}
    grad = step(w, scale)
    # Device d holds rows 2d, 2d+1 of scale, all d + 1: the gradient sums them, 1 + 2 + 3 + 4.
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.full((2, 8), 10.0))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.Param(jnp.ones(D))
        self.up = nnx.Linear(D, F, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(F, D, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h * self.norm[...])))


class Stack(nnx.Module):
    """An nnx model whose blocks are stacked (``nnx.vmap``) and run in a scan: one
    ``lwjax.gather_params`` in the scan's body, one for the embedding."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs)

        self.layers = blocks(rngs)

    def __call__(self, tokens):
        graphdef, state = nnx.split(self.embed)
        embed = nnx.merge(graphdef, lwjax.gather_params(state))
        layer_def, layers = nnx.split(self.layers)

        @jax.checkpoint
        def body(h, layer):
            return nnx.merge(layer_def, lwjax.gather_params(layer))(h), None

        h, _ = jax.lax.scan(body, embed(tokens), layers)
        return embed.attend(h)


def test_nnx_scanned_model_trains_split_over_fsdp_as_replicated():
    """An nnx model, its stacked blocks scanned, at dp 2 x fsdp 4 (every leaf split on its last
    axis) takes the replicated dp 8 step."""
    graphdef, params = nnx.split(Stack(nnx.Rngs(0)), nnx.Param)

    def loss(params, batch):
        tokens, targets = batch
        logits = nnx.merge(graphdef, params)(tokens)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    got, metrics = _train(
        loss, params, mesh, _fsdp_specs(params), param_axes="fsdp", fsdp_axes="fsdp", steps=2
    )
    want, want_metrics = _replicated(loss, params, steps=2)
    assert {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOLERANCE)
    assert float(metrics["loss"]) == pytest.approx(float(want_metrics["loss"]), rel=1e-6)


def test_optax_form_takes_the_same_step(replicated):
    """``lwjax.value_and_grad(..., fsdp_axes=)`` and ``optimizer.update`` under ``jax.jit`` (the
    optax form) at dp 2 x fsdp 4 take the replicated step, with no all-reduce of a gradient."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    params = _params()
    specs = _fsdp_specs(params)
    params = _put(params, specs, mesh)
    opt = lwjax.layerwise_muon(params, mesh, param_axes="fsdp", muon=MUON, routing=RULES)

    @jax.jit
    def train_step(params, state, batch):
        loss, grads = lwjax.value_and_grad(loss_fn, opt, fsdp_axes="fsdp")(params, batch)
        updates, state = opt.update(grads, state, params)
        return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates), state, loss

    state, batches = opt.init(params), _batches()
    compiled = train_step.lower(params, state, batches[0]).compile()
    assert collectives(compiled.as_text())["all-reduce"][1] <= 8
    for batch in batches:
        params, state, _ = compiled(params, state, batch)
    for a, b, spec in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(replicated[0]),
        jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOLERANCE)
        assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim)


def _fsdp_optimizer(specs=None, param_axes="fsdp"):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "fsdp"))
    params = _params()
    params = _put(params, specs or _fsdp_specs(params), mesh)
    return params, lwjax.layerwise_muon(
        params, mesh, param_axes=param_axes, muon=MUON, routing=RULES
    )


def test_a_loss_that_uses_blocks_without_gathering_them_is_told_how():
    """A leaf split over fsdp that the loss never gathers: the model's shape error carries a note
    naming the split leaves and lwjax.gather_params."""

    def ungathered(params, batch):
        tokens, targets = batch
        embed = lwjax.gather_params(params["embed"])
        h = embed[tokens]

        def body(h, layer):  # no gather_params: the layer's blocks
            return h + jax.nn.gelu((h * layer["norm"]) @ layer["up"]) @ layer["down"], None

        h, _ = jax.lax.scan(body, h, params["layers"])
        return jnp.mean((h - embed[targets]) ** 2)

    params, opt = _fsdp_optimizer()
    step = lwjax.make_train_step(ungathered, opt, options=lwjax.TrainStepOptions(fsdp_axes="fsdp"))
    with pytest.raises((TypeError, ValueError)) as error:
        step(params, opt.init(params), _batches(1)[0])
    note = "\n".join(getattr(error.value, "__notes__", []))
    assert "split over fsdp_axes=('fsdp',)" in note and "layers/up" in note
    assert "lwjax.gather_params" in note


def test_misuses_are_refused_with_what_to_do():
    params, opt = _fsdp_optimizer()
    with pytest.raises(ValueError, match=r"fsdp_axes names 'dp', which is not one of"):
        lwjax.make_train_step(loss_fn, opt, options=lwjax.TrainStepOptions(fsdp_axes="dp"))
    with pytest.raises(TypeError, match=r"TrainStepOptions.fsdp_axes must be a mesh axis name"):
        lwjax.TrainStepOptions(fsdp_axes=["fsdp"])
    # Split over fsdp on the scanned (stacked) axis: no layer can be gathered alone.
    specs = _fsdp_specs(params)
    specs["layers"]["norm"] = P("fsdp")
    params, stacked = _fsdp_optimizer(specs)
    with pytest.raises(ValueError, match=r"layers/norm is split over the FSDP axis 'fsdp' on its "):
        lwjax.make_train_step(loss_fn, stacked, options=lwjax.TrainStepOptions(fsdp_axes="fsdp"))
    # gather_params in a shard_map of one's own needs specs, and blocks the table tells apart.
    mesh = opt.mesh
    outside = jax.shard_map(
        lwjax.gather_params, mesh=mesh, in_specs=P(None, "fsdp"), out_specs=P(), check_vma=False
    )
    with pytest.raises(ValueError, match=r"not in the loss of lwjax.make_train_step"):
        jax.jit(outside)(jnp.ones((4, 8)))
    square = ParamGather(
        (
            lwjax.parallel.gather.LeafBlock("up", (16, 16), ((), ("fsdp",))),
            lwjax.parallel.gather.LeafBlock("down", (16, 16), (("fsdp",), ())),
        ),
        ("fsdp",),
    )
    with pytest.raises(ValueError, match=r"\(16, 16\) may be split over 'fsdp' on axis 1 \(up\)"):
        square.split_of((16, 16))
