"""The tools wing: the ``lwjax`` command, benchmarks, the demo and model presets.

Nothing in the optimizer core imports this package. Its dependencies beyond the
core (flax, rich, matplotlib) are the ``tools`` extra: ``pip install 'lwjax[tools]'``.
"""
