"""What ``lwjax plan`` plans: a model, a mesh of hosts, and the optimizer's own plan for both.

:class:`PlanMesh` is a device mesh by its sizes, ``(replica, dp, fsdp, tp)`` major to minor,
cut into hosts of ``devices_per_host`` consecutive devices; :meth:`PlanMesh.peers` says how
many of a device's partners in a collective share its host. :class:`PlanModel` is a
parameter tree of abstract arrays with its routing rules and how each leaf splits over
``fsdp`` (its last axis, as the benchmark's fully sharded step splits it) and ``tp``
(Megatron's tensor-parallel layout, for the GPT presets). :func:`step_plan` lays the model
out over the mesh with :func:`lwjax.planner.plan_params` and :func:`~lwjax.planner.plan_step`
on :class:`~lwjax.parallel.axes.MeshAxes` built from the sizes: no devices are needed.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from lwjax.config import OptimizerConfig
from lwjax.layout import DEFAULT_POLICY, LayoutConfig
from lwjax.megatron.gpt import MATRIX_CONVENTION, GPTConfig, keys_from_tree, tree_from_keys
from lwjax.muon import MuonConfig
from lwjax.parallel.axes import MeshAxes
from lwjax.parallel.mesh import resolved_layout
from lwjax.plan import StepPlan
from lwjax.planner import plan_params, plan_step
from lwjax.routing import RoutingRules
from lwjax.tools.bench.workloads import workload_config
from lwjax.tools.presets import PRESETS, preset_specs

MESH_AXES = ("replica", "dp", "fsdp", "tp")  # major to minor: consecutive devices differ in tp
PARAM_AXES = ("fsdp", "tp")  # the axes that split parameters, in layerwise_muon's order
# GPT presets and the benchmark workload of the same shapes (lwjax.tools.bench.WORKLOADS),
# whose training step `lwjax plan --compile` compiles.
PRESET_WORKLOADS = {"small": "small", "llama8b": "8b", "llama70b": "70b", "llama405b": "405b"}


@dataclasses.dataclass(frozen=True)
class PlanMesh:
    """A mesh by its sizes, devices numbered row-major over :data:`MESH_AXES`.

    Attributes:
      dp: Data-parallel devices of one sharding group (the optimizer's layout spans them).
      fsdp: Devices each parameter is split over on its last axis; the batch is split
        over them too.
      tp: Tensor-parallel devices (Megatron's split); the batch is not split over them.
      replica: Sharding groups, each holding a copy of the optimizer state.
      devices_per_host: Consecutive devices that share a host; ``None``: one host.
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    replica: int = 1
    devices_per_host: int | None = None

    def __post_init__(self):
        for name in (*MESH_AXES, "devices_per_host"):
            value = getattr(self, name)
            if value is None and name == "devices_per_host":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a positive integer; got {value!r}."
                )
        host = self.devices_per_host
        if host is not None and self.devices > host and self.devices % host:
            raise ValueError(
                f"--devices-per-host {host} does not divide the mesh's {self.devices} devices "
                f"({self.describe()}): hosts must hold whole, equal parts of the mesh."
            )

    @property
    def sizes(self) -> dict[str, int]:
        """Each axis of :data:`MESH_AXES` and its size."""
        return {name: getattr(self, name) for name in MESH_AXES}

    @property
    def devices(self) -> int:
        """Devices in the mesh."""
        return self.replica * self.dp * self.fsdp * self.tp

    @property
    def hosts(self) -> int:
        """Hosts the mesh spans."""
        return 1 if self.devices_per_host is None else -(-self.devices // self.devices_per_host)

    @property
    def data_devices(self) -> int:
        """Devices the batch is split over: ``replica * dp * fsdp``."""
        return self.replica * self.dp * self.fsdp

    def describe(self) -> str:
        """The axes of size above one, e.g. ``dp 8 x fsdp 8`` (``dp 1`` for one device)."""
        shown = [f"{name} {size}" for name, size in self.sizes.items() if size > 1]
        return " x ".join(shown) or "dp 1"

    def peers(self, axes: tuple[str, ...]) -> tuple[int, int]:
        """``(on its host, on other hosts)``: the partners of the device with the most partners
        off its host, in a collective over ``axes`` (its group: the devices that differ from
        it only along ``axes``)."""
        sizes = self.sizes
        strides, stride = {}, 1
        for name in reversed(MESH_AXES):
            strides[name] = stride
            stride *= sizes[name]

        def span(names) -> list[int]:
            offsets = [0]
            for name in names:
                offsets = [d + i * strides[name] for d in offsets for i in range(sizes[name])]
            return offsets

        group = span(axes)
        host = self.devices_per_host or self.devices
        worst = 0  # every group is a translate of device 0's, but hosts may cut each differently
        for base in span([n for n in MESH_AXES if n not in axes]):
            per_host = collections.Counter((base + d) // host for d in group)
            worst = max(worst, len(group) - min(per_host.values()))
        return len(group) - 1 - worst, worst


@dataclasses.dataclass(frozen=True)
class PlanModel:
    """A model to plan: abstract parameters and what the optimizer and the mesh do with them.

    Attributes:
      name: How the output names it.
      params: The parameter tree, ``jax.ShapeDtypeStruct`` leaves (global shapes).
      routing: The optimizer's routing rules for ``params``.
      tensor_specs: Per leaf key (``.``-joined path), the stored axis Megatron's tensor
        parallelism splits, or ``None`` (whole); ``None`` for a model without a
        tensor-parallel form.
      layer_prefix: Keys holding it are per-layer parameters, gathered inside each layer
        (again in the backward pass with rematerialisation).
      stacked: The layers are stacked on a leading axis and scanned: a per-layer leaf is
        gathered once per layer.
      workload: The benchmark workload of the same shapes, whose training step
        ``--compile`` compiles; ``None`` when there is none.
      layers: Transformer layers (the scan's length for a stacked GPT).
      gpt: The GPT's shape, for its activations; ``None`` for a spec file.
    """

    name: str
    params: dict
    routing: RoutingRules
    tensor_specs: Mapping[str, int | None] | None
    layer_prefix: str
    stacked: bool
    workload: str | None
    layers: int
    gpt: GPTConfig | None = None

    @property
    def leaves(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Leaf key (its path joined by ``.``) -> abstract array, in the tree's flatten order."""
        flat, _ = jax.tree_util.tree_flatten_with_path(self.params)
        return {".".join(str(entry.key) for entry in path): leaf for path, leaf in flat}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Leaf key -> global shape, in the tree's flatten order."""
        return {k: tuple(v.shape) for k, v in self.leaves.items()}


def gpt_model(preset: str, layers: int | None = None) -> PlanModel:
    """A GPT preset as the benchmark builds it: layers stacked ``[L, ...]``, QKV split."""
    if layers is None:
        layers = inspect.signature(PRESETS[preset]).parameters["layers"].default
    workload = PRESET_WORKLOADS[preset]
    config = workload_config(workload, layers)
    return PlanModel(
        name=f"preset {preset} ({layers} layers)",
        params=gpt_params(config, "bfloat16"),
        routing=config.routing_rules(),
        tensor_specs=_gpt_tensor_dims(config),
        layer_prefix="decoder.layers.",
        stacked=True,
        workload=workload,
        layers=layers,
        gpt=config,
    )


def gpt_params(config: GPTConfig, dtype) -> dict:
    """The GPT's parameter tree of abstract arrays in ``dtype``."""
    return tree_from_keys(
        {k: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)) for k, s in config.param_shapes().items()}
    )


def _gpt_tensor_dims(config: GPTConfig) -> dict[str, int | None] | None:
    """Per key, the stored axis of Megatron's tensor-parallel split (``None``: whole)."""
    if config.num_experts:
        return None
    dims = {}
    for key, spec in keys_from_tree(config.tensor_specs()).items():
        dims[key] = next((i for i, entry in enumerate(spec) if entry is not None), None)
    return dims


def preset_model(preset: str, layers: int | None = None) -> PlanModel:
    """A preset: the benchmark's GPT where :data:`PRESET_WORKLOADS` has one, else its specs."""
    if preset in PRESET_WORKLOADS:
        preset_specs(preset, layers=layers)  # the preset's own checks (name, layers)
        return gpt_model(preset, layers)
    specs = preset_specs(preset, layers=layers)
    return specs_model(f"preset {preset}", specs)


def specs_model(name: str, specs) -> PlanModel:
    """A model from :class:`~lwjax.layout.ParamSpec`\\ s: one leaf per parameter, Muon as each
    spec says, no tensor-parallel form, layers found by ``.layers.`` in the name."""
    params = {s.name: jax.ShapeDtypeStruct(tuple(s.shape), jnp.dtype(s.dtype)) for s in specs}
    muon = {s.name: s.is_muon for s in specs}
    layers = len({s.name.split(".layers.")[1].split(".")[0] for s in specs if ".layers." in s.name})
    return PlanModel(
        name=name,
        params=params,
        routing=RoutingRules(is_muon=lambda path, shape: muon.get(path)),
        tensor_specs=None,
        layer_prefix=".layers.",
        stacked=False,
        workload=None,
        layers=layers,
    )


def split_dims(model: PlanModel, mesh: PlanMesh) -> dict[str, dict[str, int]]:
    """Per leaf key, ``{axis: stored dim}`` for each of :data:`PARAM_AXES` of size > 1 that
    splits it: ``fsdp`` the last axis of every leaf, ``tp`` Megatron's axis.

    Raises:
      ValueError: ``tp`` on a model without a tensor-parallel form, or an axis whose
        devices do not divide the stored dimension it splits (naming the leaf).
    """
    if mesh.tp > 1 and model.tensor_specs is None:
        raise ValueError(
            f"--tp: {model.name} has no tensor-parallel form here (Megatron's split is known "
            f"for the GPT presets {', '.join(PRESET_WORKLOADS)}, not for a spec file or a "
            "mixture of experts)."
        )
    out = {}
    for key, shape in model.shapes.items():
        dims = {}
        if mesh.fsdp > 1:
            dims["fsdp"] = len(shape) - 1
        if mesh.tp > 1 and model.tensor_specs.get(key) is not None:
            dims["tp"] = model.tensor_specs[key]
        for dim in set(dims.values()):
            ways = 1
            for axis, d in dims.items():
                ways *= mesh.sizes[axis] if d == dim else 1
            if shape[dim] % ways:
                named = " x ".join(f"--{a} {mesh.sizes[a]}" for a, d in dims.items() if d == dim)
                raise ValueError(
                    f"{named}: {key} {shape} cannot be split into {ways} blocks on axis {dim} "
                    f"({shape[dim]} is not a multiple of {ways})."
                )
        out[key] = dims
    return out


def partition_specs(model: PlanModel, mesh: PlanMesh) -> dict:
    """The parameters' ``PartitionSpec`` tree on a mesh of :data:`MESH_AXES`
    (:func:`split_dims`)."""
    from jax.sharding import PartitionSpec as P

    specs = {}
    for key, dims in split_dims(model, mesh).items():
        entries: list = [None] * len(model.shapes[key])
        for axis in PARAM_AXES:
            if axis in dims:
                d = dims[axis]
                entries[d] = axis if entries[d] is None else (entries[d], axis)
        specs[key] = P(*entries)
    return tree_from_keys(specs)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The optimizer and step options a plan is made for (the benchmark's defaults).

    Attributes:
      policy: Layout policy.
      bucket_size: Bucket size in elements, ``None`` or ``"auto"``.
      grad_reduce_in_fp32: Reduce gradients in fp32 (FSDP's backward and the optimizer's).
      remat: Recompute each layer in the backward pass (FSDP gathers each layer twice);
        ``None``: on where parameters are split over ``fsdp`` (without it the backward
        keeps every layer's gathered weights), off otherwise (:meth:`remat_on`).
      ns_precision: Newton–Schulz precision (``"medium"``: bf16).
      seq_len: Tokens per sequence, for the compiled step's batch.
      micro_batch: Sequences per data-parallel device, likewise.
    """

    policy: str = DEFAULT_POLICY
    bucket_size: int | str | None = "auto"
    grad_reduce_in_fp32: bool = True
    remat: bool | None = None
    ns_precision: str = "medium"
    seq_len: int = 128
    micro_batch: int = 1

    def remat_on(self, mesh: PlanMesh) -> bool:
        """Whether the step on ``mesh`` recomputes its layers: :attr:`remat`, or where it is
        ``None``, ``mesh.fsdp > 1``."""
        return mesh.fsdp > 1 if self.remat is None else self.remat


def mesh_axes(mesh: PlanMesh) -> MeshAxes:
    """The optimizer's :class:`~lwjax.parallel.axes.MeshAxes` of ``mesh`` (axes of size one
    other than ``dp`` are left out, as a mesh without them would have them)."""
    split = tuple(a for a in PARAM_AXES if mesh.sizes[a] > 1)
    return MeshAxes(
        "dp",
        dp_size=mesh.dp,
        replica="replica" if mesh.replica > 1 else None,
        replica_size=mesh.replica,
        tp=split,
        tp_sizes=tuple(mesh.sizes[a] for a in split),
    )


def step_plan(model: PlanModel, mesh: PlanMesh, options: PlanOptions = PlanOptions()) -> StepPlan:
    """The optimizer's :class:`~lwjax.plan.StepPlan` for ``model`` on ``mesh``, as
    :func:`lwjax.layerwise_muon` builds it with the benchmark's options
    (``"duplicated"`` Muon for split matrices)."""
    axes = mesh_axes(mesh)
    dims = split_dims(model, mesh)
    tensor_dims = [tuple(dims[k].get(a) for a in axes.tp) for k in model.shapes]
    muon = MuonConfig(fp32_matmul_prec=options.ns_precision)
    config = OptimizerConfig(
        grad_reduce_in_fp32=options.grad_reduce_in_fp32, matrix_convention=MATRIX_CONVENTION
    )
    layout = LayoutConfig(policy=options.policy, bucket_size=options.bucket_size)
    plan = plan_params(
        model.params,
        axes,
        resolved_layout(layout, axes, muon),
        model.routing,
        grad_reduce_in_fp32=options.grad_reduce_in_fp32,
        matrix_convention=MATRIX_CONVENTION,
        tensor_dims=tensor_dims if axes.tp else None,
    )
    return plan_step(plan, config, muon, None, 1e-3, None)
