"""Train a small GPT written in flax linen with lwjax's layer-wise Muon.

    python examples/linen_gpt.py --steps 200
    python examples/linen_gpt.py --scan --tied --size tiny

The same model as :mod:`lwjax.tools.demo.model` (RoPE attention with fused or
separate QKV, SwiGLU, RMSNorm), written with ``nn.compact``. Linen parameters
are a plain nested dict (``variables["params"]``), which lwjax takes as is;
routing reads the same ``/``-joined paths (``blocks_0/attn/qkv/kernel``, or
``blocks/attn/qkv/kernel`` with a leading layer axis under ``--scan``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from lwjax.tools.demo.example_args import example_parser
from lwjax.tools.demo.model import GPTConfig, cross_entropy, lwjax_routing, rope


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; the fused QKV groups columns as
    [q heads, k, v] per KV head."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        b, t, _ = x.shape
        group = c.num_heads // c.kv_heads
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)  # noqa: E731
        if c.fused_qkv:
            qkv = dense((c.num_heads + 2 * c.kv_heads) * c.head_dim, "qkv")(x)
            qkv = qkv.reshape(b, t, c.kv_heads, group + 2, c.head_dim)
            q, k, v = (
                qkv[..., :group, :].reshape(b, t, c.num_heads, c.head_dim),
                qkv[..., group, :],
                qkv[..., -1, :],
            )
        else:
            q = dense(c.num_heads * c.head_dim, "q")(x).reshape(b, t, c.num_heads, c.head_dim)
            k = dense(c.kv_heads * c.head_dim, "k")(x).reshape(b, t, c.kv_heads, c.head_dim)
            v = dense(c.kv_heads * c.head_dim, "v")(x).reshape(b, t, c.kv_heads, c.head_dim)
        q, k = rope(q).reshape(b, t, c.kv_heads, group, c.head_dim), rope(k)
        scores = jnp.einsum("btkgh,bskh->bkgts", q, k) / math.sqrt(c.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(scores, axis=-1), v)
        return dense(c.d_model, "out")(out.reshape(b, t, c.num_heads * c.head_dim))


class Block(nn.Module):
    """Pre-norm block with a SwiGLU MLP. Takes and returns ``(x, None)`` so
    ``nn.scan`` can run it."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x, _=None):
        c = self.config
        x = x + Attention(c, name="attn")(nn.RMSNorm(name="attn_norm")(x))
        h = nn.RMSNorm(name="mlp_norm")(x)
        gate = nn.Dense(c.hidden, use_bias=False, name="gate")(h)
        up = nn.Dense(c.hidden, use_bias=False, name="up")(h)
        return x + nn.Dense(c.d_model, use_bias=False, name="down")(nn.silu(gate) * up), None


class GPT(nn.Module):
    """``tokens [B, T] -> logits [B, T, V]``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, name="embed")
        x = embed(tokens)
        if c.scan_layers:  # one Block whose params carry a leading [L] axis
            blocks = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.num_layers
            )
            x, _ = blocks(c, name="blocks")(x, None)
        else:
            for i in range(c.num_layers):
                x, _ = Block(c, name=f"blocks_{i}")(x)
        x = nn.RMSNorm(name="final_norm")(x)
        if c.tied_embedding:
            return embed.attend(x).astype(jnp.float32)
        return nn.Dense(
            c.vocab_size, use_bias=False, kernel_init=nn.initializers.zeros, name="lm_head"
        )(x)


def parse_args(argv=None) -> argparse.Namespace:
    return example_parser(
        __doc__.split("\n")[0], scan_help="stack the blocks with nn.scan"
    ).parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    from lwjax.tools.demo.devices import local_mesh

    mesh = local_mesh(args.devices)  # first: asks for virtual CPU devices before JAX starts

    import lwjax
    from lwjax.tools.demo.data import load_stdlib_corpus, train_batches
    from lwjax.tools.demo.model import MODEL_SIZES

    config = dataclasses.replace(
        MODEL_SIZES[args.size],
        scan_layers=args.scan,
        fused_qkv=not args.separate_qkv,
        tied_embedding=args.tied,
    )
    model = GPT(config)
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))[
        "params"
    ]

    def loss_fn(params, batch):
        return cross_entropy(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    optimizer = lwjax.layerwise_muon(
        params,
        mesh,
        learning_rate=args.lr,
        muon=lwjax.MuonConfig(nesterov=True, extra_scale_factor=0.2),
        routing=lwjax_routing(config),
    )
    muon = [r.path for r in optimizer.plan.routes if r.is_muon]
    print(f"{len(muon)} Muon leaves over {mesh.size} devices, e.g. {muon[0]}")
    state = optimizer.init(params)
    train_step = lwjax.make_train_step(loss_fn, optimizer)

    batches = train_batches(
        load_stdlib_corpus().train, args.batch_size, args.seq_len, seed=args.seed
    )
    losses = []
    for step in range(args.steps):
        params, state, metrics = train_step(params, state, next(batches))
        losses.append(float(metrics["loss"]))
        if step % args.log_every == 0 or step == args.steps - 1:
            grad_norm = float(metrics["grad_norm"])
            print(f"step {step:5d}  loss {losses[-1]:.4f}  grad norm {grad_norm:.3f}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
