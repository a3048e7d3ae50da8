"""lwjax across processes: 2 processes x 4 CPU devices train like 1 x 8, checkpoint
across, fail fast.

The multi-process runs are spawned through :func:`lwjax.launch.launch` (this
pytest process has used JAX, so it cannot join a job); the single-process
references run here, on the 8 virtual CPU devices of ``conftest.py``.
"""

import io
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from module_files import imported

from lwjax import checkpoint
from lwjax import distributed as dist
from lwjax.launch import LaunchConfig, launch
from lwjax.logical import to_logical

WORKER = pathlib.Path(__file__).parent / "workers" / "train_worker.py"
STEPS = 3
LAUNCH_TIMEOUT = 240  # s: generous for 2 shared cores, but bounded
HEARTBEAT = 5  # s


worker = imported(WORKER)


def _launch(*args, nproc=2, devices=4, **options):
    out, report = io.StringIO(), io.StringIO()
    config = LaunchConfig(
        command=(sys.executable, str(WORKER), *map(str, args)),
        nproc=nproc,
        devices_per_proc=devices,
        timeout=LAUNCH_TIMEOUT,
        env={"JAX_PLATFORMS": "cpu"},
        **options,
    )
    result = launch(config, out=out, report=report)
    return result, out.getvalue(), report.getvalue()


# --------------------------------------------------------------------------- in this process


def test_config_from_env_reads_the_launcher_variables_and_arguments_win():
    env = {
        dist.ENV_COORDINATOR: "10.0.0.1:4000",
        dist.ENV_NUM_PROCESSES: "4",
        dist.ENV_PROCESS_ID: "3",
        dist.ENV_CPU_DEVICES: "2",
        dist.ENV_HEARTBEAT_TIMEOUT: "9",
    }
    config = dist.config_from_env(env, process_id=1, shutdown_timeout=7)
    assert config == dist.DistributedConfig(
        "10.0.0.1:4000", 4, 1, cpu_devices=2, heartbeat_timeout=9, shutdown_timeout=7
    )
    assert config.is_distributed
    assert not dist.config_from_env({}).is_distributed
    assert dist.config_from_env({dist.ENV_CLUSTER_DETECTION: "slurm"}).is_distributed


@pytest.mark.parametrize(
    "env,fields,message",
    [
        (
            {dist.ENV_NUM_PROCESSES: "two"},
            {},
            "LWJAX_NUM_PROCESSES must be an integer; got LWJAX_NUM_PROCESSES='two'",
        ),
        ({}, {"num_processes": 2, "process_id": 2}, "process_id must be < num_processes"),
        ({}, {"cluster_detection": "pbs"}, "cluster_detection must be one of"),
        ({}, {"coordinator_address": "localhost"}, "must be 'host:port'"),
        ({}, {"heartbeat_timeout": 0}, "heartbeat_timeout must be a positive int"),
    ],
    ids=["env-not-int", "id-out-of-range", "unknown-cluster", "no-port", "zero-timeout"],
)
def test_config_rejects_bad_settings(env, fields, message):
    with pytest.raises(ValueError, match=message):
        dist.config_from_env(env, **fields)


def test_initialize_without_job_settings_is_a_no_op():
    info = dist.initialize(dist.DistributedConfig())
    assert info == dist.ProcessInfo(0, 1, False) and info.is_main
    assert not dist.is_initialized()
    assert dist.initialize(dist.DistributedConfig(cpu_devices=8)) == info  # what JAX already has
    assert jax.local_device_count() == 8


def test_initialize_refuses_incomplete_or_late_settings():
    with pytest.raises(ValueError, match=r"missing \['process_id'\]"):
        dist.initialize(dist.DistributedConfig("127.0.0.1:1", 2))
    with pytest.raises(RuntimeError, match="call lwjax.distributed.initialize\\(\\) first"):
        dist.initialize(dist.DistributedConfig("127.0.0.1:1", 2, 0))
    with pytest.raises(RuntimeError, match="cpu_devices=4, but JAX already started with 8"):
        dist.initialize(dist.DistributedConfig(cpu_devices=4))
    assert not dist.is_initialized()


