"""A Megatron GPT checkpoint -> lwjax's parameters and training state, ready for any mesh.

:func:`megatron_to_logical` turns a :class:`~lwjax.megatron.state.MegatronState` into the
GPT parameter tree of :mod:`lwjax.megatron.gpt` plus a
:class:`~lwjax.logical.LogicalState` (fp32 masters, Muon momenta, Adam moments as
``optax.ScaleByAdamState``, step counts) and the optimizer options that reproduce
Megatron's run; :func:`import_megatron` does it from a path (a Megatron checkpoint, or
the lwjax checkpoint ``lwjax convert`` made of one). :meth:`MegatronImport.optimizer`
and :meth:`MegatronImport.state` put the result on any mesh, and
:meth:`MegatronImport.to_megatron` turns the continued run back into Megatron's form;
:meth:`MegatronImport.data` gives the training batches it continues with.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from lwjax.megatron.data_order import MegatronBatches, megatron_batches
from lwjax.megatron.export import logical_to_megatron
from lwjax.megatron.export_records import advanced_records
from lwjax.megatron.gpt import MATRIX_CONVENTION, GPTConfig, keys_from_tree, tree_from_keys
from lwjax.megatron.lwjax_checkpoint import detect_source, state_from_lwjax
from lwjax.megatron.state import MegatronState, read_megatron

if TYPE_CHECKING:  # both import jax; reading a checkpoint does not
    from lwjax.megatron.options import MegatronOptions
    from lwjax.megatron.schedules import MegatronSchedule


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

        Raises:
          ValueError: a mixture-of-experts GPT, which lwjax's forward does not have.
        """
        from lwjax.megatron.model import check_dense, gpt_loss

        check_dense(self.config, "MegatronImport.loss_fn")

        dtypes = {np.asarray(w).dtype.name for w in keys_from_tree(self.params).values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
        return functools.partial(
            gpt_loss, config=self.config, **{"dtype": dtype, "numerics": "megatron", **options}
        )

    def data(self, path_prefix=None, **overrides) -> MegatronBatches:
        """The run's training batches from where the checkpoint stopped: megatron-core's
        ``GPTDataset`` order over one indexed dataset (``.bin``/``.idx``), global batches
        from ``args.consumed_train_samples`` on, with the checkpoint's seed, sequence
        length, batch size, split and train samples (``report()`` says where each was
        read). See :func:`~lwjax.megatron.data_order.megatron_batches`.

        Args:
          path_prefix: The dataset's path prefix; ``None`` takes ``args.data_path``.
          **overrides: Settings that replace the args' (``seed=``, ``split=``, ...).
        """
        return megatron_batches(path_prefix, self.args, self.iteration, **overrides)

    def to_megatron(self, params, logical) -> MegatronState:
        """The continued run as a :class:`~lwjax.megatron.state.MegatronState` to save with
        :func:`~lwjax.megatron.export.save_torch_dist` or
        :func:`~lwjax.megatron.export.save_safetensors`: Megatron's args, param groups
        at the schedule's current values, its scheduler and ``consumed_train_samples`` moved
        on by the steps taken since the import.

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
        args, scheduler = advanced_records(self.args, self.scheduler, self.iteration, count)
        return logical_to_megatron(
            params, logical, hyperparameters=hyperparameters, args=args, scheduler=scheduler
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
            _check_tensor_parallel_size(self.config, tensor_axis, mesh.shape[tensor_axis])
            params = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                self.params,
                named_shardings(mesh, self.config.tensor_specs(tensor_axis)),
            )
        kwargs = self.optimizer_kwargs(**overrides)
        return layerwise_muon(params, mesh, param_axes=tensor_axis, **kwargs)

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


def _check_tensor_parallel_size(config: GPTConfig, axis: str, size: int) -> None:
    """Megatron's own conditions on a tensor-parallel size: it divides the query groups (each
    rank holds whole groups of ``linear_qkv``), the attention heads, the fc1 width and the
    vocabulary."""
    counts = {
        "num_query_groups": config.num_query_groups,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
    }
    wrong = {name: count for name, count in counts.items() if count % size}
    if wrong:
        fits = [d for d in range(1, config.num_query_groups + 1) if not any(
            c % d for c in counts.values()
        )]  # fmt: skip
        raise ValueError(
            f"MegatronImport.optimizer: the mesh's {axis!r} axis has {size} devices, which does "
            f"not divide {', '.join(f'{k}={v}' for k, v in wrong.items())} (Megatron splits "
            f"whole query groups over tensor-parallel ranks); sizes that fit this model: {fits}."
        )


def gpt_config_of(
    state: MegatronState, config: GPTConfig | None, overrides: Mapping[str, Any]
) -> GPTConfig:
    """``config``, or the GPT's shape read from the state's weights and args, where
    ``overrides`` that are not ``None`` replace args entries.
    """
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

    config = gpt_config_of(state, config, config_overrides)
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
        lwjax checkpoint written by :func:`~lwjax.megatron.convert.convert` (its Megatron
        config, args, param groups and scheduler state are in its metadata).
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
    state, stored = state_from_lwjax(arrays, record)
    state.source.update(meta.get("source") or {}, converted=str(path))
    return megatron_to_logical(state, config or stored, muon=muon, **config_overrides)
