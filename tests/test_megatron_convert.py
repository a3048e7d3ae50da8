"""Megatron checkpoints into lwjax and back: exact imports, layouts, the GPT forward,
training, export, CLI."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lwjax import checkpoint
from lwjax.logical import to_logical
from lwjax.megatron import (
    ConvertConfig,
    GPTConfig,
    convert,
    gpt_loss,
    import_megatron,
    logical_to_megatron,
    megatron_to_logical,
    read_megatron,
    save_safetensors,
)
from lwjax.megatron import names as names_lib
from lwjax.megatron import read_legacy as legacy_lib
from lwjax.megatron import read_torch_dist as torch_dist_lib
from lwjax.megatron.gpt import split_qkv, tree_from_keys
from lwjax.megatron.pickle_io import load_torch_file
from lwjax.tools.cli import main

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"
# the two-step fixtures of extract_expected.py; the runs with a future (resume.npz: pp2_*,
# ep2_*) keep an expected.npz of their own form, read in test_megatron_parallel_ckpt.py
NAMES = sorted(
    p.name
    for p in FIXTURES.iterdir()
    if (p / "expected.npz").exists() and not (p / "resume.npz").exists()
)
KINDS = ("model", "masters", "momentum", "exp_avg", "exp_avg_sq")


def _info(name):
    return json.loads((FIXTURES / name / "fixture_info.json").read_text())


def _model_args(name):
    """GPT shape from fixture_info (legacy files' args do not record the heads)."""
    model = _info(name)["model"]
    return {
        "num_attention_heads": model["num_attention_heads"],
        "num_query_groups": model["num_query_groups"],
    }


def _expected(state, entry):
    kind, key = entry.split("/", 1)
    stacked, layer = names_lib.stacked_key(key)
    table = {
        "model_bf16bits": state.model,
        "master": state.masters,
        "muon_momentum": state.momentum,
        "adam_exp_avg": state.exp_avg,
        "adam_exp_avg_sq": state.exp_avg_sq,
    }[kind]
    got = table[stacked] if layer is None else table[stacked][layer]
    return got.view(np.uint16) if kind == "model_bf16bits" else got


@pytest.mark.parametrize("name", NAMES)
def test_every_fixture_imports_exactly(name):
    state = read_megatron(FIXTURES / name)
    expected = np.load(FIXTURES / name / "expected.npz")
    assert expected.files
    for entry in expected.files:
        got, want = _expected(state, entry), expected[entry]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), entry
        assert got.tobytes() == want.tobytes(), entry
    info = _info(name)
    muon = info["args"]["optim"] == "dist_muon"
    assert state.iteration == 2 and state.adam_step == 2
    assert bool(state.momentum) == muon
    assert set(state.masters) == set(state.model)
    assert set(state.exp_avg) == set(state.exp_avg_sq) == set(state.model) - set(state.momentum)
    if muon:
        assert state.hyperparameters["muon"]["momentum"] == 0.95
    assert state.hyperparameters["adam"]["betas"] == (0.9, 0.999)
    assert state.hyperparameters["adam"]["lr"] == info["train"]["lr"]


@pytest.mark.parametrize(
    "flat,reference",
    [
        ("adam_ws1", "adam_ws1_fully_reshardable"),
        ("adam_ws2", "adam_ws1"),
        ("legacy_adam", "adam_ws1"),
        ("muonL_ws2", "legacy_muon"),
    ],
)
def test_flat_buffer_layout_rederived_exactly(flat, reference):
    """Unflattened DistributedOptimizer buffers equal the same run's per-parameter
    state, bit for bit."""
    a, b = read_megatron(FIXTURES / flat), read_megatron(FIXTURES / reference)
    for kind in KINDS:
        x, y = getattr(a, kind), getattr(b, kind)
        assert list(x) == list(y), kind
        for key in x:
            assert x[key].tobytes() == y[key].tobytes(), (kind, key)


