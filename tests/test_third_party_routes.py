"""Layouts that routing got wrong silently, routed and trained at dp 8 against the reference.

flax's ``examples/imagenet`` ResNet is vendored unchanged under ``third_party/``; its conv
kernels need the one ``dims`` rule that docs/routing.md's conv section gives, and the
warning without it names that rule. The MaxText-style block is ours (written here, not
MaxText's code): a linen decoder layer scanned the way MaxText scans it,
``nn.scan(..., variable_axes={"params": 1})`` (its ``param_scan_axis=1``), which puts the
layer axis second in every leaf; its stack is found without a rule. Each test trains six
steps with ``make_train_step`` and compares every parameter with :class:`reference.Reference`.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from reference import reference_train
from test_third_party import OPTIONS, _assert_matches_reference, _falls, _mesh, _table
from third_party import loader

import lwjax
from lwjax.dims import MatrixDims
from lwjax.routing_table import routing_table

STEPS = 6  # fewer than test_third_party.py's ten: the loss falls by a fifth in six
CONV_RULE = 'dims={"*[Cc]onv*/kernel": MatrixDims((0, 1, 2), 3)}'  # as the warning writes it


def _train(params, loss_fn, batches, opt):
    """``STEPS`` steps of ``make_train_step``, and the unsharded reference over the same batches."""
    reference, _ = reference_train(params, loss_fn, batches, opt.plan.routes, **OPTIONS)
    step, state, trained, losses = lwjax.make_train_step(loss_fn, opt), opt.init(params), params, []
    for batch in batches:
        trained, state, metrics = step(trained, state, batch)  # params donated
        losses.append(float(metrics["loss"]))
    _falls(losses)
    return trained, reference


def _resnet():
    models = loader.imagenet_models()
    # Two stages of one block: the second block has a strided 1x1 conv_proj shortcut.
    return models.ResNet(stage_sizes=[1, 1], block_cls=models.ResNetBlock, num_classes=10,
                         num_filters=8)  # fmt: skip


def test_flax_resnet_conv_kernels_are_named_in_a_warning_and_train_with_its_rule():
    """Without a rule every conv kernel goes to AdamW and one warning names them with the rule;
    with that rule each is one (height · width · in) × out Muon matrix. BatchNorm runs on its
    running statistics (``train=False``), which stay out of the optimizer."""
    model = _resnet()
    images = jax.random.normal(jax.random.key(1), (16, 8, 8, 3))
    variables = model.init(jax.random.key(0), images[:2], train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]

    with pytest.warns(UserWarning, match="conv kernels go to AdamW") as caught:
        default = lwjax.layerwise_muon(params, _mesh(), muon=OPTIONS["muon_config"])
    message = next(str(w.message) for w in caught if "conv kernels" in str(w.message))
    assert CONV_RULE in message and "ResNetBlock_1/conv_proj/kernel [1, 1, 8, 16]" in message
    assert not any("model dimension 3" in r.why for r in default.plan.routes)
    convs = {"conv_init/kernel", "ResNetBlock_0/Conv_0/kernel", "ResNetBlock_0/Conv_1/kernel",
             "ResNetBlock_1/Conv_0/kernel", "ResNetBlock_1/Conv_1/kernel",
             "ResNetBlock_1/conv_proj/kernel"}  # fmt: skip
    assert {r.path for r in default.plan.routes if not r.is_muon} >= convs

    rules = lwjax.RoutingRules(dims={"*[Cc]onv*/kernel": MatrixDims((0, 1, 2), 3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule settles every doubt
        opt = lwjax.layerwise_muon(params, _mesh(), routing=rules, muon=OPTIONS["muon_config"])
    norms = ("bn_init", "ResNetBlock_0/BatchNorm_0", "ResNetBlock_0/BatchNorm_1",
             "ResNetBlock_1/BatchNorm_0", "ResNetBlock_1/BatchNorm_1",
             "ResNetBlock_1/norm_proj")  # fmt: skip
    expected = {f"{n}/{p}": "adamw" for n in norms for p in ("scale", "bias")}
    expected |= {
        "conv_init/kernel": (147, 8),  # 7 · 7 · 3 inputs
        "ResNetBlock_0/Conv_0/kernel": (72, 8),
        "ResNetBlock_0/Conv_1/kernel": (72, 8),
        "ResNetBlock_1/Conv_0/kernel": (72, 16),
        "ResNetBlock_1/Conv_1/kernel": (144, 16),
        "ResNetBlock_1/conv_proj/kernel": (8, 16),
        "Dense_0/kernel": (16, 10),  # the classifier: no name says it is a head
        "Dense_0/bias": "adamw",
    }
    assert _table(opt.plan.routes) == expected

    def loss_fn(params, batch):
        x, y = batch
        logits = model.apply({"params": params, "batch_stats": batch_stats}, x, train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    labels = jax.random.randint(jax.random.key(2), (16,), 0, 10)
    trained, reference = _train(params, loss_fn, [(images, labels)] * STEPS, opt)
    _assert_matches_reference(trained, reference)


class _RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class _Attention(nn.Module):
    heads: int
    head_dim: int

    @nn.compact
    def __call__(self, x):
        proj = {
            p: nn.DenseGeneral((self.heads, self.head_dim), use_bias=False, name=p)(x)
            for p in ("query", "key", "value")
        }
        scores = jnp.einsum("bqhd,bkhd->bhqk", proj["query"], proj["key"]) / self.head_dim**0.5
        causal = jnp.tril(jnp.ones((x.shape[1],) * 2, bool))
        att = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
        out = jnp.einsum("bhqk,bkhd->bqhd", att, proj["value"])
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="out")(out)


class _Mlp(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(nn.Dense(self.hidden, use_bias=False, name="wi")(x))
        return nn.Dense(x.shape[-1], use_bias=False, name="wo")(h)


class _Layer(nn.Module):
    """MaxText's default decoder layer: one norm, attention and MLP in parallel."""

    @nn.compact
    def __call__(self, x, _):
        h = _RMSNorm(name="pre_self_attention_layer_norm")(x)
        x = x + _Attention(4, 8, name="self_attention")(h) + _Mlp(64, name="mlp")(h)
        return x, None


