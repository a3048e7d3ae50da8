"""Models nobody here wrote, routed by default and trained at dp 8 against the unsharded reference.

flax's own ``examples/lm1b`` (linen, logical axis names) and ``examples/gemma`` (nnx, einsum
kernels) are vendored unchanged under ``third_party/``; equinox's layers come from equinox; the
Llama tree reproduces the parameter layout of transformers' ``FlaxLlamaForCausalLM``. Each test
checks the default routing against a table written from the model's architecture, trains ten
steps (the optax form or ``make_train_step``), and compares every parameter with
:class:`reference.Reference`, which runs the same algorithm on whole arrays.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import reference_train
from third_party import loader

import lwjax
from lwjax.muon import MuonConfig

# Newton–Schulz in fp32: Megatron's default bf16 iterate turns rounding-level differences of the
# reduction order into one-ulp flips of bf16 (2^-8 of an update), which ten steps then compound.
MUON = MuonConfig(fp32_matmul_prec="highest")
OPTIONS = dict(lr=0.02, weight_decay=0.01, clip_grad=1.0, muon_config=MUON)
STEPS = 10


def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("dp",))


def _table(routes):
    """``{path: view}`` for Muon leaves and ``{path: "adamw"}`` for the rest."""
    return {r.path: tuple((r.view or r.shape)) if r.is_muon else "adamw" for r in routes}


def _tokens(seed, batch, length, vocab):
    return jax.random.randint(jax.random.key(seed), (batch, length), 1, vocab)


def _assert_matches_reference(params, reference, tol=2e-4):
    leaves = jax.tree_util.tree_leaves(params)
    assert len(leaves) == len(reference.leaves)
    for route, got, want in zip(reference.routes, leaves, reference.leaves):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, err_msg=route.path)


def _falls(losses):
    assert losses[-1] < 0.8 * losses[0], losses


def test_flax_lm1b_linen_routes_by_axis_names_and_trains_like_the_reference():
    models = loader.lm1b_models()
    cfg = models.TransformerConfig(
        vocab_size=64, output_vocab_size=64, emb_dim=32, num_heads=4, qkv_dim=32, mlp_dim=64,
        num_layers=1, max_len=16, deterministic=True,
    )  # fmt: skip
    model = models.TransformerLM(cfg)
    params = model.init(jax.random.key(0), _tokens(0, 2, 16, 64))["params"]  # boxed, with names

    opt = lwjax.layerwise_muon(params, _mesh(), muon=MUON)
    block = "decoder/encoderdecoderblock_{}/"
    expected = {"decoder/Embed_0/embedding": "adamw", "decoder/logitdense/bias": "adamw"}
    expected |= {"decoder/logitdense/kernel": "adamw"}
    expected |= {f"decoder/encoderdecoder_norm/{p}": "adamw" for p in ("bias", "scale")}
    for i in range(1):
        b = block.format(i)
        expected |= {f"{b}LayerNorm_{n}/{p}": "adamw" for n in (0, 1) for p in ("bias", "scale")}
        expected |= {f"{b}MlpBlock_0/Dense_{n}/bias": "adamw" for n in (0, 1)}
        expected[f"{b}MlpBlock_0/Dense_0/kernel"] = (32, 64)  # names ('embed', 'mlp')
        expected[f"{b}MlpBlock_0/Dense_1/kernel"] = (64, 32)
        attn = f"{b}MultiHeadDotProductAttention_0/"
        expected |= {f"{attn}{p}/kernel": (32, 32) for p in ("query", "key", "value", "out")}
    assert _table(opt.plan.routes) == expected

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    batches = [_tokens(1, 16, 16, 64)] * STEPS  # one batch, learnt by heart
    reference, _ = reference_train(params, loss_fn, batches, opt.plan.routes, **OPTIONS)
    step, state, losses = lwjax.make_train_step(loss_fn, opt), opt.init(params), []
    trained = params  # donated to the step
    for batch in batches:
        trained, state, metrics = step(trained, state, batch)
        losses.append(float(metrics["loss"]))
    _falls(losses)
    _assert_matches_reference(trained, reference)


def _gemma(num_kv_heads, num_layers=2):
    gemma = loader.gemma_modules()
    cfg = gemma.transformer_cfg.TransformerConfig(
        num_layers=num_layers, num_embed=64, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
        num_kv_heads=num_kv_heads, final_logit_softcap=None, use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(gemma.transformer_cfg.AttentionType.GLOBAL,) * num_layers,
    )  # fmt: skip
    return gemma.transformer.Transformer(cfg, rngs=nnx.Rngs(params=0))


def _gemma_loss(model, tokens):
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length - 1), (batch, length - 1))
    mask = jnp.broadcast_to(
        jnp.tril(jnp.ones((length - 1,) * 2, bool)), (batch,) + (length - 1,) * 2
    )
    logits, _ = model(tokens[:, :-1], positions, None, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_flax_gemma_nnx_einsum_kernels_are_muon_matrices():
    """Both attention variants: q/kv einsums (grouped queries) and the fused qkv einsum."""
    for kv_heads, attn in (
        (2, {"q_einsum": (32, 32), "kv_einsum": (32, 32)}),
        (4, {"qkv_einsum": (32, 96)}),
    ):
        routes = lwjax.layerwise_muon(nnx.state(_gemma(kv_heads), nnx.Param), _mesh()).plan.routes
        expected = {"embedder/embedding": "adamw", "final_norm/scale": "adamw"}
        for i in range(2):
            layer = f"layers/{i}/"
            expected |= {f"{layer}attn/{k}/kernel": v for k, v in attn.items()}
            expected[f"{layer}attn/attn_vec_einsum/kernel"] = (32, 32)
            expected |= {f"{layer}mlp/{p}_proj/kernel": (32, 64) for p in ("gate", "up")}
            expected[f"{layer}mlp/down_proj/kernel"] = (64, 32)
            norms = ("pre_attention", "post_attention", "pre_ffw", "post_ffw")
            expected |= {f"{layer}{n}_norm/scale": "adamw" for n in norms}
        assert _table(routes) == expected
        q = next(r for r in routes if r.path.endswith("0/attn/attn_vec_einsum/kernel"))
        assert q.axes_order == (0, 1, 2) or q.axes_order is None  # [N, H, D]: (N·H) × D as stored


def test_flax_gemma_nnx_optimizer_trains_like_the_reference():
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` under ``nnx.jit`` on a dp-sharded batch."""
    mesh = _mesh()
    model = _gemma(2, num_layers=1)
    graphdef, params = nnx.split(model, nnx.Param)
    pure = nnx.as_pure(params)
    tx = lwjax.layerwise_muon(params, mesh, muon=MUON)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(_gemma_loss)(model, tokens)
        optimizer.update(model, grads)
        return loss

    batches = [_tokens(1, 16, 17, 64)] * STEPS
    sharded = NamedSharding(mesh, P("dp"))
    losses = [float(train_step(model, optimizer, jax.device_put(b, sharded))) for b in batches]
    _falls(losses)

    def loss_fn(params, tokens):
        return _gemma_loss(nnx.merge(graphdef, params), tokens)

    reference, _ = reference_train(pure, loss_fn, batches, tx.plan.routes, **OPTIONS)
    _assert_matches_reference(nnx.as_pure(nnx.state(model, nnx.Param)), reference)
    assert int(optimizer.opt_state.count[...]) == STEPS


