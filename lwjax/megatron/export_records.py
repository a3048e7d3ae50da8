"""The records Megatron keeps beside the tensors of a checkpoint lwjax writes: its ``args``,
the optimizer param groups, the scheduler's position and the common state object that
holds them (what :func:`lwjax.megatron.export.save_torch_dist` stores as
``common_state``).

Every value goes through :func:`plain` first, so the pickle Megatron loads names only
numbers, strings and containers of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from lwjax.megatron import names as names_lib
from lwjax.megatron.gpt import GPTConfig
from lwjax.megatron.state import MegatronState

_ADAM_GROUP_DEFAULTS = {
    "is_expert_parallel": False,
    "default_config": True,
    "lr_mult": 1.0,
    "is_decoupled_lr": False,
    "min_lr": None,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
_EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def plain(value):
    """Keep only values Megatron can unpickle (numbers, strings, containers of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        if any(item is None and v is not None for item, v in zip(items, value)):
            return None
        return type(value)(items)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return None


def megatron_args(state: MegatronState, config: GPTConfig | None) -> dict:
    args = {k: v for k, v in ((k, plain(v)) for k, v in state.args.items()) if v is not None}
    if config is not None:
        args.update(
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
            group_query_attention=config.num_query_groups != config.num_attention_heads,
            ffn_hidden_size=config.ffn_hidden_size,
            kv_channels=config.head_dim,
            padded_vocab_size=config.vocab_size,
            share_embeddings_and_output_weights=config.tied_embeddings,
            swiglu=True,
            normalization="RMSNorm",
            position_embedding_type="rope",
            add_bias_linear=False,
            norm_epsilon=config.norm_epsilon,
            rotary_base=config.rotary_base,
        )
    args.update(
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        optimizer="dist_muon" if state.momentum else "adam",
        bf16=any(w.dtype == ml_dtypes.bfloat16 for w in state.model.values()),
    )
    return args


def param_groups(state: MegatronState) -> tuple[list[dict], list[dict]]:
    adam = state.hyperparameters.get("adam", {})
    muon = state.hyperparameters.get("muon", {})
    lr = float(adam.get("lr", muon.get("lr", 0.0)))
    adam_groups = []
    for wd_mult in (1.0, 0.0):
        group = {
            **_ADAM_GROUP_DEFAULTS,
            "wd_mult": wd_mult,
            "max_lr": float(adam.get("max_lr", lr)),
            "lr": lr,
            "betas": tuple(adam.get("betas", (0.9, 0.999))),
            "eps": float(adam.get("eps", 1e-8)),
            "weight_decay": float(adam.get("weight_decay", 0.0)),
        }
        if state.adam_step is not None:
            group["step"] = float(state.adam_step)
        adam_groups.append(group)
    muon_groups = []
    if state.momentum:
        muon_lr = float(muon.get("lr", lr))
        muon_groups.append(
            {
                **{
                    k: _ADAM_GROUP_DEFAULTS[k]
                    for k in (
                        "is_expert_parallel",
                        "default_config",
                        "lr_mult",
                        "is_decoupled_lr",
                        "min_lr",
                    )
                },
                "wd_mult": 1.0,
                "max_lr": float(muon.get("max_lr", muon_lr)),
                "lr": muon_lr,
                "momentum": float(muon.get("momentum", 0.95)),
                "weight_decay": float(muon.get("weight_decay", 0.0)),
            }
        )
    return muon_groups, adam_groups


def advanced_scheduler(
    scheduler: Mapping, iteration: int | None, args: Mapping | None, step
) -> dict:
    """A Megatron import's ``opt_param_scheduler`` moved on by the steps lwjax took since:
    ``num_steps += (step - iteration) * global_batch_size``.
    """
    scheduler = dict(scheduler or {})
    if not scheduler or step is None:
        return scheduler
    taken = int(step) - int(step if iteration is None else iteration)
    if taken:
        batch = (args or {}).get("global_batch_size")
        if not batch:
            raise ValueError(
                "the run moved on from its Megatron import, but its args lack "
                "global_batch_size: the scheduler's position in samples cannot be advanced."
            )
        key = "num_steps" if "num_steps" in scheduler else "num_iters"
        scheduler[key] = int(scheduler.get(key, 0)) + taken * int(batch)
    return scheduler


def common_state(state: MegatronState, config: GPTConfig | None) -> dict:
    """The ``common_state`` object of a ``torch_dist`` checkpoint: args, iteration, the
    chained (Muon, Adam) or plain Adam optimizer's param groups, the scheduler, and
    the content metadata of Megatron's ``fully_reshardable`` optimizer keys.
    """
    muon_groups, adam_groups = param_groups(state)
    adam_part = {
        "optimizer": {"param_groups": adam_groups},
        "param_state_sharding_type": "fully_reshardable",
    }
    content = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    return {
        "args": argparse.Namespace(**megatron_args(state, config)),
        "checkpoint_version": 3.0,
        "iteration": int(state.iteration),
        "content_metadata": content,
        "num_floating_point_operations_so_far": 0,
        **({"opt_param_scheduler": plain(state.scheduler)} if state.scheduler else {}),
        "optimizer": {0: {"optimizer": {"param_groups": muon_groups}}, 1: adam_part}
        if muon_groups
        else adam_part,
    }


def extra_state_objects(state: MegatronState) -> dict[str, None]:
    """The empty ``_extra_state`` entries Megatron's layers expect, one per layer and module."""
    objects = {}
    num_layers = next((w.shape[0] for k, w in state.model.items() if names_lib.is_layer_key(k)), 0)
    for module in _EXTRA_STATE_MODULES:
        if f"{names_lib.LAYER_PREFIX}{module}.weight" in state.model:
            for layer in range(num_layers):
                objects[
                    f"{names_lib.LAYER_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}"
                ] = None
    return objects