def test_flat_buffer_layer_spec_is_chosen_by_the_masters(monkeypatch):
    assert read_megatron(FIXTURES / "adam_ws1").source["layer_spec"] == "local"
    all_orders = torch_dist_lib._flat_orders
    monkeypatch.setattr(
        torch_dist_lib, "_flat_orders", lambda model: {"te": all_orders(model)["te"]}
    )
    with pytest.raises(
        ValueError,
        match="cannot re-derive the DistributedOptimizer flat-buffer layout; te order: "
        "masters do not round to the model weights",
    ):
        read_megatron(FIXTURES / "adam_ws1")


def test_legacy_layer_wise_ids_are_named_as_megatron_numbers_them():
    info = _info("legacy_muon")
    names = [(p["name"], tuple(p["shape"])) for p in info["params_forward_order"]]
    children = load_torch_file(
        FIXTURES / "legacy_muon/iter_0000002/mp_rank_00/layer_wise_optimizer_0.pt"
    )
    pools = legacy_lib._child_pools(children, names)
    assert pools == [child["groups"] for child in info["rank0_children"]]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_merge_back(tp):
    rng = np.random.default_rng(tp)
    shapes = {
        "decoder.layers.0.self_attention.linear_qkv.weight": (128, 64),
        "decoder.layers.0.mlp.linear_fc1.weight": (256, 64),
        "decoder.layers.0.mlp.linear_fc2.weight": (64, 128),
        "decoder.layers.0.self_attention.linear_proj.weight": (64, 64),
        "output_layer.weight": (128, 64),
        "decoder.layers.0.input_layernorm.weight": (64,),
    }
    for name, shape in shapes.items():
        full = rng.standard_normal(shape).astype(np.float32)
        pieces = [names_lib.tp_shard(name, full, tp, r) for r in range(tp)]
        assert all(p.shape == names_lib.tp_local_shape(name, shape, tp) for p in pieces)
        np.testing.assert_array_equal(names_lib.tp_merge(name, pieces), full)
    fc1 = np.arange(8 * 2).reshape(8, 2)  # [gate rows 0..3; up rows 4..7]
    assert names_lib.tp_shard("mlp.linear_fc1.weight", fc1, 2, 1)[:, 0].tolist() == [4, 6, 12, 14]
    with pytest.raises(
        ValueError, match="replicated parameter differs between tensor-parallel ranks 0 and 1"
    ):
        names_lib.tp_merge("decoder.final_layernorm.weight", [np.zeros(4), np.ones(4)])


def test_names_map_between_layer_names_and_stacked_keys():
    for spec in names_lib.LAYER_SPECS:
        for key, layer in [
            ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3),
            ("decoder.layers.mlp.linear_fc1.weight", 0),
            ("output_layer.weight", None),
        ]:
            assert names_lib.stacked_key(names_lib.layer_name(key, layer, spec)) == (key, layer)
    assert (
        names_lib.layer_name("decoder.layers.mlp.linear_fc1.layer_norm_weight", 1, "local")
        == "decoder.layers.1.pre_mlp_layernorm.weight"
    )
    unknown = "decoder.layers.mlp.shared_experts.linear_fc1.weight"
    with pytest.raises(ValueError, match=f"{unknown}: no known place"):
        names_lib.definition_order([unknown], 2, "local")
    # a mixture of experts: the router is a dense parameter after the pre-MLP norm; the
    # experts' weights sit in buffers of their own
    moe = [
        "decoder.layers.mlp.experts.experts.linear_fc1.weight",
        "decoder.layers.mlp.router.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    ]
    assert names_lib.definition_order(moe, 1, "local") == [(k, 0) for k in moe[:0:-1]]


def test_qkv_rows_are_grouped_per_query_group():
    config = GPTConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=4,
        vocab_size=16,
        kv_channels=2,
    )
    rows = np.arange((4 + 2 * 2) * 2)[:, None] * np.ones((1, 8))  # row index in every column
    q, k, v = split_qkv(rows, config)
    # group g = [q heads 2g, 2g+1 (2 rows each), k_g, v_g]: 8 rows per group
    assert q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert k[:, 0].tolist() == [4, 5, 12, 13] and v[:, 0].tolist() == [6, 7, 14, 15]
    assert config.qkv_split_shapes == (4, 2, 2)


