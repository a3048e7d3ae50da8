r"""Megatron-Core's GPT in JAX: initialisation and the forward pass over its tree.

One model serves the Megatron import (continue a run at Megatron's numbers)
and the benchmarks (:mod:`lwjax.tools.bench`, :mod:`lwjax.tools.train_bench`):
pre-norm blocks of RMSNorm, causal grouped-query attention with rotary
embeddings (Megatron's non-interleaved rotate-half) over the fused,
per-query-group ``linear_qkv`` rows, and a SwiGLU MLP whose ``linear_fc1`` is
``[gate; up]``. Weights are stored ``[out, in]`` as Megatron stores them; the
layers are stacked ``[L, ...]`` and run by ``lax.scan``, or given as a list of
per-layer trees (:func:`unstack_layers`) and run one after the other,
optionally rematerialised per layer.

Numerics ``"lwjax"`` (the default, used by the benchmarks). Parameters are
cast to ``dtype`` and the activations stay in it; RMSNorm, the rotary
embedding, the softmax and the logits are computed in fp32. Attention is
``jax.nn.dot_product_attention``: on GPU with bf16 or fp16, ``"auto"`` asks for
cuDNN's fused flash attention (XLA's, the default there, materialises the
``[B, H, T, T]`` scores).

Numerics ``"megatron"`` reproduce the rounding of Megatron-Core's bf16 GPT op by op
(:mod:`lwjax.megatron.megatron_numerics`): for continuing a Megatron run, not for speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.megatron.gpt import ATTENTIONS, GPTConfig, tree_from_keys
from lwjax.megatron.megatron_numerics import (
    megatron_cross_entropy,
    megatron_embed,
    megatron_layer,
    megatron_rms_norm,
    megatron_rope_tables,
    round_to_dtype,
    rounded_matmul,
)
from lwjax.parallel.gather import gather_params, gather_rows

INIT_STD = 0.02  # Megatron's --init-method-std
NUMERICS = ("lwjax", "megatron")


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


def check_dense(config: GPTConfig, where: str) -> None:
    """Refuse a mixture-of-experts ``config``: this forward has a dense MLP alone."""
    if config.num_experts:
        raise ValueError(
            f"{where}: the GPT is a mixture of {config.num_experts} experts, and lwjax's GPT "
            "forward has no MoE layer (router, token dispatch, experts). Continue the run with "
            "a loss of your own MoE model over these parameters; the optimizer, its state and "
            "the export to Megatron take the experts as they are."
        )


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


def _megatron_logits(params, tokens, config: GPTConfig, dtype, attention: str, remat: bool):
    """The ``"megatron"`` numerics of :func:`gpt_logits`."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}; got {attention!r}.")
    if attention == "cudnn":
        raise ValueError(
            "attention='cudnn' does not follow Megatron's numerics (its local spec runs an "
            "unfused attention); use attention='auto' or 'xla' with numerics='megatron'."
        )
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(
            f"numerics='megatron' follows Megatron's bf16 (or fp32) model; got dtype={dtype.name}. "
            "Use dtype='bfloat16'."
        )
    # Float16Module's copy of the weights: dtype values, held in fp32.
    params = jax.tree.map(
        lambda x: round_to_dtype(jnp.asarray(x).astype(jnp.float32), dtype), params
    )
    cos, sin = megatron_rope_tables(tokens.shape[1], config.head_dim, config.rotary_base)
    embedding = params["embedding"]["word_embeddings"]["weight"]

    def body(x, p):
        return megatron_layer(x, p, config, cos, sin, dtype), None

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    x = round_to_dtype(megatron_embed(embedding, tokens, dtype), dtype)
    x = _run_layers(body, x, params["decoder"]["layers"])
    x = megatron_rms_norm(
        x, params["decoder"]["final_layernorm"]["weight"], config.norm_epsilon, dtype
    )
    output = embedding if config.tied_embeddings else params["output_layer"]["weight"]
    return rounded_matmul("bth,vh->btv", x, output, dtype)


def _run_layers(body, x, layers):
    """``body`` over the layers: scanned over stacked ``[L, ...]`` leaves, or one call per
    layer of a list of per-layer trees (:func:`unstack_layers`)."""
    if isinstance(layers, (list, tuple)):
        for p in layers:
            x, _ = body(x, p)
        return x
    return lax.scan(body, x, layers)[0]


def unstack_layers(params: Mapping) -> dict:
    """``params`` with ``decoder/layers`` as a list of per-layer trees instead of stacked leaves.

    The forward pass then runs the layers one after the other instead of in a
    scan, and each layer's parameters are leaves of their own, so a layer-wise
    optimizer buckets them layer by layer (route them with
    ``GPTConfig.routing_rules(stacked=False)``).
    """
    layers = params["decoder"]["layers"]
    count = len(jax.tree.leaves(layers)[0])
    unstacked = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)]
    return {**params, "decoder": {**params["decoder"], "layers": unstacked}}


