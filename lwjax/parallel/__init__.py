"""Every decision about devices: mesh axes, where parameters and state live, split geometry.

The step, the plan and the Muon math receive what this wing computed and read no mesh
themselves. Its modules are imported by name (``lwjax.parallel.geometry``); this file imports
nothing, so the wing's pure-Python modules (:mod:`lwjax.parallel.axes`,
:mod:`lwjax.parallel.geometry`) stay free of jax when imported.
"""
