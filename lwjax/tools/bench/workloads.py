"""The benchmarks' workloads: Megatron-Core GPTs, and lwjax's optimizer for them.

A workload's parameters are stored as Megatron stores them (``[out, in]``, fused
``linear_qkv`` split into its Q, K and V for Muon, fused SwiGLU ``linear_fc1``, untied
embedding and output layer) with the layers stacked ``[L, ...]``
(:class:`~lwjax.megatron.gpt.GPTConfig`).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from lwjax.config import OptimizerConfig
from lwjax.layout import LayoutConfig
from lwjax.megatron.gpt import MATRIX_CONVENTION, GPTConfig, keys_from_tree, tree_from_keys
from lwjax.muon import MuonConfig
from lwjax.optimizer import LayerwiseOptimizer, layerwise_muon

# Megatron-Core GPTs (lwjax.megatron.gpt): 8b, 70b and 405b are the layers of Llama-3-8B,
# Llama-3-70B and Llama-3.1-405B, 4 of them; 1b has 16 heads of 128. (layers, hidden, heads,
# query groups, SwiGLU width, vocabulary) each.
WORKLOADS = {
    name: GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
    )
    for name, (layers, hidden, heads, groups, ffn, vocab) in {
        "8b": (4, 4096, 32, 8, 14336, 128256),
        "70b": (4, 8192, 64, 8, 28672, 128256),
        "405b": (4, 16384, 128, 8, 53248, 128256),
        "1b": (16, 2048, 16, 8, 8192, 128256),
        "small": (4, 256, 8, 4, 704, 4096),
    }.items()
}


def workload_config(name: str, layers: int | None = None) -> GPTConfig:
    """The GPT of a :data:`WORKLOADS` entry, with ``layers`` layers instead of its own if given."""
    config = WORKLOADS[name]
    return dataclasses.replace(config, num_layers=layers) if layers else config


def workload_shapes(config: GPTConfig) -> dict:
    """The GPT's parameter tree with shape tuples as leaves (Megatron's keys, layers stacked)."""
    return tree_from_keys(config.param_shapes())


def check_tensor_split(config: GPTConfig, tp: int) -> None:
    """Raise if a split axis of the GPT does not divide by ``tp`` (or splits a query group)."""
    if config.num_query_groups % tp:
        raise ValueError(
            f"BenchConfig.tp: tp={tp} does not divide the {config.num_query_groups} query groups."
        )
    specs = keys_from_tree(config.tensor_specs())
    for key, shape in config.param_shapes().items():
        for dim, entry in enumerate(specs[key]):
            if entry is not None and shape[dim] % tp:
                raise ValueError(
                    f"BenchConfig.tp: tp={tp} does not divide axis {dim} of {key} {shape}."
                )


def workload_optimizer(
    params,
    mesh: Mesh,
    config: GPTConfig,
    *,
    ns_precision: str,
    grad_reduce_in_fp32: bool,
    policy: str,
    bucket_size,
    muon: bool = True,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float | None = 1.0,
    pipeline_muon: bool = False,
    param_axes: str | None = None,
    tp_mode: str = "duplicated",
    stacked: bool = True,
    replica_axis=None,
) -> LayerwiseOptimizer:
    """lwjax's optimizer for a workload: layers stacked (``stacked=False``: a list of
    per-layer trees), Megatron's ``[out, in]``, QKV split.

    With ``muon=False`` every leaf goes to the elementwise Adam (ZeRO-1 AdamW:
    the same reduce-scatter, clip and all-gather, no Newton–Schulz). With
    ``param_axes``, leaves whose shardings name it are split over it
    (:meth:`~lwjax.megatron.gpt.GPTConfig.tensor_specs`) and orthogonalised as ``tp_mode`` says.
    ``replica_axis``: ``layerwise_muon``'s (sharding groups).
    """
    return layerwise_muon(
        params,
        mesh,
        param_axes=param_axes,
        replica_axis=replica_axis,
        learning_rate=learning_rate,
        muon=MuonConfig(fp32_matmul_prec=ns_precision, tp_mode=tp_mode),
        config=OptimizerConfig(
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            grad_reduce_in_fp32=grad_reduce_in_fp32,
            matrix_convention=MATRIX_CONVENTION,
            pipeline_muon=pipeline_muon,
        ),
        layout=LayoutConfig(policy=policy, bucket_size=bucket_size),
        routing=config.routing_rules(muon=muon, stacked=stacked),
    )
