"""Megatron checkpoints of pipeline- and expert-parallel runs, imported exactly and continued.

The ``pp2_*`` fixtures (``tests/fixtures/megatron/make_parallel_run.py``) are megatron-core
0.19.2 runs on two pipeline stages (a layer each), saved after iteration 3 as Megatron-LM
saves by default: the DistributedOptimizer's Adam state in flat ``dp_reshardable`` buffers,
one per stage, beside Muon's per-parameter state. ``ep2_muon`` is a mixture-of-experts GPT
(4 experts per layer, top-2) at expert-parallel size 2 on two ranks (data-parallel size 2
for the dense parameters, 1 for the experts), Muon on every expert's matrices and the
router. ``expected.npz`` is the same state saved ``fully_reshardable`` and read back with
torch alone; ``resume.npz`` is what Megatron did next.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from megatron_export_run import stacked_grads

import lwjax
from lwjax.logical import to_logical
from lwjax.megatron import import_megatron, read_megatron
from lwjax.megatron.gpt import keys_from_tree, tree_from_keys
from lwjax.megatron.read_torch_dist import _pipeline_size, _unflatten_into

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
PIPELINE_RUNS = ["pp2_muon", "pp2_adam"]
EXPERT_RUN = "ep2_muon"
PARALLEL_RUNS = [*PIPELINE_RUNS, EXPERT_RUN]
SAVED_AT = 3


def _record(name):
    return np.load(FIXTURES / name / "resume.npz")


@pytest.mark.parametrize("name", PARALLEL_RUNS)
def test_parallel_checkpoint_imports_exactly(name):
    """Every weight, fp32 master, Muon momentum and Adam moment read from the per-stage (or
    data-parallel) flat buffers and the per-parameter Muon state (every expert's matrices
    under its global number) equals, bit for bit, what torch reads from the same state saved
    per parameter; the iteration and Adam's step are the checkpoint's."""
    state = read_megatron(FIXTURES / name)
    expected = np.load(FIXTURES / name / "expected.npz")
    tables = {
        "model": state.model,
        "master": state.masters,
        "momentum": state.momentum,
        "exp_avg": state.exp_avg,
        "exp_avg_sq": state.exp_avg_sq,
    }
    for entry in expected.files:
        kind, key = entry.split("/", 1)
        got = np.asarray(tables[kind][key]).astype(np.float32)
        np.testing.assert_array_equal(got, expected[entry], err_msg=entry)
    for kind, table in tables.items():
        assert sorted(table) == sorted(
            e.split("/", 1)[1] for e in expected.files if e.startswith(kind + "/")
        ), kind
    assert state.source["pp"] == (1 if name == EXPERT_RUN else 2)
    assert state.iteration == SAVED_AT and state.adam_step == SAVED_AT


def test_expert_checkpoint_gives_the_mixture_of_experts_config_and_muon_routes():
    """The GPT's config reads the experts from the weights; Muon holds each expert's matrix
    and the router as Megatron's layer-wise optimizer did (the import checks that its routes
    equal Megatron's momenta), and lwjax's GPT forward refuses the MoE it lacks."""
    imported = import_megatron(FIXTURES / EXPERT_RUN)
    assert (imported.config.num_experts, imported.config.expert_ffn_hidden_size) == (4, 16)
    assert imported.args["expert_model_parallel_size"] == 2
    momenta = keys_from_tree(imported.logical.momenta)
    for key in ("mlp.router.weight", "mlp.experts.experts.linear_fc1.weight"):
        assert momenta[f"decoder.layers.{key}"] is not None, key
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:1]), ("dp",)))
    routes = {r.path: r for r in opt.plan.routes}
    fc1 = routes["decoder/layers/mlp/experts/experts/linear_fc1/weight"]
    assert (fc1.is_muon, fc1.num_params) == (True, 2 * 4)  # a Muon matrix per layer and expert
    with pytest.raises(ValueError, match="mixture of 4 experts"):
        imported.loss_fn()


@pytest.mark.parametrize("name", PARALLEL_RUNS)
def test_parallel_checkpoint_gives_megatrons_schedule(name):
    record = _record(name)
    schedule = import_megatron(FIXTURES / name).schedule()
    column = 0 if name.endswith("muon") else 1  # the Muon group, else an Adam group
    for iteration in range(1, 6):
        count = jnp.asarray(iteration - 1, jnp.int32)
        lr, wd = record[f"lr/{iteration}"][column], record[f"wd/{iteration}"][column]
        np.testing.assert_allclose(float(schedule.learning_rate(count)), lr, rtol=1e-6)
        np.testing.assert_allclose(float(schedule.weight_decay(count)), wd, rtol=1e-6)


REPLAYS = [(name, "dp2") for name in PIPELINE_RUNS] + [
    (EXPERT_RUN, mesh) for mesh in ("dp1", "dp2", "dp1_ep2")
]


@pytest.mark.parametrize(("name", "mesh"), REPLAYS)
def test_replayed_parallel_gradients_give_megatrons_masters(name, mesh):
    """Megatron's reduced gradients of iteration 4 through lwjax's optimizer, configured from
    the checkpoint alone: the masters match Megatron's to 1e-6. The expert run replays at dp
    1, dp 2 and Megatron's own layout (``dp1_ep2``: the dense parameters data-parallel over
    both devices, the experts split over the expert axis)."""
    record = _record(name)
    imported = import_megatron(FIXTURES / name)
    devices = np.array(jax.devices()[:2])
    if mesh == "dp1_ep2":
        opt = imported.optimizer(Mesh(devices.reshape(1, 2), ("dp", "ep")), expert_axis="ep")
    else:
        opt = imported.optimizer(Mesh(devices[: int(mesh[2:])], ("dp",)))
    params, state = imported.state(opt)
    grads = stacked_grads(record, SAVED_AT + 1)
    assert sorted(grads) == sorted(keys_from_tree(imported.params))
    updates, state = jax.jit(opt.update)(tree_from_keys(grads), state, params)
    params = optax.apply_updates(params, updates)
    masters = keys_from_tree(to_logical(opt, state).masters)
    for key, got in masters.items():
        want = record[f"master/{SAVED_AT + 1}/{key}"]
        assert np.max(np.abs(np.asarray(got) - want)) <= 1e-6, key


@pytest.mark.parametrize("name", PIPELINE_RUNS)
def test_training_from_a_pipeline_checkpoint_is_megatrons_next_iteration(name):
    """lwjax trains iteration 4 from the checkpoint and Megatron's batch (dp 1): loss within
    1e-5, grad norm 1e-5 relative, masters 2e-5 (measured: 1e-6, 2e-7, 2e-7)."""
    record = _record(name)
    imported = import_megatron(FIXTURES / name)
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:1]), ("dp",)))
    params, state = imported.state(opt)
    step = lwjax.make_train_step(imported.loss_fn(), opt)
    it = SAVED_AT + 1
    tokens = record[f"tokens/{it}"]
    params, state, metrics = step(params, state, (tokens, np.roll(tokens, -1, axis=1)))
    assert abs(float(metrics["loss"]) - float(record[f"loss/{it}"])) <= 1e-5
    assert abs(float(metrics["grad_norm"]) / float(record[f"grad_norm/{it}"]) - 1) <= 1e-5
    masters = keys_from_tree(to_logical(opt, state).masters)
    worst = max(
        float(np.max(np.abs(np.asarray(v) - record[f"master/{it}/{k}"])))
        for k, v in masters.items()
    )
    assert worst <= 2e-5, worst


def test_pipeline_splits_the_flat_buffers_cannot_follow_are_refused():
    """Uneven or virtual pipeline splits and a tied embedding's last-stage copy are named,
    not guessed."""
    args = json.loads((FIXTURES / "pp2_muon" / "fixture_info.json").read_text())["args_saved"]
    model = read_megatron(FIXTURES / "pp2_muon").model
    assert _pipeline_size(args, model, "ckpt") == 2
    with pytest.raises(ValueError, match="decoder_first_pipeline_num_layers"):
        _pipeline_size({**args, "decoder_first_pipeline_num_layers": 1}, model, "ckpt")
    with pytest.raises(ValueError, match="do not split evenly into pipeline size 4"):
        _pipeline_size({**args, "pipeline_model_parallel_size": 4}, model, "ckpt")
    untied = {k: v for k, v in model.items() if k != "output_layer.weight"}
    with pytest.raises(ValueError, match="tied"):
        _pipeline_size(args, untied, "ckpt")


def test_expert_weights_in_flat_buffers_are_refused():
    """An Adam run at expert-parallel size > 1 keeps its experts' state in the flat buffers of
    each expert-parallel rank, which lwjax does not cut up: named, with the save option that
    gives per-parameter keys."""
    state = read_megatron(FIXTURES / EXPERT_RUN)
    args = json.loads((FIXTURES / EXPERT_RUN / "fixture_info.json").read_text())["args_saved"]
    momentum = {k: v for k, v in state.momentum.items() if "experts" not in k}
    tables = {"model": state.model, "momentum": momentum}
    with pytest.raises(ValueError, match="expert weights .*fully-reshardable"):
        _unflatten_into(tables, {(0, 0): {}}, {0: "bfloat16"}, args, "ckpt")
