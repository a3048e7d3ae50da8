"""The ``lwjax demo`` job and the example GPT.

* :mod:`lwjax.demo.model`: a small GPT in flax nnx (fused or separate QKV, RoPE,
  SwiGLU, RMSNorm, optional tied head and scan over layers) and its routing.
* :mod:`lwjax.demo.data`: byte-level text of the Python standard library, split
  into training and validation by file, and the unigram baseline.
* :mod:`lwjax.demo.devices`: a data-parallel mesh over local devices (virtual
  CPU devices without an accelerator) and bytes held per device.
* :mod:`lwjax.demo.loops`: the training loop and the replicated optax baseline step.
* :mod:`lwjax.demo.report`: summary table, loss-curve PNG, metrics JSON.
* :mod:`lwjax.demo.run`: :class:`~lwjax.demo.run.DemoConfig` and
  :func:`~lwjax.demo.run.run_demo`, which ``lwjax demo`` calls.

Nothing here is imported by ``import lwjax``.
"""
