"""The ``lwjax`` command line: fixture round trips, tables, --compare, user errors."""

import dataclasses
import doctest
import functools
import json
import pathlib
import re
import subprocess
import sys

import pytest

import lwjax.tools.bench
import lwjax.tools.layout_report
import lwjax.tools.presets
from lwjax import LayoutConfig
from lwjax.layout import POLICIES
from lwjax.policies import compute_full_param_layout
from lwjax.tools.cli import main
from lwjax.tools.layout_report import full_layout_to_json, summarize_layout
from lwjax.tools.presets import PRESETS, preset_specs

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "layouts"
POLICY_OF_VERSION = {"v1": "size_matching", "v2": "lpt", "v4": "ns_cost"}


def _cases(name):
    return json.loads((FIXTURES / name).read_text())["cases"]


PER_BUFFER_CASES = [c for v in ("v1", "v2", "v4") for c in _cases(f"layout_{v}.json")]
FULL_CASES = _cases("full_layout.json")


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _case_flags(case):
    flags = ["--policy", POLICY_OF_VERSION[case["version"]], "--dp", str(case["dp"])]
    if case["bucket_size"] is not None:
        flags += ["--bucket-size", str(case["bucket_size"])]
    if case["pad_buckets_for_high_nccl_busbw"]:
        flags.append("--high-busbw")
    return flags


