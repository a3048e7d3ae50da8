"""The ``lwjax demo`` job and the example GPT.

* :mod:`lwjax.tools.demo.model`: a small GPT in flax nnx (fused or separate QKV, RoPE,
  SwiGLU, RMSNorm, optional tied head and scan over layers) and its routing.
* :mod:`lwjax.tools.demo.data`: byte-level text of the Python standard library, split
  into training and validation by file, and the unigram baseline.
* :mod:`lwjax.tools.demo.devices`: a data-parallel mesh over local devices (virtual
  CPU devices without an accelerator) and bytes held per device.
* :mod:`lwjax.tools.demo.loops`: the training loop and the replicated optax baseline step.
* :mod:`lwjax.tools.demo.optimizers`: lwjax's layer-wise Muon and the optax baseline it is
  compared with, and their shared schedule.
* :mod:`lwjax.tools.demo.report`: summary table, loss-curve PNG, metrics JSON.
* :mod:`lwjax.tools.demo.config`: :class:`~lwjax.tools.demo.config.DemoConfig`, the
  demo's options, and the peak learning rates they default to.
* :mod:`lwjax.tools.demo.run`: :func:`~lwjax.tools.demo.run.run_demo`, which ``lwjax demo``
  calls (``DemoConfig`` is re-exported there).

Nothing here is imported by ``import lwjax``.
"""