def test_import_gives_a_training_state_that_continues_training():
    state = read_megatron(FIXTURES / "muonL_ws2")
    imported = megatron_to_logical(state)
    assert imported.config == GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=128,
    )
    assert (
        imported.muon
        and int(imported.logical.count) == 2
        and int(imported.logical.elementwise.count) == 2
    )
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:2]), ("dp",)))
    assert sorted(r.path for r in opt.plan.routes if r.is_muon) == sorted(
        k.replace(".", "/") for k in state.momentum
    )
    assert opt.plan.routes[
        [r.path for r in opt.plan.routes].index("decoder/layers/self_attention/linear_qkv/weight")
    ].qkv_split_shapes == (32, 16, 16)
    params, opt_state = imported.state(opt)
    for x, y in zip(jax.tree.leaves(to_logical(opt, opt_state)), jax.tree.leaves(imported.logical)):
        assert np.asarray(x).dtype == y.dtype and np.asarray(x).tobytes() == y.tobytes()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (4, 16)).astype(np.int32)
    batch = (tokens, np.roll(tokens, -1, axis=1))
    loss_fn = functools.partial(gpt_loss, config=imported.config)
    from lwjax.train import make_train_step

    step = make_train_step(loss_fn, opt, donate=False)
    params, opt_state, first = step(params, opt_state, batch)
    assert abs(float(first["loss"]) - float(loss_fn(tree_from_keys(state.model), batch))) < 1e-5
    _, opt_state, second = step(params, opt_state, batch)
    assert float(second["loss"]) < float(first["loss"]) and int(opt_state.count) == 4
    adam = megatron_to_logical(read_megatron(FIXTURES / "adam_ws1"))
    adam_opt = adam.optimizer(Mesh(np.array(jax.devices()[:2]), ("dp",)))
    assert not any(r.is_muon for r in adam_opt.plan.routes)
    assert adam.logical.momenta["output_layer"]["weight"] is None


def test_import_continues_with_tensor_parallelism_as_without():
    """Megatron's TP 2 checkpoint continued at dp 2 x tp 2, its parameters split as Megatron
    splits them. Given the same gradients, Muon on whole matrices (``duplicated``) takes the
    steps the same import takes without tensor parallelism; ``blockwise`` (each block its own
    matrix) takes visibly different ones; the parameters stay split."""
    import dataclasses

    import optax

    imported = megatron_to_logical(read_megatron(FIXTURES / "muonL_tp2"))
    assert imported.source["tp"] == 2 and imported.options["muon_tp_mode"] == "blockwise"
    with pytest.warns(UserWarning, match="muon_tp_mode='blockwise'"):
        muon = imported.optimizer_kwargs()["muon"]  # the run's own mode does not carry over
    # fp32 Newton-Schulz: in bf16 a batch of another width rounds differently (~3% of a step).
    muon = dataclasses.replace(muon, fp32_matmul_prec="highest")
    devices = np.array(jax.devices()[:4])
    grid = Mesh(devices.reshape(2, 2), ("dp", "tp"))
    specs = jax.tree.leaves(imported.config.tensor_specs("tp"), is_leaf=lambda x: isinstance(x, P))
    grad_fn = jax.jit(jax.grad(functools.partial(gpt_loss, config=imported.config)))
    rng = np.random.default_rng(0)
    grads_per_step = []
    for _ in range(2):  # the gradients at the imported weights of two batches
        tokens = rng.integers(0, 128, (4, 16)).astype(np.int32)
        grads_per_step.append(grad_fn(imported.params, (tokens, np.roll(tokens, -1, axis=1))))

    def trained(mode, tensor_axis):
        config = dataclasses.replace(muon, tp_mode=mode)
        mesh = grid if tensor_axis else Mesh(devices[:2], ("dp",))
        opt = imported.optimizer(mesh, tensor_axis=tensor_axis, muon=config)
        update = jax.jit(opt.update)
        params, state = imported.state(opt)
        placed = [x.sharding.spec for x in jax.tree.leaves(params)]
        assert placed == (specs if tensor_axis else [P()] * len(specs))
        for grads in grads_per_step:  # placed as the parameters are
            grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, params)
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return opt, params, to_logical(opt, state).masters

    opt, params, a = trained("duplicated", "tp")
    _, _, b = trained("duplicated", None)
    _, _, c = trained("blockwise", "tp")
    qkv = next(r for r in opt.plan.routes if r.path.endswith("linear_qkv/weight"))
    assert qkv.param_shape[0] * 2 == qkv.full_param_shape[0]  # each device holds half the rows

    def largest(x, y):
        """The largest difference of two master trees (fp32)."""
        return max(
            float(np.abs(np.asarray(u) - np.asarray(v)).max())
            for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y))
        )

    moved = largest(b, imported.logical.masters)
    assert largest(a, b) <= 1e-5 * moved
    assert largest(c, b) >= 0.1 * moved  # another update rule
    assert [x.sharding.spec for x in jax.tree.leaves(params)] == specs
    with pytest.raises(ValueError, match="tensor_axis='mp' is not an axis of the mesh"):
        imported.optimizer(grid, tensor_axis="mp", muon=muon)
    too_many = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("dp", "tp"))  # 2 query groups
    with pytest.raises(
        ValueError, match=r"4 devices.*num_query_groups=2.*fit this model: \[1, 2\]"
    ):
        imported.optimizer(too_many, tensor_axis="tp", muon=muon)
    other = megatron_to_logical(read_megatron(FIXTURES / "tied_adam_ws1"))  # no output layer
    with pytest.raises(ValueError, match="built for another parameter tree"):
        other.state(opt)


