"""lwjax: Megatron-Core's layer-wise distributed optimizer (distributed Muon) for JAX."""

from importlib.metadata import version as _version

__version__ = _version("lwjax")
