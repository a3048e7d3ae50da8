"""Megatron-Core's GPT as a JAX parameter tree and forward pass (RoPE, RMSNorm, GQA, SwiGLU).

The parameter tree mirrors Megatron's ``torch_dist`` keys: a nested dict whose
path, joined with ``.``, is the key, with the layers stacked on a leading axis
and weights stored ``[out, in]`` as torch does::

    embedding/word_embeddings/weight                      [V, H]
    decoder/layers/self_attention/linear_qkv/layer_norm_weight  [L, H]
    decoder/layers/self_attention/linear_qkv/weight       [L, (nq + 2 ng) d, H]
    decoder/layers/self_attention/linear_proj/weight      [L, H, nq d]
    decoder/layers/mlp/linear_fc1/layer_norm_weight       [L, H]
    decoder/layers/mlp/linear_fc1/weight                  [L, 2 F, H]   ([gate; up])
    decoder/layers/mlp/linear_fc2/weight                  [L, H, F]
    decoder/final_layernorm/weight                        [H]
    output_layer/weight                                   [V, H]        (absent when tied)

``linear_qkv`` rows are grouped per query group ``g``: ``nq/ng`` query heads,
then one key head, then one value head, ``d`` rows each
(:func:`split_qkv`). Use it with :func:`lwjax.optimizer.layerwise_muon` through
:meth:`GPTConfig.optimizer_options` (stacked layers, the QKV split, ``out_in``
matrices).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a Megatron GPT (no biases, RMSNorm, RoPE, SwiGLU).

    Attributes:
      num_layers: Transformer layers ``L``.
      hidden_size: Model width ``H``.
      num_attention_heads: Query heads ``nq``.
      num_query_groups: Key/value heads ``ng`` (GQA); ``nq`` for plain attention.
      ffn_hidden_size: MLP width ``F`` (each SwiGLU half).
      vocab_size: Rows of the embedding (Megatron's padded vocabulary).
      kv_channels: Head dimension ``d``; ``None`` means ``H / nq``.
      tied_embeddings: The output layer reuses the embedding.
      norm_epsilon: RMSNorm epsilon.
      rotary_base: RoPE base.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    kv_channels: int | None = None
    tied_embeddings: bool = False
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer; got {name}={value!r}.")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"GPTConfig.num_query_groups must divide num_attention_heads; got "
                f"{self.num_query_groups=}, {self.num_attention_heads=}."
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"GPTConfig: hidden_size={self.hidden_size} does not divide into "
                             f"{self.num_attention_heads} heads; give kv_channels.")

    @property
    def head_dim(self) -> int:
        """Channels per head ``d``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_split_shapes(self) -> tuple[int, int, int]:
        """Rows of q, k and v in one query group of ``linear_qkv``."""
        d = self.head_dim
        return (self.num_attention_heads // self.num_query_groups * d, d, d)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Megatron key -> global shape of every parameter, in definition order."""
        L, H, F, V, d = self.num_layers, self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.head_dim
        shapes = {
            "embedding.word_embeddings.weight": (V, H),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
            "decoder.layers.self_attention.linear_proj.weight": (L, H, self.num_attention_heads * d),
            "decoder.layers.self_attention.linear_qkv.weight":
                (L, (self.num_attention_heads + 2 * self.num_query_groups) * d, H),
            "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
            "decoder.layers.mlp.linear_fc1.weight": (L, 2 * F, H),
            "decoder.layers.mlp.linear_fc2.weight": (L, H, F),
            "decoder.final_layernorm.weight": (H,),
        }
        if not self.tied_embeddings:
            shapes["output_layer.weight"] = (V, H)
        return shapes

    @classmethod
    def from_megatron(cls, shapes: Mapping[str, tuple[int, ...]], args: Mapping[str, Any]) -> GPTConfig:
        """Read the configuration from a checkpoint's model shapes and its ``args``.

        Raises:
          ValueError: a parameter the GPT does not have, or shapes that disagree
            with ``args``.
        """
        try:
            L, qkv_rows, H = shapes["decoder.layers.self_attention.linear_qkv.weight"]
            V = shapes["embedding.word_embeddings.weight"][0]
            F = shapes["decoder.layers.mlp.linear_fc2.weight"][2]
        except (KeyError, ValueError) as err:
            raise ValueError(f"not a Megatron GPT checkpoint: model parameter {err} is missing or misshapen.") from None
        heads = args.get("num_attention_heads")
        if heads is None:
            raise ValueError("checkpoint args lack num_attention_heads; the QKV layout cannot be read from shapes.")
        groups = heads if args.get("group_query_attention") is False else (args.get("num_query_groups") or heads)
        config = cls(
            num_layers=int(L), hidden_size=int(H), num_attention_heads=int(heads), num_query_groups=int(groups),
            ffn_hidden_size=int(F), vocab_size=int(V), kv_channels=args.get("kv_channels"),
            tied_embeddings="output_layer.weight" not in shapes,
            norm_epsilon=float(args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5)) or 1e-5),
            rotary_base=float(args.get("rotary_base", 10000) or 10000),
        )
        expected = config.param_shapes()
        wrong = {k: (tuple(shapes.get(k, ())), v) for k, v in expected.items() if tuple(shapes.get(k, ())) != v}
        extra = sorted(set(shapes) - set(expected))
        if wrong or extra:
            detail = "; ".join(f"{k}: got {got}, expected {want}" for k, (got, want) in wrong.items())
            raise ValueError(f"checkpoint is not the GPT its args describe ({config}): {detail}"
                             + (f"; unexpected parameters {extra}" if extra else "") + ".")
        return config

    def optimizer_options(self, *, muon: bool = True) -> dict[str, Any]:
        """Routing keyword arguments for :func:`lwjax.optimizer.layerwise_muon` on this tree.

        Args:
          muon: Route the decoder matrices to Muon (Megatron's ``dist_muon``);
            ``False`` routes every parameter to the elementwise optimizer
            (Adam).
        """
        options: dict[str, Any] = {"stacked": {"decoder/layers/*": 1}}
        if muon:
            options["qkv_split"] = {"*linear_qkv/weight": self.qkv_split_shapes}
        else:
            options["is_muon"] = lambda name, shape: False
        if self.tied_embeddings:
            options["tied"] = {"embedding/word_embeddings/weight": True}
        return options