def _llama_params(key, vocab=64, dim=32, hidden=64, layers=2):
    """The parameter tree of transformers' ``FlaxLlamaForCausalLM`` (names and shapes)."""
    keys = iter(jax.random.split(key, 64))
    normal = lambda *shape: 0.02 * jax.random.normal(next(keys), shape)  # noqa: E731
    tree = {"model": {"embed_tokens": {"embedding": normal(vocab, dim)}, "layers": {}}}
    for i in range(layers):
        tree["model"]["layers"][str(i)] = {
            "self_attn": {f"{p}_proj": {"kernel": normal(dim, dim)} for p in "qkvo"},
            "mlp": {
                "gate_proj": {"kernel": normal(dim, hidden)},
                "up_proj": {"kernel": normal(dim, hidden)},
                "down_proj": {"kernel": normal(hidden, dim)},
            },
            "input_layernorm": {"weight": jnp.ones(dim)},
            "post_attention_layernorm": {"weight": jnp.ones(dim)},
        }
    tree["model"]["norm"] = {"weight": jnp.ones(dim)}
    tree["lm_head"] = {"kernel": normal(dim, vocab)}
    return tree


def _llama_loss(params, tokens, heads=4):
    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w

    x = params["model"]["embed_tokens"]["embedding"][tokens[:, :-1]]
    batch, length, dim = x.shape
    causal = jnp.tril(jnp.ones((length, length), bool))
    for layer in params["model"]["layers"].values():
        a, h = layer["self_attn"], norm(x, layer["input_layernorm"]["weight"])
        q, k, v = ((h @ a[f"{p}_proj"]["kernel"]).reshape(batch, length, heads, -1) for p in "qkv")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        x = (
            x
            + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(batch, length, dim)
            @ a["o_proj"]["kernel"]
        )
        m, h = layer["mlp"], norm(x, layer["post_attention_layernorm"]["weight"])
        x = (
            x
            + (jax.nn.silu(h @ m["gate_proj"]["kernel"]) * (h @ m["up_proj"]["kernel"]))
            @ m["down_proj"]["kernel"]
        )
    logits = norm(x, params["model"]["norm"]["weight"]) @ params["lm_head"]["kernel"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_hf_flax_llama_layout_trains_with_optax_apply_updates_under_jit():
    """The optax form in a plain ``jax.jit`` loop on global arrays, with ``optax.apply_updates``."""
    mesh = _mesh()
    params = _llama_params(jax.random.key(0))
    tx = lwjax.layerwise_muon(params, mesh, muon=MUON)
    expected = {
        "lm_head/kernel": "adamw",
        "model/embed_tokens/embedding": "adamw",
        "model/norm/weight": "adamw",
    }
    for i in range(2):
        layer = f"model/layers/{i}/"
        expected |= {f"{layer}self_attn/{p}_proj/kernel": (32, 32) for p in "qkvo"}
        expected |= {f"{layer}mlp/{p}_proj/kernel": (32, 64) for p in ("gate", "up")}
        expected[f"{layer}mlp/down_proj/kernel"] = (64, 32)
        expected |= {
            f"{layer}{n}/weight": "adamw" for n in ("input_layernorm", "post_attention_layernorm")
        }
    assert _table(tx.plan.routes) == expected

    @jax.jit
    def train_step(params, state, tokens):
        loss, grads = jax.value_and_grad(_llama_loss)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    batches = [_tokens(1, 16, 17, 64)] * STEPS
    trained, state, losses = params, tx.init(params), []
    for batch in batches:
        trained, state, loss = train_step(
            trained, state, jax.device_put(batch, NamedSharding(mesh, P("dp")))
        )
        losses.append(float(loss))
    _falls(losses)
    reference, _ = reference_train(params, _llama_loss, batches, tx.plan.routes, **OPTIONS)
    _assert_matches_reference(trained, reference)


class _EqxModel(eqx.Module):
    """An equinox MLP (weights stored ``[out, in]``) with a non-array float field."""

    layers: list
    temperature: float

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(8, 32, key=k1),
            eqx.nn.LayerNorm(32),
            eqx.nn.Linear(32, 32, key=k2),
            eqx.nn.Linear(32, 4, key=k3),
        ]
        self.temperature = 2.0

    def __call__(self, x):
        x = jax.nn.gelu(self.layers[1](self.layers[0](x)))
        return self.layers[3](jax.nn.gelu(self.layers[2](x))) / self.temperature


