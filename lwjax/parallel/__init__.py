"""Every decision about devices: how parameters split over the mesh and what each device holds.

The modules of this package are imported by name (``lwjax.parallel.geometry``); this file
imports nothing, so the pure-Python ones stay free of jax.
"""
