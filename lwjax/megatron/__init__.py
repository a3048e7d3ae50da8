"""Megatron-Core checkpoints in and out of lwjax (torch optional).

Reading needs only numpy and ml_dtypes: :func:`read_megatron` opens a
``torch_dist`` (DCP) or legacy ``torch`` checkpoint with a restricted
unpickler and returns global per-parameter arrays; ``reader="torch"`` reads
through torch's own loaders instead, with identical results. Writing
``torch_dist`` (:func:`save_torch_dist`) needs torch, imported only there.

Typical use::

    from lwjax import megatron
    imported = megatron.import_megatron("/ckpts/gpt")         # GPT params + LogicalState
    print(imported.report())                                  # options and schedule read, and where
    opt = imported.optimizer(mesh)                            # Megatron's options and schedule
    params, opt_state = imported.state(opt)                   # on the mesh, ready to train

Modules, by concern:

* checkpoint I/O (numpy and ml_dtypes; torch only in :mod:`~lwjax.megatron.torch_io`):
  :mod:`~lwjax.megatron.pickle_io` (``torch.save`` archives),
  :mod:`~lwjax.megatron.unpickler` (the restricted unpickler),
  :mod:`~lwjax.megatron.allow_list` (what a pickle may name, and what calls cost),
  :mod:`~lwjax.megatron.budget` (the per-file byte budget),
  :mod:`~lwjax.megatron.errors` (:class:`DamagedCheckpointError`),
  :mod:`~lwjax.megatron.dcp` (DCP directories), :mod:`~lwjax.megatron.torch_io`
  (torch's loaders, numpy out), :mod:`~lwjax.megatron.state` (:func:`read_megatron`:
  formats -> :class:`MegatronState`) with its readers
  :mod:`~lwjax.megatron.read_torch_dist` and :mod:`~lwjax.megatron.read_legacy`, and
  what they share: :mod:`~lwjax.megatron.common_state` (args, param groups),
  :mod:`~lwjax.megatron.flat_buffers` (the DistributedOptimizer's flat buffers),
  :mod:`~lwjax.megatron.ping_pong` (Megatron's legacy ownership);
* conversion: :mod:`~lwjax.megatron.megatron_import` (Megatron -> lwjax,
  :func:`import_megatron`), :mod:`~lwjax.megatron.export` (lwjax -> Megatron files) and
  :mod:`~lwjax.megatron.export_records` (the args, param groups and scheduler they store),
  :mod:`~lwjax.megatron.lwjax_checkpoint` (lwjax checkpoints of a converted run),
  :mod:`~lwjax.megatron.convert` (the ``lwjax convert`` job),
  :mod:`~lwjax.megatron.options` (optimizer options under all their names),
  :mod:`~lwjax.megatron.schedules` (Megatron's learning-rate and weight-decay schedules);
* the training data: :mod:`~lwjax.megatron.indexed_data` (``.bin``/``.idx`` files),
  :mod:`~lwjax.megatron.gpt_data` (``GPTDataset``'s sample order),
  :mod:`~lwjax.megatron.data_order` (a run's batches from its args,
  :meth:`MegatronImport.data`);
* the GPT workload, shared with the benchmarks: :mod:`~lwjax.megatron.gpt` (the GPT's
  shape and tree), :mod:`~lwjax.megatron.model` (its initialisation and forward pass,
  jax), :mod:`~lwjax.megatron.names` (keys, definition order, tensor-parallel chunks).

``gpt_loss`` is loaded on first use, so reading checkpoints never imports jax.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from lwjax.megatron.convert import ConvertConfig as ConvertConfig
from lwjax.megatron.convert import convert as convert
from lwjax.megatron.errors import DamagedCheckpointError as DamagedCheckpointError
from lwjax.megatron.export import logical_to_megatron as logical_to_megatron
from lwjax.megatron.export import save_safetensors as save_safetensors
from lwjax.megatron.export import save_torch_dist as save_torch_dist
from lwjax.megatron.gpt import GPTConfig as GPTConfig
from lwjax.megatron.megatron_import import MegatronImport as MegatronImport
from lwjax.megatron.megatron_import import import_megatron as import_megatron
from lwjax.megatron.megatron_import import megatron_to_logical as megatron_to_logical
from lwjax.megatron.state import MegatronState as MegatronState
from lwjax.megatron.state import read_megatron as read_megatron

if TYPE_CHECKING:
    from lwjax.megatron.model import gpt_loss as gpt_loss

__all__ = (
    "ConvertConfig",
    "DamagedCheckpointError",
    "GPTConfig",
    "MegatronImport",
    "MegatronState",
    "convert",
    "gpt_loss",
    "import_megatron",
    "logical_to_megatron",
    "megatron_to_logical",
    "read_megatron",
    "save_safetensors",
    "save_torch_dist",
)


def __getattr__(name: str):
    if name == "gpt_loss":
        return import_module("lwjax.megatron.model").gpt_loss
    raise AttributeError(f"module 'lwjax.megatron' has no attribute {name!r}")
