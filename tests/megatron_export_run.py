"""lwjax's side of the Megatron round trip: continue a ``resume_*`` fixture one iteration and
export the run as a ``torch_dist`` checkpoint for megatron-core to load.

``tests/fixtures/megatron/make_export_run.py`` runs it to make the ``export_*`` fixtures, and
``tests/test_megatron_export.py`` runs it again to check that lwjax still writes what Megatron
loaded.
"""

import pathlib

import jax
import numpy as np
from jax.sharding import Mesh

import lwjax
from lwjax.logical import to_logical
from lwjax.megatron import import_megatron, save_torch_dist

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"


def continue_and_export(resume: str, directory, iterations: int = 1):
    """Import ``resume`` (a fixture name), train ``iterations`` on Megatron's recorded batches at
    dp 1, write the export under ``directory``; returns ``(imported, opt, params, state, step,
    losses)`` so that a caller can take the next step as lwjax would.
    """
    record = np.load(FIXTURES / resume / "resume.npz")
    imported = import_megatron(FIXTURES / resume)
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:1]), ("dp",)))
    params, state = imported.state(opt)
    step = lwjax.make_train_step(imported.loss_fn(), opt)
    losses = []
    for iteration in range(imported.iteration + 1, imported.iteration + 1 + iterations):
        params, state, metrics = step(params, state, batch(record, iteration))
        losses.append(float(metrics["loss"]))
    back = imported.to_megatron(params, to_logical(opt, state))
    save_torch_dist(back, directory, config=imported.config)
    return imported, opt, params, state, step, losses


def batch(record, iteration: int):
    """Megatron's batch of ``iteration``: tokens and the tokens rolled by one."""
    tokens = record[f"tokens/{iteration}"]
    return tokens, np.roll(tokens, -1, axis=1)