def test_equinox_partitioned_module_trains_like_the_reference():
    """``eqx.partition`` trees (None leaves) go straight in; a whole module's float field is
    skipped with a warning naming it."""
    mesh = _mesh()
    model = _EqxModel(jax.random.key(0))
    with pytest.warns(UserWarning, match=r"not arrays and are not optimized: temperature"):
        lwjax.layerwise_muon(model, mesh)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    config = lwjax.OptimizerConfig(matrix_convention="out_in")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # None leaves are not parameters: no warning
        tx = lwjax.layerwise_muon(params, mesh, config=config, muon=MUON)
    assert _table(tx.plan.routes) == {
        "layers/0/weight": (32, 8),
        "layers/0/bias": "adamw",
        "layers/1/weight": "adamw",  # LayerNorm: 1-D
        "layers/1/bias": "adamw",
        "layers/2/weight": (32, 32),
        "layers/2/bias": "adamw",
        "layers/3/weight": (4, 32),
        "layers/3/bias": "adamw",
    }

    def loss_fn(params, batch):
        x, y = batch
        logits = jax.vmap(eqx.combine(params, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @eqx.filter_jit
    def train_step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, loss

    key = jax.random.key(1)
    batches = [(jax.random.normal(key, (32, 8)), jax.random.randint(key, (32,), 0, 4))] * STEPS
    trained, state, losses = params, tx.init(params), []
    for batch in batches:
        trained, state, loss = train_step(trained, state, batch)
        losses.append(float(loss))
    _falls(losses)
    reference, _ = reference_train(params, loss_fn, batches, tx.plan.routes, **OPTIONS)
    _assert_matches_reference(trained, reference)


class _ScannedMLP(nnx.Module):
    """An nnx MLP whose blocks are created with ``nnx.vmap`` and run with ``nnx.scan``."""

    def __init__(self, depth, width, rngs):
        self.inp = nnx.Linear(4, width, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0)
        def blocks(key):
            return _Block(width, nnx.Rngs(key))

        self.blocks = blocks(jax.random.split(rngs.params(), depth))
        self.out = nnx.Linear(width, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.out(run(self.inp(x), self.blocks))


class _Block(nnx.Module):
    def __init__(self, width, rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.relu(self.norm(self.linear(x)))


def test_nnx_scanned_blocks_are_found_as_stacks_and_train_like_the_reference():
    """No ``stacked=`` rule: the stacked biases and scales give the scan away."""
    model = _ScannedMLP(depth=3, width=16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.as_pure(params)
    opt = lwjax.layerwise_muon(params, _mesh(), muon=MUON)
    assert _table(opt.plan.routes) == {
        "blocks/linear/bias": "adamw",
        "blocks/linear/kernel": (3, 16, 16),
        "blocks/norm/bias": "adamw",
        "blocks/norm/scale": "adamw",
        "inp/bias": "adamw",
        "inp/kernel": (4, 16),
        "out/bias": "adamw",
        "out/kernel": "adamw",  # a top-level `out` is the head
    }
    assert {r.path: r.stack_dims for r in opt.plan.routes}["blocks/linear/kernel"] == 1

    def loss_fn(params, batch):
        x, y = batch
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    key = jax.random.key(1)
    batches = [(jax.random.normal(key, (32, 4)), jax.random.randint(key, (32,), 0, 3))] * STEPS
    reference, _ = reference_train(params, loss_fn, batches, opt.plan.routes, **OPTIONS)
    step, state, trained, losses = lwjax.make_train_step(loss_fn, opt), opt.init(params), params, []
    for batch in batches:
        trained, state, metrics = step(trained, state, batch)  # params donated
        losses.append(float(metrics["loss"]))
    _falls(losses)
    _assert_matches_reference(trained, reference)