def test_megatron_to_lwjax_checkpoint_restores_with_the_standard_restore(tmp_path):
    summary = convert(ConvertConfig(str(FIXTURES / "muonL_tp2"), str(tmp_path / "lw")))
    assert (summary.source, summary.target, summary.iteration) == ("megatron", "lwjax", 2)
    imported = megatron_to_logical(read_megatron(FIXTURES / "muonL_tp2"))
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:4]), ("dp",)))
    params, state = checkpoint.restore(tmp_path / "lw", opt)
    for x, y in zip(
        jax.tree.leaves((params, to_logical(opt, state))),
        jax.tree.leaves((imported.params, imported.logical)),
    ):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    record = checkpoint.read_record(tmp_path / "lw")
    assert record["metadata"]["megatron"]["source"]["tp"] == 2


def test_safetensors_export_holds_global_weights_masters_and_momenta(tmp_path):
    from safetensors.numpy import load_file

    state = read_megatron(FIXTURES / "muonL_tp2")
    save_safetensors(state, tmp_path / "w.safetensors")
    tensors = load_file(str(tmp_path / "w.safetensors"))
    expected = np.load(FIXTURES / "muonL_tp2" / "expected.npz")
    for entry in expected.files:
        kind, key = entry.split("/", 1)
        name = {
            "model_bf16bits": key,
            "master": "optimizer.state.fp32_param." + key,
            "muon_momentum": "optimizer.state.momentum_buffer." + key,
        }[kind]
        got = tensors[name].view(np.uint16) if kind == "model_bf16bits" else tensors[name]
        assert got.tobytes() == expected[entry].tobytes(), entry
    assert tensors["output_layer.weight"].dtype == ml_dtypes.bfloat16
    for key in state.exp_avg:  # the Adam moments of the 5 non-Muon parameters
        assert tensors["optimizer.state.exp_avg." + key].tobytes() == state.exp_avg[key].tobytes()
        sq = tensors["optimizer.state.exp_avg_sq." + key]
        assert sq.tobytes() == state.exp_avg_sq[key].tobytes()
    assert len(tensors) == 9 + 9 + 4 + 5 + 5
    with pytest.raises(ValueError, match="already exists"):
        save_safetensors(state, tmp_path / "w.safetensors")