class _MaxTextStyle(nn.Module):
    """Ours, in MaxText's names and scanned layout: kernels ``[embed, layers, ...]``."""

    vocab: int = 64
    embed: int = 32
    layers: int = 3

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.embed, name="token_embedder")(tokens)
        scanned = nn.scan(_Layer, variable_axes={"params": 1}, split_rngs={"params": True},
                          length=self.layers)  # fmt: skip
        x, _ = scanned(name="layers")(x, None)
        x = _RMSNorm(name="decoder_norm")(x)
        return nn.Dense(self.vocab, use_bias=False, name="logits_dense")(x)


def test_maxtext_style_middle_stack_axis_is_found_and_trains_like_the_reference():
    """Issue 45, item 1: each kernel is 3 matrices (the layer axis read first), found from the
    ``[embed, layers]`` norm scale and the ``layers`` module, with no rule and no warning."""
    model = _MaxTextStyle()
    tokens = jax.random.randint(jax.random.key(1), (16, 16), 1, 64)
    params = model.init(jax.random.key(0), tokens[:2])["params"]
    layer = "layers/"
    assert params["layers"]["mlp"]["wi"]["kernel"].shape == (32, 3, 64)  # the layer axis second
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = lwjax.layerwise_muon(params, _mesh(), muon=OPTIONS["muon_config"])
    expected = {
        "token_embedder/embedding": "adamw",
        "decoder_norm/scale": "adamw",
        "logits_dense/kernel": "adamw",
        layer + "pre_self_attention_layer_norm/scale": "adamw",
        layer + "mlp/wi/kernel": (3, 32, 64),
        layer + "mlp/wo/kernel": (3, 64, 32),
        **{f"{layer}self_attention/{p}/kernel": (3, 32, 32) for p in ("query", "key", "value")},
        layer + "self_attention/out/kernel": (3, 32, 32),
    }
    assert _table(opt.plan.routes) == expected
    routes = {r.path: r for r in opt.plan.routes}
    assert routes[layer + "self_attention/out/kernel"].axes_order == (1, 0, 2, 3)
    assert routes[layer + "pre_self_attention_layer_norm/scale"].param_shape == (32,)  # no decay
    views = {row[0]: row[2] for row in routing_table(opt.plan.routes)}
    assert views[layer + "mlp/wi/kernel"] == "3 × [32, 64]"

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    trained, reference = _train(params, loss_fn, [tokens] * STEPS, opt)
    _assert_matches_reference(trained, reference)
