"""A whole data-parallel train step from a loss function and a layer-wise optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.optimizer import LayerwiseOptimizer, named_shardings
from lwjax.plan import as_axis_tuple
from lwjax.speculation import chosen_on_host
from lwjax.step import LayerwiseState, speculates


def jit_shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs, *, donate_argnums=()) -> Callable:
    """``jax.jit(jax.shard_map(fn, ..., check_vma=False))``, donated arguments paired with outputs.

    The jit is given ``out_shardings`` (``out_specs`` on ``mesh``), so JAX
    aliases each donated argument to the output of the same shape and
    sharding. Without them JAX leaves the pairing to XLA, which matches
    donated buffers with outputs of the same byte size in output order: one
    output of a coincident size (a bf16 parameter block as large as an fp32
    state bucket) shifts every later pair, and XLA then copies the buffers it
    crossed (0.9 GB a step for the 1b benchmark workload at dp 4).

    Args:
      fn: The per-device function, as for ``shard_map``.
      mesh: The device mesh.
      in_specs, out_specs: ``PartitionSpec`` pytrees (prefixes) of the
        arguments and results, as for ``shard_map``.
      donate_argnums: Arguments whose buffers the call may reuse, as for ``jax.jit``.

    Returns:
      The jitted function.
    """
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False),
        out_shardings=named_shardings(mesh, out_specs),
        donate_argnums=donate_argnums,
    )


def value_and_grad(loss_fn: Callable, optimizer: LayerwiseOptimizer) -> Callable:
    """``(params, batch) -> (loss, grads)``, each device's own gradient, for ``optimizer.update``.

    Under ``jax.jit``, ``jax.grad`` of a loss over a dp-sharded batch
    all-reduces each gradient where it is produced, so a following
    reduce-scatter has nothing left to do (see ``docs/optax.md``). This
    computes ``loss_fn(params, local_batch)`` and its gradient on every
    data-parallel device inside ``shard_map`` and returns the gradients
    unreduced, stacked on a leading axis of ``dp * ep`` (split over the data
    axes); :attr:`LayerwiseOptimizer.update` recognises that shape and
    reduce-scatters them. ``loss`` is the mean over devices.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss over ``batch``.
      optimizer: The :class:`~lwjax.optimizer.LayerwiseOptimizer` the gradients are for.

    Returns:
      A function of ``(params, batch)``, to call under ``jax.jit``; the
      batch's leading axis is split over the data axes.
    """
    axes = optimizer.data_axes
    # With tensor parallelism only the data axes are manual: loss_fn sees whole (global)
    # parameters, and XLA partitions it over the tensor-parallel axis from their shardings.
    manual = {} if optimizer.tensor_axis is None else {"axis_names": set(as_axis_tuple(axes))}

    def local(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return lax.pmean(loss, axes), jax.tree.map(lambda g: g[None], grads)

    def per_device(params, batch):
        return jax.shard_map(
            local,
            mesh=optimizer.mesh,
            in_specs=(P(), P(axes)),
            out_specs=(P(), P(axes)),
            check_vma=False,
            **manual,
        )(params, batch)

    return per_device


def make_train_step(
    loss_fn: Callable,
    optimizer: LayerwiseOptimizer,
    *,
    donate: bool = True,
    has_aux: bool = False,
    mutable: bool = False,
    rng: bool = False,
    accumulate: int = 1,
    overlap_param_gather: bool = False,
) -> Callable:
    """Build ``train_step(params, state, [model_state,] batch[, key])``, jitted.

    Every data-parallel device computes ``loss_fn`` and its gradients on its
    slice of the batch (leading axis split over ``optimizer.data_axes``:
    ``dp``, or ``(dp, ep)`` with expert parallelism); the optimizer then
    reduce-scatters the gradients, updates the device's own state and gathers
    the new parameters (see :mod:`lwjax.optimizer`).

    ``loss_fn``'s arguments and results follow the flags:
    ``loss_fn(params, [model_state,] batch[, key])`` returns ``loss``, or
    ``(loss, aux)`` with ``has_aux``, ``(loss, model_state)`` with
    ``mutable``, ``(loss, (model_state, aux))`` with both.

    * ``mutable``: model state that is not trained (linen ``batch_stats``,
      the rest of an nnx model: ``nnx.split(model, nnx.Param, ...)``) goes in
      replicated and comes out as ``loss_fn`` returned it, its floating leaves
      averaged over the data-parallel devices (running batch statistics: the
      cross-device mean flax's examples take with ``sync_batch_stats``, here
      every step; each device still normalises by its own batch unless the
      model's ``BatchNorm`` has ``axis_name=optimizer.axis``). Other leaves
      (RNG counters, keys) must agree across devices.
    * ``rng``: ``train_step`` takes a key, and ``loss_fn`` gets it folded with
      the step count (``state.count``) and the device's index, so dropout masks
      differ across devices and steps (in nnx, ``nnx.reseed(model, dropout=key)``).
    * ``accumulate``: each device splits its batch slice into this many
      micro-batches on the leading axis and sums their gradients (in fp32)
      before one optimizer step; the loss, ``aux`` and gradients are their
      means, and the model state is threaded through them in order.
    * ``overlap_param_gather`` (Megatron's ``--overlap-param-gather``): the
      step ends with the new state and gathers no parameters; the next step
      all-gathers each bucket from the masters at its start
      (``optimizer.local_params``), and XLA's scheduler may run each gather
      under the forward pass of the layers before the first one that reads
      it. The step is then ``train_step(state, [model_state,] batch[, key])
      -> (state, [model_state,] metrics)``, and
      ``optimizer.gather_params(state)`` returns the parameters (evaluation,
      checkpoints). It computes what the default step computes (the
      parameters are the masters cast to the parameter dtype either way);
      only the first step differs, where the masters cannot hold the initial
      parameters exactly (``master_dtype`` narrower than them).

    With ``OptimizerConfig(pipeline_muon=True)`` and clipping, ``train_step``
    chooses on the host whether each step speculates
    (:mod:`lwjax.speculation`): from the flag of the step before last, so
    that it never waits for the step in flight, and each choice is a
    compiled step of its own, without a conditional. The second one compiles
    the first time it is chosen. A ``train_step`` called inside your own
    ``jax.jit`` (any argument traced) runs the one compiled step with its
    conditional instead.

    With an expert axis, ``loss_fn`` sees the device's local experts (expert
    leaves split over ``ep`` on their expert axis, ``optimizer.param_specs``)
    and exchanges tokens over ``ep`` itself, e.g. ``all_gather`` of the tokens,
    the local experts, ``psum_scatter`` of their outputs.

    Args:
      loss_fn: The per-device mean loss, as above.
      optimizer: A :class:`~lwjax.optimizer.LayerwiseOptimizer`.
      donate: Donate ``params``, ``state`` (and ``model_state``) buffers to the step.
      has_aux: ``loss_fn`` also returns auxiliary values (averaged over devices
        and micro-batches into ``metrics["aux"]``).
      mutable: ``loss_fn`` takes and returns model state.
      rng: ``train_step`` takes a PRNG key for ``loss_fn``.
      accumulate: Micro-batches per device and step.
      overlap_param_gather: Gather the parameters at the start of the next
        step, under its forward pass; the step takes and returns no parameters.

    Returns:
      ``train_step(params, state, [model_state,] batch[, key]) -> (params,
      state, [model_state,] metrics)`` (without ``params`` in and out with
      ``overlap_param_gather``). ``metrics`` holds the mean ``loss``,
      ``step`` (applied steps after this one) and the optimizer's metrics
      (``grad_norm``, ``clip_coef``, ``num_zeros``, ``update_rms``,
      ``skipped``, and ``grad_norm/<group>``, ``clip_coef/<group>`` per
      separate norm group), and ``aux`` with ``has_aux``.

    Raises:
      ValueError: ``accumulate`` is not a positive integer; an optimizer with
        a ``tensor_axis`` (``loss_fn`` runs per device here, and a
        tensor-parallel model's collectives belong to XLA: use
        :func:`value_and_grad` and ``optimizer.update`` under ``jax.jit``);
        (at call time) a batch leaf whose leading axis is empty or does not
        divide by the number of data-parallel devices times ``accumulate``.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding
      >>> import lwjax
      >>> params = {"w": jnp.eye(4), "b": jnp.zeros(4)}
      >>> opt = lwjax.layerwise_muon(params, Mesh(np.array(jax.devices()[:1]), ("dp",)))
      >>> def loss_fn(params, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
      >>> step = make_train_step(loss_fn, opt)
      >>> batch = (jnp.ones((8, 4)), jnp.zeros((8, 4)))
      >>> params, state, metrics = step(params, opt.init(params), batch)
      >>> int(metrics["step"]), bool(metrics["skipped"])
      (1, False)
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(
            f"make_train_step: accumulate must be a positive integer; got {accumulate!r}."
        )
    if optimizer.tensor_axis is not None:
        raise ValueError(
            f"make_train_step: the optimizer has tensor_axis={optimizer.tensor_axis!r}; a "
            "tensor-parallel loss is partitioned by XLA, not per device. Step with "
            "lwjax.value_and_grad(loss_fn, optimizer) and optimizer.update under jax.jit "
            "(docs/scaling.md)."
        )
    mesh, axes = optimizer.mesh, optimizer.data_axes
    num_data = optimizer.num_data
    param_specs = optimizer.param_specs if optimizer.param_specs is not None else P()
    dp = mesh.shape[optimizer.axis]
    size_text = (
        f"dp={dp}"
        if optimizer.expert_axis is None
        else f"dp*ep={num_data} (dp={dp}, ep={num_data // dp})"
    )
    if accumulate > 1:
        size_text += f" times accumulate={accumulate}"
    gradients = functools.partial(
        _local_gradients, loss_fn, has_aux=has_aux, mutable=mutable, accumulate=accumulate
    )

    def local_step(params, state, model_state, batch, key, speculate):
        if key is not None:
            key = jax.random.fold_in(jax.random.fold_in(key, state.count), lax.axis_index(axes))
        if overlap_param_gather:
            params = optimizer.local_params(state)
        loss, grads, model_state, aux = gradients(params, model_state, batch, key)
        chosen = {} if speculate is None else {"speculate": speculate}
        params, state, metrics = optimizer.local_update(
            grads, state, params, gather=not overlap_param_gather, **chosen
        )
        metrics = {"loss": lax.pmean(loss, axes), "step": state.count, **metrics}
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda x: lax.pmean(x, axes), aux)
        if mutable:
            model_state = jax.tree.map(
                lambda x: lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                model_state,
            )
        # A step chosen on the host also returns its new speculation flag apart from the
        # (donated) state, for the choice two steps on (lwjax.speculation).
        flag = () if speculate is None else (state.speculate,)
        return params, state, model_state, metrics, *flag

    def compiled(speculate):
        flag = () if speculate is None else (P(),)
        if overlap_param_gather:  # the state alone in and out: the parameters live in its masters
            return jit_shard_map(
                lambda *args: local_step(None, *args, speculate)[1:],
                mesh,
                (optimizer.state_specs, P(), P(axes), P()),
                (optimizer.state_specs, P(), P(), *flag),
                donate_argnums=(0, 1) if donate else (),
            )
        return jit_shard_map(
            lambda *args: local_step(*args, speculate),
            mesh,
            (param_specs, optimizer.state_specs, P(), P(axes), P()),
            (param_specs, optimizer.state_specs, P(), P(), *flag),
            donate_argnums=(0, 1, 2) if donate else (),
        )

    step_in_one = compiled(None)
    # A pipelined, clipping optimizer speculates or not as the host chooses, each choice a step
    # of its own without the conditional; step_in_one, with it, serves a traced call.
    host_step = (
        chosen_on_host(compiled, 0 if overlap_param_gather else 1)
        if speculates(optimizer.plan)
        else None
    )
    param_shardings = named_shardings(mesh, param_specs)
    replicated = NamedSharding(mesh, P())
    leading = ("state",) if overlap_param_gather else ("params", "state")
    names = [*leading, *["model_state"] * mutable, "batch", *["key"] * rng]
    signature = (
        f"train_step takes ({', '.join(names)}) with mutable={mutable}, rng={rng}, "
        f"overlap_param_gather={overlap_param_gather}"
    )

    def train_step(*args):
        if len(args) != len(names):
            raise TypeError(f"{signature}; got {len(args)} arguments.")
        if overlap_param_gather:
            args = (None, *args)
        params, state, *args = args
        if not isinstance(state, LayerwiseState):
            raise TypeError(
                f"{signature}; its argument 'state' must be the optimizer's LayerwiseState, "
                f"got {type(state).__name__}."
            )
        model_state = args[0] if mutable else None
        batch = args[int(mutable)]
        key = args[-1] if rng else None
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if not leaf.shape or not leaf.shape[0] or leaf.shape[0] % (num_data * accumulate):
                raise ValueError(
                    f"batch{jax.tree_util.keystr(path)}: leading axis must divide by {size_text} "
                    f"and not be empty; "
                    f"got shape {tuple(leaf.shape)}."
                )
        step = step_in_one
        if host_step is not None:  # (only then: flattening every argument costs each call)
            inputs = jax.tree.leaves((params, state, model_state, batch, key))
            if not any(isinstance(x, jax.core.Tracer) for x in inputs):
                step = host_step
        rest = (state, jax.device_put(model_state, replicated), batch, key)
        if overlap_param_gather:
            state, model_state, metrics = step(*rest)
        else:
            # Parameters handed in on one device are placed on the mesh first (a no-op for
            # the step's own outputs), so the step compiles once, not again for its own outputs.
            params, state, model_state, metrics = step(
                jax.device_put(params, param_shardings), *rest
            )
        kept = (state,) if overlap_param_gather else (params, state)
        return (*kept, model_state, metrics) if mutable else (*kept, metrics)

    return train_step


def _local_gradients(loss_fn, params, model_state, batch, key, *, has_aux, mutable, accumulate):
    """One device's mean loss, gradients, model state and aux over its micro-batches."""

    def objective(params, model_state, micro, key):
        # Rebuilt here, so that nnx variables in it belong to this trace and may be mutated.
        model_state = jax.tree.map(lambda x: x, model_state)
        args = (params, *((model_state,) if mutable else ()), micro)
        out = loss_fn(*args, *((key,) if key is not None else ()))
        if not (has_aux or mutable):
            return out, (model_state, None)
        loss, extra = out
        if mutable and has_aux:
            return loss, extra
        return loss, (extra, None) if mutable else (model_state, extra)

    def one(model_state, micro, key):
        (loss, (model_state, aux)), grads = jax.value_and_grad(objective, has_aux=True)(
            params, model_state, micro, key
        )
        return loss, grads, model_state, aux

    if accumulate == 1:
        return one(model_state, batch, key)
    micro_batches = jax.tree.map(
        lambda x: x.reshape(accumulate, x.shape[0] // accumulate, *x.shape[1:]), batch
    )

    def body(carry, xs):
        loss_sum, grad_sum, model_state = carry
        index, micro = xs
        micro_key = None if key is None else jax.random.fold_in(key, index)
        loss, grads, model_state, aux = one(model_state, micro, micro_key)
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
