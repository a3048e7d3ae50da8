"""Training loops of the demo: one driver for any ``step(params, state, batch)``.

Two step builders share it. lwjax's :func:`lwjax.make_train_step` (ZeRO-1
communication, state sharded over dp, Muon on whole owned matrices) and
:func:`make_replicated_step`, the plain data-parallel baseline: every device
holds the full optax state and applies the same update to the all-reduced
(``pmean``) gradient,

.. math::

   g = \\frac{1}{dp}\\sum_r \\nabla L_r, \\qquad
   (u, s) = \\text{tx.update}(g, s, p), \\qquad
   p \\leftarrow p + u.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.parallel.jit import jit_shard_map


def make_replicated_step(
    loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, *, axis: str = "dp"
):
    """Build a jitted data-parallel ``step(params, opt_state, batch)`` with replicated optax state.

    Returns:
      ``step`` with the signature of :func:`lwjax.make_train_step`'s result;
      ``metrics`` holds the dp-mean ``loss``. ``params`` and ``opt_state`` are donated.
    """

    def local_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        loss, grads = lax.pmean((loss, grads), axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return jit_shard_map(
        local_step, mesh, (P(), P(), P(axis)), (P(), P(), P()), donate_argnums=(0, 1)
    )


def init_replicated(tx: optax.GradientTransformation, params, mesh: Mesh):
    """``tx.init(params)``, replicated on every device of ``mesh``."""
    return jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)


def make_eval_fn(loss_fn: Callable, mesh: Mesh, *, axis: str = "dp"):
    """Jitted ``eval_fn(params, batch) -> mean loss``, the batch split over ``axis``."""
    return jax.jit(
        jax.shard_map(
            lambda params, batch: lax.pmean(loss_fn(params, batch), axis),
            mesh=mesh,
            in_specs=(P(), P(axis)),
            out_specs=P(),
            check_vma=False,
        )
    )


@dataclasses.dataclass
class RunLog:
    """What one training run recorded.

    Attributes:
      name: Run label.
      losses: Training loss per step (dp-mean over the global batch).
      val_losses: ``(step, loss)`` pairs; ``step`` counts applied steps.
      step_times: Wall seconds per step, including the first (compiling) one.
    """

    name: str
    losses: list[float] = dataclasses.field(default_factory=list)
    val_losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    step_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def steady_step_time(self) -> float:
        """Median step time without the first two (compile and warm-up) steps."""
        times = self.step_times[2:] or self.step_times
        return float(np.median(times))

    def final_loss(self, last: int = 10) -> float:
        """Mean training loss over the last ``last`` steps."""
        return float(np.mean(self.losses[-last:]))


def train(
    name: str,
    step: Callable,
    params,
    state,
    batches: Iterator[dict],
    num_steps: int,
    *,
    eval_fn: Callable,
    eval_batch: dict,
    eval_every: int,
    progress=None,
):
    """Run ``num_steps`` steps of ``step`` and evaluate every ``eval_every`` steps and at the end.

    Args:
      name: Label for the log and the progress bar.
      step: ``step(params, state, batch) -> (params, state, metrics)`` with a ``loss`` metric.
      params, state: Initial parameters and optimizer state (donated to ``step``).
      batches: Iterator of global batches.
      num_steps: Steps to run.
      eval_fn: ``eval_fn(params, batch) -> loss``.
      eval_batch: The fixed validation batch.
      eval_every: Evaluation period in steps (0: only at the start and the end).
      progress: A ``rich.progress.Progress`` to report to, or ``None``.

    Returns:
      ``(params, state, RunLog)``.
    """
    log = RunLog(name)
    task = (
        None
        if progress is None
        else progress.add_task(name, total=num_steps, loss=float("nan"), tps=0.0)
    )
    log.val_losses.append((0, float(eval_fn(params, eval_batch))))
    for i in range(num_steps):
        batch = next(batches)
        tokens = batch["inputs"].size
        start = time.perf_counter()
        params, state, metrics = step(params, state, batch)
        loss = float(metrics["loss"])  # waits for the step
        log.step_times.append(time.perf_counter() - start)
        log.losses.append(loss)
        if (eval_every and (i + 1) % eval_every == 0) or i + 1 == num_steps:
            log.val_losses.append((i + 1, float(eval_fn(params, eval_batch))))
        if progress is not None:
            progress.update(task, advance=1, loss=loss, tps=tokens / log.step_times[-1])
    return params, state, log
