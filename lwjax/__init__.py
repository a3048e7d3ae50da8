"""lwjax: Megatron-Core's layer-wise distributed optimizer (distributed Muon) for JAX.

The layout layer (pure Python) is imported eagerly; names that need jax are
loaded on first use, so ``import lwjax`` and ``lwjax layout`` stay fast and
jax-free.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from lwjax.layout import BufferKey as BufferKey
from lwjax.layout import FullParamLayout as FullParamLayout
from lwjax.layout import ParamSpec as ParamSpec
from lwjax.layout import PerBufferParamLayout as PerBufferParamLayout
from lwjax.policies import compute_full_param_layout as compute_full_param_layout
from lwjax.policies import compute_layout as compute_layout
from lwjax.routing import route_leaves as route_leaves

try:
    __version__ = _version("lwjax")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "MuonConfig": "lwjax.muon",
    "OptimizerConfig": "lwjax.optimizer",
    "LayerwiseState": "lwjax.optimizer",
    "LayerwiseOptimizer": "lwjax.optimizer",
    "layerwise_muon": "lwjax.optimizer",
    "make_train_step": "lwjax.train",
    "jit_shard_map": "lwjax.train",
    "make_plan": "lwjax.buffers",
    "to_logical": "lwjax.optimizer",
    "from_logical": "lwjax.optimizer",
    "save": "lwjax.checkpoint",
    "restore": "lwjax.checkpoint",
}

__all__ = (
    "BufferKey",
    "FullParamLayout",
    "ParamSpec",
    "PerBufferParamLayout",
    "compute_full_param_layout",
    "compute_layout",
    "route_leaves",
    *_LAZY,
)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lwjax' has no attribute {name!r}")
