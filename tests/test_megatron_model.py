"""Megatron's GPT in JAX (lwjax.megatron.model): its forward against a naive float64 reference,
its initialisation, remat and attention options."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lwjax.megatron.gpt import GPTConfig, tree_from_keys
from lwjax.megatron.model import attention_implementation, gpt_loss, init_params
from lwjax.tools import train_bench as tb
from lwjax.tools.bench import workload_config

TINY = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=24,
    vocab_size=50,
)
QKV = "decoder.layers.self_attention.linear_qkv.weight"


def next_token_loss(params, batch, config, **options):
    """The mean next-token cross-entropy of ``batch [B, T + 1]``."""
    return gpt_loss(params, (batch[:, :-1], batch[:, 1:]), config, **options)


LOSS = jax.jit(next_token_loss, static_argnums=2, static_argnames=("dtype", "remat"))


def naive_loss(params, batch, c: GPTConfig):
    """Float64 numpy Llama, one query head at a time, reading Megatron's per-group QKV
    rows by hand."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}  # Megatron's flat keys
    tokens, targets = batch[:, :-1], batch[:, 1:]
    heads, d = c.num_attention_heads, c.head_dim
    (batch_size, seq), per_group = tokens.shape, heads // c.num_query_groups
    angles = np.arange(seq)[:, None] * c.rotary_base ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope(v):  # [T, d]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        v1, v2 = v[:, : d // 2], v[:, d // 2 :]
        return np.concatenate([v1 * cos - v2 * sin, v2 * cos + v1 * sin], axis=-1)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_epsilon) * w

    x = p["embedding.word_embeddings.weight"][tokens]
    causal = np.triu(np.ones((seq, seq), bool), 1)
    for layer in range(c.num_layers):
        lp = {k.removeprefix("decoder.layers."): v[layer] for k, v in p.items() if "layers" in k}
        y = norm(x, lp["self_attention.linear_qkv.layer_norm_weight"])
        attn = np.zeros((batch_size, seq, heads * d))
        for head in range(heads):
            group, j = divmod(head, per_group)
            rows = lp["self_attention.linear_qkv.weight"][group * (per_group + 2) * d :]
            rows = rows[: (per_group + 2) * d]  # this group's rows
            wq, wk = rows[j * d : (j + 1) * d], rows[per_group * d :][:d]
            wv = rows[(per_group + 1) * d :][:d]
            for b in range(batch_size):
                scores = rope(y[b] @ wq.T) @ rope(y[b] @ wk.T).T / math.sqrt(d)
                scores[causal] = -np.inf
                weights = np.exp(scores - scores.max(-1, keepdims=True))
                attn[b, :, head * d : (head + 1) * d] = (
                    weights / weights.sum(-1, keepdims=True) @ (y[b] @ wv.T)
                )
        x = x + attn @ lp["self_attention.linear_proj.weight"].T
        y = norm(x, lp["mlp.linear_fc1.layer_norm_weight"])
        gate, up = np.split(y @ lp["mlp.linear_fc1.weight"].T, 2, axis=-1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lp["mlp.linear_fc2.weight"].T
    logits = norm(x, p["decoder.final_layernorm.weight"]) @ p["output_layer.weight"].T
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0])


def tiny_params(seed=0, config=TINY):
    """Larger-than-init weights (norm weights near 1), so attention is far from uniform
    and every head matters. Megatron's flat keys."""
    shapes = config.param_shapes()
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {
        name: ("norm" in name) + 0.3 * jax.random.normal(k, shape)
        for k, (name, shape) in zip(keys, shapes.items())
    }


def tiny_batch(batch_size=2, seq=12, seed=0):
    return np.random.default_rng(seed).integers(
        0, TINY.vocab_size, (batch_size, seq + 1), dtype=np.int32
    )


def test_init_params_has_the_gpt_tree():
    config = workload_config("small", 2)
    params = init_params(config, jax.random.key(0))
    got = jax.tree.map(lambda x: x.shape, params)
    assert got == tree_from_keys(config.param_shapes())
    layers = params["decoder"]["layers"]
    assert np.all(np.asarray(layers["self_attention"]["linear_qkv"]["layer_norm_weight"]) == 1)
    assert float(jnp.std(layers["mlp"]["linear_fc2"]["weight"])) == pytest.approx(
        0.02 / 2, rel=0.05
    )  # 0.02 / sqrt(2 L)


