"""A small flax nnx GPT: RoPE attention (fused or separate QKV, grouped queries), SwiGLU, RMSNorm.

The model is the one ``lwjax demo`` and ``examples/nnx_gpt.py`` train. Its
parameter names, and what :func:`lwjax_routing` plus lwjax's defaults make of them:

* ``embed/embedding`` ``[V, d]``: AdamW (an embedding; ``tied`` when it is also the head);
* ``blocks/{i}/attn/qkv/kernel`` ``[d, (H + 2K) h]``: Muon, with Q, K and V
  orthogonalised separately (``qkv_split``); or ``attn/{q,k,v}/kernel``: Muon;
* ``blocks/{i}/attn/out/kernel`` ``[H h, d]`` and ``blocks/{i}/mlp/{gate,up,down}/kernel``: Muon;
* ``blocks/{i}/{attn,mlp}_norm/scale``, ``final_norm/scale`` ``[d]``: AdamW, no weight decay;
* ``lm_head/kernel`` ``[d, V]``: AdamW (the output projection; zero at init).

With ``scan_layers=True`` the blocks are one module whose parameters carry a
leading layer axis (``blocks/attn/qkv/kernel`` is ``[L, d, (H+2K)h]``), built
with ``nnx.vmap`` and run with ``nnx.scan``; ``stacked={"blocks/*": 1}`` makes
each layer's slice its own Muon matrix.

The fused QKV projection lays its output columns out per key/value group, as
Megatron does: for each of the ``K`` groups, ``H/K`` query heads, then one key
head, then one value head, each ``h`` wide. So ``qkv_split=(H/K·h, h, h)``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import lwjax

ROPE_BASE = 10_000.0


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and options of :class:`GPT`.

    Attributes:
      vocab_size: Number of token ids (256 for bytes).
      num_layers: Transformer blocks ``L``.
      d_model: Residual width ``d``.
      num_heads: Query heads ``H``.
      num_kv_heads: Key/value heads ``K`` (grouped-query attention); ``None`` means ``H``.
      mlp_hidden: SwiGLU hidden width ``f``; ``None`` means the multiple of 32
        nearest ``8d/3``.
      fused_qkv: One ``[d, (H+2K)h]`` QKV projection instead of three.
      tied_embedding: Compute logits with the embedding table (no ``lm_head``).
      scan_layers: Stack the blocks along a leading axis and run them with ``nnx.scan``.
    """

    vocab_size: int = 256
    num_layers: int = 4
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    mlp_hidden: int | None = None
    fused_qkv: bool = True
    tied_embedding: bool = False
    scan_layers: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "d_model", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int; got {name}={value!r}.")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"GPTConfig.d_model must split into num_heads heads of even width (RoPE); "
                f"got d_model={self.d_model}, num_heads={self.num_heads}."
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"GPTConfig.num_kv_heads must divide num_heads; got num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}."
            )

    @property
    def kv_heads(self) -> int:
        """``K``: key/value heads."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """``h = d / H``."""
        return self.d_model // self.num_heads

    @property
    def hidden(self) -> int:
        """SwiGLU hidden width ``f``."""
        return self.mlp_hidden or max(32, round(8 * self.d_model / 3 / 32) * 32)

    @property
    def qkv_split(self) -> tuple[int, int, int]:
        """Output columns of q, k and v per key/value group of the fused projection."""
        return (self.num_heads // self.kv_heads * self.head_dim, self.head_dim, self.head_dim)


MODEL_SIZES = {
    "tiny": GPTConfig(num_layers=2, d_model=64, num_heads=4),
    "small": GPTConfig(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2),
    "base": GPTConfig(num_layers=6, d_model=256, num_heads=8, num_kv_heads=4),
}


def lwjax_routing(config: GPTConfig) -> lwjax.RoutingRules:
    """Routing rules for :func:`lwjax.layerwise_muon` on this model's parameters.

    Defaults already send the embedding, ``lm_head`` and norms to AdamW and every
    other 2-D kernel to Muon; this adds what the defaults cannot know: the layer
    axis of scanned blocks, the tied embedding and the fused QKV split.
    """
    return lwjax.RoutingRules(
        stacked={"blocks/*": 1} if config.scan_layers else None,
        tied={"embed/embedding": True} if config.tied_embedding else None,
        qkv_split={"*attn/qkv/kernel": config.qkv_split} if config.fused_qkv else None,
    )


def rope(x: jax.Array, base: float = ROPE_BASE) -> jax.Array:
    r"""Rotate ``x [B, T, heads, h]`` by position (rotary embeddings, half-split form).

    .. math::

       \theta_j = \text{base}^{-j/(h/2)},\quad
       (x_1, x_2) \mapsto
       (x_1 \cos t\theta - x_2 \sin t\theta,\; x_2 \cos t\theta + x_1 \sin t\theta)
    """
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs, **kwargs)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE; fused or separate QKV."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, h, heads, kv = config.d_model, config.head_dim, config.num_heads, config.kv_heads
        if config.fused_qkv:
            self.qkv = _linear(d, (heads + 2 * kv) * h, rngs)
        else:
            self.q, self.k, self.v = (
                _linear(d, heads * h, rngs),
                _linear(d, kv * h, rngs),
                _linear(d, kv * h, rngs),
            )
        self.out = _linear(heads * h, d, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        b, t, _ = x.shape
        group = c.num_heads // c.kv_heads
        if c.fused_qkv:
            qkv = self.qkv(x).reshape(b, t, c.kv_heads, group + 2, c.head_dim)
            q, k, v = qkv[..., :group, :], qkv[..., group, :], qkv[..., group + 1, :]
            q = q.reshape(b, t, c.num_heads, c.head_dim)
        else:
            q = self.q(x).reshape(b, t, c.num_heads, c.head_dim)
            k = self.k(x).reshape(b, t, c.kv_heads, c.head_dim)
            v = self.v(x).reshape(b, t, c.kv_heads, c.head_dim)
        q, k = rope(q).reshape(b, t, c.kv_heads, group, c.head_dim), rope(k)
        scores = jnp.einsum("btkgh,bskh->bkgts", q, k) / math.sqrt(c.head_dim)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(
            jnp.where(causal, scores, -1e9).astype(jnp.float32), axis=-1
        ).astype(v.dtype)
        out = jnp.einsum("bkgts,bskh->btkgh", weights, v).reshape(b, t, c.num_heads * c.head_dim)
        return self.out(out)


class MLP(nnx.Module):
    r"""SwiGLU: :math:`W_\text{down}(\operatorname{silu}(x W_\text{gate}) \odot x W_\text{up})`."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d, f = config.d_model, config.hidden
        self.gate, self.up, self.down = (
            _linear(d, f, rngs),
            _linear(d, f, rngs),
            _linear(f, d, rngs),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nnx.Module):
    """Decoder-only language model: ``tokens [B, T] -> logits [B, T, V]`` (float32).

    Examples:
      >>> from flax import nnx
      >>> model = GPT(GPTConfig(num_layers=1, d_model=32, num_heads=2), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 256)
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        if config.scan_layers:

            @nnx.split_rngs(splits=config.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs):
                return Block(config, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        if not config.tied_embedding:
            self.lm_head = _linear(
                config.d_model, config.vocab_size, rngs, kernel_init=nnx.initializers.zeros
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.config.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run_blocks(x, block):
                return block(x)

            x = run_blocks(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.config.tied_embedding else self.lm_head(x)
        return logits.astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    r"""Mean next-token loss in nats.

    .. math:: -\frac{1}{BT}\sum \log \operatorname{softmax}(z)_{y}
    """
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_loss_fn(graphdef: nnx.GraphDef, rest: nnx.State):
    """Build ``loss_fn(params, batch) -> scalar`` for the pure (lwjax) train step.

    ``graphdef`` and ``rest`` come from ``nnx.split(model, nnx.Param, ...)``;
    the loss rebuilds the model with ``nnx.merge`` (the inverse of ``split``) on
    every call, so the step sees only arrays. ``batch`` is a dict with
    ``inputs`` and ``targets``, both ``[B, T]`` int32.
    """

    def loss_fn(params: nnx.State, batch: dict) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        return cross_entropy(model(batch["inputs"]), batch["targets"])

    return loss_fn


def stack_blocks(unrolled: nnx.State, scanned: nnx.State) -> nnx.State:
    """Copy an unrolled model's parameters into a scanned model's layout.

    ``blocks/{i}/...`` leaves of ``unrolled`` are stacked along a new leading
    axis into ``blocks/...`` of (a copy of) ``scanned``; every other leaf is
    copied. The result shares no array with its inputs. The inverse of slicing
    ``blocks/...[i]``.
    """
    source = jax.tree.map(
        jnp.copy, nnx.to_pure_dict(unrolled)
    )  # fresh arrays: steps donate their inputs
    layers = source.pop("blocks")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in sorted(layers)))
    target = jax.tree.map(lambda x: x, scanned)
    nnx.replace_by_pure_dict(target, {**source, "blocks": stacked})
    return target
