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

_GROUP_FLAGS = {
    "is_expert_parallel": False,
    "default_config": True,
    "lr_mult": 1.0,
    "is_decoupled_lr": False,
}
_TORCH_ADAM_DEFAULTS = {
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
        if config.num_experts:
            args.update(
                num_experts=config.num_experts, moe_ffn_hidden_size=config.expert_ffn_hidden_size
            )
    args.update(
        ckpt_format="torch_dist",
        tensor_model_parallel_size=1,
        # the global tensors load at any pipeline size; the imported run's stays, which
        # Megatron-LM's --use-checkpoint-args resumes at
        pipeline_model_parallel_size=int(args.get("pipeline_model_parallel_size") or 1),
        optimizer="dist_muon" if state.momentum else "adam",
        no_save_rng=True,  # no torch RNG state is written: Megatron-LM then loads none
        bf16=any(w.dtype == ml_dtypes.bfloat16 for w in state.model.values()),
    )
    return args


def param_groups(state: MegatronState) -> tuple[list[dict], list[dict]]:
    """The Muon and Adam param groups, with every value Megatron-Core matches a group by
    when it loads (``param_group_identifier_keys``: ``max_lr``, ``min_lr``, ``start_wd``,
    ``end_wd``, ``wd_mult``, ``lr_mult``, ``optimizer``, ``is_expert_parallel``,
    ``is_decoupled_lr``) as its own optimizer has them: the values read from the imported
    groups, ``optimizer: "adam"`` on the Adam groups beside Muon (a plain Adam optimizer's
    groups have no such key). A mixture of experts on Muon has a second Muon group, its
    experts' (``is_expert_parallel``), as Megatron groups expert-parallel parameters apart.

    Raises:
      ValueError: expert weights on Adam, whose groups (a distributed optimizer of their own
        per expert-parallel rank) lwjax does not write.
    """
    experts = [k for k in state.model if names_lib.is_expert_key(k)]
    on_adam = [k for k in experts if k not in state.momentum]
    if on_adam:
        raise ValueError(
            f"the expert weights {on_adam} are on Adam: Megatron keeps their state in an "
            "optimizer of its own per expert-parallel rank, which lwjax does not export; "
            "continue the experts on Muon (MegatronImport with muon=True)."
        )
    adam = state.hyperparameters.get("adam", {})
    muon = state.hyperparameters.get("muon", {})
    lr = float(adam.get("lr", muon.get("lr", 0.0)))

    def shared(entry, group_lr, wd_mult):
        return {
            **_GROUP_FLAGS,
            "wd_mult": wd_mult,
            "max_lr": float(entry.get("max_lr", group_lr)),
            "min_lr": _optional_float(entry.get("min_lr")),
            **{k: float(entry[k]) for k in ("start_wd", "end_wd") if entry.get(k) is not None},
            "lr": group_lr,
            "weight_decay": float(entry.get("weight_decay", 0.0)),
        }

    adam_groups = []
    for wd_mult in (1.0, 0.0):
        group = {
            **shared(adam, lr, wd_mult),
            **({"optimizer": "adam"} if state.momentum else {}),
            **_TORCH_ADAM_DEFAULTS,
            "betas": tuple(adam.get("betas", (0.9, 0.999))),
            "eps": float(adam.get("eps", 1e-8)),
        }
        if wd_mult == 0.0:
            group["weight_decay"] = 0.0
        if state.adam_step is not None:
            group["step"] = float(state.adam_step)
        adam_groups.append(group)
    muon_groups = []
    if state.momentum:
        muon_lr = float(muon.get("lr", lr))
        group = {**shared(muon, muon_lr, 1.0), "momentum": float(muon.get("momentum", 0.95))}
        muon_groups.append(group)
        if experts:
            muon_groups.append({**group, "is_expert_parallel": True})
    return muon_groups, adam_groups


def _optional_float(value):
    return None if value is None else float(value)


def advanced_records(
    args: Mapping | None, scheduler: Mapping | None, iteration: int | None, step
) -> tuple[dict, dict]:
    """A Megatron import's ``args`` and ``opt_param_scheduler`` moved on by the steps lwjax
    took since (``step - iteration``), each step a global batch of samples:

    * ``scheduler["num_steps"] += taken * global_batch_size`` (Megatron-LM steps its
      scheduler by the samples of an iteration);
    * ``args["consumed_train_samples"] += taken * global_batch_size``, the count Megatron-LM
      resumes its data from. An import without it starts from the scheduler's sample count
      before the steps (Megatron-LM keeps the two equal), else from nothing.

    Raises:
      ValueError: steps were taken and the args lack ``global_batch_size``.
    """
    args, scheduler = dict(args or {}), dict(scheduler or {})
    if step is None:
        return args, scheduler
    taken = int(step) - int(step if iteration is None else iteration)
    batch = args.get("global_batch_size")
    if taken and not batch:
        raise ValueError(
            "the run moved on from its Megatron import, but its args lack "
            "global_batch_size: the samples it consumed cannot be counted."
        )
    samples = taken * int(batch or 0)
    key = "num_steps" if "num_steps" in scheduler else "num_iters"
    consumed = args.get("consumed_train_samples")
    if consumed is None and key in scheduler:
        consumed = scheduler[key]
    if consumed is not None:
        args["consumed_train_samples"] = int(consumed) + samples
    if scheduler:
        scheduler[key] = int(scheduler.get(key, 0)) + samples
    return args, scheduler


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
    """The empty ``_extra_state`` entries Megatron's layers expect, one per layer and module
    (and per expert, ``shard_<layer>.<expert>_<L>.<E>``, for a mixture of experts)."""
    objects = {}
    num_layers = next((w.shape[0] for k, w in state.model.items() if names_lib.is_layer_key(k)), 0)
    for module in _EXTRA_STATE_MODULES:
        if f"{names_lib.LAYER_PREFIX}{module}.weight" in state.model:
            for layer in range(num_layers):
                objects[
                    f"{names_lib.LAYER_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}"
                ] = None
    for key, weight in state.model.items():
        if names_lib.is_expert_key(key):
            module, experts = key.removesuffix(".weight"), weight.shape[1]
            for layer in range(num_layers):
                for expert in range(experts):
                    shard = f"shard_{layer}.{expert}_{num_layers}.{experts}"
                    objects[f"{module}._extra_state/{shard}"] = None
    return objects
