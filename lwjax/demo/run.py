"""``lwjax demo``: train a small GPT with layer-wise Muon, then with a replicated optax baseline.

Both runs start from the same initial parameters and see the same batches of
Python-stdlib bytes (:mod:`lwjax.demo.data`) on the same data-parallel mesh;
only the optimizer differs:

* ``lwjax``: :func:`lwjax.layerwise_muon`: Muon on the hidden matrices, each
  owned whole by one rank, AdamW on embedding, head and norms; state sharded
  over dp (ZeRO-1 communication).
* baseline ``adamw``: ``optax.adamw`` on every parameter, state replicated,
  gradients all-reduced; or ``optax_muon``: ``optax.contrib.muon`` replicated,
  so every device runs Newton–Schulz on every matrix.

Both use a warmup-cosine schedule, the same gradient clipping, weight decay and
Adam betas; each its own peak learning rate, tuned by a small sweep. The Muon
update is scaled by ``0.2·sqrt(max(m, n))`` (``scale_mode="spectral"``,
``extra_scale_factor=0.2``), which gives it AdamW's update RMS, so one learning
rate serves lwjax's Muon and AdamW parts (as in Megatron).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Literal

BASELINES = ("adamw", "optax_muon", "none")
Baseline = Literal["adamw", "optax_muon", "none"]
MUON_RMS_MATCH = 0.2  # extra_scale_factor that gives Muon updates AdamW's RMS (Moonlight)
# Peak learning rates picked by a sweep over {1, 2, 3, 5, 10, 20, 40}e-3 on the default run
# (150 steps, small model): best validation loss for each optimizer.
LEARNING_RATE = 0.02
ADAMW_LEARNING_RATE = 0.005


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Options of :func:`run_demo` (and of ``lwjax demo``, flag ``--<field-name>``).

    Attributes:
      steps: Training steps per run.
      model_size: A key of :data:`lwjax.demo.model.MODEL_SIZES`.
      devices: Data-parallel devices; ``None``: all local devices (8 virtual
        CPU devices when there is no accelerator).
      batch_size: Global batch in sequences; must divide by the device count.
      seq_len: Bytes per sequence.
      learning_rate: Peak learning rate of lwjax (Muon and its AdamW part).
      baseline_learning_rate: Peak learning rate of the baseline; ``None``:
        ``ADAMW_LEARNING_RATE`` for ``adamw``, ``learning_rate`` for ``optax_muon``.
      warmup_steps: Linear warmup before the cosine decay (to 10 %).
      weight_decay: Decoupled weight decay of matrices and embeddings.
      clip_grad: Global gradient-norm clip.
      baseline: ``"adamw"``, ``"optax_muon"`` or ``"none"``.
      eval_every: Validation period in steps (also at the start and the end).
      eval_windows: Validation sequences (rounded up to a multiple of the device count).
      seed: Seed of the initial parameters and the batch order.
      scan_layers: Train the scan-over-layers variant of the model.
      fused_qkv: One fused QKV projection (routed with ``qkv_split``).
      tied_embedding: Tie the output head to the embedding (routed with ``tied``).
      out: Directory for ``metrics.json`` and ``loss.png``; ``None`` writes nothing.
      progress: Show progress bars and the summary table.
      max_corpus_bytes: Read at most this many stdlib bytes (``None``: all top-level modules).
    """

    steps: int = 150
    model_size: str = "small"
    devices: int | None = None
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = LEARNING_RATE
    baseline_learning_rate: float | None = None
    warmup_steps: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    baseline: Baseline = "adamw"
    eval_every: int = 25
    eval_windows: int = 64
    seed: int = 0
    scan_layers: bool = False
    fused_qkv: bool = True
    tied_embedding: bool = False
    out: str | None = "lwjax-demo"
    progress: bool = True
    max_corpus_bytes: int | None = None

    def __post_init__(self):
        from lwjax.demo.model import MODEL_SIZES

        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"DemoConfig.model_size must be one of {tuple(MODEL_SIZES)}; got {self.model_size!r}.")
        if self.baseline not in BASELINES:
            raise ValueError(f"DemoConfig.baseline must be one of {BASELINES}; got {self.baseline!r}.")
        for name in ("steps", "batch_size", "seq_len", "eval_windows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DemoConfig.{name} must be a positive int; got {name}={value!r}.")
        if self.devices is not None and self.devices < 1:
            raise ValueError(f"DemoConfig.devices must be >= 1 or None; got devices={self.devices!r}.")
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ValueError(
                f"DemoConfig.warmup_steps and eval_every must be >= 0; got {self.warmup_steps=}, {self.eval_every=}."
            )
        if not self.learning_rate > 0:
            raise ValueError(f"DemoConfig.learning_rate must be > 0; got learning_rate={self.learning_rate!r}.")