def tree_from_keys(flat: Mapping[str, Any]) -> dict:
    """Nest ``{"a.b.c": x}`` into ``{"a": {"b": {"c": x}}}`` (the GPT parameter tree)."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def keys_from_tree(tree: Mapping) -> dict[str, Any]:
    """Inverse of :func:`tree_from_keys`: flatten nested dicts into ``.``-joined keys (``None`` leaves kept)."""
    flat: dict[str, Any] = {}

    def walk(node, prefix):
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, Mapping):
                walk(value, key + ".")
            else:
                flat[key] = value

    walk(tree, "")
    return flat


def split_qkv(weight, config: GPTConfig):
    """Split ``linear_qkv`` rows ``[..., (nq + 2 ng) d, H]`` into ``q [..., nq d, H]``, ``k``, ``v [..., ng d, H]``."""
    q_rows, k_rows, v_rows = config.qkv_split_shapes
    *batch, rows, cols = weight.shape
    grouped = weight.reshape(*batch, config.num_query_groups, q_rows + k_rows + v_rows, cols)
    q = grouped[..., :q_rows, :].reshape(*batch, config.num_query_groups * q_rows, cols)
    k = grouped[..., q_rows:q_rows + k_rows, :].reshape(*batch, config.num_query_groups * k_rows, cols)
    v = grouped[..., q_rows + k_rows:, :].reshape(*batch, config.num_query_groups * v_rows, cols)
    return q, k, v


def _rms_norm(x, weight, eps):
    import jax.numpy as jnp

    return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def _rope(x, base):
    """Megatron's non-interleaved rotary embedding on ``x [b, s, heads, d]``."""
    import jax.numpy as jnp

    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float32) / d))
    freqs = np.outer(np.arange(x.shape[1], dtype=np.float32), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def gpt_logits(params: Mapping, tokens, config: GPTConfig):
    """Logits ``[batch, seq, vocab]`` (float32) of the GPT for integer ``tokens [batch, seq]``.

    Weights may be any float dtype; the computation runs in float32.
    """
    import jax
    import jax.numpy as jnp

    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    embedding = f32(params["embedding"]["word_embeddings"]["weight"])
    layers = jax.tree.map(f32, params["decoder"]["layers"])
    x = embedding[tokens]
    b, s = tokens.shape
    nq, ng, d = config.num_attention_heads, config.num_query_groups, config.head_dim
    q_rows, k_rows, _ = config.qkv_split_shapes
    causal = np.tril(np.ones((s, s), dtype=bool))

    def layer(x, p):
        attn, mlp = p["self_attention"], p["mlp"]
        h = _rms_norm(x, attn["linear_qkv"]["layer_norm_weight"], config.norm_epsilon)
        qkv = (h @ attn["linear_qkv"]["weight"].T).reshape(b, s, ng, q_rows + 2 * k_rows)
        q = _rope(qkv[..., :q_rows].reshape(b, s, nq, d), config.rotary_base)
        k = _rope(qkv[..., q_rows:q_rows + k_rows], config.rotary_base)
        v = qkv[..., q_rows + k_rows:]
        k, v = jnp.repeat(k, nq // ng, axis=2), jnp.repeat(v, nq // ng, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        context = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nq * d)
        x = x + context @ attn["linear_proj"]["weight"].T
        h = _rms_norm(x, mlp["linear_fc1"]["layer_norm_weight"], config.norm_epsilon)
        gate, up = jnp.split(h @ mlp["linear_fc1"]["weight"].T, 2, axis=-1)
        return x + (jax.nn.silu(gate) * up) @ mlp["linear_fc2"]["weight"].T, None

    x, _ = jax.lax.scan(layer, x, layers)
    x = _rms_norm(x, f32(params["decoder"]["final_layernorm"]["weight"]), config.norm_epsilon)
    output = embedding if config.tied_embeddings else f32(params["output_layer"]["weight"])
    return x @ output.T


def gpt_loss(params: Mapping, batch, config: GPTConfig):
    """Mean token cross-entropy of ``batch = (tokens, labels)``, both ``[batch, seq]`` integers."""
    import jax
    import jax.numpy as jnp

    tokens, labels = batch
    logits = gpt_logits(params, tokens, config)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)
