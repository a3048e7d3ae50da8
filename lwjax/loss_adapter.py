"""A loss function's form, apart from the step that calls it: aux values, model state, keys,
micro-batches.

:func:`lwjax.make_train_step` calls ``loss_fn(params, [model_state,] batch[, key])`` on each
data-parallel device's slice of the batch. What it takes and returns follows four options,
which also decide the step's arguments after ``(params, state)``: ``[model_state,] batch[, key]``.

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
  (in nnx, ``nnx.reseed(model, dropout=key)``).
* ``accumulate``: each device splits its slice into :math:`A` micro-batches :math:`b_a` on
  the leading axis, threads the model state through them in order, and takes one optimizer
  step on the means

  .. math::

    \\ell = \\frac{1}{A} \\sum_{a=1}^{A} L(\\theta, b_a), \\qquad
    g = \\frac{1}{A} \\sum_{a=1}^{A} \\nabla_\\theta L(\\theta, b_a),

  where the sum of gradients is kept in fp32 (at least) and micro-batch :math:`a` gets the
  device's key folded with :math:`a - 1`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


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

    Raises:
      ValueError: ``accumulate`` is not a positive integer.
    """

    loss_fn: Callable
    has_aux: bool = False
    mutable: bool = False
    rng: bool = False
    accumulate: int = 1

    def __post_init__(self):
        accumulate = self.accumulate
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"make_train_step: accumulate must be a positive integer; got {accumulate!r}."
            )

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
        """The key ``loss_fn`` gets on this device: ``key`` folded with the step ``count`` and
        the device's index over ``axes`` (``None`` without ``rng``)."""
        if key is None:
            return None
        return jax.random.fold_in(jax.random.fold_in(key, count), lax.axis_index(axes))

    def device_means(self, loss, aux, model_state, axes):
        """``(metrics, model_state)``: the ``loss`` (and ``aux``) averaged over ``axes``, and the
        floating leaves of the model state averaged over them too."""
        metrics = {"loss": lax.pmean(loss, axes)}
        if self.has_aux:
            metrics["aux"] = jax.tree.map(lambda x: lax.pmean(x, axes), aux)
        if self.mutable:
            model_state = jax.tree.map(
                lambda x: lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                model_state,
            )
        return metrics, model_state

    def gradients(self, params, model_state, batch, key):
        """One device's mean loss, gradients, model state and aux over its micro-batches."""
        if self.accumulate == 1:
            return self._one(params, model_state, batch, key)
        return self._accumulated(params, model_state, batch, key)

    def _objective(self, params, model_state, micro, key):
        """``(loss, (model_state, aux))`` from ``loss_fn`` in any of its forms."""
        # Rebuilt here, so that nnx variables in it belong to this trace and may be mutated.
        model_state = jax.tree.map(lambda x: x, model_state)
        args = (params, *((model_state,) if self.mutable else ()), micro)
        out = self.loss_fn(*args, *((key,) if key is not None else ()))
        if not (self.has_aux or self.mutable):
            check_scalar_loss(out, "make_train_step")
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

    def _accumulated(self, params, model_state, batch, key):
        accumulate = self.accumulate
        micro_batches = jax.tree.map(
            lambda x: x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:]), batch
        )

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
            (jnp.arange(accumulate), micro_batches),
        )
        grads = jax.tree.map(lambda g, p: (g / accumulate).astype(p.dtype), grads, params)
        aux = jax.tree.map(lambda x: jnp.mean(x, axis=0), aux)
        return loss / accumulate, grads, model_state, aux
