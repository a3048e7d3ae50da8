"""Benchmark of a full training step: lwjax Muon against AdamW on the same Llama.

:mod:`lwjax.tools.bench` times the optimizer alone. This module times what a user pays
per step: forward, backward and optimizer of a Megatron-shaped Llama, data
parallel over a 1-D mesh axis ``dp``, and reports Muon's overhead over AdamW.

Model. Megatron-Core's GPT of :mod:`lwjax.megatron.model` (the one the
Megatron import runs) over the tree of the workload's
:class:`~lwjax.megatron.gpt.GPTConfig` (:data:`lwjax.tools.bench.WORKLOADS`):
weights ``[out, in]``, layers stacked and scanned, or with ``scan_layers=False``
a list of per-layer trees run one after the other (optionally rematerialised),
parameters and activations in ``param_dtype``, fp32 norms, rotary embeddings,
softmax and logits for the mean next-token cross-entropy.

Data. One fixed batch of uniformly random tokens (``micro_batch`` sequences of
``seq_len + 1`` tokens per device) is reused every step: synthetic, since the
step time does not depend on the token values.

Contenders, each one jitted ``shard_map`` step over the same devices and batch,
parameters and optimizer state donated:

* ``lwjax Muon``: local loss and gradients, then ``layerwise_muon``'s update
  (reduce-scatter, clip, Muon on owned matrices and Adam on owned elements,
  all-gather), built as :mod:`lwjax.tools.bench` builds it;
* ``lwjax AdamW (ZeRO-1)``: the same sharded optimizer with every parameter
  routed to Adam, i.e. the same communication without Newton–Schulz;
* ``optax AdamW (replicated)``: ``pmean`` of the gradients (all-reduce) and
  ``optax.adamw`` on fp32 parameters replicated on every device (the JAX status
  quo);
* ``forward+backward``: loss and gradients only, no communication and no
  optimizer; each contender's ``optimizer_ms`` is its step time minus this one.

With ``overlap_param_gather`` two more contenders run lwjax Muon and lwjax
AdamW as ``make_train_step(..., overlap_param_gather=True)`` does: the step
keeps only the state, and all-gathers every bucket from the masters at the
start of the next step, where XLA may run each gather under the forward pass.

Fully sharded (``fsdp``): the mesh is ``("dp", "fsdp") = (1, n)``, every
parameter split over ``fsdp`` on its last axis (:func:`fsdp_specs`) and the
batch over both axes. The forward all-gathers each layer just before it runs
(:func:`fsdp_gather`, with ``remat`` again in the backward) and the backward
reduce-scatters each layer's gradient as its turn in the scan ends; lwjax
Muon (``tensor_axis="fsdp"``, whole matrices by ``"duplicated"``) and lwjax
AdamW then update the blocks in place, and forward+backward is the same
gathers and reduce-scatters without an optimizer. No contender holds a whole
copy of the model, so none can be the replicated optax AdamW.

Each is timed as the median of ``iters`` steps after ``warmup`` steps,
synchronised with ``jax.block_until_ready``. Memory is XLA's buffer
assignment for the compiled step; on GPU it matched the allocator's
measured peak (``peak_bytes_so_far``) for every contender.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.layout import DEFAULT_POLICY
from lwjax.megatron.gpt import GPTConfig, tree_from_keys
from lwjax.megatron.model import gpt_loss, init_params, unstack_layers
from lwjax.optimizer import LayerwiseOptimizer, named_shardings, state_shardings
from lwjax.tools.bench import (
    COLLECTIVE_KINDS,
    WARMUP_STEPS,
    WORKLOADS,
    newton_schulz_floor,
    pgle,
    profile_steps,
    run_torch_script,
    time_steps,
    warmup_calls,
    workload_config,
    workload_optimizer,
)
from lwjax.tools.demo.devices import bytes_per_device
from lwjax.train import jit_shard_map, value_and_grad

MUON = "lwjax Muon"
ADAMW_SHARDED = "lwjax AdamW (ZeRO-1)"
ADAMW_REPLICATED = "optax AdamW (replicated)"
MUON_FSDP = "lwjax Muon (FSDP)"
ADAMW_FSDP = "lwjax AdamW (FSDP)"
MUON_OPTAX = "lwjax Muon, optax form (jax.grad)"
MUON_OPTAX_PER_DEVICE = "lwjax Muon, optax form (lwjax.value_and_grad)"
MUON_OVERLAP = "lwjax Muon, gather in forward"
ADAMW_OVERLAP = "lwjax AdamW (ZeRO-1), gather in forward"
FORWARD_BACKWARD = "forward+backward"
FSDP_AXIS = "fsdp"
CONTENDERS = (MUON, ADAMW_SHARDED, ADAMW_REPLICATED)  # and, with optax_form, the next two
# docs/scripts/megatron_train_bench.py's contenders, as the records name them.
MEGATRON_CONTENDERS = {
    "muon": "Megatron-Core Muon (layer-wise)",
    "muon_overlap": "Megatron-Core Muon (layer-wise), overlapped",
    "adam": "Megatron-Core Adam (distributed)",
    "adam_overlap": "Megatron-Core Adam (distributed), overlapped",
    "fwd_bwd": "Megatron-Core forward+backward",
}
OPTAX_FORM_CONTENDERS = (MUON_OPTAX, MUON_OPTAX_PER_DEVICE)
PROFILED_STEPS = 3  # traced after the timed ones, with profile_dir
# The contenders timed with lwjax_step, which also returns the gradient norm.
LWJAX_STEPS = (MUON, ADAMW_SHARDED, MUON_OVERLAP, ADAMW_OVERLAP, MUON_FSDP, ADAMW_FSDP)

# (seq_len, micro_batch) per workload when not given: the GPU workloads at 2048 tokens, the
# small one CPU-sized.
TRAIN_DEFAULTS = {"small": (128, 2), "1b": (2048, 4), "8b": (2048, 2)}
# Dense bf16 peak of one device in FLOP/s, by a substring of ``device_kind`` (vendor
# datasheets, SXM parts).
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))


def model_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    r"""Training FLOPs per token: :math:`6N + 6 L T H d`.

    :math:`N` counts the parameters of every matrix product (the layers' four
    matrices and the output layer; not the embedding lookup or the norms), at
    2 FLOPs per multiply-add and 3 products (forward, two backward) each. The
    second term is causal attention: :math:`QK^\top` and :math:`AV` cost
    :math:`2 \cdot 2 T H d` per token and layer without the mask, half with
    it, times 3. Recomputation (remat) is not counted (model FLOPs, not hardware FLOPs).
    """
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    heads, groups = config.num_attention_heads, config.num_query_groups
    per_layer = (heads + 2 * groups) * d * h + h * heads * d + 2 * f * h + h * f
    matmul_params = config.num_layers * per_layer + config.vocab_size * h
    return 6 * matmul_params + 6 * config.num_layers * seq_len * heads * d


@dataclasses.dataclass(frozen=True)
class TrainBenchConfig:
    """What :func:`run_train_bench` measures.

    Attributes:
      workload: A key of :data:`lwjax.tools.bench.WORKLOADS`.
      layers: Transformer layers (``None``: the workload's default).
      dp_sizes: Data-parallel sizes to run (each ≤ the device count).
      seq_len: Tokens per sequence (``None``: :data:`TRAIN_DEFAULTS`).
      micro_batch: Sequences per device per step (``None``: :data:`TRAIN_DEFAULTS`);
        the global batch is ``micro_batch * dp``.
      remat: Recompute each layer's activations in the backward pass.
      iters: Timed steps per measurement (median reported).
      warmup: Untimed steps first (:data:`lwjax.tools.bench.WARMUP_STEPS`).
      param_dtype: Parameter and activation dtype (the replicated optax
        contender keeps fp32 parameters and casts them in the forward).
      grad_reduce_in_fp32: lwjax reduces gradients in fp32, else in ``param_dtype``.
      ns_precision: Newton–Schulz precision (``"medium"`` = bf16, Megatron's default).
      policy: lwjax layout policy.
      bucket_size: lwjax bucket size in elements, ``None`` or ``"auto"``.
      learning_rate: Learning rate of every contender (Muon and Adam alike, as in
        :mod:`lwjax.tools.bench`).
      weight_decay: Decoupled weight decay on matrices (not on norms).
      clip_grad: Global gradient-norm clip of every contender; ``None`` or ``0`` disables.
      pipeline_muon: lwjax Muon's ``OptimizerConfig.pipeline_muon``.
      pgle: Compile every contender's step with JAX's profile-guided latency
        estimates (:func:`lwjax.tools.bench.pgle`; the profiled calls are part of
        the warm-up), as :class:`lwjax.tools.bench.BenchConfig` does for the
        optimizer step.
      baselines: Also time the replicated optax AdamW.
      optax_form: Also time lwjax Muon as an optax transformation in a plain
        ``jax.jit`` step, with gradients from ``jax.grad`` (all-reduced by
        GSPMD) and from :func:`lwjax.value_and_grad` (reduce-scattered).
      peak_flops: Peak FLOP/s of one device for MFU; ``None``: by device kind
        (:data:`PEAK_BF16_FLOPS`), and no MFU for unknown kinds (CPU).
      seed: Seed of the initial parameters and tokens.
      megatron_script: Also time Megatron-Core's own training step with this
        script (``docs/scripts/megatron_train_bench.py``; GPU host with
        megatron-core installed): Muon and Adam, each without and with
        ``--overlap-grad-reduce --overlap-param-gather``, and forward+backward
        alone, on the same shapes and dp size.
      fsdp: Split every parameter over the ``dp`` devices (an ``fsdp`` mesh
        axis, see the module docstring) instead of replicating it: lwjax Muon,
        lwjax AdamW and forward+backward, fully sharded.
      overlap_param_gather: Also time lwjax Muon and lwjax AdamW with the
        parameters gathered at the start of the next step (see the module
        docstring).
      scan_layers: Stack the layers and scan them; ``False``: one leaf per
        layer's parameter, the layers run one after the other
        (:func:`lwjax.megatron.model.unstack_layers`), every contender alike.
      profile_dir: Also trace a few steps of every contender there (GPU), and
        record device 0's kernel time per kind and how much of the
        communication ran beside compute
        (:func:`lwjax.tools.bench.profile_steps`).
    """

    workload: str = "small"
    layers: int | None = None
    dp_sizes: tuple[int, ...] = (1,)
    seq_len: int | None = None
    micro_batch: int | None = None
    remat: bool = False
    iters: int = 10
    warmup: int = WARMUP_STEPS
    param_dtype: str = "bfloat16"
    grad_reduce_in_fp32: bool = True
    ns_precision: str = "medium"
    policy: str = DEFAULT_POLICY
    bucket_size: int | str | None = "auto"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    pipeline_muon: bool = False
    pgle: bool = False
    baselines: bool = True
    optax_form: bool = False
    peak_flops: float | None = None
    seed: int = 0
    megatron_script: str | None = None
    fsdp: bool = False
    overlap_param_gather: bool = False
    scan_layers: bool = True
    profile_dir: str | None = None

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"TrainBenchConfig.workload must be one of {tuple(WORKLOADS)}; "
                f"got {self.workload!r}."
            )
        if not self.dp_sizes or min(self.dp_sizes) < 1:
            raise ValueError(
                f"TrainBenchConfig.dp_sizes must be positive integers; got {self.dp_sizes!r}."
            )
        if self.megatron_script and (
            self.workload not in ("1b", "8b") or self.param_dtype != "bfloat16"
        ):
            raise ValueError(
                "TrainBenchConfig.megatron_script: Megatron's training step runs the 1b and 8b "
                f"workloads in bfloat16 only; got workload={self.workload!r}, "
                f"param_dtype={self.param_dtype!r}."
            )
        replicating = {
            name: getattr(self, name)
            for name in ("baselines", "optax_form", "megatron_script")
            if getattr(self, name)
        }
        if self.fsdp and (self.overlap_param_gather or not self.scan_layers):
            raise ValueError(
                "TrainBenchConfig.fsdp needs overlap_param_gather=False and scan_layers=True "
                "(its steps gather each layer of the stacked, scanned model in the forward "
                f"pass already); got overlap_param_gather={self.overlap_param_gather!r}, "
                f"scan_layers={self.scan_layers!r}."
            )
        if self.fsdp and replicating:
            raise ValueError(
                "TrainBenchConfig.fsdp times lwjax's fully sharded steps only; turn off "
                f"baselines, optax_form and megatron_script (they replicate the model); got "
                f"{', '.join(f'{k}={v!r}' for k, v in replicating.items())}."
            )
        seq_len, micro_batch = TRAIN_DEFAULTS[self.workload]
        object.__setattr__(self, "seq_len", self.seq_len if self.seq_len is not None else seq_len)
        object.__setattr__(
            self, "micro_batch", self.micro_batch if self.micro_batch is not None else micro_batch
        )
        for name, least in (("seq_len", 1), ("micro_batch", 1), ("iters", 1), ("warmup", 0)):
            if getattr(self, name) < least:
                raise ValueError(
                    f"TrainBenchConfig.{name} must be >= {least}; got {getattr(self, name)!r}."
                )

    def model(self) -> GPTConfig:
        """The benchmarked model."""
        return workload_config(self.workload, self.layers)

    def loss(self, gather=None):
        """``loss(params, tokens [B, T + 1])``: mean next-token cross-entropy in ``param_dtype``
        (``gather``: :func:`lwjax.megatron.model.gpt_logits`'s)."""
        config = self.model()

        def loss(params, batch):
            return gpt_loss(
                params,
                (batch[:, :-1], batch[:, 1:]),
                config,
                dtype=self.param_dtype,
                remat=self.remat,
                gather=gather,
            )

        return loss


def lwjax_optimizer(
    params, mesh: Mesh, cfg: TrainBenchConfig, *, muon: bool = True
) -> LayerwiseOptimizer:
    """The optimizer of ``lwjax Muon`` (``muon=True``) or ``lwjax AdamW (ZeRO-1)``.

    :func:`lwjax.tools.bench.workload_optimizer` with ``cfg``'s hyper-parameters;
    with ``cfg.fsdp``, over parameters split over ``fsdp`` (``tensor_axis``).
    """
    return workload_optimizer(
        params,
        mesh,
        cfg.model(),
        muon=muon,
        ns_precision=cfg.ns_precision,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        policy=cfg.policy,
        bucket_size=cfg.bucket_size,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        clip_grad=cfg.clip_grad,
        pipeline_muon=cfg.pipeline_muon,
        tensor_axis=FSDP_AXIS if cfg.fsdp else None,
        stacked=cfg.scan_layers,
    )


def lwjax_step(
    loss, optimizer: LayerwiseOptimizer, *, fsdp: bool = False, overlap_param_gather=False
):
    """``step(params, state, batch) -> (params, state, loss, grad_norm)``.

    Local gradients go into ``optimizer.local_update``, which takes each
    device's gradient of its local mean loss and the mean over dp itself
    (inside its reduce-scatter). With ``fsdp`` the loss gathers the
    parameters over ``fsdp`` (:func:`fsdp_gather`), whose transpose has summed
    the ``n`` devices' gradients into each block: divided by ``n``, the
    gradient of the mean loss. ``params`` (split as ``optimizer.param_specs``
    says) and ``state`` are donated; ``batch`` is split over the data axes
    on its leading axis. With ``overlap_param_gather`` the step is
    ``step(state, batch) -> (state, loss, grad_norm)``: it gathers the
    parameters from the masters first and none at the end.
    """
    data_axes = (optimizer.axis, FSDP_AXIS) if fsdp else optimizer.axis
    fsdp_size = optimizer.mesh.shape[FSDP_AXIS] if fsdp else 1

    def local(params, state, batch):
        if overlap_param_gather:
            params = optimizer.local_params(state)
        value, grads = jax.value_and_grad(loss)(params, batch)
        grads = jax.tree.map(lambda g: g / fsdp_size, grads) if fsdp else grads
        params, state, metrics = optimizer.local_update(
            grads, state, params, gather=not overlap_param_gather
        )
        return params, state, lax.pmean(value, data_axes), metrics["grad_norm"]

    if overlap_param_gather:
        return jit_shard_map(
            lambda state, batch: local(None, state, batch)[1:],
            optimizer.mesh,
            (optimizer.state_specs, P(data_axes)),
            (optimizer.state_specs, P(), P()),
            donate_argnums=(0,),
        )
    specs = optimizer.param_specs
    return jit_shard_map(
        local,
        optimizer.mesh,
        (specs, optimizer.state_specs, P(data_axes)),
        (specs, optimizer.state_specs, P(), P()),
        donate_argnums=(0, 1),
    )


def fsdp_specs(config: GPTConfig, devices: int) -> dict:
    """Every parameter of ``config`` split over ``fsdp`` on its last axis, as a
    ``PartitionSpec`` tree (layer-stacked leaves keep their layer axis whole).

    Raises:
      ValueError: a leaf whose last axis does not divide by ``devices``.
    """
    shapes = config.param_shapes()
    uneven = {key: shape for key, shape in shapes.items() if shape[-1] % devices}
    if uneven:
        raise ValueError(
            f"TrainBenchConfig.fsdp: {devices} devices do not divide the last axis of "
            f"{', '.join(f'{k} {s}' for k, s in uneven.items())}."
        )
    return tree_from_keys(
        {key: P(*[None] * (len(shape) - 1), FSDP_AXIS) for key, shape in shapes.items()}
    )


def fsdp_gather(tree, *, reduce_in_fp32: bool = False):
    """Inside ``shard_map``: each leaf's blocks all-gathered over ``fsdp`` on its last axis.

    The transpose of the all-gather is a reduce-scatter: the gradient of each
    block is the sum over the ``fsdp`` devices of their gradients of it, taken
    in the leaf's dtype, or with ``reduce_in_fp32`` in fp32 and rounded to the
    leaf's dtype once (``TrainBenchConfig.grad_reduce_in_fp32``: where the
    gradients are reduced in the fully sharded step).
    """
    return jax.tree.map(_gather_reduced_in_fp32 if reduce_in_fp32 else _gather, tree)


def _gather(x: jax.Array) -> jax.Array:
    return lax.all_gather(x, FSDP_AXIS, axis=x.ndim - 1, tiled=True)


@jax.custom_vjp
def _gather_reduced_in_fp32(x: jax.Array) -> jax.Array:
    return _gather(x)


def _scatter_in_fp32(_, g):
    summed = lax.psum_scatter(
        g.astype(jnp.float32), FSDP_AXIS, scatter_dimension=g.ndim - 1, tiled=True
    )
    return (summed.astype(g.dtype),)


_gather_reduced_in_fp32.defvjp(lambda x: (_gather(x), None), _scatter_in_fp32)


def lwjax_optax_step(loss, optimizer: LayerwiseOptimizer, *, per_device: bool):
    """``step(params, state, batch) -> (params, state, loss)``: the optax form under ``jax.jit``.

    Gradients come from ``jax.grad`` on the global batch (GSPMD all-reduces
    them), or with ``per_device`` from :func:`lwjax.value_and_grad`
    (reduce-scattered by ``optimizer.update``); ``optax.apply_updates``
    applies the updates. ``params`` and ``state`` are donated.
    """
    grad_fn = value_and_grad(loss, optimizer) if per_device else jax.value_and_grad(loss)

    def step(params, state, batch):
        value, grads = grad_fn(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    replicated = NamedSharding(optimizer.mesh, P())
    return jax.jit(
        step,
        out_shardings=(replicated, state_shardings(optimizer), replicated),
        donate_argnums=(0, 1),
    )


def _is_matrix(path, x) -> bool:
    """A leaf whose (per-layer) parameters have 2+ dims: decayed, as lwjax decays them."""
    stacked = 1 if jax.tree_util.keystr(path).startswith("['decoder']['layers']") else 0
    return x.ndim - stacked >= 2


def optax_adamw(cfg: TrainBenchConfig) -> optax.GradientTransformation:
    r"""AdamW as lwjax applies it to elementwise parameters, clipped as optax clips.

    (lwjax divides by :math:`\lVert g \rVert + 10^{-6}`, optax by :math:`\lVert g \rVert`.)

    .. math::

       g \leftarrow g \min\!\big(1, c / \lVert g \rVert\big), \qquad
       p \leftarrow p - \eta\Big(\frac{\hat m}{\sqrt{\hat v} + \epsilon}
                        + \lambda \mathbb{1}_{\text{matrix}}\, p\Big)

    with :math:`c` = ``clip_grad`` (skipped when ``None``/0), :math:`\eta` =
    ``learning_rate``, :math:`\lambda` = ``weight_decay``, Adam's
    :math:`(\beta_1, \beta_2, \epsilon) = (0.9, 0.999, 10^{-8})`, and the
    decay only on matrices (a stacked ``[L, h]`` norm is ``L`` vectors).
    """
    mask = lambda params: jax.tree_util.tree_map_with_path(_is_matrix, params)  # noqa: E731
    adamw = optax.adamw(
        cfg.learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay, mask=mask
    )
    return optax.chain(optax.clip_by_global_norm(cfg.clip_grad), adamw) if cfg.clip_grad else adamw


def optax_step(loss, tx: optax.GradientTransformation, mesh: Mesh, *, axis: str = "dp"):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``.

    All-reduce, then ``tx`` on every device.

    Parameters and optimizer state are replicated (``P()``) and donated.
    """

    def local(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        grads = lax.pmean(grads, axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(value, axis)

    return jit_shard_map(local, mesh, (P(), P(), P(axis)), (P(), P(), P()), donate_argnums=(0, 1))


def forward_backward_step(
    loss, mesh: Mesh, *, axis: str | tuple[str, ...] = "dp", param_specs=None
):
    r"""``step(params, batch) -> (loss, a sum of squares of the gradients)``: the compute floor.

    ``batch`` is split over ``axis`` (a name or a tuple), ``params`` as ``param_specs`` says
    (``None``: replicated). The sum keeps every gradient computed: of each device's own gradients
    (:math:`\sum_d \lVert g_d \rVert^2`), or with ``params`` split as
    :func:`fsdp_specs` says, of the blocks the gathers' transposes summed
    (:math:`\lVert \sum_d g_d \rVert^2`).
    """

    def local(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        square = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
        return lax.pmean(value, axis), lax.psum(square, axis)

    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P() if param_specs is None else param_specs, P(axis)),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )


def synthetic_batch(
    mesh: Mesh,
    micro_batch: int,
    seq_len: int,
    vocab: int,
    seed: int = 0,
    *,
    axis: str | tuple[str, ...] = "dp",
):
    """Uniformly random tokens ``[devices * micro_batch, seq_len + 1]`` (int32), split over
    ``axis`` (a mesh axis or a tuple of them, ``devices`` in all)."""
    rng = np.random.default_rng(seed)
    devices = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    tokens = rng.integers(0, vocab, (devices * micro_batch, seq_len + 1), dtype=np.int32)
    return jax.device_put(tokens, NamedSharding(mesh, P(axis)))


def _replicated(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Per collective kind, ``(instances, result elements)`` in an optimized HLO module's text.

    A tuple-shaped result (combined collectives, ``*-start`` ops) counts all its
    arrays; kinds: ``all-reduce``, ``reduce-scatter``, ``all-gather``.
    """
    out = {}
    for kind in COLLECTIVE_KINDS:
        sizes = []
        for match in re.finditer(rf"= (\(?[^=]*?\)?) {kind}(-start)?\(", hlo_text):
            shapes = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match[1])
            sizes.append(sum(math.prod(int(d) for d in s.split(",") if d) for s in shapes))
        out[kind] = (len(sizes), sum(sizes))
    return out


def _compiled_bytes(compiled) -> int | None:
    """Device memory of a compiled step: arguments + outputs − donated + temporaries."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )


def _peak_flops(cfg: TrainBenchConfig, device) -> float | None:
    if cfg.peak_flops:
        return cfg.peak_flops
    return next((peak for kind, peak in PEAK_BF16_FLOPS if kind in device.device_kind), None)


def _fsdp_params(config: GPTConfig, key, dtype, mesh: Mesh, specs):
    """:func:`~lwjax.megatron.model.init_params` made split as ``specs`` say (no whole copy)."""
    shardings = named_shardings(mesh, specs)
    return jax.jit(lambda key: init_params(config, key, dtype), out_shardings=shardings)(key)


def _run_contender(name: str, cfg: TrainBenchConfig, mesh, batch) -> dict:
    """Build, compile and time one contender at one dp size; its params and state are freed."""
    key, config = jax.random.key(cfg.seed), cfg.model()
    if cfg.fsdp:
        specs = fsdp_specs(config, mesh.shape[FSDP_AXIS])
        params = _fsdp_params(config, key, cfg.param_dtype, mesh, specs)
        loss = cfg.loss(
            gather=functools.partial(fsdp_gather, reduce_in_fp32=cfg.grad_reduce_in_fp32)
        )
        if name == FORWARD_BACKWARD:
            step = forward_backward_step(loss, mesh, axis=("dp", FSDP_AXIS), param_specs=specs)
            args = (params,)
        else:
            optimizer = lwjax_optimizer(params, mesh, cfg, muon=name == MUON_FSDP)
            step = lwjax_step(loss, optimizer, fsdp=True)
            args = (params, optimizer.init(params))
        return _measure(name, cfg, mesh, batch, step, args)
    loss = cfg.loss()
    if name in (MUON, ADAMW_SHARDED, MUON_OVERLAP, ADAMW_OVERLAP):
        overlap = name in (MUON_OVERLAP, ADAMW_OVERLAP)  # the state's masters hold the params
        params = _replicated(_init_params(cfg, key, cfg.param_dtype), mesh)
        optimizer = lwjax_optimizer(params, mesh, cfg, muon=name in (MUON, MUON_OVERLAP))
        step = lwjax_step(loss, optimizer, overlap_param_gather=overlap)
        args = (optimizer.init(params),) if overlap else (params, optimizer.init(params))
    elif name in (MUON_OPTAX, MUON_OPTAX_PER_DEVICE):
        params = _replicated(_init_params(cfg, key, cfg.param_dtype), mesh)
        optimizer = lwjax_optimizer(params, mesh, cfg)
        per_device = name == MUON_OPTAX_PER_DEVICE
        step = lwjax_optax_step(loss, optimizer, per_device=per_device)
        args = (params, optimizer.init(params))
    elif name == ADAMW_REPLICATED:
        params = _replicated(_init_params(cfg, key, "float32"), mesh)
        tx = optax_adamw(cfg)
        step, args = optax_step(loss, tx, mesh), (params, _replicated(tx.init(params), mesh))
    else:
        step, args = (
            forward_backward_step(loss, mesh),
            (_replicated(_init_params(cfg, key, cfg.param_dtype), mesh),),
        )
    record = _measure(name, cfg, mesh, batch, step, args)
    if name == MUON:  # the compute Muon adds to forward+backward, once per dp size
        record["newton_schulz"] = newton_schulz_floor(
            optimizer.plan, mesh, cfg.ns_precision, cfg.iters, cfg.warmup
        )
    return record


def _init_params(cfg: TrainBenchConfig, key, dtype) -> dict:
    """The workload's initial parameters, their layers stacked or (``scan_layers=False``) a list."""
    params = init_params(cfg.model(), key, dtype)
    return params if cfg.scan_layers else unstack_layers(params)


def _measure(name: str, cfg: TrainBenchConfig, mesh, batch, step, args) -> dict:
    """Compile ``step`` on ``args`` and ``batch``, time it, and record what it holds."""
    compiled = step.lower(*args, batch).compile()
    text = compiled.as_text()
    record = dict(
        compiled_bytes_per_device=_compiled_bytes(compiled),
        attention="cudnn" if "cudnn$fmha" in text else "xla",
        collectives=collectives(text),
    )
    # Under PGLE the step is called through jit, which profiles the first calls and recompiles; the
    # executable compiled above only gives the memory figures then.
    run = step if cfg.pgle else compiled
    warmup = warmup_calls(cfg.warmup, cfg.pgle)
    n = len(args)  # (params, state), the state alone, or forward+backward's params
    if name == FORWARD_BACKWARD:
        fn, args = (lambda p, out: (p, run(p, batch))), (*args, None)
    else:
        fn = lambda *a: run(*a, batch)[:n]  # noqa: E731
    with pgle() if cfg.pgle else contextlib.nullcontext():
        seconds, args = time_steps(fn, args, cfg.iters, warmup)
        if cfg.profile_dir:
            directory = f"{cfg.profile_dir}/{re.sub('[^a-z0-9]+', '_', name.lower()).strip('_')}"
            record["profile"], args = profile_steps(fn, args, PROFILED_STEPS, directory)
        record["state_bytes_per_device"] = bytes_per_device(args[:n])
        if name != FORWARD_BACKWARD:
            out = run(*args, batch)
            record["loss"] = float(out[n])
            if name in LWJAX_STEPS:
                record["grad_norm"] = float(out[n + 1])  # above clip_grad: clipping bound
    record["step_ms"] = seconds * 1e3
    stats = mesh.devices.flat[0].memory_stats()  # None on CPU
    record["peak_bytes_so_far"] = stats.get("peak_bytes_in_use") if stats else None
    record["device_bytes_limit"] = stats.get("bytes_limit") if stats else None
    return record


def run_train_bench(cfg: TrainBenchConfig) -> list[dict]:
    """Time a full training step: lwjax Muon, lwjax AdamW, optax AdamW, forward+backward alone.

    Returns:
      One record per (contender, dp): ``step_ms`` (median), ``tokens_per_s``
      (global), ``mfu`` (model FLOPs utilisation over all dp devices, see
      :func:`model_flops_per_token`; ``None`` without a known peak),
      ``optimizer_ms`` (``step_ms`` minus forward+backward's), ``floor_ms``
      (what no schedule removes from the step: forward+backward's
      ``step_ms``, plus for lwjax's Muon steps the busiest rank's
      Newton–Schulz, ``ns_computed_ms`` of the Muon record's
      ``newton_schulz``, :func:`lwjax.tools.bench.newton_schulz_floor`; not
      recorded for the fully sharded Muon),
      ``compiled_bytes_per_device`` (XLA's estimate for the step),
      ``peak_bytes_so_far`` (device 0's peak memory since the process
      started, a running maximum over the records; ``None`` on CPU),
      ``device_bytes_limit`` (what XLA may allocate on a device; ``None`` on
      CPU), ``replicated_bytes`` (the parameters in ``param_dtype`` plus fp32
      gradients: what one device would hold before any optimizer state if
      the model were replicated), ``state_bytes_per_device`` (parameters plus optimizer state on one
      device), ``loss`` of one more step after the timed ones,
      ``attention`` (``"cudnn"`` where the compiled step calls cuDNN's fused
      attention, else ``"xla"``), ``grad_norm`` of that step (lwjax contenders:
      above ``clip_grad``, the clip bound, so a pipelined Muon step ran
      serially, or recomputed its directions if the step before did not clip),
      ``profile`` (with ``profile_dir``: :func:`lwjax.tools.bench.profile_steps`'s
      summary of device 0's kernels; empty without a GPU), and the settings
      (``warmup``: the untimed calls each contender made first). The Muon
      record adds ``muon_overhead_pct``: per other contender,
      :math:`100\\,(t_\\text{Muon} / t - 1)`. With ``megatron_script``,
      Megatron-Core's contenders follow each dp size's (:func:`megatron_train_records`,
      run before JAX starts, which then holds most of each GPU's memory).
    """
    model = cfg.model()
    # Megatron first: once JAX starts, XLA holds most of each GPU's memory (75% by default).
    megatron = {
        dp: megatron_train_records(cfg, dp, dp * cfg.micro_batch * cfg.seq_len)
        for dp in (cfg.dp_sizes if cfg.megatron_script else ())
    }
    devices = jax.devices()
    numel = sum(math.prod(s) for s in model.param_shapes().values())
    flops_per_token = model_flops_per_token(model, cfg.seq_len)
    peak = _peak_flops(cfg, devices[0])
    muon = MUON_FSDP if cfg.fsdp else MUON
    names = [
        muon,
        *(OPTAX_FORM_CONTENDERS if cfg.optax_form else ()),
        *([MUON_OVERLAP] if cfg.overlap_param_gather else []),
        ADAMW_FSDP if cfg.fsdp else ADAMW_SHARDED,
        *([ADAMW_OVERLAP] if cfg.overlap_param_gather else []),
        *([ADAMW_REPLICATED] if cfg.baselines else []),
        FORWARD_BACKWARD,
    ]
    records = []
    for dp in cfg.dp_sizes:
        if dp > len(devices):
            raise ValueError(
                f"TrainBenchConfig.dp_sizes: dp={dp} exceeds the {len(devices)} available devices."
            )
        if cfg.fsdp:
            mesh = Mesh(np.array(devices[:dp]).reshape(1, dp), ("dp", FSDP_AXIS))
        else:
            mesh = Mesh(np.array(devices[:dp]), ("dp",))
        batch = synthetic_batch(
            mesh,
            cfg.micro_batch,
            cfg.seq_len,
            model.vocab_size,
            cfg.seed,
            axis=("dp", FSDP_AXIS) if cfg.fsdp else "dp",
        )
        tokens = dp * cfg.micro_batch * cfg.seq_len
        base = dict(
            workload=cfg.workload,
            layers=model.num_layers,
            params=numel,
            dp=dp,
            seq_len=cfg.seq_len,
            micro_batch=cfg.micro_batch,
            global_batch=dp * cfg.micro_batch,
            tokens_per_step=tokens,
            remat=cfg.remat,
            param_dtype=cfg.param_dtype,
            fsdp=cfg.fsdp,
            # parameters (param_dtype) and fp32 gradients whole on every device: the criterion
            # of a model too big to replicate
            replicated_bytes=numel * (jnp.dtype(cfg.param_dtype).itemsize + 4),
            model_flops_per_token=flops_per_token,
            pipeline_muon=cfg.pipeline_muon,
            overlap_param_gather=cfg.overlap_param_gather,
            scan_layers=cfg.scan_layers,
            pgle=cfg.pgle,
            iters=cfg.iters,
            warmup=warmup_calls(cfg.warmup, cfg.pgle),
            device=devices[0].device_kind,
            jax=jax.__version__,
        )
        rows = {}
        for name in names:
            r = _run_contender(name, cfg, mesh, batch)
            seconds = r["step_ms"] / 1e3
            r["tokens_per_s"] = tokens / seconds
            r["mfu"] = tokens * flops_per_token / (seconds * dp * peak) if peak else None
            rows[name] = dict(base, contender=name, **r)
        floor_ms = rows[FORWARD_BACKWARD]["step_ms"]
        ns = rows[muon].get("newton_schulz")  # not measured for the fully sharded Muon
        for name in names[:-1]:
            rows[name]["optimizer_ms"] = rows[name]["step_ms"] - floor_ms
            # What no schedule removes: forward+backward, and a Muon step's Newton-Schulz.
            if "Muon" not in name:
                rows[name]["floor_ms"] = floor_ms
            elif ns:
                rows[name]["floor_ms"] = floor_ms + ns["ns_computed_ms"]
        muon_ms = rows[muon]["step_ms"]
        rows[muon]["muon_overhead_pct"] = {
            n: 100 * (muon_ms / rows[n]["step_ms"] - 1)
            for n in names[1:-1]
            if "Muon" not in n and n != ADAMW_OVERLAP
        }
        if cfg.overlap_param_gather:  # against AdamW with the same gathers
            rows[MUON_OVERLAP]["muon_overhead_pct"] = {
                ADAMW_OVERLAP: 100
                * (rows[MUON_OVERLAP]["step_ms"] / rows[ADAMW_OVERLAP]["step_ms"] - 1)
            }
        for name in OPTAX_FORM_CONTENDERS:
            if name in rows:  # the optax form against make_train_step's per-device step
                rows[name]["vs_lwjax_step_pct"] = 100 * (rows[name]["step_ms"] / muon_ms - 1)
        records += rows.values()
        for r in megatron.get(dp, ()):
            seconds = r.get("step_ms", 0) / 1e3
            mfu = tokens * flops_per_token / (seconds * dp * peak) if peak and seconds else None
            records.append(dict(base, **r, mfu=mfu))
    return records


def megatron_train_records(cfg: TrainBenchConfig, dp: int, tokens: int) -> list[dict]:
    """Megatron-Core's training step on ``dp`` GPUs (torchrun of ``cfg.megatron_script``),
    one record per contender it ran (:data:`MEGATRON_CONTENDERS`).

    ``optimizer_ms`` is against Megatron's own forward+backward, and each Muon
    record's ``muon_overhead_pct`` against Megatron's Adam with the same overlap.
    A contender the script skipped is reported with its reason, not dropped.
    """
    args = [
        *("--preset", cfg.workload, "--layers", str(cfg.model().num_layers)),
        *("--seq-len", str(cfg.seq_len), "--micro-batch", str(cfg.micro_batch)),
        *("--iters", str(cfg.iters), "--warmup", str(cfg.warmup)),
        *("--lr", repr(cfg.learning_rate), "--weight-decay", repr(cfg.weight_decay)),
        *("--clip-grad", repr(cfg.clip_grad or 0.0), "--ns-prec", cfg.ns_precision),
        "--grad-reduce-in-fp32" if cfg.grad_reduce_in_fp32 else "--no-grad-reduce-in-fp32",
        *(["--recompute"] if cfg.remat else []),
    ]
    result = run_torch_script(cfg.megatron_script, dp, args, timeout=1800)
    ran = result["contenders"]
    floor = ran.get("fwd_bwd", {}).get("median_ms")
    records = []
    for key, name in MEGATRON_CONTENDERS.items():
        r = ran.get(key)
        if r is None:
            continue
        if "median_ms" not in r:
            records.append(dict(contender=name, skipped=r.get("skipped", "no time reported")))
            continue
        record = dict(
            contender=name,
            step_ms=r["median_ms"],
            tokens_per_s=tokens / (r["median_ms"] / 1e3),
            compiled_bytes_per_device=None,
            measured_peak_bytes=r.get("peak_mem_bytes"),
            flags=r.get("flags"),
            megatron=result.get("config", {}).get("versions"),
            attention=result.get("config", {}).get("attention"),
        )
        if r.get("skipped"):  # flags it ran without: named in the table too
            record["skipped_flags"] = r["skipped"]
            record["contender"] = f"{name} (without {', '.join(map(str, r['skipped']))})"
        if floor and key != "fwd_bwd":
            record["optimizer_ms"] = r["median_ms"] - floor
        adam = ran.get(key.replace("muon", "adam"), {}).get("median_ms")
        if key.startswith("muon") and adam:
            record["muon_overhead_pct"] = {
                MEGATRON_CONTENDERS[key.replace("muon", "adam")]: 100 * (r["median_ms"] / adam - 1)
            }
        records.append(record)
    return records
