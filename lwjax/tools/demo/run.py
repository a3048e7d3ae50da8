"""``lwjax demo``: train a small GPT with layer-wise Muon, then with a replicated optax baseline.

Both runs start from the same initial parameters and see the same batches of
Python-stdlib bytes (:mod:`lwjax.tools.demo.data`) on the same data-parallel mesh;
only the optimizer differs:

* ``lwjax``: :func:`lwjax.layerwise_muon`: Muon on the hidden matrices, each
  owned whole by one rank, AdamW on embedding, head and norms; state sharded
  over dp (ZeRO-1 communication).
* baseline ``adamw``: ``optax.adamw`` on every parameter, state replicated,
  gradients all-reduced; or ``optax_muon``: ``optax.contrib.muon`` replicated,
  so every device runs Newton–Schulz on every matrix.

Both use a warmup-cosine schedule, the same gradient clipping, weight decay and
Adam betas; each its own peak learning rate, tuned by a small sweep
(:mod:`lwjax.tools.demo.optimizers` builds both optimizers).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from lwjax.tools.demo.config import BASELINES, Baseline, DemoConfig
from lwjax.tools.demo.optimizers import baseline_optimizer, lwjax_optimizer

# DemoConfig and its choices are re-exported from here, their old home.
__all__ = ["BASELINES", "Baseline", "DemoConfig", "run_demo"]


def _run_summary(
    optimizer: str, peak: float, log, state_bytes: int, param_bytes: int, tokens_per_step: int
) -> dict:
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


@dataclasses.dataclass(frozen=True)
class _Workload:
    """What both runs share: mesh, model, initial weights, data and evaluation."""

    mesh: Any
    gpt_config: Any  # the model's GPTConfig
    params: Any  # the model's nnx.Param state: the optimizer's template
    initial: Any  # the same as numpy arrays: both runs start here (steps donate their inputs)
    loss_fn: Callable
    corpus: Any  # the ByteCorpus
    val_batch: dict
    eval_fn: Callable


def _local_job(config: DemoConfig):
    """The data-parallel mesh, and ``config`` as this process runs it (only process 0 reports)."""
    from lwjax.tools.demo.devices import local_mesh

    mesh = local_mesh(config.devices)  # before any other JAX work: sizes the CPU backend
    import jax

    if jax.process_index() != 0:  # one process prints and writes for the whole job
        config = dataclasses.replace(config, out=None, progress=False)
    return mesh, config


def _prepare(config: DemoConfig, mesh) -> _Workload:
    """Check the batch against the mesh; load the corpus; build the model and the evaluation."""
    import jax
    import numpy as np
    from flax import nnx

    from lwjax.tools.demo import data as data_lib
    from lwjax.tools.demo import loops
    from lwjax.tools.demo.model import GPT, MODEL_SIZES, make_loss_fn

    dp = mesh.size
    if config.batch_size % dp:
        raise ValueError(
            f"DemoConfig.batch_size must divide by the {dp} devices; "
            f"got batch_size={config.batch_size}. Pass a multiple of {dp} or fewer devices."
        )
    corpus = data_lib.load_stdlib_corpus(config.max_corpus_bytes)
    gpt_config = dataclasses.replace(
        MODEL_SIZES[config.model_size],
        scan_layers=config.scan_layers,
        fused_qkv=config.fused_qkv,
        tied_embedding=config.tied_embedding,
    )
    graphdef, params, rest = nnx.split(GPT(gpt_config, rngs=nnx.Rngs(config.seed)), nnx.Param, ...)
    loss_fn = make_loss_fn(graphdef, rest)
    windows = -(-config.eval_windows // dp) * dp
    return _Workload(
        mesh=mesh,
        gpt_config=gpt_config,
        params=params,
        initial=jax.tree.map(np.asarray, params),
        loss_fn=loss_fn,
        corpus=corpus,
        val_batch=data_lib.eval_batch(corpus.val, windows, config.seq_len),
        eval_fn=loops.make_eval_fn(loss_fn, mesh),
    )


def _progress(config: DemoConfig, console):
    """One ``rich`` progress bar per run, with its loss and tokens/s; off without ``progress``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:>9,.0f} tok/s"),
        TimeElapsedColumn(),
        console=console,
        disable=not config.progress,
    )


