"""Whether the next pipelined step speculates, chosen on the host.

A pipelined, clipping optimizer (``OptimizerConfig(pipeline_muon=True)``)
starts Newton–Schulz before the gradient norm only after a step that needed
no Muon clip (:mod:`lwjax.pipelined`). Inside one compiled step that choice
is a ``lax.cond`` over the whole step, and on GPU the conditional has a cost
of its own (``docs/benchmarks.md``): with the clip binding on every step, it
made the pipelined step slower than the serial step it runs.
Chosen on the host instead, each choice is a compiled step of its own, with
no conditional in it.

The host must not wait for a step to end before dispatching the next, or
the devices idle between steps. So the choice for step ``n`` reads the flag
step ``n - 2`` wrote, which is ready once step ``n - 2`` ends while step
``n - 1`` runs: the guess lags the device's by one step. Clipping holds for
runs of steps, so in a run of steps that clip (or that do not) only the
first two are guessed wrong, where the conditional guesses only the first
wrong. Step ``n - 2``'s flag lives in a state that step ``n - 1`` has
consumed (donated), so each step also returns its flag on its own, as a
replicated scalar outside the state.

Every process must choose alike, or the processes would run different
programs and their collectives would wait for each other forever. The flag
comes from statistics summed over all devices (``psum``), the same bits on
every device, as the conditional's predicate must be too.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from lwjax.plan import StepPlan
from lwjax.state import LayerwiseState, speculates

# The first call, counting from 0, at which a run that starts from a fresh or restored state
# (its flag off) may speculate: after the flag of the step before last turned on.
FIRST_SPECULATION = 2


class HostSpeculation:
    """Chooses, step after step of one run, whether the next pipelined step speculates.

    Use it around two compiled steps, one built with ``speculate=True`` and
    one with ``speculate=False`` (``update_pipelined``'s argument), each of
    which also returns the new state's ``speculate`` flag on its own, as
    :func:`chosen_on_host` does:

    .. code-block:: python

        chooser = HostSpeculation()
        speculate = chooser.choose(state)
        state, flag = steps[speculate](state, ...)
        chooser.record(state, flag)

    A state that is not the one last recorded (a fresh or restored state,
    another run's) starts the lag again: its own flag is read, waiting for the
    step that wrote it.
    """

    def __init__(self):
        self._handed = None  # the speculate leaf of the state last recorded
        self._last = None  # the flag the last recorded step returned
        self._before = None  # the flag the step before it returned (or a state's own)
        self._own = None  # a new run's own flag, read by choose and kept by record

    def choose(self, state: LayerwiseState) -> bool:
        """Whether the step that takes ``state`` should speculate.

        Raises:
          ValueError: ``state`` has no speculation flag.
        """
        if state.speculate is None:
            raise ValueError(
                "state.speculate: a pipelined, clipping optimizer's state needs its speculation "
                "flag (LayerwiseState.speculate, a bool scalar); got None. Build the state with "
                "the optimizer's init or lwjax.from_logical."
            )
        # The flags are replicated, so each process reads its own first device's copy.
        if state.speculate is not self._handed:  # a new run: its own flag, read as it is
            self._own = bool(state.speculate)
            return self._own
        self._own = None
        return bool(self._before)

    def record(self, state: LayerwiseState, flag: jax.Array) -> None:
        """Note the step's new ``state`` and the flag it returned apart from it, whose copy to
        the host starts now, so that reading it two steps on does not wait for a transfer."""
        flag.copy_to_host_async()
        before = self._last if self._own is None else self._own
        self._before, self._last, self._own = before, flag, None
        self._handed = state.speculate


def chosen_on_host(compiled: Callable[[bool], Callable], state_index: int) -> Callable:
    """A step that runs ``compiled(True)`` or ``compiled(False)`` as a :class:`HostSpeculation`
    chooses.

    Args:
      compiled: ``speculate -> step``; each step takes the state as its
        argument ``state_index``, returns the new state at the same index of
        its results, and returns the new state's ``speculate`` flag last.
      state_index: Where the state is among the arguments and the results.

    Returns:
      The step, with the same arguments and the results without the flag. Its
      attribute ``compiled`` holds the two steps by ``speculate`` (e.g. to
      ``lower`` one).
    """
    steps = {speculate: compiled(speculate) for speculate in (True, False)}
    chooser = HostSpeculation()

    def step(*args):
        *out, flag = steps[chooser.choose(args[state_index])](*args)
        chooser.record(out[state_index], flag)
        return tuple(out)

    step.compiled = steps
    return step


def with_host_speculation(
    compiled: Callable[[bool | None], Callable], plan: StepPlan, state_index: int
) -> Callable:
    """The step to call for ``plan``, around the steps ``compiled`` builds.

    ``compiled(None)`` is the step with the choice inside it (a conditional
    where the plan speculates). Where it speculates (:func:`speculates`), a
    call with concrete arguments runs :func:`chosen_on_host` instead, and a
    call with traced ones (inside the caller's own ``jax.jit``) runs
    ``compiled(None)``: a traced flag cannot be read on the host.

    Args:
      compiled: ``speculate -> step``, as for :func:`chosen_on_host`, and
        ``compiled(None)`` a step that returns no flag.
      plan: The optimizer's plan.
      state_index: Where the state is among the arguments and the results.

    Returns:
      The step, with ``compiled(None)``'s arguments and results.
    """
    in_one = compiled(None)
    if not speculates(plan):
        return in_one
    on_host = chosen_on_host(compiled, state_index)

    def step(*args):
        return (in_one if is_traced(args) else on_host)(*args)

    return step


def is_traced(args) -> bool:
    """Whether any leaf of ``args`` is a tracer: the call is inside another ``jax.jit`` (or
    other transformation), not from the host."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
