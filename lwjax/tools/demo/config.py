"""What ``lwjax demo`` runs: :class:`DemoConfig` and the peak learning rates it defaults to.

Nothing here imports jax at module level (``lwjax demo`` parses its flags without it).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# Peak learning rates picked by a sweep over {1, 2, 3, 5, 10, 20, 40}e-3 on the default run
# (150 steps, small model): best validation loss for each optimizer.
LEARNING_RATE = 0.02
ADAMW_LEARNING_RATE = 0.005

BASELINES = ("adamw", "optax_muon", "none")
Baseline = Literal["adamw", "optax_muon", "none"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Options of :func:`~lwjax.tools.demo.run.run_demo` (``lwjax demo``: flag ``--<field-name>``).

    Attributes:
      steps: Training steps per run.
      model_size: A key of :data:`lwjax.tools.demo.model.MODEL_SIZES`.
      devices: Data-parallel devices; ``None``: all local devices (8 virtual
        CPU devices when there is no accelerator).
      batch_size: Global batch in sequences; must divide by the device count.
      seq_len: Bytes per sequence.
      learning_rate: Peak learning rate of lwjax (Muon and its AdamW part).
      baseline_learning_rate: Peak learning rate of the baseline; ``None``:
        :data:`ADAMW_LEARNING_RATE` for ``adamw``,
        ``learning_rate`` for ``optax_muon``.
      warmup_steps: Linear warmup before the cosine decay (to 10 %).
      weight_decay: Decoupled weight decay of matrices and embeddings.
      clip_grad: Global gradient-norm clip.
      baseline: ``"adamw"``, ``"optax_muon"`` or ``"none"``.
      eval_every: Validation period in steps (also at the start and the end).
      eval_windows: Validation sequences (rounded up to a multiple of the device count).
      seed: Seed of the initial parameters and the batch order.
      scan_layers: Train the scan-over-layers variant of the model.
      fused_qkv: One fused QKV projection (routed with ``qkv_split``).
      tied_embedding: Tie the output head to the embedding (routed with ``tied``).
      out: Directory for ``metrics.json`` and ``loss.png``; ``None`` writes nothing.
      progress: Show progress bars and the summary table.
      max_corpus_bytes: Read at most this many stdlib bytes (``None``: all top-level modules).
    """

    steps: int = 150
    model_size: str = "small"
    devices: int | None = None
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = LEARNING_RATE
    baseline_learning_rate: float | None = None
    warmup_steps: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    baseline: Baseline = "adamw"
    eval_every: int = 25
    eval_windows: int = 64
    seed: int = 0
    scan_layers: bool = False
    fused_qkv: bool = True
    tied_embedding: bool = False
    out: str | None = "lwjax-demo"
    progress: bool = True
    max_corpus_bytes: int | None = None

    def __post_init__(self):
        from lwjax.tools.demo.model import MODEL_SIZES

        if self.model_size not in MODEL_SIZES:
            raise ValueError(
                f"DemoConfig.model_size must be one of {tuple(MODEL_SIZES)}; "
                f"got {self.model_size!r}."
            )
        if self.baseline not in BASELINES:
            raise ValueError(
                f"DemoConfig.baseline must be one of {BASELINES}; got {self.baseline!r}."
            )
        for name in ("steps", "batch_size", "seq_len", "eval_windows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DemoConfig.{name} must be a positive int; got {name}={value!r}.")
        if self.devices is not None and self.devices < 1:
            raise ValueError(
                f"DemoConfig.devices must be >= 1 or None; got devices={self.devices!r}."
            )
        if self.warmup_steps < 0 or self.eval_every < 0:
            raise ValueError(
                "DemoConfig.warmup_steps and eval_every must be >= 0; "
                f"got {self.warmup_steps=}, {self.eval_every=}."
            )
        if not self.learning_rate > 0:
            raise ValueError(
                f"DemoConfig.learning_rate must be > 0; got learning_rate={self.learning_rate!r}."
            )
