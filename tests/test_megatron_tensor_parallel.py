"""Tensor-parallel Muon against megatron-core 0.19.2 itself, per ``--muon-tp-mode``.

The fixtures (``tests/fixtures/megatron/tp2_<mode>``, ``make_tp_step.py``) hold two
optimizer steps of a real TP=2 run: each rank's local masters before and after,
its reduced gradients, Muon momenta and Adam moments, and the gradient norm. Here
the ranks' blocks are joined into global leaves sharded over ``tp`` as Megatron
splits them, lwjax takes the same gradients, and every rank's result must be
Megatron's: the clipped norm (the replicated norms counted once), the masters and
the optimizer state.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import lwjax
from lwjax.logical import from_logical, to_logical
from lwjax.muon import MuonConfig
from lwjax.optimizer import OptimizerConfig
from lwjax.routing import RoutingRules

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"


def _fixture(mode):
    folder = FIXTURES / f"tp2_{mode}"
    info = json.loads((folder / "info.json").read_text())
    return info, dict(np.load(folder / "step.npz"))


def _joined(arrays, key, it, info):
    """Per parameter, the two ranks' blocks of ``key`` at iteration ``it`` joined as Megatron
    splits them (a replicated parameter: rank 0's copy, checked equal to rank 1's)."""
    out = {}
    for p in info["params"]:
        name, dim = p["name"], p["partition_dim"]
        blocks = [arrays.get(f"{key}/{it}/{t}/{name}") for t in range(2)]
        if blocks[0] is None:
            continue
        if dim < 0:
            np.testing.assert_array_equal(blocks[0], blocks[1])
            out[name] = blocks[0]
        else:
            out[name] = np.concatenate(blocks, axis=dim)
    return out


def _specs(info):
    return {
        p["name"]: P(*([None] * p["partition_dim"]), "tp") if p["partition_dim"] >= 0 else P()
        for p in info["params"]
    }


def _put(tree, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


@pytest.mark.parametrize(
    "mode,dp", [("blockwise", 1), ("duplicated", 2), ("distributed", 1), ("duplicated", 1)]
)
def test_each_tp_mode_matches_megatron(mode, dp):
    info, arrays = _fixture(mode)
    options = info["optimizer"]
    assert info["muon_tp_mode"] == mode and info["parallel"]["tensor_model_parallel_size"] == 2
    mesh = Mesh(np.array(jax.devices()[: 2 * dp]).reshape(dp, 2), ("dp", "tp"))
    specs = _specs(info)
    params = _put(_joined(arrays, "master_before", 1, info), specs, mesh)
    split = {p["qkv_split_shapes"] and tuple(p["qkv_split_shapes"]) for p in info["params"]} - {
        None
    }
    opt = lwjax.layerwise_muon(
        params,
        mesh,
        param_axes="tp",
        learning_rate=options["lr"],
        muon=MuonConfig(
            momentum=options["muon_momentum"],
            nesterov=False,
            tp_mode=mode,
            fp32_matmul_prec="high",
        ),
        config=OptimizerConfig(
            weight_decay=options["weight_decay"],
            clip_grad=options["clip_grad"],
            matrix_convention="out_in",
        ),
        routing=RoutingRules(qkv_split={"*linear_qkv.weight": split.pop()}),
    )
    muon_names = {p["name"] for p in info["params"] if p["is_muon"]}
    assert {r.path for r in opt.plan.routes if r.is_muon} == muon_names
    step = jax.jit(
        jax.shard_map(
            lambda g, s, p: opt.local_update(g, s, p, reduced=True),
            mesh=mesh,
            in_specs=(opt.param_specs, opt.state_specs, opt.param_specs),
            out_specs=(opt.param_specs, opt.state_specs, P()),
            check_vma=False,
        )
    )
    state = opt.init(params)
    for it in (1, 2):
        if it == 2:  # Megatron's own state before its second step (each mode's)
            state = _state_from_megatron(opt, state, arrays, info)
            params = _put(_joined(arrays, "master_before", 2, info), specs, mesh)
        grads = _put(_joined(arrays, "grad", it, info), specs, mesh)
        params, state, metrics = step(grads, state, params)
        np.testing.assert_allclose(
            float(metrics["grad_norm"]), arrays[f"grad_norm/{it}"], rtol=1e-6
        )
        assert float(metrics["clip_coef"]) < 1
        assert int(metrics["num_zeros"]) == int(arrays[f"num_zeros/{it}"])
        want = _joined(arrays, "master_after", it, info)
        before = _joined(arrays, "master_before", it, info)
        for name, value in want.items():
            moved = np.abs(value - before[name]).max()
            np.testing.assert_allclose(
                np.asarray(params[name]), value, atol=1e-3 * moved, err_msg=f"{name} it {it}"
            )
        logical = to_logical(opt, state)
        for name, value in _joined(arrays, "momentum", it, info).items():
            np.testing.assert_allclose(
                np.asarray(logical.momenta[name]), value, rtol=1e-5, atol=1e-9, err_msg=name
            )
        adam = logical.elementwise
        for key, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
            for name, value in _joined(arrays, key, it, info).items():
                np.testing.assert_allclose(  # to the rounding of small sums, relative to the leaf
                    np.asarray(tree[name]), value, atol=1e-5 * np.abs(value).max(), err_msg=name
                )


def _state_from_megatron(opt, state, arrays, info):
    """The lwjax state holding Megatron's masters and moments after its first step."""
    logical = to_logical(opt, state)
    masters = _joined(arrays, "master_before", 2, info)
    momenta = _joined(arrays, "momentum", 1, info)
    mu, nu = _joined(arrays, "exp_avg", 1, info), _joined(arrays, "exp_avg_sq", 1, info)
    adam = logical.elementwise
    logical = logical._replace(
        count=np.int32(1),
        masters={k: masters[k] for k in logical.masters},
        momenta={k: momenta.get(k) for k in logical.momenta},
        elementwise=adam._replace(
            count=np.int32(1),
            mu={k: mu.get(k) for k in adam.mu},
            nu={k: nu.get(k) for k in adam.nu},
        ),
    )
    return from_logical(opt, logical)


def test_blockwise_is_not_duplicated():
    """The fixtures tell the modes apart: one step from the same gradients moves a Muon matrix
    differently when each block is orthogonalised on its own."""
    (info, blockwise), (_, duplicated) = _fixture("blockwise"), _fixture("duplicated")
    name = next(p["name"] for p in info["params"] if p["is_muon"])
    key = f"master_after/1/0/{name}"
    np.testing.assert_array_equal(blockwise[f"grad/1/0/{name}"], duplicated[f"grad/1/0/{name}"])
    assert np.abs(blockwise[key] - duplicated[key]).max() > 1e-3