def _schedule(config: DemoConfig, peak: float):
    """Linear warmup to ``peak``, then cosine decay to ``peak / 10`` at the last step."""
    import optax

    warmup = max(1, min(config.warmup_steps, config.steps - 1))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(config.steps, warmup + 1), peak * 0.1)


def _baseline_tx(config: DemoConfig, plan):
    """The replicated optax baseline, routed and masked like lwjax's plan."""
    import jax
    import optax

    peak = config.baseline_learning_rate
    if peak is None:
        peak = ADAMW_LEARNING_RATE if config.baseline == "adamw" else config.learning_rate
    schedule = _schedule(config, peak)
    decay_mask = jax.tree_util.tree_unflatten(plan.treedef, [len(r.param_shape) >= 2 for r in plan.routes])
    clip = optax.clip_by_global_norm(config.clip_grad)
    if config.baseline == "adamw":
        return "AdamW (optax, replicated)", peak, optax.chain(
            clip, optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=config.weight_decay, mask=decay_mask)
        )
    dims = jax.tree_util.tree_unflatten(
        plan.treedef,
        [optax.contrib.MuonDimensionNumbers(r.stack_dims, r.stack_dims + 1) if r.is_muon else None
         for r in plan.routes],
    )
    return "Muon (optax.contrib, replicated)", peak, optax.chain(
        clip,
        optax.contrib.muon(
            schedule, beta=0.95, weight_decay=config.weight_decay, weight_decay_mask=decay_mask,
            adam_weight_decay=config.weight_decay, muon_weight_dimension_numbers=dims,
            consistent_rms=MUON_RMS_MATCH,
        ),
    )


def _run_summary(optimizer: str, peak: float, log, state_bytes: int, param_bytes: int, tokens_per_step: int) -> dict:
    step_time = log.steady_step_time
    return {
        "optimizer": optimizer,
        "peak_learning_rate": peak,
        "final_train_loss": log.final_loss(),
        "final_val_loss": log.val_losses[-1][1],
        "val_losses": [list(v) for v in log.val_losses],
        "train_losses": log.losses,
        "step_time_s": step_time,
        "first_step_s": log.step_times[0],
        "tokens_per_s": tokens_per_step / step_time,
        "state_bytes_per_device": state_bytes,
        "param_bytes_per_device": param_bytes,
        "wall_s": sum(log.step_times),
    }