def gpt_logits(
    params: Mapping,
    tokens,
    config: GPTConfig,
    *,
    dtype="float32",
    attention: str = "auto",
    remat: bool = False,
    numerics: Literal["lwjax", "megatron"] = "lwjax",
    gather: Callable[[Any], Any] | None = None,
) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` (float32) of the GPT for integer ``tokens [batch, seq]``.

    Args:
      params: The GPT tree (:meth:`GPTConfig.param_shapes`, nested), its
        layers stacked or a list (:func:`unstack_layers`).
      tokens: Token ids ``[batch, seq]``.
      config: The GPT's shape.
      dtype: Compute dtype of weights and activations (see the module docstring).
      attention: ``"auto"``, ``"cudnn"`` or ``"xla"`` (``jax.nn.dot_product_attention``);
        Megatron's numerics run its unfused attention for ``"auto"`` and ``"xla"``.
      remat: Recompute each layer in the backward pass: only the layer inputs
        are kept between forward and backward.
      numerics: ``"lwjax"`` (norms, rotary embedding, softmax and logits in
        fp32) or ``"megatron"``: round to ``dtype`` wherever Megatron-Core's
        bf16 GPT does (see the module docstring), for losses and
        gradients that agree with a Megatron run at the same weights; the
        logits are then ``dtype`` values returned as float32.
      gather: ``tree -> tree``, called on each layer's parameters inside the
        scan or loop (inside the rematerialised body with ``remat``) and on the other
        parameters, after the cast to ``dtype`` and before their use
        (``"lwjax"`` numerics only). Fully sharded data parallelism passes an
        all-gather of each device's blocks inside ``shard_map``: one layer is
        then whole at a time, and its transpose reduce-scatters the layer's
        gradient in the backward scan. With :func:`lwjax.gather_params` itself,
        an untied embedding is not gathered: its rows are looked up from the
        blocks (:func:`lwjax.parallel.gather.gather_rows`).

    Raises:
      ValueError: an unknown ``attention`` or ``numerics``; with Megatron's
        numerics, ``"cudnn"`` attention, a ``dtype`` other than bfloat16 or
        float32, or ``gather``; a mixture-of-experts ``config``.
    """
    check_dense(config, "gpt_logits")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}; got {numerics!r}.")
    if numerics == "megatron":
        if gather is not None:
            raise ValueError("gather applies to numerics='lwjax' only.")
        return _megatron_logits(params, tokens, config, dtype, attention, remat)
    implementation = attention_implementation(attention, dtype)
    gather = gather or (lambda tree: tree)
    params = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), params)
    layers = params["decoder"]["layers"]  # gathered one at a time, in the scan or loop
    # With gather_params, an untied embedding is looked up from its blocks, never whole.
    by_rows = gather is gather_params and not config.tied_embeddings
    table = params["embedding"]["word_embeddings"]["weight"]
    params = gather(
        {
            **params,
            "embedding": {"word_embeddings": None} if by_rows else params["embedding"],
            "decoder": {**params["decoder"], "layers": None},
        }
    )
    cos, sin = rope_tables(tokens.shape[1], config.head_dim, config.rotary_base)
    if by_rows:
        x = gather_rows(table, tokens)
    else:
        embedding = params["embedding"]["word_embeddings"]["weight"]
        x = embedding[tokens]

    def body(x, p):
        return _layer(x, gather(p), config, cos, sin, implementation), None

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    x = _run_layers(body, x, layers)
    x = rms_norm(x, params["decoder"]["final_layernorm"]["weight"], config.norm_epsilon)
    output = embedding if config.tied_embeddings else params["output_layer"]["weight"]
    return jnp.einsum("bth,vh->btv", x, output, preferred_element_type=jnp.float32)


def gpt_loss(params: Mapping, batch, config: GPTConfig, **options) -> jax.Array:
    r"""Mean token cross-entropy of ``batch = (tokens, labels)``, both ``[batch, seq]`` integers.

    .. math:: \ell = \frac{1}{BT} \sum_{b, t} \Big(\log \sum_v e^{z_{btv}} - z_{b,t,y_{bt}}\Big)

    with the fp32 logits :math:`z` of :func:`gpt_logits` (``options`` are its
    keyword arguments). With ``numerics="megatron"`` the per-token losses are
    Megatron's cross-entropy of its bf16 logits, and so is their gradient (see
    the module docstring).
    """
    tokens, labels = batch
    logits = gpt_logits(params, tokens, config, **options)
    if options.get("numerics") == "megatron":
        return jnp.mean(megatron_cross_entropy(logits, labels))
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
