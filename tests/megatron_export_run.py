"""lwjax's side of the Megatron round trip: continue a ``resume_*`` fixture one iteration and
export the run as a ``torch_dist`` checkpoint for megatron-core to load. A mixture of experts,
which lwjax's GPT cannot step, is continued by replaying Megatron's own reduced gradients
through lwjax's optimizer instead.

``tests/fixtures/megatron/make_export_run.py`` runs it to make the ``export_*`` fixtures, and
``tests/test_megatron_export.py`` runs it again to check that lwjax still writes what Megatron
loaded.
"""

import pathlib
import re

import jax
import numpy as np
import optax
from jax.sharding import Mesh

import lwjax
from lwjax.logical import to_logical
from lwjax.megatron import import_megatron, save_torch_dist
from lwjax.megatron import names as names_lib
from lwjax.megatron.gpt import tree_from_keys

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
# each export fixture and the resume fixture it continues: megatron-core loaded the pp2 ones at
# pipeline size 2 and the ep2 one at expert-parallel size 2, on two ranks, as the runs were made
RUNS = {
    "export_muon": "resume_muon",
    "export_adam": "resume_adam",
    "export_pp2_muon": "pp2_muon",
    "export_pp2_adam": "pp2_adam",
    "export_ep2_muon": "ep2_muon",
}
# lwjax's GPT has no MoE forward: these continue by Megatron's own gradients through lwjax's
# optimizer (replay_and_export)
REPLAYED = ("export_ep2_muon",)
# a layer's expert under its global number, as make_parallel_run.py records its gradients
_EXPERT_RE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$")


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


def replay_and_export(resume: str, directory):
    """Import ``resume`` (a fixture name), apply Megatron's reduced gradients of the next
    iteration through lwjax's optimizer (dp 1) and write the export under ``directory``;
    returns ``(imported, opt, params, state)``."""
    record = np.load(FIXTURES / resume / "resume.npz")
    imported = import_megatron(FIXTURES / resume)
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:1]), ("dp",)))
    params, state = imported.state(opt)
    grads = tree_from_keys(stacked_grads(record, imported.iteration + 1))
    updates, state = jax.jit(opt.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
    back = imported.to_megatron(params, to_logical(opt, state))
    save_torch_dist(back, directory, config=imported.config)
    return imported, opt, params, state


def stacked_grads(record, iteration: int) -> dict:
    """Megatron's reduced gradients of ``iteration`` under the stacked keys (experts stacked
    on the axis after the layers')."""
    parts: dict[str, dict[tuple, np.ndarray]] = {}
    prefix = f"grad/{iteration}/"
    for entry in record.files:
        if entry.startswith(prefix):
            name, expert = entry[len(prefix) :], None
            if (m := _EXPERT_RE.match(name)) is not None:
                name, expert = f"{m.group(1)}experts.{m.group(3)}", int(m.group(2))
            key, layer = names_lib.stacked_key(name)
            parts.setdefault(key, {})[(layer, expert)] = record[entry]
    out = {}
    for key, found in parts.items():
        if (None, None) in found:
            out[key] = found[(None, None)]
            continue
        layers = sorted({layer for layer, _ in found})
        experts = sorted({expert for _, expert in found})
        if experts == [None]:
            out[key] = np.stack([found[(i, None)] for i in layers])
        else:
            out[key] = np.stack([np.stack([found[(i, e)] for e in experts]) for i in layers])
    return out
