r"""Megatron-Core's bf16 GPT rounding, op by op, for :func:`lwjax.megatron.model.gpt_logits`.

Numerics ``"megatron"``: the rounding of megatron-core 0.19.2's bf16 GPT
(``Float16Module`` around a ``GPTModel`` of the local layer spec, torch
RMSNorm, unfused rotary embedding and softmax, no bias or activation fusion),
as read in its source and checked op by op against it on CPU (torch 2.13).
Weights are ``dtype`` copies. A torch op on bf16 tensors computes in fp32 and
rounds its result once, and the gradient it returns for each bf16 input is
rounded too; autograd rounds the sum when a tensor is read twice. Per op:

* embedding: a bf16 row lookup; its gradient is summed into a bf16 table one
  token at a time, rounding after every addition;
* RMSNorm (``torch.nn.RMSNorm``): :math:`x \cdot (1 / \sqrt{\overline{x^2} + \epsilon}) \cdot w`
  all in fp32 (a square root, then a division: no approximate ``rsqrt``; the
  weight multiply included), one rounding;
* linear layers: bf16 matmuls, fp32 sums, one rounding (both backward matmuls
  alike);
* rotary embedding: angles in fp32 (:math:`\theta_i = 1 / b^{2i/d}` in fp32),
  ``cos``/``sin`` in fp32, then rounded to bf16; :math:`x \cos`,
  :math:`\mathrm{rot}(x) \sin` and their sum are three bf16 ops, each rounded;
* attention scores: ``baddbmm(alpha=1/\sqrt{d})``, the scale applied to the
  fp32 sum, one rounding; in the backward :math:`g k` is rounded and then
  :math:`\tfrac{1}{\sqrt{d}}\, g k` again; grouped keys and values are
  repeated per query head, their per-head gradients summed in fp32, rounded;
* softmax: bf16 scores upcast, causal positions filled with :math:`-10^4`,
  softmax in fp32 (``attention_softmax_in_fp32``; no further scale), the
  probabilities rounded to bf16; probabilities times values is a bf16 matmul;
* residual adds: bf16 + bf16, rounded (``fp32_residual_connection`` off, and
  dropout with :math:`p = 0` is the identity);
* SwiGLU: :math:`\mathrm{silu}(g) = g / (1 + e^{-g})` in fp32 from the bf16
  gate, rounded once (its gradient too); times ``up`` is a bf16 multiply;
* logits: a bf16 matmul, so bf16 logits (returned here as float32);
* cross-entropy (``vocab_parallel_cross_entropy``): the logits upcast to fp32,
  :math:`\log \sum_v e^{z_v - m} - (z_y - m)` in fp32; its gradient
  :math:`(\mathrm{softmax} - \mathbb{1}_y)\, g` in fp32, rounded to bf16 as
  it enters the logits; the loss is the fp32 mean of the per-token losses;
* parameter gradients come out bf16 (Megatron's fp32 ``main_grad`` holds that
  bf16 value at data-parallel size 1).

Here a bf16 value is kept in an fp32 array and each rounding is an explicit
``lax.reduce_precision``. bf16 arrays would not do: with
``--xla_allow_excess_precision`` on (XLA's default, on CPU too) XLA drops
fp32 -> bf16 -> fp32 round trips inside its fusions, and written that way this
mode missed Megatron's loss by ~3e-5 and its gradients by ~0.5% (it matched
with the flag off). XLA keeps ``reduce_precision``, so no flag is needed. On
CPU, at the weights of a Megatron checkpoint, the loss agrees to ~1e-6 and the
gradients bit for bit, but for a rare last-bit difference where a matmul sums
in another order than torch's oneDNN. This mode holds activations in fp32
(twice the memory) and runs fp32 matmuls on bf16 values: it is for reproducing
Megatron, not for speed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lwjax.megatron.gpt import GPTConfig

# Values Megatron holds in ``dtype`` are fp32 arrays of ``dtype`` values here, and each
# rounding torch does is an explicit ``lax.reduce_precision`` (:func:`round_to_dtype`), which XLA
# keeps: a bf16 round trip (``convert``) may be dropped where ``xla_allow_excess_precision``
# is on, its default. ``reduce_precision`` is its own transpose, so rounding an op's inputs
# and its output (:func:`_rounded_op`) rounds the gradients at torch's places too: each
# op's input gradients, and their sum for a value read twice.


def round_to_dtype(x: jax.Array, dtype) -> jax.Array:
    """Round ``x`` to ``dtype``'s precision, keeping its fp32 type (identity for fp32)."""
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return x
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _rounded_op(op, *args, dtype):
    """``op`` of ``args`` rounded to ``dtype``, its result rounded: a torch op on ``dtype``
    tensors (forward and backward)."""
    return round_to_dtype(op(*(round_to_dtype(a, dtype) for a in args)), dtype)