def test_loss_matches_naive_per_head_reference():
    params, batch = tiny_params(), tiny_batch()
    want = naive_loss(params, batch, TINY)
    got = float(LOSS(tree_from_keys(params), batch, TINY))
    assert got == pytest.approx(want, rel=1e-5)
    # k and v rows of group 0 swapped: the loss must move.
    qkv = np.array(params[QKV])
    d, per_group = TINY.head_dim, TINY.num_attention_heads // TINY.num_query_groups
    k_rows = slice(per_group * d, (per_group + 1) * d)
    v_rows = slice((per_group + 1) * d, (per_group + 2) * d)
    qkv[:, k_rows], qkv[:, v_rows] = qkv[:, v_rows].copy(), qkv[:, k_rows].copy()
    assert abs(naive_loss({**params, QKV: qkv}, batch, TINY) - want) > 1e-3


def test_remat_keeps_loss_and_grads():
    one_layer = dataclasses.replace(TINY, num_layers=1)
    params, batch = tree_from_keys(tiny_params(1, one_layer)), tiny_batch(seed=1)
    value_and_grad = jax.jit(
        jax.value_and_grad(next_token_loss), static_argnums=2, static_argnames="remat"
    )
    remat = value_and_grad(params, batch, one_layer, remat=True)
    plain = value_and_grad(params, batch, one_layer)
    for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(b)), 1e-30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_at_init_is_log_vocab(dtype):
    config = workload_config("small", 2)
    params = init_params(config, jax.random.key(0), dtype)
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    batch = tb.synthetic_batch(mesh, 4, 32, config.vocab_size)
    loss = float(LOSS(params, batch, config, dtype=dtype))
    assert loss == pytest.approx(math.log(config.vocab_size), abs=0.15)


def test_attention_resolves_and_is_checked():
    assert attention_implementation("auto", "float32") == "xla"  # cuDNN on GPU for bf16/fp16 only
    assert attention_implementation("cudnn", "float32") == "cudnn"
    with pytest.raises(ValueError, match="attention must be one of"):
        attention_implementation("flash", "float32")


def _double(tree):
    return jax.tree.map(lambda x: 2 * x, tree)


def test_gather_is_applied_once_to_every_weight_norms_included():
    """A gather that doubles its tree gives the loss of the doubled weights (the naive float64
    reference's); it sees the non-layer weights once (``decoder.layers`` None) and then one
    layer's weights at a time (no layer axis), all already cast to ``dtype``."""
    params, batch = tiny_params(2), tiny_batch(seed=2)
    want = naive_loss({k: 2 * np.asarray(v, np.float64) for k, v in params.items()}, batch, TINY)
    seen = []

    def gather(tree):
        seen.append(jax.tree.map(lambda x: (x.shape, x.dtype), tree))
        return _double(tree)

    got = jax.jit(lambda p, b: next_token_loss(p, b, TINY, gather=gather))(
        tree_from_keys(params), batch
    )
    assert float(got) == pytest.approx(want, rel=1e-5)
    assert abs(float(LOSS(tree_from_keys(params), batch, TINY)) - want) > 1e-2  # doubling shows

    shapes = {k: (s, jnp.dtype("float32")) for k, s in TINY.param_shapes().items()}
    layer_keys = [k for k in shapes if k.startswith("decoder.layers.")]
    outer = tree_from_keys({k: v for k, v in shapes.items() if k not in layer_keys})
    outer["decoder"]["layers"] = None
    one_layer = tree_from_keys(
        {k.removeprefix("decoder.layers."): (shapes[k][0][1:], shapes[k][1]) for k in layer_keys}
    )
    assert seen[0] == outer and len(seen) >= 2 and all(s == one_layer for s in seen[1:])

    seen.clear()  # bf16: gathered after the cast
    jax.eval_shape(
        lambda p, b: next_token_loss(p, b, TINY, dtype="bfloat16", gather=gather),
        tree_from_keys(params),
        batch,
    )
    assert {
        d for s in seen for _, d in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, tuple))
    } == {jnp.dtype("bfloat16")}


def test_gather_in_the_rematerialised_scan_has_the_chain_rule_gradient():
    """With remat the gather runs again in the backward: the gradient through a doubling gather
    is twice the gradient at the doubled weights."""
    params, batch = tree_from_keys(tiny_params(3)), tiny_batch(seed=3)
    grad = jax.jit(jax.value_and_grad(next_token_loss), static_argnums=2, static_argnames="remat")
    got_loss, got = jax.jit(
        jax.value_and_grad(lambda p, b: next_token_loss(p, b, TINY, remat=True, gather=_double))
    )(params, batch)
    want_loss, want = grad(_double(params), batch, TINY, remat=True)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), 2 * np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)), path


def test_gather_is_refused_with_megatron_numerics():
    params, batch = tree_from_keys(tiny_params()), tiny_batch()
    with pytest.raises(ValueError, match="gather applies to numerics='lwjax' only"):
        next_token_loss(params, batch, TINY, numerics="megatron", gather=_double)
