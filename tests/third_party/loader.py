"""Imports the vendored flax example models (see README.md here); the vendored files are unchanged.

flax's gemma example imports its sibling files as top-level modules (``import layers``,
``from transformer_cfg import TransformerConfig``). Rather than put that folder on ``sys.path``,
each file is imported as ``third_party.flax_gemma.<name>`` in dependency order, its bare name
aliased in ``sys.modules`` only while the later files import it. (Their ``jaxtyping`` import is
met by the test extra's equinox.)
"""

import functools
import importlib
import sys
import types

# The gemma files, each after the ones it imports.
_GEMMA_FILES = (
    "params",
    "positional_embeddings",
    "sow_lib",
    "transformer_cfg",
    "layers",
    "modules",
    "helpers",
    "transformer",
)


@functools.cache
def lm1b_models() -> types.ModuleType:
    """flax ``examples/lm1b/models.py``: ``TransformerConfig``, ``TransformerLM`` (linen)."""
    return importlib.import_module(f"{__package__}.flax_lm1b.models")


@functools.cache
def imagenet_models() -> types.ModuleType:
    """flax ``examples/imagenet/models.py``: ``ResNet``, ``ResNetBlock``, ``ResNet18``, ...
    (linen, with ``nn.BatchNorm``)."""
    return importlib.import_module(f"{__package__}.flax_imagenet.models")


@functools.cache
def gemma_modules() -> types.SimpleNamespace:
    """flax ``examples/gemma`` modules by file name: ``.transformer.Transformer``,
    ``.transformer_cfg.TransformerConfig``, ``.modules``, ``.layers``, ... (nnx)."""
    aliases = {name: sys.modules.get(name) for name in _GEMMA_FILES}
    loaded = {}
    try:
        for name in _GEMMA_FILES:
            loaded[name] = importlib.import_module(f"{__package__}.flax_gemma.{name}")
            sys.modules[name] = loaded[name]
    finally:
        for name, previous in aliases.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return types.SimpleNamespace(**loaded)