def rounded_matmul(subscripts: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """A ``dtype`` matmul: exact products, fp32 sums, one rounding (backward likewise).

    The operands hold ``dtype`` values, so any matmul precision from bf16 up
    multiplies them exactly.
    """
    return _rounded_op(functools.partial(jnp.einsum, subscripts), a, b, dtype=dtype)


def megatron_rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    r"""``cos`` and ``sin`` ``[T, d]`` (fp32) of the rotary angles as Megatron computes them.

    :math:`\theta_i = 1 / b^{2i/d}` with the power correctly rounded and every
    other step in fp32, angles :math:`t\,\theta_i` in fp32, then cos and sin
    rounded from float64 (torch's fp32 ``cos``/``sin`` are within one ulp of
    that, which bf16 does not see).
    """
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    inv_freq = f32(1) / (np.float64(base) ** exponent.astype(np.float64)).astype(f32)
    angles = np.arange(seq_len, dtype=f32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def megatron_rms_norm(x, weight, eps: float, dtype):
    r""":math:`x / \sqrt{\overline{x^2} + \epsilon} \odot w` in fp32, rounded once
    (``torch.nn.RMSNorm``)."""

    def norm(x, weight):
        root = jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
        # torch divides by the root; XLA would turn 1 / sqrt into its rsqrt, off by an ulp.
        return x * (1 / lax.optimization_barrier(root)) * weight

    return _rounded_op(norm, x, weight, dtype=dtype)


def _megatron_rope(x, cos, sin, dtype):
    r""":math:`x \cos + (-x_2, x_1) \sin` with the tables, each product and the sum rounded."""
    cos, sin = round_to_dtype(cos[:, None, :], dtype), round_to_dtype(sin[:, None, :], dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return _rounded_op(
        jnp.add,
        _rounded_op(jnp.multiply, x, cos, dtype=dtype),
        _rounded_op(jnp.multiply, rotated, sin, dtype=dtype),
        dtype=dtype,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _megatron_silu(x: jax.Array, dtype) -> jax.Array:
    r""":math:`x / (1 + e^{-x})` in fp32, rounded once; its gradient
    :math:`g\,\sigma(1 + x(1 - \sigma))` likewise (torch's ``silu`` kernels)."""
    return round_to_dtype(x / (1 + jnp.exp(-x)), dtype)


def _megatron_silu_fwd(x, dtype):
    return _megatron_silu(x, dtype), x


def _megatron_silu_bwd(dtype, x, g):
    sigmoid = 1 / (1 + jnp.exp(-x))
    return (round_to_dtype(g * sigmoid * (1 + x * (1 - sigmoid)), dtype),)


_megatron_silu.defvjp(_megatron_silu_fwd, _megatron_silu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _megatron_scores(q: jax.Array, k: jax.Array, scale: float, dtype) -> jax.Array:
    r"""Scores ``[B, N, Tq, Tk]`` :math:`= s\, q k^\top`, scaled before the one rounding
    (``baddbmm(alpha=s)``); the gradients are rounded twice, :math:`g k` and then
    :math:`s\,(g k)`, as torch's ``baddbmm`` backward does."""
    return round_to_dtype(jnp.einsum("bqnd,bknd->bnqk", q, k) * scale, dtype)


def _megatron_scores_fwd(q, k, scale, dtype):
    return _megatron_scores(q, k, scale, dtype), (q, k)


def _megatron_scores_bwd(scale, dtype, residuals, g):
    q, k = residuals
    dq = round_to_dtype(jnp.einsum("bnqk,bknd->bqnd", g, k), dtype)
    dk = round_to_dtype(jnp.einsum("bnqk,bqnd->bknd", g, q), dtype)
    return round_to_dtype(dq * scale, dtype), round_to_dtype(dk * scale, dtype)


_megatron_scores.defvjp(_megatron_scores_fwd, _megatron_scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def megatron_embed(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """Rows ``table[tokens]``; the gradient sums into a ``dtype`` table token by token,
    rounding after each addition (torch's CPU ``embedding_dense_backward``)."""
    return table[tokens]


def _megatron_embed_fwd(table, tokens, dtype):
    return table[tokens], (tokens, table.shape)


def _megatron_embed_bwd(dtype, residuals, g):
    tokens, shape = residuals
    rows = g.reshape(-1, shape[-1]).astype(dtype)
    table = jnp.zeros(shape, dtype).at[tokens.reshape(-1)].add(rows)
    return table.astype(jnp.float32), np.zeros(tokens.shape, jax.dtypes.float0)


megatron_embed.defvjp(_megatron_embed_fwd, _megatron_embed_bwd)


def _megatron_attention(x, p, config: GPTConfig, cos, sin, dtype):
    """Megatron's local ``DotProductAttention``: explicit scores, fp32 masked softmax."""
    batch, seq, _ = x.shape
    groups, d = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    qkv = rounded_matmul("bth,oh->bto", x, p["linear_qkv"]["weight"], dtype)
    qkv = qkv.reshape(batch, seq, groups, per_group + 2, d)
    q = qkv[:, :, :, :per_group].reshape(batch, seq, config.num_attention_heads, d)
    q = _megatron_rope(q, cos, sin, dtype)
    # Key/value heads repeated per query head: their gradients are summed in fp32, then rounded.
    k = jnp.repeat(_megatron_rope(qkv[:, :, :, per_group], cos, sin, dtype), per_group, axis=2)
    v = jnp.repeat(qkv[:, :, :, per_group + 1], per_group, axis=2)
    scores = _megatron_scores(q, k, 1.0 / math.sqrt(d), dtype)
    causal = jnp.tril(jnp.ones((seq, seq), bool))

    def masked_softmax(scores):
        return jax.nn.softmax(jnp.where(causal, scores, -10000.0), axis=-1)

    probs = _rounded_op(masked_softmax, scores, dtype=dtype)
    out = rounded_matmul("bnqk,bknd->bqnd", probs, v, dtype)
    out = out.reshape(batch, seq, config.num_attention_heads * d)
    return rounded_matmul("btf,hf->bth", out, p["linear_proj"]["weight"], dtype)


def megatron_layer(x, p, config: GPTConfig, cos, sin, dtype):
    """A pre-norm block whose residual sums are rounded to ``dtype``."""
    attn, mlp = p["self_attention"], p["mlp"]
    y = megatron_rms_norm(x, attn["linear_qkv"]["layer_norm_weight"], config.norm_epsilon, dtype)
    x = _rounded_op(jnp.add, x, _megatron_attention(y, attn, config, cos, sin, dtype), dtype=dtype)
    y = megatron_rms_norm(x, mlp["linear_fc1"]["layer_norm_weight"], config.norm_epsilon, dtype)
    gate, up = jnp.split(
        rounded_matmul("bth,oh->bto", y, mlp["linear_fc1"]["weight"], dtype), 2, axis=-1
    )
    hidden = _rounded_op(jnp.multiply, _megatron_silu(gate, dtype), up, dtype=dtype)
    out = rounded_matmul("btf,hf->bth", hidden, mlp["linear_fc2"]["weight"], dtype)
    return _rounded_op(jnp.add, x, out, dtype=dtype)


@jax.custom_vjp
def megatron_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    r"""Per-token :math:`\log \sum_v e^{z_v - m} - (z_y - m)`, :math:`m = \max_v z_v`, in fp32;
    gradient :math:`g\,(e^{z - m} / \sum_v e^{z_v - m} - \mathbb{1}_y)` (Megatron's
    ``vocab_parallel_cross_entropy``)."""
    return _megatron_cross_entropy_fwd(logits, labels)[0]


def _megatron_cross_entropy_fwd(logits, labels):
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    exp = jnp.exp(shifted)
    total = jnp.sum(exp, axis=-1)
    picked = jnp.take_along_axis(shifted, labels[..., None], axis=-1)[..., 0]
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return jnp.log(total) - picked, (exp / total[..., None] - onehot, labels)


def _megatron_cross_entropy_bwd(residuals, g):
    softmax_minus_onehot, labels = residuals
    return softmax_minus_onehot * g[..., None], np.zeros(labels.shape, jax.dtypes.float0)


megatron_cross_entropy.defvjp(_megatron_cross_entropy_fwd, _megatron_cross_entropy_bwd)
