r"""Megatron-Core's GPT in JAX: initialisation and the forward pass over its tree.

One model serves the Megatron import (continue a run at Megatron's numbers)
and the benchmarks (:mod:`lwjax.tools.bench`, :mod:`lwjax.tools.train_bench`):
pre-norm blocks of RMSNorm, causal grouped-query attention with rotary
embeddings (Megatron's non-interleaved rotate-half) over the fused,
per-query-group ``linear_qkv`` rows, and a SwiGLU MLP whose ``linear_fc1`` is
``[gate; up]``. Weights are stored ``[out, in]`` as Megatron stores them; the
layers are stacked ``[L, ...]`` and run by ``lax.scan``, optionally
rematerialised per layer.

Numerics. Parameters are cast to ``dtype`` and the activations stay in it;
RMSNorm, the rotary embedding, the softmax and the logits are computed in fp32.
Attention is ``jax.nn.dot_product_attention``: on GPU with bf16 or fp16,
``"auto"`` asks for cuDNN's fused flash attention (XLA's, the default there,
materialises the ``[B, H, T, T]`` scores).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.megatron.gpt import GPTConfig, tree_from_keys

INIT_STD = 0.02  # Megatron's --init-method-std
ATTENTIONS = ("auto", "cudnn", "xla")


def init_params(config: GPTConfig, key: jax.Array, dtype="float32") -> dict:
    r"""Random parameters of ``config``'s tree with Megatron's initialisation.

    Norm weights are ones; ``linear_proj`` and ``linear_fc2`` (the layer outputs)
    are :math:`\mathcal{N}(0, \sigma^2 / (2L))`; every other matrix is
    :math:`\mathcal{N}(0, \sigma^2)`, :math:`\sigma` = ``INIT_STD``.
    """
    shapes = config.param_shapes()

    # One program for all leaves: fast on CPU, and no fp32 copy of every leaf at once on GPU.
    @jax.jit
    def make(key):
        out = {}
        for k, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items()):
            if "norm" in name:
                out[name] = jnp.ones(shape, dtype)
                continue
            std = INIT_STD
            if "linear_proj" in name or "linear_fc2" in name:
                std /= math.sqrt(2 * config.num_layers)
            out[name] = (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return out

    return tree_from_keys(make(key))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    r""":math:`y = x / \sqrt{\overline{x^2} + \epsilon} \odot w`, in fp32, cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    r"""``cos`` and ``sin`` of the rotary angles :math:`t\, \theta^{-2i/d}`, each ``[T, d]``."""
    inv_freq = base ** (-np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(seq_len)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    r"""Rotate ``x [B, T, N, d]`` by position.

    .. math:: x' = x \cos + (-x_2, x_1) \sin, \qquad x = (x_1, x_2)
    """
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def attention_implementation(attention: str, dtype) -> str:
    """``"cudnn"`` or ``"xla"``: ``attention``, with ``"auto"`` resolved for the default backend."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}; got {attention!r}.")
    if attention != "auto":
        return attention
    fused = jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return "cudnn" if fused else "xla"


def _attention(x, p, config: GPTConfig, cos, sin, implementation: str):
    """Causal grouped-query self-attention over Megatron's fused, per-group QKV rows."""
    batch, seq, _ = x.shape
    groups, d = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    qkv = jnp.einsum("bth,oh->bto", x, p["linear_qkv"]["weight"])
    qkv = qkv.reshape(batch, seq, groups, per_group + 2, d)
    # Query head g * per_group + j uses key/value head g.
    q = qkv[:, :, :, :per_group].reshape(batch, seq, config.num_attention_heads, d)
    k, v = qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
    out = jax.nn.dot_product_attention(
        apply_rope(q, cos, sin),
        apply_rope(k, cos, sin),
        v,
        is_causal=True,
        implementation=implementation,
    )
    out = out.reshape(batch, seq, config.num_attention_heads * d)
    return jnp.einsum("btf,hf->bth", out, p["linear_proj"]["weight"])


def _layer(x, p, config: GPTConfig, cos, sin, implementation: str):
    r"""A pre-norm block: :math:`x \mathrel{+}= \text{attn}(\text{norm}(x))`, then SwiGLU alike."""
    attn, mlp = p["self_attention"], p["mlp"]
    y = rms_norm(x, attn["linear_qkv"]["layer_norm_weight"], config.norm_epsilon)
    x = x + _attention(y, attn, config, cos, sin, implementation)
    y = rms_norm(x, mlp["linear_fc1"]["layer_norm_weight"], config.norm_epsilon)
    gate, up = jnp.split(jnp.einsum("bth,oh->bto", y, mlp["linear_fc1"]["weight"]), 2, axis=-1)
    return x + jnp.einsum("btf,hf->bth", jax.nn.silu(gate) * up, mlp["linear_fc2"]["weight"])


def gpt_logits(
    params: Mapping,
    tokens,
    config: GPTConfig,
    *,
    dtype="float32",
    attention: str = "auto",
    remat: bool = False,
) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` (float32) of the GPT for integer ``tokens [batch, seq]``.

    Args:
      params: The GPT tree (:meth:`GPTConfig.param_shapes`, nested).
      tokens: Token ids ``[batch, seq]``.
      config: The GPT's shape.
      dtype: Compute dtype of weights and activations (see the module docstring).
      attention: ``"auto"``, ``"cudnn"`` or ``"xla"`` (``jax.nn.dot_product_attention``).
      remat: Recompute each layer in the backward pass: only the layer inputs
        are kept between forward and backward.
    """
    implementation = attention_implementation(attention, dtype)
    params = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), params)
    cos, sin = rope_tables(tokens.shape[1], config.head_dim, config.rotary_base)
    embedding = params["embedding"]["word_embeddings"]["weight"]
    x = embedding[tokens]

    def body(x, p):
        return _layer(x, p, config, cos, sin, implementation), None

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    x, _ = lax.scan(body, x, params["decoder"]["layers"])
    x = rms_norm(x, params["decoder"]["final_layernorm"]["weight"], config.norm_epsilon)
    output = embedding if config.tied_embeddings else params["output_layer"]["weight"]
    return jnp.einsum("bth,vh->btv", x, output, preferred_element_type=jnp.float32)


def gpt_loss(params: Mapping, batch, config: GPTConfig, **options) -> jax.Array:
    r"""Mean token cross-entropy of ``batch = (tokens, labels)``, both ``[batch, seq]`` integers.

    .. math:: \ell = \frac{1}{BT} \sum_{b, t} \Big(\log \sum_v e^{z_{btv}} - z_{b,t,y_{bt}}\Big)

    with the fp32 logits :math:`z` of :func:`gpt_logits` (``options`` are its
    keyword arguments).
    """
    tokens, labels = batch
    logits = gpt_logits(params, tokens, config, **options)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