def test_batches_and_replicas_in_one_process():
    mesh = dist.global_mesh()
    assert mesh.shape == {"dp": 8} and dist.global_mesh(4).shape == {"dp": 4}
    with pytest.raises(
        ValueError, match=r"num_devices must be a multiple of the 1 process\(es\) in \[1, 8\]"
    ):
        dist.global_mesh(9)
    assert dist.process_rows(32, mesh) == slice(0, 32)
    with pytest.raises(ValueError, match="must divide by dp=8; got global_rows=12"):
        dist.process_rows(12, mesh)
    batch = worker.global_batch_at(0)
    sharded = dist.shard_batch(batch, mesh)
    assert sharded["inputs"].sharding == NamedSharding(mesh, P("dp"))
    np.testing.assert_array_equal(dist.gather_to_host(sharded)["inputs"], batch["inputs"])
    replicated = dist.replicate({"w": np.arange(6.0).reshape(2, 3)}, mesh)["w"]
    assert replicated.sharding.is_fully_replicated and replicated.sharding.mesh == mesh
    placed = dist.place({"a": np.arange(16.0), "b": np.ones(3)}, mesh, {"a": P("dp"), "b": P()})
    assert placed["a"].sharding.spec == P("dp") and placed["b"].sharding.is_fully_replicated
    np.testing.assert_array_equal(dist.gather_to_host(placed)["a"], np.arange(16.0))
    dist.barrier("single process: no-op")


def test_batches_split_over_several_axes():
    mesh = Mesh(
        np.array(jax.devices()).reshape(4, 2), ("dp", "ep")
    )  # e.g. optimizer.data_axes == ("dp", "ep")
    assert dist.process_rows(16, mesh, axis=("dp", "ep")) == slice(0, 16)
    batch = dist.shard_batch({"x": np.arange(16 * 3).reshape(16, 3)}, mesh, axis=("dp", "ep"))
    assert batch["x"].sharding.spec == P(("dp", "ep")) and len(batch["x"].sharding.device_set) == 8
    assert dist.global_batch({"x": np.zeros((8, 2))}, mesh, axis="dp")["x"].shape == (8, 2)


# --------------------------------------------------------------------------- spawned processes


