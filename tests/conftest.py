"""Test session setup: 8 virtual CPU devices, configured before any JAX op and started at once."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backend now: a CLI call inside a test asks for its own --dp devices, which would
# otherwise set the whole session's count when that test happens to run first.
jax.devices()
