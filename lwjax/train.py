"""A whole data-parallel train step from a loss function and a layer-wise optimizer."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwjax.loss_adapter import BatchStats, LossAdapter
from lwjax.optimizer import LayerwiseOptimizer, named_shardings
from lwjax.parallel.axes import as_axis_tuple
from lwjax.parallel.gather import WHOLE
from lwjax.parallel.jit import jit_shard_map
from lwjax.sharded_gradients import batch_axes, check_fsdp_axes, sharded_gradients
from lwjax.speculation import is_traced, with_host_speculation
from lwjax.state import LayerwiseState
from lwjax.train_options import TrainStepOptions


def value_and_grad(
    loss_fn: Callable,
    optimizer: LayerwiseOptimizer,
    *,
    has_aux: bool = False,
    mutable: bool = False,
    rng: bool = False,
    accumulate: int = 1,
    fsdp_axes: str | tuple[str, ...] = (),
) -> Callable:
    """``(params, [model_state,] batch[, key]) -> (value, grads)``, each device's own gradient,
    for ``optimizer.update``.

    Under ``jax.jit``, ``jax.grad`` of a loss over a dp-sharded batch
    all-reduces each gradient where it is produced, so a following
    reduce-scatter has nothing left to do (see ``docs/optax.md``). This
    computes ``loss_fn`` and its gradient on every data-parallel device's
    slice of the batch inside ``shard_map`` and returns the gradients
    unreduced, stacked on a leading axis of ``dp * ep`` (split over the data
    axes); :attr:`LayerwiseOptimizer.update` recognises that shape and
    reduce-scatters them.

    ``loss_fn`` takes and returns what it does for :func:`make_train_step`
    with the same options (:mod:`lwjax.loss_adapter`), and ``value`` has the
    form of its result: ``loss``, ``(loss, aux)`` with ``has_aux``, ``(loss,
    model_state)`` with ``mutable``, ``(loss, (model_state, aux))`` with both;
    ``loss`` and ``aux`` are the means over devices, and so are the floating
    leaves of ``model_state``. An nnx model with BatchNorm or Dropout changes
    state as it runs: pass the rest of the model as ``model_state``
    (``mutable=True``) and put the returned state back (``nnx.update``).

    With ``param_axes``, the loss runs as :func:`make_train_step`'s does
    (:mod:`lwjax.sharded_gradients`): the ``fsdp_axes`` split the batch too and
    the loss sees its blocks of the leaves they split, which it gathers with
    :func:`lwjax.gather_params`; the other parameter axes are XLA's. The
    gradients come out split as the parameters, averaged over the FSDP
    devices, still stacked over the data axes.

    Args:
      loss_fn: ``loss_fn(params, [model_state,] batch[, key])``, the mean loss
        over ``batch``, as above.
      optimizer: The :class:`~lwjax.optimizer.LayerwiseOptimizer` the gradients are for.
      has_aux: ``loss_fn`` also returns auxiliary values.
      mutable: ``loss_fn`` takes and returns model state.
      rng: The function takes a PRNG key last, and ``loss_fn`` gets it folded
        with the device's index (dropout masks differ across devices; pass a
        new key each step).
      accumulate: Micro-batches per device, a positive integer.
      fsdp_axes: The optimizer's ``param_axes`` that also split the batch
        (:class:`TrainStepOptions` ``fsdp_axes``).

    Returns:
      A function of ``(params, [model_state,] batch[, key])``, to call under
      ``jax.jit``; the batch's leading axis is split over the data axes (and
      ``fsdp_axes``).

    Raises:
      ValueError: ``accumulate`` is not a positive integer; ``fsdp_axes`` not
        among the optimizer's ``param_axes``, or splitting a leaf on a
        stacked axis; (at call time) a batch leaf whose leading axis is empty
        or does not divide by the number of batch devices times ``accumulate``.
    """
    adapter = LossAdapter(
        loss_fn,
        has_aux=has_aux,
        mutable=mutable,
        rng=rng,
        accumulate=accumulate,
        caller="lwjax.value_and_grad",
    )
    fsdp_axes = as_axis_tuple(fsdp_axes)
    check_fsdp_axes(optimizer, fsdp_axes, "lwjax.value_and_grad")
    gradients = _per_device_gradients(adapter, optimizer, fsdp_axes)
    names = ("params", *adapter.argument_names)
    signature = f"value_and_grad's function takes ({', '.join(names)})"

    def per_device(*args):
        if len(args) != len(names):
            raise TypeError(
                f"{signature} with mutable={mutable}, rng={rng}; got {len(args)} arguments."
            )
        params, *rest = args
        model_state, batch, key = adapter.split_arguments(rest)
        adapter.check_batch(batch, *_batch_devices(optimizer, fsdp_axes))
        means, model_state, grads = gradients(params, model_state, batch, key, None)
        return adapter.value(means, model_state), grads

    return per_device


def _per_device_gradients(adapter: LossAdapter, optimizer, fsdp_axes) -> Callable:
    """``(params, model_state, batch, key, count) -> (means, model_state, grads)``, each
    data-parallel device's gradients stacked on a leading axis over the data axes; with
    ``param_axes``, :func:`lwjax.sharded_gradients.sharded_gradients`."""
    if optimizer.param_axes is not None:
        return sharded_gradients(adapter, optimizer, fsdp_axes)[0]
    axes = optimizer.data_axes

    def local(params, model_state, batch, key, count):
        key = adapter.device_key(key, count, axes)
        with WHOLE.active():
            loss, grads, model_state, aux = adapter.gradients(params, model_state, batch, key)
        means, model_state = adapter.device_means(loss, aux, model_state, axes)
        return means, model_state, jax.tree.map(lambda g: g[None], grads)

    return jax.shard_map(
        local,
        mesh=optimizer.mesh,
        in_specs=(P(), P(), P(axes), P(), P()),
        out_specs=(P(), P(), P(axes)),
        check_vma=False,
    )


def _batch_devices(optimizer: LayerwiseOptimizer, fsdp_axes: tuple[str, ...] = ()):
    """``(count, text)``: the devices the batch is split over, and their count for errors:
    ``dp=8``, ``dp*ep=8 (dp=4, ep=2)``, ``dp*fsdp=8 (dp=2, fsdp=4)``."""
    shape, names = optimizer.mesh.shape, batch_axes(optimizer, fsdp_axes)
    count = math.prod(shape[a] for a in names)
    if len(names) == 1:
        return count, f"{names[0]}={count}"
    each = ", ".join(f"{a}={shape[a]}" for a in names)
    return count, f"{'*'.join(names)}={count} ({each})"


def make_train_step(
    loss_fn: Callable,
    optimizer: LayerwiseOptimizer,
    *,
    options: TrainStepOptions | None = None,
    donate: bool = True,
    has_aux: bool = False,
    mutable: bool = False,
    rng: bool = False,
    accumulate: int = 1,
    batch_stats: BatchStats = "per_device",
    overlap_param_gather: bool | None = None,
) -> Callable:
    """Build ``train_step(params, state, [model_state,] batch[, key])``, jitted.

    Every data-parallel device computes ``loss_fn`` and its gradients on its
    slice of the batch (leading axis split over ``optimizer.data_axes``:
    ``dp``, or ``(dp, ep)`` with expert parallelism); the optimizer then
    reduce-scatters the gradients, updates the device's own state and gathers
    the new parameters (see :mod:`lwjax.optimizer`). ``loss_fn``'s arguments
    and results, and the step's after ``(params, state)``, follow ``has_aux``,
    ``mutable``, ``rng`` and ``accumulate`` (:mod:`lwjax.loss_adapter`):
    ``loss_fn(params, [model_state,] batch[, key])`` returns ``loss``, or
    ``(loss, aux)`` with ``has_aux``, ``(loss, model_state)`` with
    ``mutable``, ``(loss, (model_state, aux))`` with both. ``options``
    schedule the step's communication (:class:`TrainStepOptions`).

    With ``OptimizerConfig(pipeline_muon=True)`` and clipping, ``train_step``
    chooses on the host whether each step speculates, from the flag of the
    step before last, each choice a compiled step without a conditional; the
    second compiles the first time it is chosen. Called inside your own
    ``jax.jit``, it runs the one step with its conditional instead
    (:func:`lwjax.speculation.with_host_speculation`).

    With an expert axis, ``loss_fn`` sees the device's local experts (expert
    leaves split over ``ep`` on their expert axis, ``optimizer.param_specs``)
    and exchanges tokens over ``ep`` itself, e.g. ``all_gather`` of the tokens,
    the local experts, ``psum_scatter`` of their outputs.

    With ``param_axes`` (parameters split over FSDP and/or tensor-parallel
    axes), the loss runs in ``shard_map`` manual over the data axes and
    ``options.fsdp_axes``, which split the batch: it gets its blocks of the
    leaves split over an FSDP axis and gathers them with
    :func:`lwjax.gather_params` (each scanned layer's in the scan's body, whose
    transpose reduce-scatters the layer's gradient in the optimizer's
    reduction dtype), and sees leaves split over the other (tensor-parallel)
    axes as global arrays that XLA partitions. The gradients are averaged over
    the FSDP devices (:mod:`lwjax.sharded_gradients`) and handed to the
    optimizer, which runs Newton–Schulz on the whole matrices it owns
    (``muon.tp_mode``) and gathers only its blocks over the data axes.

    Args:
      loss_fn: The per-device mean loss, as above.
      optimizer: A :class:`~lwjax.optimizer.LayerwiseOptimizer`.
      options: The step's :class:`TrainStepOptions`; ``None`` for the defaults.
      donate: Donate ``params``, ``state`` (and ``model_state``) buffers to the step.
      has_aux: ``loss_fn`` also returns auxiliary values (averaged over devices
        and micro-batches into ``metrics["aux"]``).
      mutable: ``loss_fn`` takes and returns model state (its floating leaves
        averaged over devices).
      rng: ``train_step`` takes a PRNG key for ``loss_fn``, folded with the
        step count and the device's index.
      accumulate: Micro-batches per device and step.
      batch_stats: ``"per_device"`` (``loss_fn`` sees each device's slice) or
        ``"global"`` (it sees the global batch, as above; the key is folded
        with the step count only).
      overlap_param_gather: Deprecated: ``options=TrainStepOptions(overlap_param_gather=...)``.

    Returns:
      ``train_step(params, state, [model_state,] batch[, key]) -> (params,
      state, [model_state,] metrics)``; ``params`` is ``None`` in and out with
      ``overlap_param_gather``. ``metrics`` holds the mean ``loss``, ``step``
      (applied steps after this one) and the optimizer's metrics
      (``grad_norm``, ``clip_coef``, ``num_zeros``, ``update_rms``,
      ``skipped``, and ``grad_norm/<group>``, ``clip_coef/<group>`` per
      separate norm group), and ``aux`` with ``has_aux``.

    Raises:
      ValueError: ``accumulate`` is not a positive integer; ``fsdp_axes`` not
        among the optimizer's ``param_axes``, or splitting a leaf on its
        stacked axis; ``param_axes`` with ``batch_stats="global"``, an expert
        axis or ``overlap_param_gather`` (not built); (at call time) a batch
        leaf whose leading axis is empty or does not divide by the number of
        batch devices times ``accumulate``;
        ``batch_stats`` is not one of the two, or is ``"global"`` with an
        expert axis (``loss_fn`` exchanges tokens per device there).

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
    options = _resolved_options(options, overlap_param_gather)
    adapter = LossAdapter(
        loss_fn,
        has_aux=has_aux,
        mutable=mutable,
        rng=rng,
        accumulate=accumulate,
        batch_stats=batch_stats,
    )
    _check_steppable(adapter, optimizer, options)
    # With the gather overlapped the parameters live in the state's masters: None between steps.
    param_specs = optimizer.param_specs
    if param_specs is None or options.overlap_param_gather:
        param_specs = P()
    compiled = _compiled_steps(adapter, optimizer, options, param_specs, donate=donate)
    step = with_host_speculation(compiled, optimizer.plan, state_index=1)
    return _host_side(step, adapter, optimizer, options, param_specs)


def _check_steppable(
    adapter: LossAdapter, optimizer: LayerwiseOptimizer, options: TrainStepOptions
) -> None:
    """Refuse what ``make_train_step`` cannot step: global batch statistics beside an expert
    axis or split parameters, split parameters beside an expert axis or with the gather
    overlapped, and FSDP axes that are not the optimizer's (:func:`check_fsdp_axes`)."""
    if not adapter.per_device and optimizer.expert_axis is not None:
        raise ValueError(
            f"make_train_step: batch_stats='global' with expert_axis={optimizer.expert_axis!r}; "
            "an expert-parallel loss_fn exchanges tokens per device. Use batch_stats='per_device'."
        )
    check_fsdp_axes(optimizer, options.fsdp_axes, "make_train_step")
    if optimizer.param_axes is None:
        return
    refused = {
        "batch_stats='global'": not adapter.per_device,
        f"expert_axis={optimizer.expert_axis!r}": optimizer.expert_axis is not None,
        "overlap_param_gather=True": options.overlap_param_gather,
    }
    for what, given in refused.items():
        if given:
            raise ValueError(
                f"make_train_step: {what} with param_axes={optimizer.param_axes!r} is not "
                "built; step a model with split parameters per device, without it, or with "
                "lwjax.value_and_grad and optimizer.update under jax.jit (docs/scaling.md)."
            )


def _resolved_options(options: TrainStepOptions | None, overlap_param_gather) -> TrainStepOptions:
    """``options``, or the defaults, or (deprecated) the options from the old keyword."""
    if overlap_param_gather is None:
        return TrainStepOptions() if options is None else options
    if options is not None:
        raise TypeError(
            "make_train_step: pass options=TrainStepOptions(overlap_param_gather=...) alone; got "
            f"both options and overlap_param_gather={overlap_param_gather!r}."
        )
    warnings.warn(
        "make_train_step(..., overlap_param_gather=...) is deprecated and will be removed in the "
        "next release; pass options=lwjax.TrainStepOptions(overlap_param_gather=...).",
        DeprecationWarning,
        stacklevel=3,
    )
    return TrainStepOptions(overlap_param_gather=bool(overlap_param_gather))


def _compiled_steps(adapter: LossAdapter, optimizer, options, param_specs, *, donate):
    """``speculate -> step``: the jitted step ``(params, state, model_state, batch, key) ->
    (params, state, model_state, metrics)``, and the new speculation flag last unless
    ``speculate`` is ``None`` (:func:`lwjax.speculation.with_host_speculation`). Per device, the
    whole step runs in ``shard_map``; with the global batch, the gradients come from GSPMD and
    only the optimizer's half runs in ``shard_map``, on reduced gradients."""
    mesh, axes, overlap = optimizer.mesh, optimizer.data_axes, options.overlap_param_gather
    state_specs = optimizer.state_specs

    def optimizer_step(grads, state, params, speculate):
        """One device's update: ``(params, state, metrics[, flag])``."""
        chosen = {} if speculate is None else {"speculate": speculate}
        params, state, metrics = optimizer.local_update(
            grads, state, params, gather=not overlap, reduced=not adapter.per_device, **chosen
        )
        # A step chosen on the host also returns its new speculation flag apart from the
        # (donated) state, for the choice two steps on (lwjax.speculation).
        flag = () if speculate is None else (state.speculate,)
        return params, state, {"step": state.count, **metrics}, *flag

    def local_step(params, state, model_state, batch, key, speculate):
        key = adapter.device_key(key, state.count, axes)
        if overlap:  # each bucket gathered from the masters, under the forward pass
            params = optimizer.local_params(state)
        with WHOLE.active():  # lwjax.gather_params passes whole parameters through
            loss, grads, model_state, aux = adapter.gradients(params, model_state, batch, key)
        params, state, metrics, *flag = optimizer_step(grads, state, params, speculate)
        means, model_state = adapter.device_means(loss, aux, model_state, axes)
        return params, state, model_state, {**means, **metrics}, *flag

    def optimizer_in_shard_map(grads, state, params, grad_specs, speculate, *, unstack=False):
        """:func:`optimizer_step` over global arrays; ``unstack``: the gradients carry a
        leading axis over the data axes (each device's own)."""
        flag = () if speculate is None else (P(),)
        take = (lambda g: jax.tree.map(lambda x: x[0], g)) if unstack else (lambda g: g)
        return jax.shard_map(
            lambda g, s, p: optimizer_step(take(g), s, p, speculate),
            mesh=mesh,
            in_specs=(grad_specs, state_specs, param_specs),
            out_specs=(param_specs, state_specs, P(), *flag),
            check_vma=False,
        )(grads, state, params)

    def global_step(params, state, model_state, batch, key, speculate):
        key = adapter.device_key(key, state.count, axes)
        if overlap:
            params = optimizer.gather_params(state)
        batch = lax.with_sharding_constraint(batch, NamedSharding(mesh, P(axes)))
        loss, grads, model_state, aux = adapter.gradients(
            params, model_state, batch, key, devices=optimizer.num_data
        )
        means, model_state = adapter.device_means(loss, aux, model_state, axes)
        params, state, metrics, *flag = optimizer_in_shard_map(grads, state, params, P(), speculate)
        return params, state, model_state, {**means, **metrics}, *flag

    def sharded_step(params, state, model_state, batch, key, speculate):
        means, model_state, grads = gradients(params, model_state, batch, key, state.count)
        params, state, metrics, *flag = optimizer_in_shard_map(
            grads, state, params, grad_specs, speculate, unstack=True
        )
        return params, state, model_state, {**means, **metrics}, *flag

    if optimizer.param_axes is not None:  # the loss per batch device, split leaves as blocks
        gradients, grad_specs = sharded_gradients(adapter, optimizer, options.fsdp_axes)

    def compiled(speculate):
        flag = () if speculate is None else (P(),)
        in_specs = (param_specs, state_specs, P(), P(axes), P())
        out_specs = (param_specs, state_specs, P(), P(), *flag)
        donate_argnums = (0, 1, 2) if donate else ()

        def jitted(compiler_options):
            jit_options = dict(donate_argnums=donate_argnums, compiler_options=compiler_options)
            if adapter.per_device and optimizer.param_axes is None:
                step = lambda *args: local_step(*args, speculate)  # noqa: E731
                return jit_shard_map(step, mesh, in_specs, out_specs, **jit_options)
            step = sharded_step if adapter.per_device else global_step
            return jax.jit(
                lambda *args: step(*args, speculate),
                out_shardings=named_shardings(mesh, out_specs),
                **jit_options,
            )

        return _with_compiler_options(jitted, options.compiler_options)

    return compiled


def _with_compiler_options(jitted: Callable, compiler_options) -> Callable:
    """``jitted(compiler_options)`` called from the host; ``jitted(None)`` called inside another
    trace, whose compilation the outer ``jax.jit`` owns (JAX takes compiler options only at the
    top level)."""
    top, nested = jitted(dict(compiler_options)), jitted(None)
    return lambda *args: (nested if is_traced(args) else top)(*args)


def _host_side(step, adapter: LossAdapter, optimizer, options, param_specs) -> Callable:
    """``train_step``: the arguments checked and placed on the mesh around ``step``, and the
    deprecated form of an overlapped gather's step, without ``params`` in and out."""
    mesh, overlap = optimizer.mesh, options.overlap_param_gather
    names = ("params", "state", *adapter.argument_names)
    signature = f"train_step takes ({', '.join(names)})"
    if overlap:
        signature += f" with params None, or takes ({', '.join(names[1:])}) (deprecated),"
    signature += (
        f" with mutable={adapter.mutable}, rng={adapter.rng}, overlap_param_gather={overlap}"
    )
    num_data, data_text = _batch_devices(optimizer, options.fsdp_axes)
    param_shardings = named_shardings(mesh, param_specs)
    replicated = NamedSharding(mesh, P())

    def train_step(*args):
        state_only = overlap and len(args) == len(names) - 1
        if state_only:
            warnings.warn(_STATE_ONLY_DEPRECATED, DeprecationWarning, stacklevel=2)
            args = (None, *args)
        if len(args) != len(names):
            raise TypeError(f"{signature}; got {len(args)} arguments.")
        params, state, *rest = args
        if overlap and params is not None:
            raise TypeError(
                f"{signature}; the parameters live in the state's masters "
                f"(optimizer.gather_params(state)), got params of type {type(params).__name__}."
            )
        if not isinstance(state, LayerwiseState):
            raise TypeError(
                f"{signature}; its argument 'state' must be the optimizer's LayerwiseState, "
                f"got {type(state).__name__}."
            )
        model_state, batch, key = adapter.split_arguments(rest)
        adapter.check_batch(batch, num_data, data_text)
        # Parameters handed in on one device are placed on the mesh first (a no-op for the
        # step's own outputs), so the step compiles once, not again for its own outputs.
        out = step(
            jax.device_put(params, param_shardings),
            state,
            jax.device_put(model_state, replicated),
            batch,
            key,
        )
        out = adapter.results(*out)
        return out[1:] if state_only else out

    return train_step


_STATE_ONLY_DEPRECATED = (
    "train_step(state, [model_state,] batch[, key]) of make_train_step with "
    "overlap_param_gather=True is deprecated and will be removed in the next release; call "
    "train_step(None, state, ...), which returns (None, state, ...)."
)