@pytest.mark.parametrize("case", PER_BUFFER_CASES, ids=[c["case_id"] for c in PER_BUFFER_CASES])
def test_layout_json_reproduces_fixture(case, tmp_path, capsys):
    spec = tmp_path / "params.json"
    spec.write_text(json.dumps(case["params"]))
    code, out, err = _run(capsys, "layout", "--spec", str(spec), *_case_flags(case), "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == case["expected"]


def test_layout_json_accepts_megatron_flag_aliases_and_case_objects(tmp_path, capsys):
    case = next(
        c for c in PER_BUFFER_CASES if c["bucket_size"] and c["pad_buckets_for_high_nccl_busbw"]
    )
    spec = tmp_path / "case.json"
    spec.write_text(json.dumps(case))  # a whole fixture case: its "params" are read
    flags = [
        "--policy",
        POLICY_OF_VERSION[case["version"]],
        "--dp",
        str(case["dp"]),
        "--ddp-bucket-size",
        str(case["bucket_size"]),
        "--ddp-pad-buckets-for-high-nccl-busbw",
    ]
    code, out, _ = _run(capsys, "layout", "--spec", str(spec), *flags, "--json")
    assert code == 0 and json.loads(out) == case["expected"]


@pytest.mark.parametrize("case", FULL_CASES, ids=[c["case_id"] for c in FULL_CASES])
def test_layout_full_json_reproduces_full_layout_fixture(case, tmp_path, capsys):
    spec = tmp_path / "params.json"
    spec.write_text(json.dumps(case["params"]))
    flags = _case_flags(case)
    if case["expert_dp"] is not None:
        flags += ["--expert-dp", str(case["expert_dp"])]
    if not case["grad_reduce_in_fp32"]:
        flags.append("--no-grad-reduce-in-fp32")
    code, out, err = _run(capsys, "layout", "--spec", str(spec), *flags, "--json", "--full")
    assert (code, err) == (0, "")
    got = json.loads(out)["buffers"]
    expected = case["expected"]["buffers"]
    assert len(got) == len(expected)
    for buffer, exp in zip(got, expected):
        assert buffer == exp  # shard_of only for layer-wise buffers, in both


@pytest.mark.parametrize("preset", list(PRESETS))
def test_layout_compare_lists_every_policy(preset, capsys):
    code, out, err = _run(
        capsys, "layout", "--preset", preset, "--dp", "8", "--layers", "2", "--compare"
    )
    assert (code, err) == (0, "")
    for policy in POLICIES:
        assert policy in out
    for column in ("padding", "max/mean el.", "max/mean NS FLOPs", "buckets", "layout ms"):
        assert column in out


@pytest.mark.parametrize("preset", list(PRESETS))
def test_layout_compare_json_on_full_presets(preset, capsys):
    code, out, _ = _run(
        capsys,
        "layout",
        "--preset",
        preset,
        "--dp",
        "8",
        "--bucket-size",
        "40000000",
        "--compare",
        "--json",
    )
    rows = json.loads(out)
    assert code == 0 and [r["policy"] for r in rows] == list(POLICIES)
    total = sum(s.numel for s in preset_specs(preset))
    for row in rows:
        assert row["real_numel"] == total and row["numel"] >= total
        assert row["padding_pct"] >= 0 and row["numel_balance"] >= 1 and row["layout_ms"] > 0


def test_layout_table_shows_buffers_shards_and_summary(capsys):
    code, out, err = _run(
        capsys, "layout", "--preset", "moe", "--layers", "2", "--dp", "4", "--expert-dp", "2"
    )
    assert (code, err) == (0, "")
    assert "expert · layer-wise (Muon) · 2 shards" in out
    assert "dense · elementwise (distributed optimizer) · 4 shards" in out
    assert "shard 3" in out and "Model summary" in out and "Per rank, all 4-way buffers" in out
    assert "ranks of 2-way buffers" in out


def test_layout_preset_json_is_the_full_layout(capsys):
    code, out, _ = _run(
        capsys,
        "layout",
        "--preset",
        "tied",
        "--layers",
        "1",
        "--dp",
        "2",
        "--policy",
        "lpt",
        "--json",
    )
    specs = preset_specs("tied", layers=1)
    assert code == 0
    assert json.loads(out) == full_layout_to_json(
        compute_full_param_layout(specs, 2, LayoutConfig(policy="lpt"))
    )


def test_layout_list_of_shapes_spec(tmp_path, capsys):
    spec = tmp_path / "shapes.json"
    spec.write_text(json.dumps([[256, 256], [256], [512, 128], [512, 128]]))
    code, out, _ = _run(capsys, "layout", "--spec", str(spec), "--dp", "2", "--json")
    layout = json.loads(out)
    assert code == 0 and layout["shard_of"]["p2"] != layout["shard_of"]["p3"]
    code, out, _ = _run(capsys, "layout", "--spec", str(spec), "--dp", "2")
    assert code == 0 and "Model summary" in out


def test_layout_summary_numbers(capsys):
    specs = preset_specs("llama8b")
    summary = summarize_layout(compute_full_param_layout(specs, 8), specs)
    assert summary.real_numel == 8_030_261_248 and summary.padding_pct < 0.01
    assert summary.numel_balance == pytest.approx(1.0, abs=1e-3)
    assert summary.flops_balance == pytest.approx(1.0)


USER_ERRORS = {
    "dp_zero": (
        "layout --preset llama8b --dp 0",
        "lwjax layout: compute_full_param_layout: dp must be a positive integer; got dp=0.",
    ),
    "unknown_preset": (
        "layout --preset gpt5 --dp 8",
        "lwjax layout: argument --preset: invalid choice: 'gpt5'",
    ),
    "unknown_policy": (
        "layout --preset tied --dp 2 --policy best",
        "lwjax layout: argument --policy: invalid choice: 'best'",
    ),
    "dp_not_int": (
        "layout --preset tied --dp two",
        "lwjax layout: argument --dp: invalid int value: 'two'",
    ),
    "no_model": (
        "layout --groups --dp 1024",
        "lwjax layout: the model to lay out is required: --preset NAME (one of llama8b, llama1b, "
        "llama70b, llama405b, small, moe, tied) or --spec FILE.json.",
    ),
    "layers_zero": (
        "layout --preset tied --dp 2 --layers 0",
        "lwjax layout: preset tied: layers must be a positive integer",
    ),
    "bucket_zero": (
        "layout --preset tied --dp 2 --bucket-size 0",
        "lwjax layout: LayoutConfig.bucket_size must be 'auto', None or a positive integer",
    ),
    "ns_steps_zero": (
        "layout --preset tied --dp 2 --ns-steps 0",
        "lwjax layout: evaluate_policy: num_ns_steps must be a positive integer",
    ),
    "missing_file": (
        "layout --spec /nonexistent/model.json --dp 2",
        "lwjax layout: --spec: cannot read /nonexistent/model.json",
    ),
    "unknown_command": ("frobnicate", "lwjax: argument COMMAND: invalid choice: 'frobnicate'"),
    "no_command": ("", "lwjax: the following arguments are required: COMMAND"),
}


@pytest.mark.parametrize("command, message", USER_ERRORS.values(), ids=USER_ERRORS.keys())
def test_user_errors_exit_2_with_one_line(command, message, capsys):
    code, out, err = _run(capsys, *command.split())
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        (
            json.dumps([[4, 4], [0]]),
            "params[1]: shape must be a list of positive integers; got [0].",
        ),
        (
            json.dumps([{"name": "a", "shape": [4]}, {"name": "a", "shape": [4]}]),
            "params[1] (a): duplicate parameter name",
        ),
    ],
    ids=["bad_json", "bad_shape", "duplicate"],
)
def test_bad_spec_file_exits_2(content, message, tmp_path, capsys):
    spec = tmp_path / "model.json"
    spec.write_text(content)
    code, out, err = _run(capsys, "layout", "--spec", str(spec), "--dp", "2", "--json")
    assert code == 2 and out == "" and err.startswith("lwjax layout: ") and message in err
    assert err.count("\n") == 1


def test_layers_with_spec_is_an_error(tmp_path, capsys):
    spec = tmp_path / "model.json"
    spec.write_text("[[4, 4]]")
    code, _, err = _run(capsys, "layout", "--spec", str(spec), "--dp", "2", "--layers", "3")
    assert code == 2 and err == "lwjax layout: --layers applies to --preset only.\n"


def test_help_exits_0(capsys):
    code, out, _ = _run(capsys, "layout", "--help")
    assert code == 0 and "--ddp-bucket-size" in out and "--compare" in out