def _train_run(
    config: DemoConfig,
    work: _Workload,
    name: str,
    peak: float,
    init: Callable,
    step: Callable,
    progress,
) -> dict:
    """Train from the shared initial weights on the shared batches; return the run's summary.

    Args:
      name: The optimizer's label.
      peak: Its peak learning rate (reported).
      init: ``init(params) -> state``, the optimizer state on the mesh.
      step: ``step(params, state, batch) -> (params, state, metrics)``.
      progress: The ``rich`` progress to report to.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lwjax.tools.demo import data as data_lib
    from lwjax.tools.demo import loops
    from lwjax.tools.demo.devices import bytes_per_device

    params = jax.device_put(work.initial, NamedSharding(work.mesh, P()))
    state = init(params)
    state_bytes, param_bytes = bytes_per_device(state), bytes_per_device(params)
    batches = data_lib.train_batches(
        work.corpus.train, config.batch_size, config.seq_len, seed=config.seed
    )
    _, _, log = loops.train(
        name,
        step,
        params,
        state,
        batches,
        config.steps,
        eval_fn=work.eval_fn,
        eval_batch=work.val_batch,
        eval_every=config.eval_every,
        progress=progress,
    )
    tokens_per_step = config.batch_size * config.seq_len
    return _run_summary(name, peak, log, state_bytes, param_bytes, tokens_per_step)


def _train_runs(config: DemoConfig, work: _Workload, optimizer, progress) -> dict:
    """Train with lwjax, then with the baseline (unless ``"none"``); return the runs' summaries."""
    import lwjax
    from lwjax.tools.demo import loops

    runs = {
        "lwjax": _train_run(
            config,
            work,
            "layer-wise Muon (lwjax)",
            config.learning_rate,
            optimizer.init,
            lwjax.make_train_step(work.loss_fn, optimizer),
            progress,
        )
    }
    if config.baseline != "none":
        name, peak, tx = baseline_optimizer(config, optimizer.plan)
        runs[config.baseline] = _train_run(
            config,
            work,
            name,
            peak,
            lambda params: loops.init_replicated(tx, params, work.mesh),
            loops.make_replicated_step(work.loss_fn, tx, work.mesh),
            progress,
        )
    return runs


def _metrics(config: DemoConfig, work: _Workload, routes, runs: dict) -> dict:
    """The JSON-ready metrics of :func:`run_demo`, without ``wall_s`` and with no outputs yet."""
    import jax
    import numpy as np

    import lwjax

    corpus = work.corpus
    return {
        "lwjax_version": lwjax.__version__,
        "jax_version": jax.__version__,
        "config": dataclasses.asdict(config),
        "model": {
            "size": config.model_size,
            "num_params": int(sum(np.prod(r.shape) for r in routes)),
            "num_muon_matrices": sum(r.num_params for r in routes if r.is_muon),
            "gpt_config": dataclasses.asdict(work.gpt_config),
        },
        "devices": {"platform": work.mesh.devices.flat[0].platform, "count": work.mesh.size},
        "data": {
            "root": corpus.root,
            "num_files": corpus.num_files,
            "train_tokens": int(corpus.train.size),
            "val_tokens": int(work.val_batch["inputs"].size),
            "unigram_entropy": corpus.unigram_entropy(),
        },
        "runs": runs,
        "outputs": {},
    }


def _write_and_report(metrics: dict, config: DemoConfig, console, start: float) -> None:
    """Write ``loss.png`` and ``metrics.json`` into ``config.out``; print the summary table."""
    from lwjax.tools.demo import report

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
    mesh, config = _local_job(config)
    work = _prepare(config, mesh)
    from rich.console import Console

    console = console or Console(width=None if sys.stdout.isatty() else 120)
    progress = _progress(config, console)
    optimizer = lwjax_optimizer(config, work.params, work.mesh, work.gpt_config)
    with progress:
        runs = _train_runs(config, work, optimizer, progress)
    metrics = _metrics(config, work, optimizer.plan.routes, runs)
    _write_and_report(metrics, config, console, start)
    return metrics
