"""How the step that :func:`lwjax.make_train_step` builds schedules its communication."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainStepOptions:
    """Options of the step's schedule; none changes its signature or (after the first step) what it
    computes.

    The other overlap, Newton–Schulz under the gradients' reduce-scatters
    (Megatron has none), is ``OptimizerConfig(pipeline_muon=True)``, not an
    option here: it changes the optimizer's plan and its state (the
    speculation flag ``LayerwiseState.speculate``), which the optax form
    (``optimizer.update``) and checkpoints share with this step. The step
    reads it from the optimizer, and with clipping chooses on the host
    whether each step speculates (:mod:`lwjax.speculation`).

    Attributes:
      overlap_param_gather: (Megatron's ``--overlap-param-gather``) The step
        ends with the new state and gathers no parameters; the next step
        all-gathers each bucket from the masters at its start
        (``optimizer.local_params``), and XLA's scheduler may run each gather
        under the forward pass of the layers before the first one that reads
        it. The step then takes and returns ``None`` for the parameters, and
        ``optimizer.gather_params(state)`` returns them (evaluation,
        checkpoints). It computes what the default step computes (the
        parameters are the masters cast to the parameter dtype either way);
        only the first step differs, where the masters cannot hold the
        initial parameters exactly (``master_dtype`` narrower than them).

    Raises:
      TypeError: ``overlap_param_gather`` is not a bool.
    """

    overlap_param_gather: bool = False

    def __post_init__(self):
        if not isinstance(self.overlap_param_gather, bool):
            raise TypeError(
                "TrainStepOptions.overlap_param_gather must be a bool; "
                f"got {self.overlap_param_gather!r}."
            )
