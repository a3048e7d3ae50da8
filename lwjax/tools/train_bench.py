"""The training-step benchmark's former module, kept for one release.

Its names now live in :mod:`lwjax.tools.bench` (:mod:`~lwjax.tools.bench.train_bench`,
:mod:`~lwjax.tools.bench.train_contenders`, :mod:`~lwjax.tools.bench.train_steps`,
:mod:`~lwjax.tools.bench.fsdp`); every name of that package is readable here too.
"""

from lwjax.tools import bench as _bench

# The contenders whose step also returns the gradient norm (each one's ``outputs`` says so now).
LWJAX_STEPS = (
    _bench.MUON,
    _bench.ADAMW_SHARDED,
    _bench.MUON_OVERLAP,
    _bench.ADAMW_OVERLAP,
    _bench.MUON_FSDP,
    _bench.ADAMW_FSDP,
)


def __getattr__(name: str):
    return getattr(_bench, name)
