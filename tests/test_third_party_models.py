"""Hugging Face transformers' Flax ViT and T5, routed by default and trained at dp 8.

transformers comes from the test extra (``transformers>=4.40,<5``; version 5 dropped Flax), not
vendored. Each test builds the model from a small config, checks the default routing against a
table written from the architecture (Muon for the hidden weight matrices; AdamW for embeddings,
class token, heads, norms and biases), checks that building the optimizer warns about nothing,
trains a few steps and compares every parameter with :class:`reference.Reference`, the same
algorithm on whole arrays.
"""

import types
import warnings

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import reference_train
from test_third_party import (
    MUON,
    OPTIONS,
    _assert_matches_reference,
    _falls,
    _mesh,
    _table,
    _tokens,
)

import lwjax
from lwjax.routing import path_name

STEPS = 6


def _optimizer_without_warnings(params):
    """``layerwise_muon``'s optimizer for ``params``, built with every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return lwjax.layerwise_muon(params, _mesh(), muon=MUON)


def _initialised(model):
    """``model`` (built with ``_do_init=False``) and its parameters, initialised in one compiled
    program: ``_do_init=True`` runs the initialisers op by op, seconds slower on CPU."""
    return model, jax.jit(model.init_weights, static_argnums=1)(model.key, model.input_shape)


def _vit():
    """``FlaxViTForImageClassification`` on 16×16 RGB images: 4×4 patches, width 32, one block."""
    from transformers import FlaxViTForImageClassification, ViTConfig

    config = ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=10,
    )  # fmt: skip
    return _initialised(FlaxViTForImageClassification(config, _do_init=False))


def _vit_expected():
    embeddings = "vit/embeddings/"
    expected = {f"{embeddings}{p}": "adamw" for p in ("cls_token", "position_embeddings")}
    # The patch embedding: a conv kernel [4, 4, 3, 32] and its bias, AdamW by the name above.
    patch = f"{embeddings}patch_embeddings/projection/"
    expected |= {f"{patch}{p}": "adamw" for p in ("kernel", "bias")}
    expected |= {f"classifier/{p}": "adamw" for p in ("kernel", "bias")}
    expected |= {f"vit/layernorm/{p}": "adamw" for p in ("bias", "scale")}
    layer = "vit/encoder/layer/0/"
    norms = ("layernorm_before", "layernorm_after")
    expected |= {f"{layer}{n}/{p}": "adamw" for n in norms for p in ("bias", "scale")}
    dense = {f"attention/attention/{p}": (32, 32) for p in ("query", "key", "value")}
    dense |= {"attention/output/dense": (32, 32), "intermediate/dense": (32, 64)}
    dense["output/dense"] = (64, 32)
    expected |= {f"{layer}{d}/kernel": view for d, view in dense.items()}
    expected |= {f"{layer}{d}/bias": "adamw" for d in dense}
    return expected


def _key_bias_held(params):
    """``params`` with the attention key bias out of the gradient.

    Its exact gradient is zero (softmax ignores a shift that all keys share), so what the
    backward pass gives it is rounding noise, which Adam scales up to full steps of random
    sign: noise that no two reduction orders share. Held, it takes weight decay alone.
    """

    def hold(path, leaf):
        return jax.lax.stop_gradient(leaf) if path_name(path).endswith("/key/bias") else leaf

    return jax.tree_util.tree_map_with_path(hold, params)


def test_hf_flax_vit_routes_and_trains_with_optax_apply_updates_like_the_reference():
    """The optax form in a plain ``jax.jit`` loop, images split over dp."""
    mesh = _mesh()
    model, params = _vit()
    tx = _optimizer_without_warnings(params)
    assert _table(tx.plan.routes) == _vit_expected()

    def loss_fn(params, batch):
        images, labels = batch  # images [batch, channels, height, width], as HF's ViT takes them
        logits = model(images, params=_key_bias_held(params), train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @jax.jit
    def train_step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    key = jax.random.key(1)
    images, labels = jax.random.normal(key, (16, 3, 16, 16)), jax.random.randint(key, (16,), 0, 10)
    batches = [(images, labels)] * STEPS  # one batch, learnt by heart
    sharded = NamedSharding(mesh, P("dp"))
    trained = jax.device_put(params, NamedSharding(mesh, P()))  # as the step returns them
    state, losses = tx.init(trained), []
    for batch in batches:
        trained, state, loss = train_step(trained, state, jax.device_put(batch, sharded))
        losses.append(float(loss))
    _falls(losses)
    reference, _ = reference_train(params, loss_fn, batches, tx.plan.routes, **OPTIONS)
    _assert_matches_reference(trained, reference)


def _t5(monkeypatch):
    """``FlaxT5ForConditionalGeneration``, T5.1.1-style (gated GELU MLP, untied head): width 32,
    one layer each side.

    transformers' Flax T5 calls ``jnp.clip(x, a_max=...)``, a keyword that jax has since dropped
    (``min``/``max`` now); its module's ``jnp`` is swapped, for this test, for one whose
    ``clip`` passes the bounds on by position, which every jax reads the same way.
    """
    from transformers import FlaxT5ForConditionalGeneration, T5Config
    from transformers.models.t5 import modeling_flax_t5

    def clip(x, a_min=None, a_max=None):
        return jnp.clip(x, a_min, a_max)

    jnp_taking_a_max = types.SimpleNamespace(**{**vars(jnp), "clip": clip})
    monkeypatch.setattr(modeling_flax_t5, "jnp", jnp_taking_a_max)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
    )  # fmt: skip
    return _initialised(FlaxT5ForConditionalGeneration(config, _do_init=False))


def _t5_expected():
    expected = {"shared/embedding": "adamw", "lm_head/kernel": "adamw"}
    attention = {"encoder": ("0/SelfAttention",)}
    attention["decoder"] = ("0/SelfAttention", "1/EncDecAttention")
    for stack, mlp in (("encoder", 1), ("decoder", 2)):
        layer = f"{stack}/block/0/layer/"
        for attn in attention[stack]:
            expected |= {f"{layer}{attn}/{p}/kernel": (32, 32) for p in "qkvo"}
        # [buckets, heads]: a learned bias per relative distance, AdamW by its name `embedding`.
        expected[f"{layer}0/SelfAttention/relative_attention_bias/embedding"] = "adamw"
        expected |= {f"{layer}{mlp}/DenseReluDense/wi_{n}/kernel": (32, 64) for n in (0, 1)}
        expected[f"{layer}{mlp}/DenseReluDense/wo/kernel"] = (64, 32)
        expected |= {f"{layer}{n}/layer_norm/weight": "adamw" for n in range(mlp + 1)}
        expected[f"{stack}/final_layer_norm/weight"] = "adamw"
    return expected


def test_hf_flax_t5_routes_and_trains_with_make_train_step_like_the_reference(monkeypatch):
    model, params = _t5(monkeypatch)
    opt = _optimizer_without_warnings(params)
    assert _table(opt.plan.routes) == _t5_expected()

    def loss_fn(params, batch):
        inputs, targets = batch
        decoder_inputs = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))  # shifted right, 0 first
        logits = model(inputs, decoder_input_ids=decoder_inputs, params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    inputs = _tokens(1, 16, 8, 64)
    batches = [(inputs, jnp.flip(inputs, axis=1))] * STEPS  # learn to reverse one batch
    reference, _ = reference_train(params, loss_fn, batches, opt.plan.routes, **OPTIONS)
    step, state, trained, losses = lwjax.make_train_step(loss_fn, opt), opt.init(params), params, []
    for batch in batches:
        trained, state, metrics = step(trained, state, batch)  # params donated
        losses.append(float(metrics["loss"]))
    _falls(losses)
    _assert_matches_reference(trained, reference)