def test_cli_and_layout_report_import_no_jax():
    """The layout command runs with jax unimportable."""
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import lwjax.tools.presets, lwjax.tools.layout_report, lwjax.tools.cli\n"
        "sys.exit(lwjax.tools.cli.main(['layout', '--preset', 'tied', '--layers', '1', "
        "'--dp', '2', '--compare']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "size_matching" in result.stdout


def test_console_script_runs():
    script = pathlib.Path(sys.executable).parent / "lwjax"
    if not script.exists():
        pytest.skip("lwjax console script not installed in this environment")
    result = subprocess.run(
        [str(script), "layout", "--preset", "tied", "--dp", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == "lwjax layout: compute_full_param_layout: dp must be a positive integer; got dp=0.\n"
    )


@pytest.mark.parametrize(
    "module", [lwjax.tools.presets, lwjax.tools.layout_report], ids=["presets", "layout_report"]
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


class _Config(Exception):
    """Raised by a stand-in for ``run_bench`` / ``run_train_bench`` with the config it was given."""


@pytest.mark.parametrize(
    "argv, warmup", [((), "default"), (("--warmup", "3"), 3)], ids=["default", "given"]
)
@pytest.mark.parametrize(
    "runner",
    ["lwjax.tools.bench.run_bench", "lwjax.tools.bench.run_train_bench"],
    ids=["optimizer_step", "train_step"],
)
def test_bench_warms_up_the_configs_default_unless_told(monkeypatch, runner, argv, warmup):
    """Without --warmup both benches warm up ``WARMUP_STEPS`` calls (a pipelined
    step's first calls run slow)."""

    def capture(config):
        raise _Config(config)

    monkeypatch.setattr(runner, capture)
    train = ("--train-step",) if "train" in runner else ()
    with pytest.raises(_Config) as raised:
        main(["bench", "--workload", "small", "--dp", "2", *train, *argv])
    want = lwjax.tools.bench.WARMUP_STEPS if warmup == "default" else warmup
    assert raised.value.args[0].warmup == want
    assert (
        lwjax.tools.bench.WARMUP_STEPS >= 6
    )  # the compiling call and the 4 slow ones measured after it


@pytest.mark.parametrize(
    "runner",
    ["lwjax.tools.bench.run_bench", "lwjax.tools.bench.run_train_bench"],
    ids=["optimizer_step", "train_step"],
)
def test_bench_takes_every_workload_the_benchmarks_define(monkeypatch, runner):
    """``--workload`` offers each of ``WORKLOADS`` (70b for issue 47's fully sharded slice)
    and hands the GPT with the layers asked for to the benchmark."""

    def capture(config):
        raise _Config(config)

    monkeypatch.setattr(runner, capture)
    train = ("--train-step",) if "train" in runner else ()
    for name, gpt in lwjax.tools.bench.WORKLOADS.items():
        with pytest.raises(_Config) as raised:
            main(["bench", "--workload", name, "--layers", "3", "--dp", "2", *train])
        config = raised.value.args[0]
        assert (config.workload, config.layers) == (name, 3)
        assert lwjax.tools.bench.workload_config(config.workload, config.layers) == (
            dataclasses.replace(gpt, num_layers=3)
        )


def test_kernel_summary_counts_communication_exposed_only_where_no_compute_runs():
    """A hand-drawn trace of two steps (times in ms): a reduce-scatter half under compute, two
    overlapping all-gathers partly under it; every figure worked out by hand, per step."""
    kernels = [
        ("sm90_xmma_gemm_bf16", 0, 10),
        ("loop_add_fusion", 20, 30),
        ("ncclDevKernel_ReduceScatter_Sum_f32", 5, 25),  # under compute 5-10 and 20-25
        ("ncclDevKernel_AllGather_RING_LL", 28, 40),  # under compute 28-30
        ("ncclDevKernel_AllGather_RING_LL", 35, 45),  # beside the other gather
        ("loop_add_fusion", 50, 52),
    ]
    summary = lwjax.tools.bench.kernel_summary(
        [(name, start * 1e6, end * 1e6) for name, start, end in kernels], steps=2
    )
    assert summary["kernel_ms"] == {
        "matmul": pytest.approx(5),
        "other": pytest.approx(6),
        "reduce-scatter": pytest.approx(10),
        "all-gather": pytest.approx(11),
    }
    assert summary["comm_ms"] == pytest.approx(37 / 2)  # 5-25 and 28-45
    assert summary["compute_ms"] == pytest.approx(22 / 2)  # 0-10, 20-30, 50-52
    assert summary["overlap_ms"] == pytest.approx(12 / 2)  # 5-10, 20-25, 28-30
    assert summary["exposed_ms"] == {
        "reduce-scatter": pytest.approx(5),
        "all-gather": pytest.approx(15 / 2),
    }
    assert summary["top_other_ms"] == {"loop_add_fusion": 6.0}


def test_bench_optimizer_step_reports_the_gradient_norm_it_was_given(capsys):
    """The random gradients' global norm is what --grad-std sets (std * sqrt(N / dp)
    for the mean), and it is reported."""
    code = main(
        [
            "bench",
            "--workload",
            "small",
            "--layers",
            "1",
            "--dp",
            "2",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--no-baselines",
            "--grad-std",
            "2e-5",
            "--pipeline-muon",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    (record,) = json.loads(out)
    assert record["contender"] == "lwjax" and record["pipeline_muon"] and record["step_ms"] > 0
    # One warm-up call asked for; the speculative step, first chosen at the third call, is
    # compiled and run once more before timing.
    assert (record["iters"], record["warmup"]) == (1, 3)
    assert (
        min(record["back_to_back_ms"], record["rs_back_to_back_ms"], record["ag_back_to_back_ms"])
        > 0
    )
    assert record["floor_sum_back_to_back_ms"] == pytest.approx(
        record["rs_back_to_back_ms"]
        + record["ag_back_to_back_ms"]
        + record["ns_ms"]
        + record["bytes_ms"]
    )
    assert record["grad_norm"] == pytest.approx(2e-5 * (record["params"] / 2) ** 0.5, rel=0.02)
    assert main(["bench", "--grad-std", "0"]) == 2
    assert capsys.readouterr().err.startswith(
        "lwjax bench: BenchConfig.grad_std must be positive; got 0.0."
    )


def test_bench_optimizer_step_at_dp_x_tp_splits_the_state_as_megatron_splits_the_model(
    capsys, tmp_path
):
    """--tp 2 at dp 2 (4 devices): the record says tp and tp mode and that the floor and the
    optax baseline were not measured; a device holds the state of dp 2 alone with every split
    leaf's share halved (vocabulary, column- and row-parallel matrices split, norms whole).
    The tp 1 run is also traced (--profile): the traced steps donate the state, and the state
    they hand back is the one measured."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from lwjax.megatron.gpt import keys_from_tree
    from lwjax.tools import bench

    argv = ["bench", "--workload", "small", "--layers", "1", "--dp", "2", "--tp", "2"]
    code = main([*argv, "--iters", "1", "--warmup", "1", "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    (record,) = json.loads(out)  # no optax baseline at tp > 1
    assert (record["contender"], record["dp"], record["tp"]) == ("lwjax", 2, 2)
    assert record["tp_mode"] == "duplicated" and record["step_ms"] > 0
    assert "rs_ms" not in record and "tensor-parallel" in record["floor_skipped"]
    assert "no tensor parallelism" in record["baseline_skipped"]
    assert record["grad_norm"] == pytest.approx(1e-2 * (record["params"] / 2) ** 0.5, rel=0.02)

    config = bench.workload_config("small", 1)
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    traced = bench.BenchConfig(iters=1, warmup=1, profile_dir=str(tmp_path))
    tp1_bytes = bench.time_lwjax(traced, config, mesh)[2]
    # fp32 master and momentum per Muon element (the stacked matrices), master and two Adam
    # moments per other element; a split leaf's share halves.
    shapes = config.param_shapes()
    specs = keys_from_tree(config.tensor_specs())
    per_element = {k: (8 if len(s) == 3 else 12) * int(np.prod(s)) for k, s in shapes.items()}
    split = sum(v for k, v in per_element.items() if len(specs[k]))
    assert 0 < split < sum(per_element.values())  # the norms stay whole
    want = 1 - split / 2 / sum(per_element.values())
    assert record["state_bytes_per_device"] / tp1_bytes == pytest.approx(want, rel=0.01)
    assert main([*argv, "--train-step"]) == 2
    assert "--tp and --tp-mode apply to the optimizer step only" in capsys.readouterr().err


def _state_bytes_per_device(opt, params) -> int:
    """The busiest device's bytes of ``opt.init(params)``."""
    import jax

    state = jax.tree.leaves(opt.init(params))
    return max(
        sum(s.data.nbytes for leaf in state for s in leaf.addressable_shards if s.device == d)
        for d in opt.mesh.devices.flat
    )


@pytest.mark.parametrize("replica", ["2", "auto"])
def test_bench_optimizer_step_in_sharding_groups_holds_one_groups_state(capsys, replica):
    """--dp 4 --replica 2: the record and the table name 2 groups of 2, a device holds the
    state of the model laid out over 2 devices (about twice dp 4's), and the floor reduces
    across the groups too. --replica auto runs the groups lwjax.parallel.mesh.auto_groups
    picks for the policy."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from lwjax.groups import AutoGroups
    from lwjax.parallel.mesh import auto_groups
    from lwjax.tools import bench
    from lwjax.tools.render import print_bench

    argv = ["bench", "--workload", "small", "--layers", "1", "--dp", "4", "--replica", replica]
    code = main([*argv, "--iters", "1", "--warmup", "1", "--no-baselines", "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    (record,) = json.loads(out)
    if replica == "auto":  # the chooser's pick for the bench's policy: 2 groups of 2 here
        config = bench.workload_config("small", 1)
        mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
        _, _, choice = auto_groups(
            bench.constant_params(bench.workload_shapes(config), mesh, jax.numpy.bfloat16),
            mesh,
            groups=AutoGroups(policies=("ns_cost",)),
            routing=config.routing_rules(),
            matrix_convention=bench.MATRIX_CONVENTION,
        )
        assert (choice.option.replicas, choice.option.shards) == (2, 2)
    assert (record["dp"], record["replica"]) == (4, replica if replica == "auto" else 2)
    assert (record["replicas"], record["group_size"]) == (2, 2)
    assert record["step_ms"] > 0 and record["rs_ms"] > 0 and record["floor_sum_ms"] > 0
    print_bench([record])
    assert "4 = 2 × 2" + (" auto" if replica == "auto" else "") in capsys.readouterr().out

    # The busiest device's state of the layout over 2 devices, more than that over 4 (whole
    # matrices pad the 4-device layout more, so not quite twice).
    state = _small_bench_state_bytes()
    assert record["state_bytes_per_device"] == state[2] > 1.5 * state[4]


@functools.cache
def _small_bench_state_bytes() -> dict[int, int]:
    """``{dp: bytes}``: the busiest device's state of the bench's default optimizer (bfloat16
    parameters, ``medium`` precision) for its one-layer small workload at dp 2 and 4."""
    import jax

    state = {}
    for dp in (2, 4):
        _, params, opt = _small_bench_optimizer(dp, jax.numpy.bfloat16, "medium")
        state[dp] = _state_bytes_per_device(opt, params)
    return state


def test_bench_step_in_sharding_groups_equals_one_groups_step():
    """One optimizer step of the bench at dp 4 as 2 groups of 2 gives the parameters one
    group of 4 gives for the same per-device gradients: only the layout differs. The small
    workload's layer at a quarter of its width and an eighth of its vocabulary: the same
    leaves, compiled in about half the time."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from lwjax.tools import bench
    from lwjax.tools.bench.optimizer_contenders import grouped_mesh

    config = dataclasses.replace(
        bench.workload_config("small", 1), hidden_size=64, ffn_hidden_size=176, vocab_size=512
    )
    shapes = bench.workload_shapes(config)
    plain = Mesh(np.array(jax.devices()[:4]), ("dp",))
    stepped = {}
    for replica in (1, 2):
        mesh, replica_axis = grouped_mesh(bench.BenchConfig(dp_sizes=(4,), replica=replica), plain)
        params = bench.constant_params(shapes, mesh, jax.numpy.float32)
        opt = _workload_optimizer(params, mesh, config, "highest", replica_axis=replica_axis)
        assert opt.mesh_axes.group_size == 4 // replica
        grads = bench.local_grads(shapes, mesh, jax.numpy.float32, 1e-2, axis=opt.data_axes)
        new, _ = bench.optimizer_step(opt)(params, opt.init(params), grads)
        stepped[replica] = jax.tree.map(np.asarray, new)
    lr = 1e-3  # the bench's
    moved = jax.tree.leaves(jax.tree.map(lambda x: np.abs(x - 0.01).max(), stepped[1]))
    assert min(moved) > lr / 2  # every leaf took a step
    # To rounding: the two reduce in another order, and Adam's g / (|g| + eps) turns that into
    # a visible share of the step where g is near 0 (up to 0.2% of it here): within 1% of the
    # learning rate (one group's gradients alone in each group move a quarter of the elements
    # by up to 2 lr).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * lr),
        stepped[2],
        stepped[1],
    )


def test_bench_replica_must_divide_every_dp_size(capsys):
    assert main(["bench", "--dp", "2,4", "--replica", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lwjax bench: --replica 4 must divide every --dp size")
    assert "dp 2 does not" in err
    with pytest.raises(ValueError, match=r"BenchConfig.replica=3 must divide every dp size"):
        lwjax.tools.bench.BenchConfig(dp_sizes=(4,), replica=3)
    assert main(["bench", "--dp", "4", "--replica", "2", "--train-step"]) == 2
    assert "--replica applies to the optimizer step only" in capsys.readouterr().err


def test_bench_builds_the_pipelined_optimizer_it_reports():
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from lwjax.tools import bench

    config = bench.workload_config("small", 1)
    shapes = bench.workload_shapes(config)
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    params = bench.constant_params(shapes, mesh, jax.numpy.float32)
    grads = bench.local_grads(shapes, mesh, jax.numpy.float32, 2e-5)
    for pipelined in (False, True):
        opt = _workload_optimizer(params, mesh, config, "highest", pipeline_muon=pipelined)
        metrics = jax.eval_shape(
            jax.shard_map(
                lambda p, s, g, opt=opt: opt.local_update(jax.tree.map(lambda x: x[0], g), s, p)[2],
                mesh=mesh,
                in_specs=(P(), opt.state_specs, P("dp")),
                out_specs=P(),
                check_vma=False,
            ),
            params,
            opt.init(params),
            grads,
        )
        assert ("recomputed" in metrics) == pipelined  # the speculation's own metric


def test_bench_time_back_to_back_runs_the_steps_back_to_back_and_divides_by_their_number():
    """Each of the ``iters`` calls gets the previous call's outputs; the time is per
    step, not per window."""
    import time

    import jax

    from lwjax.tools import bench

    calls = []

    def step(x):
        calls.append(x)
        time.sleep(0.02)
        return (x + 1,)

    seconds, (last,) = bench.time_back_to_back(step, (jax.numpy.zeros(()),), 5)
    assert len(calls) == 5 and int(last) == 5
    assert 0.02 <= seconds < 0.1  # five sleeps of 20 ms over five steps


def _small_bench_optimizer(dp: int, dtype, precision: str):
    """``(mesh, params, optimizer)`` of the bench's one-layer small workload on ``dp`` devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from lwjax.tools import bench

    config = bench.workload_config("small", 1)
    mesh = Mesh(np.array(jax.devices()[:dp]), ("dp",))
    params = bench.constant_params(bench.workload_shapes(config), mesh, dtype)
    return mesh, params, _workload_optimizer(params, mesh, config, precision)


def _workload_optimizer(params, mesh, config, precision: str, **options):
    """The bench's lwjax optimizer for ``config`` as ``lwjax bench`` builds it by default (fp32
    reduction, ``ns_cost``, automatic buckets), with ``precision`` and ``options``."""
    from lwjax.tools import bench

    return bench.workload_optimizer(
        params,
        mesh,
        config,
        ns_precision=precision,
        grad_reduce_in_fp32=True,
        policy="ns_cost",
        bucket_size="auto",
        **options,
    )


def _best_seconds(fn, x) -> float:
    """The fastest of five synchronised calls of ``fn(x)``, after one."""
    import time

    fn(x).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def test_bench_floor_matmul_rate_is_one_products_rate():
    """The floor times a chain of products per call; its rate is per product, as one
    timed product's is."""
    import jax

    from lwjax.tools import bench

    mesh, _, opt = _small_bench_optimizer(2, jax.numpy.float32, "medium")
    floor = bench.optimizer_step_floor(bench.BenchConfig(iters=3, warmup=1), opt, mesh, 0)
    # Off CUDA Newton-Schulz runs full products: the FLOPs it computes are Megatron's.
    assert bench.symmetric_share(mesh.devices.flat[0], "medium") is None
    assert floor["ns_gflop_computed_max_rank"] == floor["ns_gflop_max_rank"] > 0
    assert floor["floor_sum_computed_ms"] == floor["floor_sum_ms"]
    seconds = _best_seconds(jax.jit(lambda x: x @ x), jax.numpy.ones((1024, 1024), "bfloat16"))
    assert 1 / 3 < floor["matmul_tflops"] / (2 * 1024**3 / seconds / 1e12) < 3


@pytest.mark.parametrize("dp", [1, 2])
def test_bench_floor_bytes_are_the_state_read_and_written_and_the_gradients_read_twice(dp):
    """The floor's memory term, against the arrays themselves: every state array a device
    holds read and written, its gradients read twice (bf16 as given at dp 1, the fp32
    reduction's shard at dp 2), its parameters written once; and the copy rate is one
    streamed copy's, timed here."""
    import jax
    import numpy as np

    from lwjax.tools import bench

    mesh, params, opt = _small_bench_optimizer(dp, jax.numpy.bfloat16, "medium")
    shapes = bench.workload_shapes(bench.workload_config("small", 1))
    device = mesh.devices.flat[0]
    state = sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(opt.init(params))
        for s in leaf.addressable_shards
        if s.device == device
    )
    # Padding aside, a device's share of the parameters and gradients is 1/dp of the model's.
    numel = sum(
        int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    )
    padded = sum(b.numel for b in opt.plan.buffers)
    assert numel <= padded < 1.05 * numel
    grad_bytes = 2 if dp == 1 else 4
    assert bench.step_bytes(opt.plan, dp, state) == 2 * state + (2 * grad_bytes + 2) * padded // dp

    x = jax.numpy.zeros((2**22,), jax.numpy.float32)
    one = 2 * x.nbytes / _best_seconds(jax.jit(lambda x: x + 1), x)
    assert 1 / 3 < bench.copy_bandwidth(device, 3, 1) / one < 3


@pytest.mark.parametrize("precision, counted", [("medium", True), ("highest", False)])
def test_bench_floor_counts_the_upper_tile_kernel_where_the_cuda_branch_runs(
    monkeypatch, capsys, precision, counted
):
    """With the CUDA branch taken (patched in) the computed floor counts the kernel's
    share, and the table shows it."""
    import jax

    from lwjax import gram
    from lwjax.tools import bench

    monkeypatch.setattr(gram, "MIN_SIZE", 256)  # the small workload's 256-row matrices
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    mesh, _, opt = _small_bench_optimizer(2, jax.numpy.float32, precision)
    assert (
        bench.symmetric_share(mesh.devices.flat[0], precision) is gram.computed_share
    ) is counted
    floor = bench.optimizer_step_floor(
        bench.BenchConfig(iters=2, warmup=1, ns_precision=precision), opt, mesh, 0
    )
    assert (floor["ns_gflop_computed_max_rank"] < floor["ns_gflop_max_rank"]) is counted
    assert floor["floor_sum_computed_ms"] == pytest.approx(
        floor["rs_ms"] + floor["ag_ms"] + floor["ns_computed_ms"] + floor["bytes_ms"]
    )
    record = dict(
        workload="small",
        layers=1,
        params=1,
        device="cpu",
        jax="x",
        grad_norm=1.0,
        contender="lwjax",
        dp=2,
        step_ms=10.0,
        back_to_back_ms=9.0,
        state_bytes_per_device=1,
        **floor,
    )
    monkeypatch.setattr("lwjax.tools.bench.run_bench", lambda config: [record])
    assert main(["bench", "--workload", "small", "--dp", "2"]) == 0
    assert ("FLOPs lwjax computes" in capsys.readouterr().out) is counted


def test_layout_default_is_the_optimizers_default_layout(capsys):
    """``lwjax layout`` without --bucket-size shows what ``layerwise_muon(params, mesh)`` builds
    (its ``LayoutConfig()``: automatic bucket size); 'none' is one bucket per buffer."""
    import inspect

    import lwjax

    default = inspect.signature(lwjax.layerwise_muon).parameters["layout"].default
    specs = preset_specs("llama1b")
    code, out, _ = _run(capsys, "layout", "--preset", "llama1b", "--dp", "8", "--json")
    assert code == 0
    assert json.loads(out) == full_layout_to_json(compute_full_param_layout(specs, 8, default))
    code, out, _ = _run(
        capsys, "layout", "--preset", "llama1b", "--dp", "8", "--json", "--bucket-size", "none"
    )
    one_bucket = compute_full_param_layout(specs, 8, LayoutConfig(bucket_size=None))
    assert (
        json.loads(out)
        == full_layout_to_json(one_bucket)
        != full_layout_to_json(compute_full_param_layout(specs, 8, default))
    )


def test_version_prints_the_package_version(capsys):
    import lwjax

    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out == f"lwjax {lwjax.__version__}\n"


def test_routes_shows_the_note_column_of_the_routing_table(tmp_path, capsys):
    """``lwjax routes`` has the routing table's columns, the note (issue 45, item 5) among them."""
    shapes = {"embed/table": [64, 16], "attn/kv_einsum/w": [2, 2, 16, 8], "mlp/up": [16, 32]}
    (tmp_path / "shapes.json").write_text(json.dumps(shapes))
    code, out, _ = _run(capsys, "routes", str(tmp_path / "shapes.json"), "--json")
    notes = {r["path"]: r["note"] for r in json.loads(out)["routes"]}
    assert code == 0 and notes == {
        "embed/table": "",
        "attn/kv_einsum/w": "k and v in one matrix (a dims= rule splits them)",
        "mlp/up": "",
    }
    code, out, _ = _run(capsys, "routes", str(tmp_path / "shapes.json"))
    assert code == 0 and "note" in out and "k and v in one matrix" in out


def test_routes_prints_the_routing_table_of_a_shape_file_and_a_checkpoint(tmp_path, capsys):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import lwjax

    shapes = {"embed/table": [64, 16], "attn/q_einsum/w": [4, 16, 8], "attn/norm/scale": [16]}
    (tmp_path / "shapes.json").write_text(json.dumps(shapes))
    code, out, _ = _run(capsys, "routes", str(tmp_path / "shapes.json"), "--json")
    report = json.loads(out)
    assert code == 0 and report["matrix_convention"] == "in_out"
    rows = {r["path"]: r for r in report["routes"]}
    assert rows["attn/q_einsum/w"]["matrix_view"] == "[16, 32]"
    assert [rows[p]["optimizer"] for p in shapes] == ["AdamW", "Muon", "AdamW"]
    assert report["muon_fraction"] == 512 / (1024 + 512 + 16)

    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(8)}
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
    opt = lwjax.layerwise_muon(
        params, mesh, config=lwjax.OptimizerConfig(matrix_convention="out_in")
    )
    lwjax.save(tmp_path / "ckpt", params, opt.init(params), opt)
    code, out, _ = _run(capsys, "routes", str(tmp_path / "ckpt"), "--json")
    report = json.loads(out)
    assert report["matrix_convention"] == "out_in"
    assert {r["path"]: r["optimizer"] for r in report["routes"]} == {"b": "AdamW", "w": "Muon"}
    code, _, err = _run(capsys, "routes", str(tmp_path / "missing.json"))
    assert code == 2 and "not a checkpoint directory or a readable JSON file" in err


def _long_paths_file(tmp_path) -> pathlib.Path:
    """Leaf shapes of two Llama-style layers under Hugging Face's long names."""
    shapes = {"model/embed_tokens/embedding": [32000, 4096], "lm_head/kernel": [4096, 32000]}
    for i in range(2):
        layer = f"model/layers/{i}"
        shapes[f"{layer}/self_attn/q_proj/kernel"] = [4096, 4096]
        shapes[f"{layer}/self_attn/o_proj/einsum_kernel"] = [32, 128, 4096]
        shapes[f"{layer}/mlp/down_proj/kernel"] = [14336, 4096]
        shapes[f"{layer}/post_attention_layernorm/scale"] = [4096]
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(shapes))
    return path


def _bench_records():
    base = dict(workload="1b", layers=2, params=1_234_567_890, device="cpu", jax="0.0", dp=8)
    optimizer = [
        dict(base, contender="lwjax", step_ms=12.5, grad_norm=1.0, state_bytes_per_device=10**9),
        dict(base, contender="optax muon (replicated)", step_ms=20.0, grad_norm=1.0),
    ]
    optimizer[0].update(floor_sum_ms=9.0, floor_sum_back_to_back_ms=8.0, back_to_back_ms=12.0)
    optimizer[0].update(rs_ms=1.0, ag_ms=2.0, ns_ms=5.0, bytes_ms=1.0)
    optimizer[0].update(step_gbytes=3.0, copy_gbytes_per_s=3000.0)
    train = dict(base, micro_batch=4, seq_len=2048, remat=True, param_dtype="bfloat16", mfu=0.4)
    step = [
        dict(train, contender="lwjax Muon, parameters gathered in the forward", step_ms=100.0),
        dict(train, contender="Megatron Muon", skipped="megatron-core is not installed here"),
    ]
    step[0].update(compiled_bytes_per_device=3 * 10**9, tokens_per_s=123456.0, floor_ms=90.0)
    return optimizer, step


def _demo_metrics():
    run = dict(final_train_loss=1.5, final_val_loss=1.6, step_time_s=0.25, tokens_per_s=8192.0)
    return {
        "model": {"size": "small", "num_params": 812_345},
        "devices": {"count": 8, "platform": "cpu"},
        "config": {"steps": 150},
        "data": {"unigram_entropy": 3.2, "val_tokens": 8192, "num_files": 180},
        "runs": {
            "lwjax": dict(run, optimizer="layer-wise Muon (lwjax)", state_bytes_per_device=10**6),
            "adamw": dict(run, optimizer="AdamW (replicated)", state_bytes_per_device=8 * 10**6),
        },
    }


def _print_tables(name, tmp_path):
    """Print one of the CLI's tables; return the headers it must show in full."""
    from lwjax.tools import render
    from lwjax.tools.demo.report import summary_table

    if name == "routes":
        assert main(["routes", str(_long_paths_file(tmp_path))]) == 0
        return ["path", "optimizer"]
    if name == "layout":
        assert main(["layout", "--preset", "moe", "--layers", "2", "--dp", "4"]) == 0
        return ["bucket", "shard", "elements", "padding", "max/mean el.", "max/mean FLOPs"]
    if name == "compare":
        assert main(["layout", "--preset", "llama8b", "--dp", "8", "--compare"]) == 0
        return ["policy", "padding", "max/mean el.", "max/mean NS FLOPs"]
    if name == "groups":
        assert main(["layout", "--preset", "llama8b", "--dp", "64", "--groups"]) == 0
        return ["group size", "policy", "padding", "max device NS FLOPs", "NS / least"]
    optimizer, step = _bench_records()
    if name == "bench":
        render.print_bench(optimizer)
        return ["contender", "dp", "step ms", "vs lwjax"]
    if name == "train_bench":
        render.print_train_bench(step)
        return ["contender", "dp", "step ms", "Muon overhead", "floor ms", "over floor"]
    render.console().print(summary_table(_demo_metrics()))
    return ["optimizer", "val loss", "step time", "opt. state / device"]


@pytest.mark.parametrize("width", [120, 80])
@pytest.mark.parametrize(
    "name", ["routes", "layout", "compare", "groups", "bench", "train_bench", "demo"]
)
def test_tables_fit_the_console_and_keep_their_essential_columns(
    name, width, tmp_path, capsys, monkeypatch
):
    """At ``COLUMNS`` wide no line is wider, and the columns a table is about keep whole
    headers (columns of lesser value are left out, long paths and names fold); ``lwjax
    routes`` still says Muon or AdamW for every leaf."""
    monkeypatch.setenv("COLUMNS", str(width))
    essential = _print_tables(name, tmp_path)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= width
    headers = [line for line in out.splitlines() if line.startswith("┃")]
    for column in essential:
        header = re.compile(rf"┃ +{re.escape(column)} +┃")
        assert any(header.search(line) for line in headers), (column, headers)
    if name == "routes":
        routed = [line for line in out.splitlines() if re.search(r"│ (Muon|AdamW) +│", line)]
        assert len(routed) == len(json.loads((tmp_path / "shapes.json").read_text()))