def test_logical_round_trips_through_megatron_state():
    state = read_megatron(FIXTURES / "legacy_muon")
    imported = megatron_to_logical(state, **_model_args("legacy_muon"))
    back = logical_to_megatron(
        imported.params, imported.logical, hyperparameters=imported.hyperparameters
    )
    for kind in KINDS:
        x, y = getattr(state, kind), getattr(back, kind)
        assert set(x) == set(y) and all(x[k].tobytes() == y[k].tobytes() for k in x), kind
    assert (back.iteration, back.adam_step) == (2, 2)
    with pytest.raises(ValueError, match="args lack num_attention_heads.*--num-attention-heads"):
        megatron_to_logical(state)
    with pytest.raises(ValueError, match="lack num_query_groups.*--num-query-groups"):
        megatron_to_logical(state, num_attention_heads=4)  # GQA read as plain attention


def test_tied_embeddings_route_to_adam_and_export_without_an_output_layer(tmp_path):
    from safetensors.numpy import load_file

    from lwjax.optimizer import OptimizerConfig, layerwise_muon

    config = GPTConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=32,
        vocab_size=64,
        tied_embeddings=True,
    )
    rng = np.random.default_rng(0)
    shapes = config.param_shapes()
    assert "output_layer.weight" not in shapes
    params = tree_from_keys(
        {k: (0.02 * rng.standard_normal(s)).astype(ml_dtypes.bfloat16) for k, s in shapes.items()}
    )
    opt = layerwise_muon(
        params,
        Mesh(np.array(jax.devices()[:2]), ("dp",)),
        config=OptimizerConfig(matrix_convention="out_in"),
        routing=config.routing_rules(),
    )
    routes = {r.path: r for r in opt.plan.routes}
    embedding = routes["embedding/word_embeddings/weight"]
    assert embedding.is_tied and not embedding.is_muon
    logical = to_logical(opt, opt.init(params))
    exported = logical_to_megatron(params, logical, iteration=5)
    assert (
        GPTConfig.from_megatron(
            {k: v.shape for k, v in exported.model.items()},
            {"num_attention_heads": 4, "num_query_groups": 2},
        )
        == config
    )
    save_safetensors(exported, tmp_path / "tied.safetensors")
    assert not any(
        k.endswith("output_layer.weight") for k in load_file(str(tmp_path / "tied.safetensors"))
    )
    tokens = rng.integers(0, 64, (2, 8)).astype(np.int32)
    assert np.isfinite(float(gpt_loss(params, (tokens, tokens), config)))


def test_cli_convert_needs_no_extra(tmp_path, capsys, monkeypatch):
    """Reading Megatron needs neither extra: without rich (the tools extra) ``lwjax convert``
    converts and lists the parameters as plain text, where it used to refuse."""
    import sys

    monkeypatch.setitem(sys.modules, "rich", None)  # import rich raises ImportError
    assert main(["convert", str(FIXTURES / "adam_ws2"), str(tmp_path / "lw")]) == 0
    out = capsys.readouterr().out
    assert "(megatron) ->" in out and "9 parameters" in out
    line = next(x for x in out.splitlines() if x.startswith("decoder.layers.mlp.linear_fc1.weight"))
    assert line.split() == ["decoder.layers.mlp.linear_fc1.weight", "2×256×64", "bfloat16"] + [
        "master,", "exp_avg,", "exp_avg_sq"
    ]  # fmt: skip