def run_demo(config: DemoConfig | None = None, *, console=None) -> dict:
    """Train the demo GPT with lwjax and with the baseline; return (and write) the metrics.

    Args:
      config: The options; ``None`` means ``DemoConfig()``.
      console: A ``rich.console.Console`` for progress and the summary; ``None``:
        a new one on stdout (unused when ``config.progress`` is false).

    Returns:
      A JSON-ready dict: ``config``, ``model``, ``devices``, ``data`` (with
      ``unigram_entropy``), ``runs`` (``lwjax`` and the baseline, each with
      ``final_train_loss``, ``final_val_loss``, ``step_time_s``,
      ``tokens_per_s``, ``state_bytes_per_device``, loss curves) and ``outputs``.

    Raises:
      ValueError: The batch does not divide over the devices, or more devices
        are asked for than exist.
    """
    start = time.perf_counter()
    config = config if config is not None else DemoConfig()
    from lwjax.demo.devices import local_mesh

    mesh = local_mesh(config.devices)  # before any other JAX work: sizes the CPU backend
    import jax

    if jax.process_index() != 0:  # one process prints and writes for the whole job
        config = dataclasses.replace(config, out=None, progress=False)
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    import lwjax
    from lwjax.demo import data as data_lib
    from lwjax.demo import loops, report
    from lwjax.demo.devices import bytes_per_device
    from lwjax.demo.model import GPT, MODEL_SIZES, lwjax_routing, make_loss_fn
    from lwjax.muon import MuonConfig
    from lwjax.optimizer import OptimizerConfig

    dp = mesh.size
    if config.batch_size % dp:
        raise ValueError(
            f"DemoConfig.batch_size must divide by the {dp} devices; got batch_size={config.batch_size}. "
            f"Pass a multiple of {dp} or fewer devices."
        )
    corpus = data_lib.load_stdlib_corpus(config.max_corpus_bytes)
    gpt_config = dataclasses.replace(
        MODEL_SIZES[config.model_size],
        scan_layers=config.scan_layers, fused_qkv=config.fused_qkv, tied_embedding=config.tied_embedding,
    )
    graphdef, params, rest = nnx.split(GPT(gpt_config, rngs=nnx.Rngs(config.seed)), nnx.Param, ...)
    loss_fn = make_loss_fn(graphdef, rest)
    initial = jax.tree.map(np.asarray, params)  # both runs start here (steps donate their inputs)
    replicated = NamedSharding(mesh, P())
    windows = -(-config.eval_windows // dp) * dp
    val_batch = data_lib.eval_batch(corpus.val, windows, config.seq_len)
    eval_fn = loops.make_eval_fn(loss_fn, mesh)
    tokens_per_step = config.batch_size * config.seq_len

    console = console or Console(width=None if sys.stdout.isatty() else 120)
    progress = Progress(
        TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:>9,.0f} tok/s"),
        TimeElapsedColumn(), console=console, disable=not config.progress,
    )
    optimizer = lwjax.layerwise_muon(
        params, mesh, learning_rate=_schedule(config, config.learning_rate),
        muon=MuonConfig(momentum=0.95, nesterov=True, extra_scale_factor=MUON_RMS_MATCH),
        config=OptimizerConfig(weight_decay=config.weight_decay, clip_grad=config.clip_grad),
        **lwjax_routing(gpt_config),
    )
    runs = {}
    with progress:
        p = jax.device_put(initial, replicated)
        state = optimizer.init(p)
        state_bytes, param_bytes = bytes_per_device(state), bytes_per_device(p)
        batches = data_lib.train_batches(corpus.train, config.batch_size, config.seq_len, seed=config.seed)
        p, state, log = loops.train(
            "layer-wise Muon (lwjax)", lwjax.make_train_step(loss_fn, optimizer), p, state, batches, config.steps,
            eval_fn=eval_fn, eval_batch=val_batch, eval_every=config.eval_every, progress=progress,
        )
        runs["lwjax"] = _run_summary(
            "layer-wise Muon (lwjax)", config.learning_rate, log, state_bytes, param_bytes, tokens_per_step
        )
        if config.baseline != "none":
            name, peak, tx = _baseline_tx(config, optimizer.plan)
            p = jax.device_put(initial, replicated)
            state = loops.init_replicated(tx, p, mesh)
            state_bytes, param_bytes = bytes_per_device(state), bytes_per_device(p)
            batches = data_lib.train_batches(corpus.train, config.batch_size, config.seq_len, seed=config.seed)
            p, state, log = loops.train(
                name, loops.make_replicated_step(loss_fn, tx, mesh), p, state, batches, config.steps,
                eval_fn=eval_fn, eval_batch=val_batch, eval_every=config.eval_every, progress=progress,
            )
            runs[config.baseline] = _run_summary(name, peak, log, state_bytes, param_bytes, tokens_per_step)

    routes = optimizer.plan.routes
    metrics = {
        "lwjax_version": lwjax.__version__,
        "jax_version": jax.__version__,
        "config": dataclasses.asdict(config),
        "model": {
            "size": config.model_size,
            "num_params": int(sum(np.prod(r.shape) for r in routes)),
            "num_muon_matrices": sum(r.num_params for r in routes if r.is_muon),
            "gpt_config": dataclasses.asdict(gpt_config),
        },
        "devices": {"platform": mesh.devices.flat[0].platform, "count": dp},
        "data": {
            "root": corpus.root,
            "num_files": corpus.num_files,
            "train_tokens": int(corpus.train.size),
            "val_tokens": int(val_batch["inputs"].size),
            "unigram_entropy": corpus.unigram_entropy(),
        },
        "runs": runs,
        "outputs": {},
    }
    if config.out is not None:
        out = pathlib.Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        metrics["outputs"] = {"json": str(out / "metrics.json"), "plot": str(out / "loss.png")}
        report.write_plot(metrics, out / "loss.png")
    metrics["wall_s"] = time.perf_counter() - start
    if config.out is not None:
        report.write_json(metrics, out / "metrics.json")
    if config.progress:
        console.print(report.summary_table(metrics))
        if config.out is not None:
            console.print(f"wrote {metrics['outputs']['json']} and {metrics['outputs']['plot']}")
    return metrics
