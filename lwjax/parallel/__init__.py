"""Every decision about devices: mesh axes, split geometry, the exchanges of split matrices.

The step, the plan and the Muon math receive what these modules compute and never read a
mesh axis name themselves. This file imports nothing, so the wing's pure-Python modules stay
free of jax when imported.
"""