def _state_on_host(optimizer, params, state) -> dict:
    return worker.flat(
        dist.gather_to_host({"params": params, "state": to_logical(optimizer, state)})
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The worker model, 3 steps: here on 1 process x 8 devices (saved), then on 2 processes x 4.

    The 2-process job also saves a checkpoint and restores the 1-process one.
    """
    out_dir = tmp_path_factory.mktemp("runs")
    optimizer, params, state, losses = worker.train(dist.global_mesh(), STEPS, log=lambda _: None)
    checkpoint.save(out_dir / "one_process_ckpt", params, state, optimizer)
    one = {"losses": np.asarray(losses), **_state_on_host(optimizer, params, state)}
    result, out, report = _launch(
        "--steps", STEPS, "--out", out_dir, "--save", "--restore", out_dir / "one_process_ckpt"
    )
    assert result.returncode == 0, out + report
    return {"one": one, "two": dict(np.load(out_dir / "result.npz")), "dir": out_dir, "out": out}


def test_two_processes_train_like_one_process(runs):
    out, one, two = runs["out"], runs["one"], runs["two"]
    assert "[p0] process 0/2: 4 local, 8 global devices" in out and "[p1] step 2" in out
    assert (
        "rows 0:16" in out and "rows 16:32" in out
    )  # each process loads half of each global batch
    assert set(two) == set(one)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
    for (
        name,
        value,
    ) in one.items():  # same mesh, layout and data; only the reduction order may differ
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert int(two["['state'].count"]) == STEPS


def test_checkpoint_from_two_processes_restores_in_one(runs):
    for dp in (8, 2):
        mesh = dist.global_mesh(dp)
        optimizer = worker.make_optimizer(worker.make_params(), mesh)
        params, state = checkpoint.restore(runs["dir"] / "ckpt", optimizer)
        restored = _state_on_host(optimizer, params, state)
        for name, value in restored.items():  # bit for bit
            np.testing.assert_array_equal(value, runs["two"][name], err_msg=f"dp={dp} {name}")
        assert all(x.sharding.mesh == mesh for x in jax.tree.leaves((params, state)))


def test_checkpoint_from_two_processes_restores_in_four(runs, tmp_path):
    """The 2 x 4 checkpoint (logical arrays split over all 8 devices, written by both
    processes) restored by 4 processes x 2 devices: bit for bit."""
    result, out, report = _launch(
        "--steps", 0, "--out", tmp_path, "--restore", runs["dir"] / "ckpt", nproc=4, devices=2
    )
    assert result.returncode == 0, out + report
    assert "[p3] process 3/4: 2 local, 8 global devices" in out
    restored = dict(np.load(tmp_path / "restored.npz"))
    two = {k: v for k, v in runs["two"].items() if k != "losses"}
    assert set(restored) == set(two)
    for name, value in two.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """The worker model with every leaf split over fsdp (dp 2 x fsdp 4, a process an fsdp
    group), 3 steps: here on 1 process x 8 devices, then on 2 processes x 4, which save."""
    out_dir = tmp_path_factory.mktemp("fsdp_runs")
    optimizer, params, state, losses = worker.train(worker.fsdp_mesh(4), STEPS, log=lambda _: None)
    one = {"losses": np.asarray(losses), **_state_on_host(optimizer, params, state)}
    result, out, report = _launch("--steps", STEPS, "--out", out_dir, "--save", "--fsdp", 4)
    assert result.returncode == 0, out + report
    return {"one": one, "two": dict(np.load(out_dir / "result.npz")), "dir": out_dir}


def test_two_processes_train_fsdp_split_parameters_like_one_process(fsdp_runs):
    """make_train_step over parameters split over fsdp (gathered in the loss, gradients
    reduce-scattered), the batch over dp x fsdp: 2 processes as 1."""
    one, two = fsdp_runs["one"], fsdp_runs["two"]
    assert set(two) == set(one)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_fsdp_checkpoint_from_two_processes_restores_replicated_at_dp_8(fsdp_runs):
    """The fsdp run's 2-process checkpoint restored by one process at dp 8 with replicated
    parameters: its parameters and logical state bit for bit."""
    mesh = dist.global_mesh(8)
    optimizer = worker.make_optimizer(worker.make_params(), mesh)
    params, state = checkpoint.restore(fsdp_runs["dir"] / "ckpt", optimizer)
    restored = _state_on_host(optimizer, params, state)
    two = {k: v for k, v in fsdp_runs["two"].items() if k != "losses"}
    assert set(restored) == set(two)
    for name, value in two.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_checkpoint_from_one_process_restores_in_two(runs):
    restored = dict(np.load(runs["dir"] / "restored.npz"))
    one = {k: v for k, v in runs["one"].items() if k != "losses"}
    assert set(restored) == set(one)
    for name, value in one.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_dead_process_fails_the_others_at_their_next_collective():
    # Process 1 crashes after step 2; process 0 waits a second on the host, then enters step 3's
    # reduce-scatter and fails there. (Entering it at once, it could end in the same instant as
    # process 1, and which ended first was a race.) The launcher lets it run
    # (stop_on_failure=False) to show that lwjax.distributed itself ends it.
    result, out, report = _launch(
        "--steps",
        1000,
        "--die-after",
        2,
        "--die-process",
        1,
        "--hang-process",
        0,
        "--hang-seconds",
        1,
        devices=2,
        heartbeat_timeout=HEARTBEAT,
        stop_on_failure=False,
    )
    p0, p1 = result.exits
    assert result.failed == 1 and p1.returncode == 1, out + report
    assert p0.returncode != 0 and not p0.stopped_by_launcher, out + report
    assert p0.end_s - p1.end_s < HEARTBEAT + 10, (p0, p1)
    assert "[p1] simulated crash of process 1 after step 2" in out
    assert "[p0] lwjax.distributed: process 0 of 2 failed" in out or "[p0] F" in out, out
    assert "process 1 of 2 failed first (exit status 1)" in report


def test_dead_process_ends_a_process_outside_collectives_by_heartbeat():
    # Process 0 sleeps on the host when process 1 dies: only JAX's heartbeat can tell it.
    result, out, report = _launch(
        "--steps",
        1000,
        "--die-after",
        2,
        "--die-process",
        1,
        "--hang-process",
        0,
        devices=2,
        heartbeat_timeout=HEARTBEAT,
        stop_on_failure=False,
    )
    p0, p1 = result.exits
    assert result.failed == 1 and p1.returncode == 1, out + report
    assert "[p0] process 0 sleeps on the host" in out
    assert p0.returncode == -6, out + report  # SIGABRT from JAX, well before the 120 s sleep ends
    assert p0.end_s - p1.end_s < HEARTBEAT + 10, (p0, p1)
    assert "heartbeat" in out.lower(), out
    assert "p0: killed by SIGABRT (signal 6)" in report
