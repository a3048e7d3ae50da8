r"""What a run costs per device, read off the optimizer's plan: memory, collectives, Newton–Schulz.

:func:`plan_run` takes a :class:`~lwjax.tools.plan_model.PlanModel` and a
:class:`~lwjax.tools.plan_model.PlanMesh`, builds the optimizer's
:class:`~lwjax.plan.StepPlan` and reports, for one device:

* memory (:func:`memory`): the device's parameter blocks and their gradients in the
  parameter dtype, its shards of the fp32 masters, Muon momenta and Adam moments (bucket
  padding included), with FSDP one layer gathered whole, and for a GPT its activations
  (:func:`activations`);
* the collectives of one training step (:func:`collectives`), each with the elements of
  its result and the bytes a device exchanges with partners on its host and on others;
* the Newton–Schulz FLOPs of the busiest device (:func:`newton_schulz`).

The step is the benchmark's (:mod:`lwjax.tools.bench.train_steps`): with FSDP every layer
all-gathered in the forward (again in the backward with ``remat``) and its gradient
reduce-scattered in the backward; then the optimizer: each bucket reduce-scattered over a
sharding group, all-reduced across groups, split Muon matrices exchanged (``all_to_all``,
``"duplicated"``) for Newton–Schulz and sent back, each bucket all-gathered. A model's own
tensor-parallel collectives (its activations) are not counted.

Bytes exchanged. A collective over ``n`` devices whose result on a device has :math:`S`
bytes moves, from or to each partner, :math:`S/n` (all-gather, all-to-all), :math:`S`
(reduce-scatter: the result is the shard) or :math:`2S/n` (all-reduce: a reduce-scatter
and an all-gather); a device's bytes inside and across hosts are that times its partners
on its host and on other hosts (:meth:`~lwjax.tools.plan_model.PlanMesh.peers`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lwjax.muon import piece_stacks
from lwjax.newton_schulz import _storage_dtype
from lwjax.parallel.exchange import deal_tables, exchange_rounds, tensor_split
from lwjax.parallel.ns_deal import is_dealt, matrix_ns_flops, ns_critical_path, whole_shape
from lwjax.plan import StepPlan
from lwjax.tools.plan_model import (
    MESH_AXES,
    PlanMesh,
    PlanModel,
    PlanOptions,
    split_dims,
    step_plan,
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective of a step, summed over its executions, on one device.

    Attributes:
      name: What it does (``"fsdp gather (forward)"``, ...).
      kind: XLA's name: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``.
      axes: The mesh axes its groups span.
      group: Devices per group.
      executions: Times it runs per step.
      elements: Elements of its results on the device, over all executions.
      itemsize: Bytes per element.
      phase: ``"model"`` (forward/backward) or ``"optimizer"``.
      inside: Bytes the device exchanges with partners on its host.
      across: Bytes it exchanges with partners on other hosts.
    """

    name: str
    kind: str
    axes: tuple[str, ...]
    group: int
    executions: int
    elements: int
    itemsize: int
    phase: str
    inside: int = 0
    across: int = 0

    @property
    def bytes(self) -> int:
        """Bytes of its results on the device."""
        return self.elements * self.itemsize


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run` found for one model on one mesh.

    Attributes:
      model: The model's name.
      mesh: The mesh.
      memory: Bytes per device by what they hold (:func:`memory`).
      collectives: The step's collectives (:func:`collectives`).
      ns_busiest: Newton–Schulz FLOPs per step of the busiest device.
      ns_total: Of every Muon matrix once, over all devices.
      ns_largest: Of the largest single matrix.
      plan: The optimizer's :class:`~lwjax.plan.StepPlan`.
    """

    model: str
    mesh: PlanMesh
    memory: dict[str, int]
    collectives: tuple[Collective, ...]
    ns_busiest: int
    ns_total: int
    ns_largest: int
    plan: StepPlan

    @property
    def state_bytes(self) -> int:
        """Parameters and optimizer state: what a device keeps between steps."""
        return sum(self.memory[k] for k in ("parameters", "masters", "momenta", "adam moments"))

    @property
    def total_bytes(self) -> int:
        """Every row of :attr:`memory`."""
        return sum(self.memory.values())

    @property
    def ns_ideal(self) -> float:
        """The least the busiest device can do: ``max(total / devices, largest matrix)``."""
        return max(self.ns_total / self.mesh.devices, self.ns_largest)

    def bytes_across(self) -> int:
        """Bytes a device exchanges with other hosts per step."""
        return sum(c.across for c in self.collectives)

    def bytes_inside(self) -> int:
        """Bytes a device exchanges inside its host per step."""
        return sum(c.inside for c in self.collectives)


def plan_run(model: PlanModel, mesh: PlanMesh, options: PlanOptions | None = None) -> RunPlan:
    """Plan ``model`` on ``mesh``: the optimizer's plan and what it costs one device
    (``options``: :class:`~lwjax.tools.plan_model.PlanOptions`, the benchmark's by default)."""
    options = options or PlanOptions()
    plan = step_plan(model, mesh, options)
    busiest, total, largest = newton_schulz(plan)
    return RunPlan(
        model=model.name,
        mesh=mesh,
        memory=memory(model, mesh, plan, options),
        collectives=collectives(model, mesh, plan, options),
        ns_busiest=busiest,
        ns_total=total,
        ns_largest=largest,
        plan=plan,
    )


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _local(model: PlanModel, mesh: PlanMesh) -> dict[str, tuple[int, int, int]]:
    """Per leaf key: ``(elements on a device, elements whole over fsdp, itemsize)``."""
    dims = split_dims(model, mesh)
    out = {}
    for key, leaf in model.leaves.items():
        split = math.prod(mesh.sizes[a] for a in dims[key])
        numel = math.prod(leaf.shape) // split
        out[key] = (numel, numel * (mesh.fsdp if "fsdp" in dims[key] else 1), _itemsize(leaf.dtype))
    return out


def memory(
    model: PlanModel, mesh: PlanMesh, plan: StepPlan, options: PlanOptions
) -> dict[str, int]:
    """Bytes per device: ``parameters`` and ``gradients`` (the device's blocks, parameter
    dtype), ``masters``, ``momenta`` and ``adam moments`` (its bucket shards, padding
    included, in the plan's dtypes), with FSDP ``gathered layer``: the largest layer's
    parameters gathered whole over ``fsdp`` (one is live at a time in the forward), and for
    a GPT ``activations`` (:func:`activations`)."""
    local = _local(model, mesh)
    params = sum(n * size for n, _, size in local.values())
    out = {"parameters": params, "gradients": params}
    master = _itemsize(plan.master_dtype)
    masters = momenta = moments = 0
    for buffer in plan.buffers:
        for shard in buffer.shard_sizes:
            masters += shard * master
            if buffer.key.is_layer_wise:
                momenta += shard * master
            else:
                state = jax.eval_shape(
                    plan.elementwise.init, jax.ShapeDtypeStruct((shard,), plan.master_dtype)
                )
                moments += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    out |= {"masters": masters + 4, "momenta": momenta, "adam moments": moments}  # + the count
    if mesh.fsdp > 1:
        layer = sum(
            whole * size // model.layers
            for key, (_, whole, size) in local.items()
            if model.layer_prefix in key
        )
        out["gathered layer"] = layer
    if model.gpt is not None:
        out["activations"] = activations(model, mesh, options)
    return out


def activations(model: PlanModel, mesh: PlanMesh, options: PlanOptions) -> int:
    r"""Bytes of a GPT's activations kept for the backward pass on one device.

    With :math:`b` sequences (``micro_batch``) of :math:`T` tokens (``seq_len``) per
    device, :math:`s = bT`, width :math:`H`, :math:`n_q` query and :math:`n_g` key/value
    heads of :math:`d` channels, MLP width :math:`F`, vocabulary :math:`V`, :math:`L`
    layers and :math:`p` bytes per parameter-dtype element:

    .. math::

       A_	ext{layer} &= s\,p\,ig(3H + (2n_q + 2n_g)\,d + 3Fig) + 8\,b\,n_q T^2 \
       A &= egin{cases} L\,s\,H\,p + A_	ext{layer} + 8\,sV & 	ext{remat} \
                          L\,A_	ext{layer} + 8\,sV & 	ext{otherwise} \end{cases}

    :math:`A_	ext{layer}` is what one layer keeps for its backward: its two norms' outputs
    and the residual between them (:math:`3H`), the query/key/value projection and the
    attention's output, the MLP's two halves and their product (:math:`3F`), and the fp32
    attention scores and probabilities (XLA's attention; a fused kernel keeps neither). With
    ``remat`` each layer keeps only its input, and one layer at a time is recomputed. The
    logits and their gradient are fp32 (:math:`8sV`)."""
    gpt = model.gpt
    tokens = options.micro_batch * options.seq_len
    itemsize = max(leaf.dtype.itemsize for leaf in model.leaves.values())
    heads, groups, d = gpt.num_attention_heads, gpt.num_query_groups, gpt.head_dim
    hidden, ffn = gpt.hidden_size, gpt.ffn_hidden_size
    layer = tokens * itemsize * (3 * hidden + (2 * heads + 2 * groups) * d + 3 * ffn)
    layer += 8 * options.micro_batch * heads * options.seq_len**2
    logits = 8 * tokens * gpt.vocab_size
    if options.remat_on(mesh):
        return model.layers * tokens * hidden * itemsize + layer + logits
    return model.layers * layer + logits


def collectives(
    model: PlanModel, mesh: PlanMesh, plan: StepPlan, options: PlanOptions
) -> tuple[Collective, ...]:
    """The collectives of one training step on a device (see the module's docstring)."""
    rows = []
    if mesh.fsdp > 1:
        rows += _fsdp_collectives(model, mesh, options)
    rows += _optimizer_collectives(plan, mesh, options)
    return tuple(_with_hosts(c, mesh) for c in rows if c.executions)


EMBEDDING = "embedding.word_embeddings.weight"  # a GPT's table, looked up by rows


def _fsdp_collectives(model: PlanModel, mesh: PlanMesh, options: PlanOptions) -> list[Collective]:
    """Each leaf gathered over ``fsdp`` in the forward (per-layer leaves once per layer, twice
    with ``remat``) and its gradient reduce-scattered in the backward; a GPT's untied
    embedding instead looked up by rows (:func:`lwjax.parallel.gather.gather_rows`): the
    token ids all-gathered, each token's row sent whole to its device (an all-to-all, in
    the reduction dtype) and its gradient sent back."""
    gathers = executions = scatters = scattered = size = 0
    by_rows = model.gpt is not None and not model.gpt.tied_embeddings
    for key, (numel, whole, itemsize) in _local(model, mesh).items():
        if whole == numel or (by_rows and key == EMBEDDING):
            continue  # not split over fsdp, or looked up by rows
        in_layer = model.layer_prefix in key
        times = model.layers if in_layer and model.stacked else 1
        again = 2 if options.remat_on(mesh) and in_layer else 1
        gathers += whole * again
        executions += times * again
        scatters += times
        scattered += numel
        size = itemsize
    grad_size = 4 if options.grad_reduce_in_fp32 else size
    axes = ("fsdp",)
    rows = [
        Collective("fsdp gather (forward)", "all-gather", axes, mesh.fsdp, executions, gathers,
                   size, "model"),
        Collective("fsdp gradient reduce-scatter (backward)", "reduce-scatter", axes, mesh.fsdp,
                   scatters, scattered, grad_size, "model"),
    ]  # fmt: skip
    if by_rows:
        tokens = options.micro_batch * options.seq_len
        rows += [
            Collective("embedding token ids", "all-gather", axes, mesh.fsdp, 1,
                       mesh.fsdp * tokens, 4, "model"),
            Collective("embedding rows (forward, backward)", "all-to-all", axes, mesh.fsdp, 2,
                       2 * tokens * model.gpt.hidden_size, grad_size, "model"),
        ]  # fmt: skip
    return rows


def _optimizer_collectives(plan: StepPlan, mesh: PlanMesh, options) -> list[Collective]:
    """The optimizer's: gradient reduce-scatter, across-group all-reduce, Newton–Schulz
    exchanges, parameter all-gather, and the gradient statistics."""
    group = ("dp",)
    rs = ar = ag = 0
    grad = param = 0
    buckets = 0
    for buffer in plan.buffers:
        grad, param = _itemsize(buffer.key.grad_dtype), _itemsize(buffer.key.param_dtype)
        for shard in buffer.shard_sizes:
            rs += shard
            ar += shard
            ag += shard * buffer.dp
            buckets += 1
    alone = mesh.dp == 1  # a collective over one device moves nothing
    rows = [
        Collective("gradient reduce-scatter", "reduce-scatter", group, mesh.dp,
                   0 if alone else buckets, rs, grad, "optimizer"),
        Collective("gradient all-reduce across groups", "all-reduce", ("replica",), mesh.replica,
                   buckets if mesh.replica > 1 else 0, ar, grad, "optimizer"),
        *_exchanges(plan, options),
        Collective("parameter all-gather", "all-gather", group, mesh.dp, 0 if alone else buckets,
                   ag, param, "optimizer"),
    ]  # fmt: skip
    # One psum of each norm group's sum of squares over every data-parallel and split device;
    # the training step's mean loss joins it (XLA combines them).
    stats = ("replica", "dp", "fsdp", "tp")
    rows += [
        Collective("gradient norm (scalars)", "all-reduce", stats, mesh.devices, 1,
                   len(plan.norm_groups), 4, "optimizer"),
        Collective("loss (scalar)", "all-reduce", stats, mesh.devices, 1, 1, 4, "model"),
    ]  # fmt: skip
    return rows


def _exchanges(plan: StepPlan, options: PlanOptions) -> list[Collective]:
    """``"duplicated"`` Muon's joint exchange (:mod:`lwjax.joint_directions`): per block shape
    (each QKV piece shape of a fused matrix its own), one ``all_to_all`` of every dealt matrix's
    blocks of the step to the devices that assemble them, in the masters' dtype, and one back,
    in Newton–Schulz's, in rounds (:func:`lwjax.parallel.exchange.exchange_rounds`); each
    chunk holds the most matrices any device assembles
    (:func:`lwjax.parallel.exchange.deal_tables`)."""
    out_size = _itemsize(plan.master_dtype)
    back_size = _itemsize(_storage_dtype(plan.master_dtype, options.ns_precision))
    batches: dict[tuple, list[tuple]] = {}  # (axes, devices, block) -> (deal, pieces, width)
    for buffer in plan.buffers:
        for group in buffer.slot_groups:
            if not is_dealt(group):
                continue
            split = tensor_split(plan.axes, group, plan.transpose)
            devices = math.prod(size for _, size in (*split.rows, *split.cols))
            rows_, cols = reversed(group.shape) if plan.transpose else group.shape
            qkv = group.qkv_split_shapes if plan.muon.split_qkv else None
            for count, piece_rows in piece_stacks(rows_, qkv):
                key = (split.names, plan.axes.of(buffer.key), devices, piece_rows, cols)
                batches.setdefault(key, []).append((group.ns_devices, count, group.width))
    rows: dict[tuple, list[int]] = {}
    for (names, _, devices, piece_rows, cols), stacks in batches.items():
        per = deal_tables(stacks, devices).per
        counts = rows.setdefault((names, devices), [0, 0])
        counts[0] += len(exchange_rounds(per, devices * piece_rows * cols * out_size))
        counts[1] += devices * per * piece_rows * cols
    out = []
    for (names, devices), (executions, elements) in rows.items():
        for direction, size in (("out", out_size), ("back", back_size)):
            out.append(
                Collective(f"Newton-Schulz exchange ({direction})", "all-to-all", names, devices,
                           executions, elements, size, "optimizer")
            )  # fmt: skip
    return out


def _with_hosts(c: Collective, mesh: PlanMesh) -> Collective:
    """``c`` with its bytes inside and across hosts (see the module's docstring)."""
    if c.group <= 1:
        return c
    same, other = mesh.peers(tuple(a for a in MESH_AXES if a in c.axes))
    per_execution = c.bytes / c.executions
    share = {
        "all-gather": per_execution / c.group,
        "all-to-all": per_execution / c.group,
        "reduce-scatter": per_execution,
        "all-reduce": 2 * per_execution / c.group,
    }[c.kind]
    each = share * c.executions
    return dataclasses.replace(c, inside=round(same * each), across=round(other * each))


def newton_schulz(plan: StepPlan) -> tuple[int, int, int]:
    """``(critical path, every matrix once, largest matrix)``: Newton–Schulz FLOPs per step.

    The critical path is what the step waits for: each Newton–Schulz region's busiest
    device, summed (:func:`lwjax.parallel.ns_deal.ns_critical_path`).
    """
    muon = plan.muon
    total = largest = 0
    for buffer in plan.buffers:
        for group in buffer.slot_groups:
            each = matrix_ns_flops(
                whole_shape(plan.axes, group, plan.transpose),
                group.qkv_split_shapes,
                muon.num_ns_steps,
                muon.split_qkv,
            )
            total += each * sum(len(names) for names in group.names)
            largest = max(largest, each)
    return ns_critical_path(plan), total, largest


def candidate_meshes(devices: int, devices_per_host: int | None) -> list[PlanMesh]:
    """Every ``dp x fsdp x tp`` factorisation of ``devices``, ``tp`` within a host."""
    host = devices_per_host or devices
    out = []
    for tp in range(1, devices + 1):
        if devices % tp or tp > host:
            continue
        for fsdp in range(1, devices // tp + 1):
            if (devices // tp) % fsdp == 0:
                dp = devices // tp // fsdp
                out.append(PlanMesh(dp=dp, fsdp=fsdp, tp=tp, devices_per_host=devices_per_host))
    return out


def rank_meshes(
    model: PlanModel,
    devices: int,
    devices_per_host: int | None,
    memory_gb: float | None,
    options: PlanOptions | None = None,
) -> tuple[list[RunPlan], list[tuple[str, str]], str]:
    """Plan every candidate mesh (:func:`candidate_meshes`) and rank them.

    Order: meshes whose :attr:`RunPlan.total_bytes` fit ``memory_gb`` first, then the fewest
    bytes across hosts per device, then the least Newton–Schulz on the busiest device, then
    the fewest bytes inside hosts.

    Returns:
      The plans best first, the meshes left out with why (a split that does not divide,
      no tensor-parallel form), and a sentence saying why the first is recommended.
    """
    runs, skipped = [], []
    for mesh in candidate_meshes(devices, devices_per_host):
        try:
            runs.append(plan_run(model, mesh, options))
        except ValueError as err:
            skipped.append((mesh.describe(), str(err)))
    if not runs:
        raise ValueError(f"--devices {devices}: no mesh can hold {model.name}: {skipped[0][1]}")
    limit = None if memory_gb is None else memory_gb * 1e9

    def key(run: RunPlan):
        fits = limit is None or run.total_bytes <= limit
        return (not fits, run.bytes_across(), run.ns_busiest, run.bytes_inside())

    runs.sort(key=key)
    return runs, skipped, _why(runs, limit)


def _why(runs: list[RunPlan], limit: float | None) -> str:
    best = runs[0]
    gb = lambda n: f"{n / 1e9:,.1f} GB"  # noqa: E731
    parts = [f"Recommended: {best.mesh.describe()}"]
    if limit is not None:
        fitting = sum(r.total_bytes <= limit for r in runs)
        if best.total_bytes > limit:
            return (
                f"No mesh fits {gb(limit)} per device: the smallest needs "
                f"{gb(min(r.total_bytes for r in runs))} before XLA's temporaries."
            )
        parts.append(
            f"it fits {gb(limit)} ({gb(best.total_bytes)} before XLA's temporaries; "
            f"{fitting} of {len(runs)} meshes fit)"
        )
    parts.append(f"it moves the fewest bytes across hosts ({gb(best.bytes_across())} per device "
                 f"per step; {gb(best.bytes_inside())} inside its host)")  # fmt: skip
    ratio = best.ns_busiest / best.ns_ideal if best.ns_ideal else 0
    parts.append(f"its busiest device runs {best.ns_busiest / 1e12:,.1f} TFLOP of Newton-Schulz "
                 f"({ratio:.2f}x the least possible)")  # fmt: skip
    if len(runs) > 1:
        second = runs[1]
        parts.append(
            f"next: {second.mesh.describe()} ({gb(second.bytes_across())} across hosts, "
            f"{second.ns_busiest / 1e12:,.1f} TFLOP)"
        )
    return "; ".join(parts) + "."
