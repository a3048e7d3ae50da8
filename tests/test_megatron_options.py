"""Megatron's optimizer options under both their names, and what an import reports."""

import dataclasses
import pathlib

import numpy as np
import pytest

from lwjax.megatron import convert, import_megatron
from lwjax.megatron.convert import ConvertConfig
from lwjax.megatron.options import OPTIONS, read_options

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "megatron"


@pytest.mark.parametrize(
    "name, lm_value, core_value, field",
    [
        ("muon_nesterov", {"muon_use_nesterov": True}, {"muon_nesterov": True}, True),
        ("muon_momentum", {"muon_momentum": 0.9}, {"muon_momentum": 0.9}, 0.9),
        (
            "muon_coefficient_type",
            {"muon_coefficient_type": "polar_express"},
            None,
            "polar_express",
        ),
        ("muon_num_ns_steps", {"muon_num_ns_steps": 7}, None, 7),
        ("muon_scale_mode", {"muon_scale_mode": "unit_rms_norm"}, None, "unit_rms_norm"),
        ("adam_eps", {"adam_eps": 1e-6}, None, 1e-6),
    ],
)
def test_each_option_is_read_under_the_megatron_lm_and_the_megatron_core_name(
    name, lm_value, core_value, field
):
    for args in filter(None, (lm_value, core_value)):
        options = read_options(args, {})
        assert options[name] == field
        assert options.sources[name] == f"args.{next(iter(args))}"
    assert read_options({}, {}).sources[name] == "default"


def test_both_names_that_disagree_are_an_error():
    with pytest.raises(ValueError, match=r"muon_nesterov: the checkpoint's args disagree"):
        read_options({"muon_use_nesterov": True, "muon_nesterov": False}, {})


@pytest.mark.parametrize(
    "args, match",
    [
        ({"muon_coefficient_type": "custom"}, r"muon_coefficient_type \(from args"),
        ({"muon_fp32_matmul_prec": "low"}, r"muon_fp32_matmul_prec \(from args.*'low'"),
        ({"muon_scalar_optimizer": "lion"}, r"muon_scalar_optimizer"),
        ({"optimizer": "sgd"}, r"optimizer \(from args.optimizer\)"),
        ({"decoupled_weight_decay": False}, r"decoupled_weight_decay"),
        ({"decoupled_lr": 1e-4}, r"decoupled_lr"),
        ({"muon_num_ns_steps": 0}, r"muon_num_ns_steps.*positive integer"),
        ({"muon_momentum": 1.5}, r"muon_momentum.*\[0.0, 1.0\)"),
        ({"muon_use_nesterov": "yes"}, r"muon_nesterov \(from args.muon_use_nesterov\)"),
        ({"muon_tp_mode": "layer_sharded"}, r"muon_tp_mode"),
    ],
)
def test_an_unsupported_value_is_an_error_naming_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        read_options(args, {})


def test_param_groups_hold_what_the_optimizer_used():
    hyper = {"muon": {"momentum": 0.8}, "adam": {"betas": (0.85, 0.98), "eps": 1e-7}}
    options = read_options({"muon_momentum": 0.95, "adam_beta1": 0.9}, hyper)
    assert (options["muon_momentum"], options["adam_beta1"], options["adam_beta2"]) == (
        0.8,
        0.85,
        0.98,
    )
    assert options.sources["adam_beta2"] == "param group adam.betas[1]"
    assert {o.name for o in OPTIONS} == set(options.values)


def test_import_reads_the_options_into_the_optimizer():
    imported = import_megatron(FIXTURES / "resume_muon")
    kwargs = imported.optimizer_kwargs()
    assert kwargs["muon"].nesterov and kwargs["muon"].momentum == 0.9
    assert kwargs["config"].clip_grad == 1.0
    # A non-default coefficient table continues as stored, not with the default.
    changed = dataclasses.replace(imported, args={**imported.args, "muon_coefficient_type": "aol"})
    assert changed.optimizer_kwargs()["muon"].coefficient_type == "aol"


def test_an_adam_run_continues_with_muon_on_request():
    adam = import_megatron(FIXTURES / "resume_adam")
    assert not adam.muon
    switched = import_megatron(FIXTURES / "resume_adam", muon=True)
    assert switched.muon and switched.source["switched_from"] == "adam"
    matrices = [k for k, v in switched.logical.momenta["decoder"]["layers"]["mlp"].items()]
    assert matrices
    fc1 = switched.logical.momenta["decoder"]["layers"]["mlp"]["linear_fc1"]["weight"]
    assert fc1 is not None and not np.any(fc1)  # Muon momentum starts at zero
    mu = switched.logical.elementwise.mu
    assert mu["decoder"]["layers"]["mlp"]["linear_fc1"]["weight"] is None
    # The embedding keeps its Adam moments.
    np.testing.assert_array_equal(
        mu["embedding"]["word_embeddings"]["weight"],
        adam.logical.elementwise.mu["embedding"]["word_embeddings"]["weight"],
    )


def test_a_converted_checkpoint_opens_with_its_options_and_schedule(tmp_path):
    convert(ConvertConfig(str(FIXTURES / "resume_muon"), str(tmp_path / "lw")))
    direct = import_megatron(FIXTURES / "resume_muon")
    converted = import_megatron(tmp_path / "lw")
    assert converted.config == direct.config and converted.muon
    assert converted.scheduler == direct.scheduler and converted.iteration == 3
    assert converted.options.values == direct.options.values
    for count in (3, 4, 5):
        assert float(converted.schedule().learning_rate(count)) == float(
            direct.schedule().learning_rate(count)
        )
    from lwjax.checkpoint import save_logical
    from lwjax.megatron.gpt import MATRIX_CONVENTION

    routes = direct.optimizer(_mesh()).plan.routes
    save_logical(
        tmp_path / "plain",
        direct.params,
        direct.logical,
        routes,
        step=3,
        matrix_convention=MATRIX_CONVENTION,
    )
    with pytest.raises(ValueError, match="without Megatron metadata"):
        import_megatron(tmp_path / "plain")


def _mesh():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:2]), ("dp",))


def test_export_moves_the_scheduler_on_by_the_steps_taken(tmp_path):
    from lwjax.megatron import read_megatron, save_torch_dist

    imported = import_megatron(FIXTURES / "resume_muon")
    assert imported.scheduler["num_steps"] == 12  # 3 iterations of global batch 4
    later = imported.logical._replace(count=np.asarray(5, np.int32))
    back = imported.to_megatron(imported.params, later)
    assert back.iteration == 5 and back.scheduler["num_steps"] == 12 + 2 * 4
    schedule = imported.schedule()
    np.testing.assert_allclose(
        back.hyperparameters["muon"]["lr"], schedule.learning_rate_at(20), rtol=1e-12
    )
    save_torch_dist(back, tmp_path / "out", config=imported.config)
    again = read_megatron(tmp_path / "out")
    assert again.scheduler == back.scheduler and again.args["global_batch_size"] == 4
    assert import_megatron(tmp_path / "out").schedule().num_steps == 20
