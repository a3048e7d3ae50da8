"""Megatron checkpoints <-> lwjax training state, and the ``lwjax convert`` job.

In: :func:`megatron_to_logical` turns a :class:`~lwjax.megatron.state.MegatronState`
into the GPT parameter tree of :mod:`lwjax.megatron.gpt` plus a
:class:`~lwjax.logical.LogicalState` (fp32 masters, Muon momenta, Adam moments
as ``optax.ScaleByAdamState``, step counts) and the optimizer options that
reproduce Megatron's run; :meth:`MegatronImport.optimizer` and
:meth:`MegatronImport.state` put it on any mesh.

Out: :func:`logical_to_megatron` is the inverse; :func:`save_torch_dist` writes
a ``torch_dist`` checkpoint with per-parameter optimizer keys (Megatron's
``fully_reshardable`` naming, torch needed) and :func:`save_safetensors` the
global weights (plus ``optimizer.state.fp32_param.<key>`` masters,
``optimizer.state.momentum_buffer.<key>`` Muon momenta and
``optimizer.state.exp_avg[_sq].<key>`` Adam moments).

:func:`convert` runs one conversion from a :class:`ConvertConfig` (the CLI's
``lwjax convert``): Megatron -> lwjax checkpoint or safetensors, lwjax
checkpoint -> ``torch_dist`` or safetensors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import ml_dtypes
import numpy as np

from lwjax.megatron import names as names_lib
from lwjax.megatron.gpt import MATRIX_CONVENTION, GPTConfig, keys_from_tree, tree_from_keys
from lwjax.megatron.state import READERS, MegatronState, read_megatron

if TYPE_CHECKING:  # both import jax; reading a checkpoint does not
    from lwjax.megatron.options import MegatronOptions
    from lwjax.megatron.schedules import MegatronSchedule

TARGETS = ("lwjax", "safetensors", "torch_dist")
Target = Literal["lwjax", "safetensors", "torch_dist"]
FP32_PREFIX = "optimizer.state.fp32_param."
MOMENTUM_PREFIX = "optimizer.state.momentum_buffer."
EXP_AVG_PREFIX = "optimizer.state.exp_avg."
EXP_AVG_SQ_PREFIX = "optimizer.state.exp_avg_sq."
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


@dataclasses.dataclass(frozen=True)
class MegatronImport:
    """A Megatron GPT checkpoint as lwjax arrays (numpy), ready for any mesh.

    Attributes:
      config: The model's :class:`~lwjax.megatron.gpt.GPTConfig`.
      params: The GPT parameter tree (stored dtype, e.g. bf16).
      logical: The :class:`~lwjax.logical.LogicalState` of
        :func:`lwjax.optimizer.layerwise_muon` with Adam as its elementwise transform.
      muon: Whether Megatron ran Muon on the decoder matrices (``dist_muon``).
      hyperparameters: Megatron's ``{"muon": {...}, "adam": {...}}`` param-group values.
      iteration: Iterations done.
      source: Where the checkpoint came from (format, sharding, reader, ...).
      args: Megatron's ``args``.
      scheduler: Megatron-LM's stored ``opt_param_scheduler`` state (may be empty).
    """

    config: GPTConfig
    params: dict
    logical: Any
    muon: bool
    hyperparameters: dict
    iteration: int
    source: dict
    args: dict
    scheduler: dict = dataclasses.field(default_factory=dict)

    @property
    def options(self) -> MegatronOptions:
        """The run's optimizer options and where each was read
        (:func:`~lwjax.megatron.options.read_options`).
        """
        from lwjax.megatron.options import read_options

        return read_options(self.args, self.hyperparameters)

    def schedule(self) -> MegatronSchedule | None:
        """The run's learning-rate and weight-decay schedule, resumed where the checkpoint
        stopped; ``None`` when the checkpoint stores none (no ``train_iters`` or
        ``train_samples`` in its args and no ``opt_param_scheduler``).

        Raises:
          ValueError: a schedule argument lwjax cannot follow (named).
        """
        if not self.scheduler and not (
            self.args.get("train_iters") or self.args.get("train_samples")
        ):
            return None
        from lwjax.megatron.schedules import schedule_from_megatron

        return schedule_from_megatron(self.args, self.scheduler or None, self.iteration)

    def optimizer_kwargs(self, **overrides) -> dict[str, Any]:
        """Keyword arguments of :func:`~lwjax.optimizer.layerwise_muon` that continue
        Megatron's run: its Muon and Adam options (:attr:`options`) and its schedule
        (:meth:`schedule`), or, when the checkpoint stores no schedule, the param
        groups' current learning rate and weight decay held constant (with a warning).

        ``overrides`` replace entries (e.g. ``learning_rate=``, ``muon=``).
        """
        import optax

        from lwjax.muon import MuonConfig
        from lwjax.optimizer import OptimizerConfig

        options = self.options
        schedule = self.schedule()
        if schedule is None:
            group = self.hyperparameters.get("muon") or self.hyperparameters.get("adam", {})
            learning_rate = float(group.get("lr", self.args.get("lr", 1e-3)))
            weight_decay = float(group.get("weight_decay", self.args.get("weight_decay", 0.01)))
            if "learning_rate" not in overrides:
                warnings.warn(
                    f"{self.source.get('directory', 'the checkpoint')}: no learning-rate "
                    "schedule stored (no train_iters/train_samples in args, no "
                    f"opt_param_scheduler); continuing with the param groups' lr={learning_rate} "
                    f"and weight_decay={weight_decay} held constant. Pass learning_rate= "
                    "(and weight decay through config=) to follow a schedule.",
                    stacklevel=2,
                )
        else:
            learning_rate, weight_decay = schedule.learning_rate, schedule.weight_decay
        tp = int(self.source.get("tp") or 1)
        blockwise = options["muon_tp_mode"] == "blockwise" and "muon" not in overrides
        if self.muon and tp > 1 and blockwise:
            warnings.warn(
                f"muon_tp_mode='blockwise' at tensor_model_parallel_size={tp}: Megatron "
                "orthogonalised each tensor-parallel block of a matrix separately. The "
                "converted parameters are whole matrices: without tensor parallelism (or at "
                "another size) each is one block, and lwjax's contiguous linear_fc1 blocks "
                "are not Megatron's interleaved [gate_r; up_r] ones, so the continued run "
                "follows a different update rule. Pass muon=MuonConfig(tp_mode='duplicated') "
                "for the whole matrix's update (Megatron-LM main's default).",
                stacklevel=2,
            )
        clip = options["clip_grad"]
        kwargs = {
            "learning_rate": learning_rate,
            "adam_learning_rate": learning_rate,
            "muon": MuonConfig(
                momentum=options["muon_momentum"],
                nesterov=options["muon_nesterov"],
                coefficient_type=options["muon_coefficient_type"],
                num_ns_steps=options["muon_num_ns_steps"],
                scale_mode=options["muon_scale_mode"],
                extra_scale_factor=options["muon_extra_scale_factor"],
                fp32_matmul_prec=options["muon_fp32_matmul_prec"],
                split_qkv=options["muon_split_qkv"],
                tp_mode=options["muon_tp_mode"],
            ),
            "elementwise": optax.scale_by_adam(
                b1=options["adam_beta1"], b2=options["adam_beta2"], eps=options["adam_eps"]
            ),
            "config": OptimizerConfig(
                weight_decay=weight_decay,
                clip_grad=clip if clip else None,
                matrix_convention=MATRIX_CONVENTION,
            ),
            "routing": self.config.routing_rules(muon=self.muon),
        }
        kwargs.update(overrides)
        return kwargs

    def loss_fn(self, **options) -> Callable:
        """``loss(params, (tokens, labels))``: the GPT's mean token cross-entropy
        (:func:`~lwjax.megatron.model.gpt_loss`) with Megatron's numerics in the stored
        weights' dtype (bf16 for a ``--bf16`` run, as its ``Float16Module`` computes).

        ``options`` override :func:`~lwjax.megatron.model.gpt_loss`'s keywords, e.g.
        ``numerics="lwjax"`` for the faster forward with fp32 norms and softmax.
        """
        from lwjax.megatron.model import gpt_loss

        dtypes = {np.asarray(w).dtype.name for w in keys_from_tree(self.params).values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
        return functools.partial(
            gpt_loss, config=self.config, **{"dtype": dtype, "numerics": "megatron", **options}
        )

    def to_megatron(self, params, logical) -> MegatronState:
        """The continued run as a :class:`~lwjax.megatron.state.MegatronState` to save with
        :func:`save_torch_dist` or :func:`save_safetensors`: Megatron's args, param groups
        at the schedule's current values, and its scheduler moved on by the steps taken
        since the import.

        Args:
          params: The GPT parameter tree.
          logical: Its :class:`~lwjax.logical.LogicalState`
            (:func:`lwjax.logical.to_logical`).
        """
        count = int(np.asarray(logical.count))
        hyperparameters = {kind: dict(v) for kind, v in self.hyperparameters.items()}
        schedule = self.schedule()
        if schedule is not None:
            samples = schedule.num_steps_of(count)  # Megatron's values, in float64
            for entry in hyperparameters.values():
                entry["lr"] = float(schedule.learning_rate_at(samples))
                entry["weight_decay"] = float(schedule.weight_decay_at(samples))
        return logical_to_megatron(
            params,
            logical,
            hyperparameters=hyperparameters,
            args=self.args,
            scheduler=_advanced_scheduler(self.scheduler, self.iteration, self.args, count),
        )

    def report(self) -> str:
        """What was read and from where: the source, the model, every optimizer option
        and the schedule.
        """
        schedule = self.schedule()
        lines = [
            f"source: {self.source.get('format')} {self.source.get('directory', '')}".rstrip(),
            f"iteration: {self.iteration}",
            f"model: {self.config}",
            f"optimizer: {'Muon (decoder matrices) + Adam' if self.muon else 'Adam'}",
            self.options.report(),
        ]
        if schedule is None:
            lines.append("schedule: none stored (the param groups' lr and weight decay, constant)")
        else:
            described = schedule.describe()
            width = max(map(len, described))
            lines.append("schedule:")
            lines += [
                f"  {name:<{width}} = {entry['value']!r}  ({entry['from']})"
                for name, entry in described.items()
            ]
        return "\n".join(lines)

    def optimizer(self, mesh, *, tensor_axis: str | None = None, **overrides):
        """A :func:`~lwjax.optimizer.layerwise_muon` for these parameters on ``mesh``.

        With ``tensor_axis`` (a mesh axis), the parameters are split over it as
        Megatron-Core splits them (:meth:`GPTConfig.tensor_specs`), at any
        tensor-parallel size that divides them, and Muon orthogonalises a split
        matrix as the run's ``muon_tp_mode`` says (``muon=`` overrides it).
        ``overrides`` are :meth:`optimizer_kwargs`'s.
        """
        import jax

        from lwjax.optimizer import layerwise_muon, named_shardings

        params = self.params
        if tensor_axis is not None:
            if tensor_axis not in mesh.axis_names:
                raise ValueError(
                    f"MegatronImport.optimizer: tensor_axis={tensor_axis!r} is not an axis of "
                    f"the mesh {dict(mesh.shape)}."
                )
            params = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                self.params,
                named_shardings(mesh, self.config.tensor_specs(tensor_axis)),
            )
        kwargs = self.optimizer_kwargs(**overrides)
        return layerwise_muon(params, mesh, tensor_axis=tensor_axis, **kwargs)

    def state(self, optimizer):
        """``(params, state)`` on ``optimizer``'s mesh: the parameters placed as the optimizer
        holds them (whole, or split over its tensor-parallel axis) and the packed optimizer
        state.
        """
        import jax

        from lwjax.logical import from_logical

        shardings = optimizer.leaf_shardings()
        flat, treedef = jax.tree_util.tree_flatten(self.params)
        if treedef != optimizer.plan.treedef:
            raise ValueError(
                "MegatronImport.state: the optimizer was built for another parameter tree; "
                "build it with MegatronImport.optimizer."
            )
        placed = [jax.device_put(x, shardings[r.path]) for x, r in zip(flat, optimizer.plan.routes)]
        return jax.tree_util.tree_unflatten(treedef, placed), from_logical(optimizer, self.logical)


def _gpt_config(
    state: MegatronState, config: GPTConfig | None, overrides: Mapping[str, Any]
) -> GPTConfig:
    if config is not None:
        return config
    args = {**state.args, **{k: v for k, v in overrides.items() if v is not None}}
    return GPTConfig.from_megatron({k: v.shape for k, v in state.model.items()}, args)


def megatron_to_logical(
    state: MegatronState,
    config: GPTConfig | None = None,
    *,
    muon: bool | None = None,
    **config_overrides,
) -> MegatronImport:
    """Turn a Megatron checkpoint into lwjax's GPT parameters and logical optimizer state.

    Args:
      state: From :func:`~lwjax.megatron.state.read_megatron`.
      config: The GPT's shape; read from the checkpoint's args when ``None``.
      muon: Continue with Muon on the decoder matrices (``True``) or Adam on
        everything (``False``); ``None`` continues as Megatron ran. Switching an
        Adam run to Muon starts those matrices' momenta at zero and drops their
        Adam moments; switching Muon to Adam starts their moments at zero.
      **config_overrides: ``args`` entries to use where the checkpoint lacks
        them (e.g. ``num_attention_heads``, ``num_query_groups``).

    Returns:
      A :class:`MegatronImport`. Without optimizer state in the checkpoint,
      masters are the weights in fp32 and moments are zero.

    Raises:
      ValueError: not the GPT of :mod:`lwjax.megatron.gpt`, or Muon state on
        parameters lwjax does not route to Muon.
    """
    import optax

    from lwjax.logical import LogicalState
    from lwjax.optimizer import route_params

    config = _gpt_config(state, config, config_overrides)
    ran_muon = bool(state.momentum)
    muon = ran_muon if muon is None else bool(muon)
    params = tree_from_keys(state.model)
    routes = {
        r.path.replace("/", "."): r
        for r in route_params(
            params, config.routing_rules(muon=muon), matrix_convention=MATRIX_CONVENTION
        )
    }
    lwjax_muon = {k for k, r in routes.items() if r.is_muon}
    if muon and ran_muon and lwjax_muon != set(state.momentum):
        raise ValueError(
            f"Megatron ran Muon on {sorted(state.momentum)}, lwjax's GPT routing gives "
            f"{sorted(lwjax_muon)}; they must agree to continue the run."
        )
    masters, mu, nu, momenta = {}, {}, {}, {}
    for key, weight in state.model.items():
        masters[key] = state.masters[key] if key in state.masters else weight.astype(np.float32)
        if key in lwjax_muon:
            momenta[key] = state.momentum.get(key, np.zeros(weight.shape, np.float32))
            mu[key] = nu[key] = None
        else:
            momenta[key] = None
            mu[key] = state.exp_avg.get(key, np.zeros(weight.shape, np.float32))
            nu[key] = state.exp_avg_sq.get(key, np.zeros(weight.shape, np.float32))
    iteration = int(state.iteration)
    adam_step = state.adam_step if state.adam_step is not None else iteration
    logical = LogicalState(
        count=np.asarray(iteration, np.int32),
        masters=tree_from_keys(masters),
        momenta=tree_from_keys(momenta),
        elementwise=optax.ScaleByAdamState(
            count=np.asarray(adam_step, np.int32), mu=tree_from_keys(mu), nu=tree_from_keys(nu)
        ),
    )
    return MegatronImport(
        config=config,
        params=params,
        logical=logical,
        muon=muon,
        hyperparameters=state.hyperparameters,
        iteration=iteration,
        source={
            **state.source,
            "has_optimizer_state": bool(state.masters),
            **({"switched_from": "muon" if ran_muon else "adam"} if muon != ran_muon else {}),
        },
        args=state.args,
        scheduler=dict(state.scheduler),
    )


def import_megatron(
    path,
    *,
    iteration: int | None = None,
    reader: str = "numpy",
    weights_only: bool = False,
    config: GPTConfig | None = None,
    muon: bool | None = None,
    **config_overrides,
) -> MegatronImport:
    """Open a Megatron checkpoint, or the lwjax checkpoint ``lwjax convert`` made of one,
    ready to continue training.

    Args:
      path: A Megatron checkpoint directory (``torch_dist`` or legacy ``torch``), or an
        lwjax checkpoint written by :func:`convert` (its Megatron config, args, param
        groups and scheduler state are in its metadata).
      iteration, reader, weights_only: As for :func:`~lwjax.megatron.state.read_megatron`.
      config, muon, **config_overrides: As for :func:`megatron_to_logical`.

    Raises:
      ValueError: unreadable input, or an lwjax checkpoint without Megatron metadata.
    """
    if detect_source(path) == "megatron":
        state = read_megatron(path, iteration=iteration, reader=reader, weights_only=weights_only)
        return megatron_to_logical(state, config, muon=muon, **config_overrides)
    from lwjax.checkpoint import load_arrays

    arrays, record = load_arrays(path)
    meta = record.get("metadata", {}).get("megatron")
    if not meta:
        raise ValueError(
            f"{path}: an lwjax checkpoint without Megatron metadata (not written by "
            "lwjax convert); restore it with lwjax.checkpoint instead."
        )
    state, stored = _state_from_lwjax(arrays, record)
    state.source.update(meta.get("source") or {}, converted=str(path))
    return megatron_to_logical(state, config or stored, muon=muon, **config_overrides)


def _adam_state(elementwise):
    """The ``ScaleByAdamState`` inside an elementwise optax state
    (a chain's tuple or the state itself).
    """
    if hasattr(elementwise, "mu") and hasattr(elementwise, "nu"):
        return elementwise
    if isinstance(elementwise, tuple):
        for part in elementwise:
            if (found := _adam_state(part)) is not None:
                return found
    return None


def logical_to_megatron(
    params,
    logical,
    *,
    iteration: int | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    args: Mapping[str, Any] | None = None,
    scheduler: Mapping[str, Any] | None = None,
) -> MegatronState:
    """Inverse of :func:`megatron_to_logical`: a :class:`MegatronState` from GPT parameters
    and logical state.

    Args:
      params: The GPT parameter tree (nested dicts of Megatron key parts).
      logical: Its :class:`~lwjax.logical.LogicalState`, Adam as elementwise state.
      iteration: Iterations done; defaults to ``logical.count``.
      hyperparameters: ``{"muon": {...}, "adam": {...}}`` for the param groups.
      args: Megatron ``args`` to record.
      scheduler: Megatron-LM's ``opt_param_scheduler`` state to record.

    Raises:
      ValueError: an elementwise state without Adam moments.
    """
    to_np = lambda x: None if x is None else np.asarray(x)  # noqa: E731
    model = {k: to_np(v) for k, v in keys_from_tree(params).items()}
    masters = {k: to_np(v) for k, v in keys_from_tree(logical.masters).items()}
    momenta = {k: to_np(v) for k, v in keys_from_tree(logical.momenta).items() if v is not None}
    adam = _adam_state(logical.elementwise)
    if adam is None and len(momenta) < len(model):
        raise ValueError(
            "logical_to_megatron: the elementwise state has no Adam moments (mu, nu); "
            "Megatron's optimizer state cannot be written."
        )
    exp_avg = (
        {k: to_np(v) for k, v in keys_from_tree(adam.mu).items() if v is not None} if adam else {}
    )
    exp_avg_sq = (
        {k: to_np(v) for k, v in keys_from_tree(adam.nu).items() if v is not None} if adam else {}
    )
    count = int(np.asarray(logical.count))
    return MegatronState(
        iteration=count if iteration is None else int(iteration),
        model=model,
        masters=masters,
        momentum=momenta,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        adam_step=int(np.asarray(adam.count)) if adam is not None else None,
        hyperparameters=dict(hyperparameters or {}),
        args=dict(args or {}),
        source={"format": "lwjax"},
        scheduler=dict(scheduler or {}),
    )


def _plain(value):
    """Keep only values Megatron can unpickle (numbers, strings, containers of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if any(item is None and v is not None for item, v in zip(items, value)):
            return None
        return type(value)(items)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return None


def _megatron_args(state: MegatronState, config: GPTConfig | None) -> dict:
    args = {k: v for k, v in ((k, _plain(v)) for k, v in state.args.items()) if v is not None}
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


def _param_groups(state: MegatronState) -> tuple[list[dict], list[dict]]:
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


def megatron_tensors(state: MegatronState) -> dict[str, np.ndarray]:
    """The ``torch_dist`` tensors of a state: model keys plus per-parameter optimizer keys."""
    tensors = dict(state.model)
    for key in state.model:
        if key in state.momentum:
            tensors[FP32_PREFIX + key] = state.masters[key]
            tensors[MOMENTUM_PREFIX + key] = state.momentum[key]
        elif key in state.masters:
            tensors["optimizer.state.param." + key] = state.masters[key]
            if key in state.exp_avg:
                tensors[EXP_AVG_PREFIX + key] = state.exp_avg[key]
                tensors[EXP_AVG_SQ_PREFIX + key] = state.exp_avg_sq[key]
    return tensors


def save_torch_dist(
    state: MegatronState, directory, *, config: GPTConfig | None = None, overwrite: bool = False
) -> pathlib.Path:
    """Write ``state`` as a Megatron ``torch_dist`` checkpoint (needs torch).

    Layout: ``<directory>/latest_checkpointed_iteration.txt`` and
    ``<directory>/iter_<N>/`` with ``.metadata``, ``__0_0.distcp`` and
    ``metadata.json``. Model weights are global, stacked tensors; optimizer
    state uses per-parameter keys (Megatron's ``fully_reshardable`` naming:
    Muon ``optimizer.state.{fp32_param,momentum_buffer}.<key>``, Adam
    ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``); the common state
    (args, iteration, param groups, content metadata) is the ``common_state``
    object.

    Returns:
      The iteration directory.

    Raises:
      ValueError: ``directory`` holds a checkpoint already (without ``overwrite``).
    """
    from lwjax.megatron.dcp import save_dcp_torch

    directory = pathlib.Path(directory)
    iteration_dir = directory / f"iter_{state.iteration:07d}"
    if iteration_dir.exists():
        if not overwrite:
            raise ValueError(
                f"{iteration_dir}: already exists; pass overwrite=True (--overwrite) to replace it."
            )
        import shutil

        shutil.rmtree(iteration_dir)
    muon_groups, adam_groups = _param_groups(state)
    adam_part = {
        "optimizer": {"param_groups": adam_groups},
        "param_state_sharding_type": "fully_reshardable",
    }
    content = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    import argparse

    common = {
        "args": argparse.Namespace(**_megatron_args(state, config)),
        "checkpoint_version": 3.0,
        "iteration": int(state.iteration),
        "content_metadata": content,
        "num_floating_point_operations_so_far": 0,
        **({"opt_param_scheduler": _plain(state.scheduler)} if state.scheduler else {}),
        "optimizer": {0: {"optimizer": {"param_groups": muon_groups}}, 1: adam_part}
        if muon_groups
        else adam_part,
    }
    objects = {"common_state/shard_0_1": common}
    num_layers = next((w.shape[0] for k, w in state.model.items() if names_lib.is_layer_key(k)), 0)
    for module in _EXTRA_STATE_MODULES:
        if f"{names_lib.LAYER_PREFIX}{module}.weight" in state.model:
            for layer in range(num_layers):
                objects[
                    f"{names_lib.LAYER_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}"
                ] = None
    directory.mkdir(parents=True, exist_ok=True)
    save_dcp_torch(iteration_dir, megatron_tensors(state), objects)
    (iteration_dir / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    (directory / "latest_checkpointed_iteration.txt").write_text(str(state.iteration))
    return iteration_dir


def safetensors_tensors(state: MegatronState) -> dict[str, np.ndarray]:
    """Model weights under their Megatron keys; fp32 masters, Muon momenta and Adam
    moments under optimizer keys (``optimizer.state.{fp32_param,momentum_buffer,
    exp_avg,exp_avg_sq}.<key>``).
    """
    tensors = dict(state.model)
    tensors.update({FP32_PREFIX + k: v for k, v in state.masters.items()})
    tensors.update({MOMENTUM_PREFIX + k: v for k, v in state.momentum.items()})
    tensors.update({EXP_AVG_PREFIX + k: v for k, v in state.exp_avg.items()})
    tensors.update({EXP_AVG_SQ_PREFIX + k: v for k, v in state.exp_avg_sq.items()})
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def save_safetensors(state: MegatronState, path, *, overwrite: bool = False) -> pathlib.Path:
    """Write global weights, masters, Muon momenta and Adam moments to one ``.safetensors``
    file (:func:`safetensors_tensors`); the metadata holds the iteration, Adam's step and
    the source.

    Raises:
      ValueError: ``path`` exists (without ``overwrite``), or safetensors is not installed.
    """
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ValueError(
            f"{path}: writing safetensors needs the megatron extra: pip install 'lwjax[megatron]'."
        ) from None

    path = pathlib.Path(path)
    if path.exists() and not overwrite:
        raise ValueError(
            f"{path}: already exists; pass overwrite=True (--overwrite) to replace it."
        )
    metadata = {
        "format": "megatron",
        "iteration": str(state.iteration),
        "adam_step": str(state.adam_step),
        "source": json.dumps(
            {k: v for k, v in state.source.items() if isinstance(v, (str, int, bool))}
        ),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(safetensors_tensors(state), str(tmp), metadata=metadata)
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------- the convert job


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """One ``lwjax convert`` job.

    Attributes:
      src: A Megatron checkpoint directory or an lwjax checkpoint directory.
      dst: Output: a directory, or a path ending in ``.safetensors``.
      to: ``"lwjax"``, ``"safetensors"`` or ``"torch_dist"``; ``None`` infers it
        (``.safetensors`` suffix; else the other side of ``src``).
      reader: Megatron reader, ``"numpy"`` (no torch) or ``"torch"``.
      iteration: Megatron iteration to read; ``None`` for the latest.
      num_attention_heads: For checkpoints whose args lack it.
      num_query_groups: For checkpoints whose args lack it.
      overwrite: Replace an existing output.
      weights_only: Take a Megatron checkpoint's model weights alone (fresh
        optimizer state in the output), e.g. when its optimizer file is lost.
    """

    src: str
    dst: str
    to: Target | None = None
    reader: str = "numpy"
    iteration: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    overwrite: bool = False
    weights_only: bool = False

    def __post_init__(self):
        if self.to is not None and self.to not in TARGETS:
            raise ValueError(
                f"ConvertConfig.to must be one of {TARGETS} or None; got to={self.to!r}."
            )
        if self.reader not in READERS:
            raise ValueError(
                f"ConvertConfig.reader must be one of {READERS}; got reader={self.reader!r}."
            )


@dataclasses.dataclass(frozen=True)
class ConvertSummary:
    """What a conversion did.

    Attributes:
      source: ``"megatron"`` or ``"lwjax"``; ``target``: one of :data:`TARGETS`.
      src, dst: Paths read and written.
      iteration: Iterations done.
      rows: ``(key, shape, dtype, state kinds)`` per parameter.
      notes: Source details (format, optimizer sharding, reader).
      seconds: Wall time.
    """

    source: str
    target: str
    src: str
    dst: str
    iteration: int
    rows: tuple[tuple[str, tuple[int, ...], str, str], ...]
    notes: dict
    seconds: float


def detect_source(path) -> str:
    """``"lwjax"`` for an lwjax checkpoint directory, ``"megatron"`` otherwise (checked on read)."""
    path = pathlib.Path(path)
    if (path / "lwjax").is_dir() and (path / "arrays").is_dir():
        return "lwjax"
    return "megatron"


def _rows(state: MegatronState) -> tuple:
    rows = []
    for key, weight in state.model.items():
        tables = (
            ("master", state.masters),
            ("momentum", state.momentum),
            ("exp_avg", state.exp_avg),
            ("exp_avg_sq", state.exp_avg_sq),
        )
        kinds = [name for name, table in tables if key in table]
        rows.append((key, tuple(weight.shape), weight.dtype.name, ", ".join(kinds) or "-"))
    return tuple(rows)


def _state_from_lwjax(
    arrays: Mapping[str, np.ndarray], record: Mapping
) -> tuple[MegatronState, GPTConfig | None]:
    """A MegatronState from an lwjax checkpoint of the GPT tree
    (names ``params/...``, ``state/...``).
    """
    import optax

    from lwjax.logical import LogicalState

    def group(prefix):
        return {
            name[len(prefix) :].replace("/", "."): value
            for name, value in arrays.items()
            if name.startswith(prefix)
        }

    params, masters, momenta = group("params/"), group("state/masters/"), group("state/momenta/")
    mu, nu = group("state/elementwise/mu/"), group("state/elementwise/nu/")
    if not params or not masters:
        raise ValueError("the lwjax checkpoint has no params/ or state/masters/ arrays.")
    fill = lambda table: tree_from_keys({k: table.get(k) for k in params})  # noqa: E731
    count = arrays.get("state/elementwise/count", arrays.get("state/count"))
    logical = LogicalState(
        count=arrays["state/count"],
        masters=fill(masters),
        momenta=fill(momenta),
        elementwise=optax.ScaleByAdamState(count=count, mu=fill(mu), nu=fill(nu)),
    )
    meta = record.get("metadata", {}).get("megatron", {})
    config = GPTConfig(**meta["config"]) if "config" in meta else None
    state = logical_to_megatron(
        tree_from_keys(params),
        logical,
        iteration=record.get("step"),
        hyperparameters=meta.get("hyperparameters"),
        args=meta.get("args"),
        scheduler=_advanced_scheduler(
            meta.get("scheduler"), meta.get("iteration"), meta.get("args"), record.get("step")
        ),
    )
    return state, config


def _advanced_scheduler(
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


def convert(
    config: ConvertConfig, progress: Callable[[str, int, int], None] | None = None
) -> ConvertSummary:
    """Run one conversion (see :class:`ConvertConfig`); ``progress(stage, done, total)``
    reports stages.

    Raises:
      ValueError: unreadable input, an output that exists, or an impossible direction.
    """
    started = time.perf_counter()
    report = progress or (lambda *_: None)
    source = detect_source(config.src)
    target = config.to or (
        "safetensors"
        if config.dst.endswith(".safetensors")
        else "torch_dist"
        if source == "lwjax"
        else "lwjax"
    )
    if source == "lwjax" and target == "lwjax":
        raise ValueError(
            f"{config.src} is already an lwjax checkpoint; choose --to torch_dist or safetensors."
        )
    if target == "safetensors" and not config.dst.endswith(".safetensors"):
        raise ValueError(f"{config.dst}: a safetensors output must end in .safetensors.")
    total = 3
    report("reading", 0, total)
    gpt = None
    if source == "megatron":
        state = read_megatron(
            config.src,
            iteration=config.iteration,
            reader=config.reader,
            weights_only=config.weights_only,
        )
    else:
        from lwjax.checkpoint import load_arrays

        arrays, record = load_arrays(config.src)
        state, gpt = _state_from_lwjax(arrays, record)
    report("converting", 1, total)
    if target == "lwjax":
        from lwjax.checkpoint import save_logical
        from lwjax.optimizer import route_params

        imported = megatron_to_logical(
            state,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
        )
        routes = route_params(
            imported.params,
            imported.config.routing_rules(muon=imported.muon),
            matrix_convention=MATRIX_CONVENTION,
        )
        metadata = {
            "megatron": {
                "config": dataclasses.asdict(imported.config),
                "hyperparameters": _plain(imported.hyperparameters),
                "args": {
                    k: v
                    for k, v in ((k, _plain(v)) for k, v in imported.args.items())
                    if v is not None
                },
                "source": _plain(imported.source),
                "muon": imported.muon,
                "scheduler": _plain(imported.scheduler),
                "iteration": imported.iteration,
            }
        }
        report("writing", 2, total)
        save_logical(
            config.dst,
            imported.params,
            imported.logical,
            routes,
            step=imported.iteration,
            metadata=metadata,
            overwrite=config.overwrite,
            matrix_convention=MATRIX_CONVENTION,
            elementwise_transform="scale_by_adam",  # Megatron's Adam, as optimizer_kwargs builds
        )
    elif target == "safetensors":
        report("writing", 2, total)
        save_safetensors(state, config.dst, overwrite=config.overwrite)
    else:
        if gpt is None and source == "megatron":
            gpt = _gpt_config(
                state,
                None,
                {
                    "num_attention_heads": config.num_attention_heads,
                    "num_query_groups": config.num_query_groups,
                },
            )
        report("writing", 2, total)
        save_torch_dist(state, config.dst, config=gpt, overwrite=config.overwrite)
    report("done", total, total)
    return ConvertSummary(
        source=source,
        target=target,
        src=str(config.src),
        dst=str(config.dst),
        iteration=state.iteration,
        rows=_rows(state),
        notes={k: v for k, v in state.source.items() if k != "directory"},
        seconds=time.perf_counter() - started,
    )
