"""``HostSpeculation``: the guess from the step before last, and where a run starts again."""

import jax.numpy as jnp
import pytest

from lwjax.speculation import HostSpeculation
from lwjax.state import LayerwiseState


def _state(flag):
    return LayerwiseState(jnp.zeros([], jnp.int32), (), (), (), jnp.asarray(flag))


def _steps(chooser, state, flags):
    """Per flag: the guess for the step, then the step "returns" a state and that flag."""
    guesses = []
    for flag in flags:
        guesses.append(chooser.choose(state))
        state = _state(flag)
        chooser.record(state, jnp.asarray(flag))
    return guesses, state


def test_each_guess_is_the_flag_of_the_step_before_last():
    chooser = HostSpeculation()
    # A fresh state's flag (off) decides the first two steps; then each step's flag decides
    # the step after next.
    guesses, state = _steps(chooser, _state(False), [True, True, False, False, True, True])
    assert guesses == [False, False, True, True, False, False]
    # A state the chooser did not hand back last starts again from its own flag, twice.
    guesses, _ = _steps(chooser, _state(True), [False, False, False])
    assert guesses == [True, True, False]


def test_a_step_that_never_returned_leaves_the_run_as_it_was():
    chooser = HostSpeculation()
    _, state = _steps(chooser, _state(False), [True, False])  # flags: before True, last False
    assert chooser.choose(_state(True)) is True  # another run's state; its step fails
    # The run goes on from its own state: the flags of the steps before last, not the
    # abandoned state's.
    guesses, _ = _steps(chooser, state, [False, False])
    assert guesses == [True, False]


def test_a_state_without_its_flag_is_refused():
    with pytest.raises(ValueError, match=r"state\.speculate: .* got None"):
        HostSpeculation().choose(_state(False)._replace(speculate=None))