def test_cli_convert_prints_a_summary_and_reports_errors(tmp_path, capsys):
    assert main(["convert", str(FIXTURES / "adam_ws2"), str(tmp_path / "w.safetensors")]) == 0
    out = capsys.readouterr().out
    assert (
        "(megatron) ->" in out
        and "decoder.layers.mlp.linear_fc1.weight" in out
        and "9 parameters" in out
    )
    assert "optimizer_sharding dp_reshardable" in out
    assert main(["convert", str(FIXTURES / "adam_ws2"), str(tmp_path / "w.safetensors")]) == 2
    assert "lwjax convert:" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert (
        main(
            [
                "convert",
                str(FIXTURES / "legacy_adam"),
                str(tmp_path / "lw"),
                "--json",
                "--num-attention-heads",
                "4",
                "--num-query-groups",
                "2",
            ]
        )
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["target"] == "lwjax" and len(record["params"]) == 9


# --------------------------------------------------------------------------- with torch


def _batches(info):
    import torch

    generator = torch.Generator().manual_seed(info["args"]["data_seed"])
    out = []
    for _ in range(info["train"]["steps"]):
        tokens = torch.randint(
            0,
            info["args"]["vocab"],
            (info["args"]["batch"], info["args"]["seq"]),
            generator=generator,
        )
        out.append((tokens.numpy(), torch.roll(tokens, -1, dims=1).numpy()))
    return out


def _orthogonalized(momentum, key, config, tp):
    """Megatron's Muon direction (spectral scale; blockwise over TP shards, as
    muon_tp_mode='blockwise')."""
    from lwjax import muon as muon_lib

    split = config.qkv_split_shapes if "linear_qkv" in key else None
    layers = []
    for m in momentum:
        shards = [names_lib.tp_shard(key, m, tp, r) for r in range(tp)]
        done = [
            np.asarray(muon_lib.orthogonalize(jnp.asarray(s), qkv_split_shapes=split))
            for s in shards
        ]
        layers.append(names_lib.tp_merge(key, done))
    return np.stack(layers)


def _previous_weights(state, config, tp):
    """Undo the checkpoint's last optimizer step: the masters before it, from the saved moments."""
    adam, muon = state.hyperparameters["adam"], state.hyperparameters.get("muon", {})
    (b1, b2), eps, t = adam["betas"], adam["eps"], state.adam_step
    previous = {}
    for key, w in state.masters.items():
        per_param_dims = w.ndim - names_lib.is_layer_key(key)
        if key in state.momentum:
            lr, wd = muon["lr"], muon["weight_decay"]
            previous[key] = (w + lr * _orthogonalized(state.momentum[key], key, config, tp)) / (
                1 - lr * wd
            )
        else:
            lr, wd = adam["lr"], adam["weight_decay"] if per_param_dims >= 2 else 0.0
            m, v = state.exp_avg[key].astype(np.float64), state.exp_avg_sq[key].astype(np.float64)
            step = lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
            previous[key] = (w + step) / (1 - lr * wd)
    return {
        k: jnp.asarray(np.asarray(v, np.float32).astype(ml_dtypes.bfloat16))
        for k, v in previous.items()
    }


@pytest.mark.parametrize("name", NAMES)
def test_imported_state_reproduces_the_recorded_loss(name):
    """The loss Megatron logged for its last step, from the imported weights with that
    step undone."""
    pytest.importorskip("torch")
    info = _info(name)
    imported = megatron_to_logical(read_megatron(FIXTURES / name), **_model_args(name))
    state = read_megatron(FIXTURES / name)
    batch = _batches(info)[-1]
    previous = _previous_weights(state, imported.config, info["args"]["tp"])
    loss = float(
        jax.jit(gpt_loss, static_argnums=2)(tree_from_keys(previous), batch, imported.config)
    )
    assert abs(loss - info["losses"][-1]) < 5e-4, (loss, info["losses"])
    # The checkpoint's own weights were trained on that batch: their loss is far lower.
    current = tree_from_keys({k: jnp.asarray(v) for k, v in state.model.items()})
    assert (
        float(jax.jit(gpt_loss, static_argnums=2)(current, batch, imported.config))
        < info["losses"][-1] - 0.05
    )


def test_recorded_loss_detects_wrong_layouts():
    """Reading linear_qkv as [all q; all k; all v], or fc1 as [up; gate], misses the logged loss."""
    pytest.importorskip("torch")
    info = _info("muonL_ws1")
    state = read_megatron(FIXTURES / "muonL_ws1")
    config = megatron_to_logical(state).config
    previous = _previous_weights(state, config, 1)
    batch = _batches(info)[-1]
    loss = jax.jit(gpt_loss, static_argnums=2)
    qkv, fc1 = (
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.mlp.linear_fc1.weight",
    )
    ungrouped = dict(previous, **{qkv: jnp.concatenate(split_qkv(previous[qkv], config), axis=1)})
    swapped = dict(previous, **{fc1: jnp.roll(previous[fc1], config.ffn_hidden_size, axis=1)})
    for wrong in (ungrouped, swapped):
        assert abs(float(loss(tree_from_keys(wrong), batch, config)) - info["losses"][-1]) > 1e-3


def test_torch_dist_export_reads_back_identically_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    convert(ConvertConfig(str(FIXTURES / "muonL_ws2"), str(tmp_path / "lw")))
    summary = convert(ConvertConfig(str(tmp_path / "lw"), str(tmp_path / "megatron")))
    assert (summary.source, summary.target) == ("lwjax", "torch_dist")
    iteration_dir = tmp_path / "megatron" / "iter_0000002"
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "2"
    original = read_megatron(FIXTURES / "muonL_ws2")
    reader = FileSystemReader(str(iteration_dir))
    metadata = reader.read_metadata()
    wanted = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if hasattr(m, "size")
    }
    dcp.load(wanted, storage_reader=reader, no_dist=True)
    muon = original.momentum
    expected = {**original.model}
    expected.update(
        {"optimizer.state.fp32_param." + k: v for k, v in original.masters.items() if k in muon}
    )
    expected.update({"optimizer.state.momentum_buffer." + k: v for k, v in muon.items()})
    for kind, table in (
        ("param", original.masters),
        ("exp_avg", original.exp_avg),
        ("exp_avg_sq", original.exp_avg_sq),
    ):
        expected.update(
            {f"optimizer.state.{kind}.{k}": v for k, v in table.items() if k not in muon}
        )
    assert set(wanted) == set(expected)
    for key, tensor in wanted.items():
        want = expected[key]
        got = (
            tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            if tensor.dtype == torch.bfloat16
            else tensor.numpy()
        )
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), key
    again = read_megatron(tmp_path / "megatron", reader="torch")
    convert(
        ConvertConfig(
            str(FIXTURES / "legacy_muon"),
            str(tmp_path / "from_legacy"),
            to="torch_dist",
            num_attention_heads=4,
            num_query_groups=2,
        )
    )
    legacy, per_param = (
        read_megatron(FIXTURES / "legacy_muon"),
        read_megatron(tmp_path / "from_legacy"),
    )
    for kind in KINDS:
        x, y = getattr(legacy, kind), getattr(per_param, kind)
        assert set(x) == set(y) and all(x[k].tobytes() == y[k].tobytes() for k in x), kind
    for kind in KINDS:
        x, y = getattr(original, kind), getattr(again, kind)
        assert set(x) == set(y) and all(x[k].tobytes() == y[k].tobytes() for k in x), kind
    assert again.hyperparameters["muon"]["momentum"] == 0.95 and again.adam_step == 2
    assert again.source["optimizer_sharding"] == "fully_reshardable"


@pytest.mark.parametrize("name", ["muonL_ws2", "adam_ws2"])
def test_cli_routes_shows_the_routing_the_import_uses(name, tmp_path, capsys):
    """``lwjax routes`` on a Megatron checkpoint, and on the lwjax checkpoint converted from it,
    gives the routing ``import_megatron`` builds its optimizer with (Muon only on the decoder
    matrices of a Muon run, q/k/v apart, one matrix per layer), not lwjax's default rules."""
    from lwjax.routing_table import COLUMNS, routing_table

    imported = import_megatron(FIXTURES / name)
    opt = imported.optimizer(Mesh(np.array(jax.devices()[:1]), ("dp",)))
    keys = [column.replace(" ", "_") for column in COLUMNS]
    want = {row[0]: dict(zip(keys, row)) for row in routing_table(opt.plan.routes)}
    assert main(["convert", str(FIXTURES / name), str(tmp_path / "lw")]) == 0
    capsys.readouterr()
    for source in (FIXTURES / name, tmp_path / "lw"):
        assert main(["routes", str(source), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert "import_megatron" in shown["routing"]
        assert {row["path"]: row for row in shown["routes"]} == want, source
