"""The two optimizers ``lwjax demo`` compares, and the schedule they share.

* :func:`lwjax_optimizer`: :func:`lwjax.layerwise_muon`, Muon on the hidden
  matrices and AdamW on embedding, head and norms, state sharded over dp;
* :func:`baseline_optimizer`: a replicated optax transformation, ``optax.adamw``
  or ``optax.contrib.muon``, routed and weight-decay masked like lwjax's plan.

Both use :func:`schedule` (warmup, then cosine decay), the same gradient
clipping, weight decay and Adam betas; each its own peak learning rate, tuned by
a small sweep. The Muon update is scaled by ``0.2·sqrt(max(m, n))``
(``scale_mode="spectral"``, ``extra_scale_factor=0.2``), which gives it AdamW's
update RMS, so one learning rate serves lwjax's Muon and AdamW parts (as in
Megatron). Nothing here imports jax at module level.
"""

from __future__ import annotations

from typing import Any

from lwjax.tools.demo.config import ADAMW_LEARNING_RATE, LEARNING_RATE, DemoConfig

# The learning rates are re-exported from here, their old home.
__all__ = [
    "ADAMW_LEARNING_RATE",
    "LEARNING_RATE",
    "MUON_RMS_MATCH",
    "baseline_optimizer",
    "lwjax_optimizer",
    "schedule",
]

MUON_RMS_MATCH = 0.2  # extra_scale_factor that gives Muon updates AdamW's RMS (Moonlight)


def schedule(config: DemoConfig, peak: float):
    """Linear warmup to ``peak``, then cosine decay to ``peak / 10`` at the last step."""
    import optax

    warmup = max(1, min(config.warmup_steps, config.steps - 1))
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, warmup, max(config.steps, warmup + 1), peak * 0.1
    )


def lwjax_optimizer(config: DemoConfig, params, mesh, gpt_config):
    """lwjax's layer-wise Muon for the demo GPT (``gpt_config``) on ``mesh``.

    ``params`` is the model's parameter tree (the template); the Muon update gets
    AdamW's RMS, and :func:`schedule` runs to ``config.learning_rate``.
    """
    import lwjax
    from lwjax.muon import MuonConfig
    from lwjax.optimizer import OptimizerConfig
    from lwjax.tools.demo.model import lwjax_routing

    return lwjax.layerwise_muon(
        params,
        mesh,
        learning_rate=schedule(config, config.learning_rate),
        muon=MuonConfig(momentum=0.95, nesterov=True, extra_scale_factor=MUON_RMS_MATCH),
        config=OptimizerConfig(weight_decay=config.weight_decay, clip_grad=config.clip_grad),
        routing=lwjax_routing(gpt_config),
    )


def baseline_optimizer(config: DemoConfig, plan) -> tuple[str, float, Any]:
    """The replicated optax baseline, routed and masked like lwjax's ``plan``.

    Returns:
      ``(label, peak learning rate, optax transformation)``.
    """
    import jax
    import optax

    peak = config.baseline_learning_rate
    if peak is None:
        peak = ADAMW_LEARNING_RATE if config.baseline == "adamw" else config.learning_rate
    lr = schedule(config, peak)
    decay_mask = jax.tree_util.tree_unflatten(
        plan.treedef, [len(r.param_shape) >= 2 for r in plan.routes]
    )
    clip = optax.clip_by_global_norm(config.clip_grad)
    if config.baseline == "adamw":
        return (
            "AdamW (optax, replicated)",
            peak,
            optax.chain(
                clip,
                optax.adamw(
                    lr,
                    b1=0.9,
                    b2=0.999,
                    eps=1e-8,
                    weight_decay=config.weight_decay,
                    mask=decay_mask,
                ),
            ),
        )
    dims = jax.tree_util.tree_unflatten(
        plan.treedef,
        [
            optax.contrib.MuonDimensionNumbers(r.stack_dims, r.stack_dims + 1)
            if r.is_muon
            else None
            for r in plan.routes
        ],
    )
    return (
        "Muon (optax.contrib, replicated)",
        peak,
        optax.chain(
            clip,
            optax.contrib.muon(
                lr,
                beta=0.95,
                weight_decay=config.weight_decay,
                weight_decay_mask=decay_mask,
                adam_weight_decay=config.weight_decay,
                muon_weight_dimension_numbers=dims,
                consistent_rms=MUON_RMS_MATCH,
            ),
        ),
    )
