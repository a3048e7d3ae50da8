"""A loss function's form, apart from the step that calls it: aux values, model state, keys,
micro-batches, and which batch it sees.

:func:`lwjax.make_train_step` calls ``loss_fn(params, [model_state,] batch[, key])`` on each
data-parallel device's slice of the batch (:func:`lwjax.value_and_grad` too). What it takes and
returns follows four options, which also decide the step's arguments after ``(params, state)``:
``[model_state,] batch[, key]``; a fifth, ``batch_stats``, decides which batch it sees.

* ``has_aux``: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged over the
  data-parallel devices and the micro-batches.
* ``mutable``: model state that is not trained (linen ``batch_stats``, the rest of an nnx
  model: ``nnx.split(model, nnx.Param, ...)``) goes in replicated and comes out as
  ``loss_fn`` returned it (``(loss, model_state)``, or ``(loss, (model_state, aux))`` with
  ``has_aux``), its floating leaves averaged over the data-parallel devices (running batch
  statistics: the cross-device mean flax's examples take with ``sync_batch_stats``, here every
  step; each device still normalises by its own batch unless the model's ``BatchNorm`` has
  ``axis_name=optimizer.axis``). Other leaves (RNG counters, keys) must agree across devices.
* ``rng``: the step takes a key last, and ``loss_fn`` gets it folded with the step count
  (``state.count``) and the device's index, so dropout masks differ across devices and steps
  (in nnx, ``nnx.reseed(model, dropout=key)``). Model state is rebuilt inside the traced
  function, so an nnx model merged from it may update its batch statistics and RNG counts;
  a ``loss_fn`` that closes over such state instead fails with flax's ``TraceContextError``,
  to which the adapter adds how to pass the state.
* ``accumulate``: each device splits its slice into :math:`A` micro-batches :math:`b_a` on
  the leading axis, threads the model state through them in order, and takes one optimizer
  step on the means

  .. math::

    \\ell = \\frac{1}{A} \\sum_{a=1}^{A} L(\\theta, b_a), \\qquad
    g = \\frac{1}{A} \\sum_{a=1}^{A} \\nabla_\\theta L(\\theta, b_a),

  where the sum of gradients is kept in fp32 (at least) and micro-batch :math:`a` gets the
  device's key folded with :math:`a - 1`.
* ``batch_stats``: ``"per_device"`` (the default) calls ``loss_fn`` per device, as above, so
  anything it computes over the batch (BatchNorm's mean and variance) is the device's slice's.
  ``"global"`` calls it once on the global batch under ``jax.jit``, outside ``shard_map``:
  XLA's partitioner (GSPMD) splits it by the batch and adds the all-reduces that make every
  batch statistic the global batch's, and the gradients come out reduced
  (all-reduced where they are produced), as in the optax form. The key is folded with the
  step count only (one dropout mask over the global batch), and micro-batch :math:`a` is the
  :math:`a`-th micro-batch of every device's slice together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax

BatchStats = Literal["per_device", "global"]


def check_scalar_loss(out, where: str) -> None:
    """Refuse a ``loss_fn`` result that is a tuple or list where the loss alone is expected.

    ``jax.grad`` would stop on it with "Gradient only defined for scalar-output
    functions"; the usual cause is a ``(loss, aux)`` pair without ``has_aux=True``.

    Raises:
      TypeError: ``out`` is a tuple or list; the message starts with ``where``.
    """
    if isinstance(out, (tuple, list)):
        raise TypeError(
            f"{where}: loss_fn returned a {type(out).__name__} of {len(out)}, not a scalar loss; "
            "if it returns (loss, aux), pass has_aux=True."
        )


@dataclasses.dataclass(frozen=True)
class LossAdapter:
    """``loss_fn`` with its form: how the step calls it and reads its results.

    Attributes:
      loss_fn: The per-device mean loss, ``loss_fn(params, [model_state,] batch[, key])``.
      has_aux: ``loss_fn`` also returns auxiliary values.
      mutable: ``loss_fn`` takes and returns model state.
      rng: ``loss_fn`` takes a PRNG key last.
      accumulate: Micro-batches per device and step, a positive integer.
      batch_stats: ``"per_device"``: ``loss_fn`` sees each device's slice of
        the batch, inside ``shard_map``; ``"global"``: it sees the global
        batch, under ``jax.jit`` (see the module's docstring).
      caller: The public function whose name its errors give.

    Raises:
      ValueError: ``accumulate`` is not a positive integer; ``batch_stats`` is
        neither ``"per_device"`` nor ``"global"``.
    """

    loss_fn: Callable
    has_aux: bool = False
    mutable: bool = False
    rng: bool = False
    accumulate: int = 1
    batch_stats: BatchStats = "per_device"
    caller: str = "make_train_step"

    def __post_init__(self):
        accumulate = self.accumulate
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"{self.caller}: accumulate must be a positive integer; got {accumulate!r}."
            )
        if self.batch_stats not in get_args(BatchStats):
            raise ValueError(
                f"make_train_step: batch_stats must be one of {get_args(BatchStats)}; "
                f"got {self.batch_stats!r}."
            )

    @property
    def per_device(self) -> bool:
        """Whether ``loss_fn`` sees each device's slice of the batch (not the global batch)."""
        return self.batch_stats == "per_device"

    @property
    def argument_names(self) -> tuple[str, ...]:
        """The step's arguments after ``(params, state)``."""
        return (*("model_state",) * self.mutable, "batch", *("key",) * self.rng)

    def split_arguments(self, args):
        """``(model_state, batch, key)`` from the step's arguments after ``(params, state)``,
        ``None`` for those the options leave out."""
        model_state = args[0] if self.mutable else None
        key = args[-1] if self.rng else None
        return model_state, args[int(self.mutable)], key

    def value(self, metrics, model_state):
        """``loss_fn``'s result in its own form, with the means of ``metrics`` (``loss``,
        ``aux``) and the model state in it."""
        loss, aux = metrics["loss"], metrics.get("aux")
        if self.mutable:
            return loss, (model_state, aux) if self.has_aux else model_state
        return (loss, aux) if self.has_aux else loss

    def results(self, params, state, model_state, metrics) -> tuple:
        """The step's results: ``(params, state, [model_state,] metrics)``."""
        return (params, state, model_state, metrics) if self.mutable else (params, state, metrics)

    def check_batch(self, batch, num_data: int, data_text: str) -> None:
        """Refuse a batch leaf whose leading axis is empty or does not divide by ``num_data``
        devices times ``accumulate`` (``data_text`` names the devices' count)."""
        if self.accumulate > 1:
            data_text += f" times accumulate={self.accumulate}"
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if not leaf.shape or not leaf.shape[0] or leaf.shape[0] % (num_data * self.accumulate):
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)}: leading axis must divide by {data_text} "
                    f"and not be empty; "
                    f"got shape {tuple(leaf.shape)}."
                )

    def device_key(self, key, count, axes):
        """The key ``loss_fn`` gets: ``key`` folded with the step ``count`` (unless ``None``)
        and, per device, the device's index over ``axes`` (``None`` without ``rng``)."""
        if key is None:
            return None
        if count is not None:
            key = jax.random.fold_in(key, count)
        return jax.random.fold_in(key, lax.axis_index(axes)) if self.per_device else key

    def device_means(self, loss, aux, model_state, axes):
        """``(metrics, model_state)``: the ``loss`` (and ``aux``) averaged over ``axes``, and the
        floating leaves of the model state averaged over them too; per device only (the global
        batch's are already global)."""
        if not self.per_device:
            return {"loss": loss, **({"aux": aux} if self.has_aux else {})}, model_state
        metrics = {"loss": lax.pmean(loss, axes)}
        if self.has_aux:
            metrics["aux"] = jax.tree.map(lambda x: lax.pmean(x, axes), aux)
        if self.mutable:
            model_state = jax.tree.map(
                lambda x: lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                model_state,
            )
        return metrics, model_state

    def gradients(self, params, model_state, batch, key, *, devices=1):
        """The mean loss, gradients, model state and aux over ``batch``'s micro-batches:
        one device's, or with ``devices`` slices one after another in ``batch`` (the global
        batch), micro-batch :math:`a` the :math:`a`-th of every slice."""
        if self.accumulate == 1:
            return self._one(params, model_state, batch, key)
        return self._accumulated(params, model_state, batch, key, devices)

    def _objective(self, params, model_state, micro, key):
        """``(loss, (model_state, aux))`` from ``loss_fn`` in any of its forms."""
        # Rebuilt here, so that nnx variables in it belong to this trace and may be mutated.
        model_state = jax.tree.map(lambda x: x, model_state)
        args = (params, *((model_state,) if self.mutable else ()), micro)
        try:
            out = self.loss_fn(*args, *((key,) if key is not None else ()))
        except Exception as err:
            if type(err).__name__ == "TraceContextError":  # flax's, not imported here
                err.add_note(_OUTER_STATE_HINT)
            raise
        if not (self.has_aux or self.mutable):
            check_scalar_loss(out, self.caller)
            return out, (model_state, None)
        loss, extra = out
        if self.mutable and self.has_aux:
            return loss, extra
        return loss, (extra, None) if self.mutable else (model_state, extra)

    def _one(self, params, model_state, micro, key):
        (loss, (model_state, aux)), grads = jax.value_and_grad(self._objective, has_aux=True)(
            params, model_state, micro, key
        )
        return loss, grads, model_state, aux

    def _accumulated(self, params, model_state, batch, key, devices):
        accumulate = self.accumulate

        def micro_batches(x):  # [devices * accumulate * rows] -> [accumulate, devices * rows]
            x = x.reshape(devices, accumulate, x.shape[0] // (devices * accumulate), *x.shape[1:])
            return jnp.swapaxes(x, 0, 1).reshape(accumulate, -1, *x.shape[3:])

        def body(carry, xs):
            loss_sum, grad_sum, model_state = carry
            index, micro = xs
            micro_key = None if key is None else jax.random.fold_in(key, index)
            loss, grads, model_state, aux = self._one(params, model_state, micro, micro_key)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
            return (loss_sum + loss, grad_sum, model_state), aux

        zeros = jax.tree.map(
            lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params
        )
        (loss, grads, model_state), aux = lax.scan(
            body,
            (jnp.zeros((), jnp.float32), zeros, model_state),
            (jnp.arange(accumulate), jax.tree.map(micro_batches, batch)),
        )
        grads = jax.tree.map(lambda g, p: (g / accumulate).astype(p.dtype), grads, params)
        aux = jax.tree.map(lambda x: jnp.mean(x, axis=0), aux)
        return loss / accumulate, grads, model_state, aux


_OUTER_STATE_HINT = (
    "lwjax: loss_fn changed nnx state (BatchNorm statistics, Dropout's RNG counts) that it "
    "closes over from outside the traced step. Pass that state in and return it: with "
    "mutable=True, loss_fn(params, rest, batch) merges nnx.merge(graphdef, params, rest) and "
    "returns (loss, nnx.state(model, nnx.Not(nnx.Param))); for Dropout also rng=True and "
    "nnx.reseed(model, dropout=key) (docs/own-step.md)."
)
