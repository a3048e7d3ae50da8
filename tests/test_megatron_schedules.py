"""Megatron's schedules as optax schedules, against megatron-core's own ``OptimizerParamScheduler``.

``fixtures/megatron/schedules.json`` (from ``make_schedules.py``) holds, per case, the
Megatron-LM args, the stored ``opt_param_scheduler`` at the resume iteration and the learning
rate and weight decay megatron-core set before each later iteration.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwjax.megatron.schedules import (
    LR_DECAY_STYLES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
    MegatronSchedule,
    schedule_from_megatron,
)

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "megatron" / "schedules.json"
CASES = json.loads(FIXTURE.read_text())["cases"]
RUNS = [c for c in CASES if "megatron_error" not in c]
REFUSED = [c for c in CASES if "megatron_error" in c]


def _schedule(case) -> MegatronSchedule:
    return schedule_from_megatron(case["args"], case["scheduler"], case["iteration"])


def _counts(case) -> np.ndarray:
    return case["iteration"] + np.arange(len(case["lr"]))


def test_fixture_covers_every_style():
    args = [c["args"] for c in RUNS]
    assert {a["lr_decay_style"] for a in args} == set(LR_DECAY_STYLES)
    wsd = {a["lr_wsd_decay_style"] for a in args if a["lr_decay_style"] == "WSD"}
    assert wsd == set(WSD_DECAY_STYLES)
    assert {a["weight_decay_incr_style"] for a in args} == set(WD_INCR_STYLES)
    assert any(a["train_samples"] for a in args) and any(a["train_iters"] for a in args)
    assert any(a["lr_warmup_fraction"] for a in args) and any(a["lr_warmup_init"] for a in args)
    assert any(c["scheduler"] and "num_iters" in c["scheduler"] for c in RUNS)


@pytest.mark.parametrize("case", RUNS, ids=[c["name"] for c in RUNS])
def test_schedule_matches_megatron_in_float64(case):
    schedule = _schedule(case)
    counts = _counts(case)
    np.testing.assert_array_equal(schedule.num_steps_of(counts), case["num_steps"])
    samples = schedule.num_steps_of(counts)
    weight_decay = schedule.weight_decay_at(samples)
    if schedule.resume_wd is not None:  # Megatron's first resumed step: see MegatronSchedule
        weight_decay[0] = schedule.resume_wd
    for got, want in ((schedule.learning_rate_at(samples), case["lr"]), (weight_decay, case["wd"])):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)


@pytest.mark.parametrize("case", RUNS, ids=[c["name"] for c in RUNS])
def test_schedule_is_an_optax_schedule_in_float32(case):
    schedule = _schedule(case)
    counts = jnp.asarray(_counts(case), jnp.int32)
    lr = jax.jit(jax.vmap(schedule.learning_rate))(counts)
    wd = jax.jit(jax.vmap(schedule.weight_decay))(counts)
    assert lr.dtype == wd.dtype == jnp.float32
    peak_lr = max(case["lr"])
    np.testing.assert_allclose(lr, case["lr"], rtol=1e-6, atol=1e-6 * peak_lr)
    np.testing.assert_allclose(wd, case["wd"], rtol=1e-6, atol=1e-6 * max(case["wd"]))
    # A Python int count (optax calls schedules with the state's count) gives the same value.
    assert float(schedule.learning_rate(int(counts[1]))) == pytest.approx(case["lr"][1], rel=1e-6)


@pytest.mark.parametrize("case", REFUSED, ids=[c["name"] for c in REFUSED])
def test_stored_values_megatron_refuses_are_refused(case):
    with pytest.raises(ValueError, match=r"opt_param_scheduler\.max_lr: differs"):
        _schedule(case)


def test_only_changed_weight_decay_settings_give_a_resume_weight_decay():
    got = {c["name"] for c in RUNS if _schedule(c).resume_wd is not None}
    assert got == {"resume_use_checkpoint_values"}


def test_describe_names_where_each_value_came_from():
    case = next(c for c in RUNS if c["name"] == "resume_use_checkpoint_values")
    described = _schedule(case).describe()
    assert described["max_lr"] == {"value": 0.01, "from": "opt_param_scheduler.max_lr"}
    assert described["init_lr"] == {"value": 2e-3, "from": "args.lr_warmup_init"}
    assert described["num_steps"]["from"] == "opt_param_scheduler.num_steps"
    assert described["increment"] == {"value": 4, "from": "args.global_batch_size"}
    old = _schedule(next(c for c in RUNS if c["name"] == "resume_old_names_iter")).describe()
    assert old["warmup_steps"]["from"] == "opt_param_scheduler.warmup_iter"
    assert old["start_wd"]["from"] == "args.start_weight_decay"
    fresh = schedule_from_megatron({"lr": 1.0, "train_iters": 5, "global_batch_size": 2}, None, 3)
    assert fresh.describe()["num_steps"] == {
        "value": 6,
        "from": "iteration * args.global_batch_size",
    }


BASE = {"lr": 1e-2, "train_iters": 10, "global_batch_size": 4, "lr_warmup_iters": 2}


@pytest.mark.parametrize(
    "changes, scheduler, match",
    [
        ({"lr_decay_style": "foo"}, None, r"args\.lr_decay_style: expected one of .*; got 'foo'"),
        (
            {"lr_decay_style": "WSD", "lr_wsd_decay_style": "step", "lr_wsd_decay_iters": 2},
            None,
            r"args\.lr_wsd_decay_style: expected one of",
        ),
        ({"weight_decay_incr_style": "exp"}, None, r"args\.weight_decay_incr_style: expected"),
        ({"train_iters": None}, None, r"args\.train_iters, args\.train_samples"),
        ({"global_batch_size": None}, None, r"args\.global_batch_size: expected an integer"),
        ({"lr": None}, None, r"args\.lr: expected a finite real number"),
        ({"min_lr": -1e-3}, None, r"args\.min_lr: expected a finite number >= 0"),
        ({"lr_warmup_iters": -1}, None, r"args\.lr_warmup_iters: expected an integer >= 0"),
        ({"lr_warmup_iters": 10}, None, r"args\.lr_warmup_iters \* args\.global_batch_size: "),
        ({"lr_warmup_init": 1.0}, None, r"args\.lr_warmup_init: must not exceed"),
        ({"lr_decay_style": "WSD"}, None, r"args\.lr_wsd_decay_iters: lr_decay_style 'WSD'"),
        (
            {"weight_decay_incr_style": "constant", "start_weight_decay": 0.0},
            None,
            r"args\.weight_decay_incr_style: a constant weight decay needs equal start",
        ),
        (
            {
                "start_weight_decay": 0.2,
                "end_weight_decay": 0.1,
                "weight_decay_incr_style": "linear",
            },
            None,
            r"args\.end_weight_decay: must be >=",
        ),
        ({}, {"max_lr": float("nan")}, r"opt_param_scheduler\.max_lr: expected a finite real"),
        (
            {"use_checkpoint_opt_param_scheduler": True},
            {"lr_decay_style": "bar"},
            r"opt_param_scheduler\.lr_decay_style: expected one of",
        ),
        ({}, {"num_steps": -4}, r"opt_param_scheduler\.num_steps: expected an integer >= 0"),
        (
            {"train_iters": None, "train_samples": 100, "rampup_batch_size": [1, 1, 50]},
            {"num_steps": 20},
            r"args\.rampup_batch_size: the batch-size ramp-up \(50 samples\) is not over",
        ),
    ],
    ids=[
        "decay_style",
        "wsd_style",
        "wd_style",
        "no_train_length",
        "no_batch",
        "no_lr",
        "negative_min_lr",
        "negative_warmup",
        "warmup_past_decay",
        "init_above_peak",
        "wsd_without_anneal",
        "constant_wd_changes",
        "wd_decreases",
        "stored_nan",
        "stored_style",
        "stored_negative_steps",
        "rampup_in_progress",
    ],
)
def test_bad_inputs_name_the_megatron_argument(changes, scheduler, match):
    with pytest.raises(ValueError, match=match):
        schedule_from_megatron({**BASE, **changes}, scheduler, iteration=5)


def test_a_finished_rampup_steps_by_the_global_batch():
    args = {**BASE, "train_iters": None, "train_samples": 100, "rampup_batch_size": ["1", "1", 8]}
    schedule = schedule_from_megatron(args, {"num_steps": 12}, iteration=5)
    assert int(schedule.num_steps_of(7)) == 20


def test_argparse_namespace_is_read_like_a_dict():
    import argparse

    a = schedule_from_megatron(argparse.Namespace(**BASE), None, 1)
    assert a == schedule_from_megatron(BASE, None, 1)


def test_schedules_plug_into_the_optimizer_config_and_docstring_examples_run():
    import doctest

    from lwjax.megatron import schedules
    from lwjax.optimizer import OptimizerConfig

    schedule = _schedule(RUNS[0])
    config = OptimizerConfig(weight_decay=schedule.weight_decay)
    assert hash(config) == hash(OptimizerConfig(weight_decay=schedule.weight_decay))
    result = doctest.testmod(schedules)
    assert result.failed == 0 and result.attempted > 0
