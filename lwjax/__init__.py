"""lwjax: Megatron-Core's layer-wise distributed optimizer (distributed Muon) for JAX.

The layout layer (pure Python) is imported eagerly. The names that need jax
are imported on first use, so ``import lwjax`` and the jax-free tools
(``lwjax layout``, ``lwjax launch``, the Megatron reader) stay fast; type
checkers read them from the ``TYPE_CHECKING`` block below.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

from lwjax.layout import BufferKey as BufferKey
from lwjax.layout import FullParamLayout as FullParamLayout
from lwjax.layout import LayoutConfig as LayoutConfig
from lwjax.layout import ParamSpec as ParamSpec
from lwjax.layout import PerBufferParamLayout as PerBufferParamLayout
from lwjax.policies import compute_full_param_layout as compute_full_param_layout
from lwjax.policies import compute_layout as compute_layout
from lwjax.routing import RoutingRules as RoutingRules
from lwjax.routing import route_leaves as route_leaves

if TYPE_CHECKING:
    from lwjax.checkpoint import restore as restore
    from lwjax.checkpoint import save as save
    from lwjax.checkpoint_manager import CheckpointManager as CheckpointManager
    from lwjax.config import OptimizerConfig as OptimizerConfig
    from lwjax.logical import from_logical as from_logical
    from lwjax.logical import to_logical as to_logical
    from lwjax.muon import MuonConfig as MuonConfig
    from lwjax.optimizer import LayerwiseOptimizer as LayerwiseOptimizer
    from lwjax.optimizer import layerwise_muon as layerwise_muon
    from lwjax.parallel.gather import gather_params as gather_params
    from lwjax.parallel.jit import jit_shard_map as jit_shard_map
    from lwjax.state import LayerwiseState as LayerwiseState
    from lwjax.train import make_train_step as make_train_step
    from lwjax.train import value_and_grad as value_and_grad
    from lwjax.train_options import TrainStepOptions as TrainStepOptions

try:
    __version__ = _version("lwjax")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

# name -> module: the names of the TYPE_CHECKING block (a test checks that they agree).
_LAZY = {
    "restore": "lwjax.checkpoint",
    "save": "lwjax.checkpoint",
    "CheckpointManager": "lwjax.checkpoint_manager",
    "from_logical": "lwjax.logical",
    "to_logical": "lwjax.logical",
    "MuonConfig": "lwjax.muon",
    "LayerwiseOptimizer": "lwjax.optimizer",
    "OptimizerConfig": "lwjax.config",
    "layerwise_muon": "lwjax.optimizer",
    "gather_params": "lwjax.parallel.gather",
    "LayerwiseState": "lwjax.state",
    "jit_shard_map": "lwjax.parallel.jit",
    "make_train_step": "lwjax.train",
    "value_and_grad": "lwjax.train",
    "TrainStepOptions": "lwjax.train_options",
}

__all__ = (
    "BufferKey",
    "FullParamLayout",
    "LayoutConfig",
    "ParamSpec",
    "PerBufferParamLayout",
    "RoutingRules",
    "compute_full_param_layout",
    "compute_layout",
    "route_leaves",
    *_LAZY,
)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lwjax' has no attribute {name!r}")
